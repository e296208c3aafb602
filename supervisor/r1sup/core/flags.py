"""The engine flags r1sup manages: one frozen value shared by the planner, the search, the launcher and
profiles; and the flags a logged launch ran with (:func:`flags_from_log`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FP8_KV_DTYPES = frozenset({"fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc"})


@dataclass(frozen=True)
class EngineFlags:
    """vLLM's memory-relevant flags. ``None`` means: leave vLLM's default."""

    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    quantization: str | None = None
    tensor_parallel_size: int = 1
    kv_cache_memory_bytes: int | None = None
    cpu_offload_gb: float | None = None

    @classmethod
    def from_start(cls, start: Any) -> EngineFlags:
        """From a ``[start]`` section (or anything with the same attributes)."""
        return cls(**{f.name: getattr(start, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineFlags:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown flag(s): {', '.join(sorted(unknown))}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> EngineFlags:
        return dataclasses.replace(self, **changes)

    @property
    def fp8_kv(self) -> bool:
        return self.kv_cache_dtype in FP8_KV_DTYPES

    def to_argv(self) -> list[str]:
        """vLLM command-line arguments for these flags, in a stable order."""
        argv: list[str] = []
        if self.max_model_len is not None:
            argv += ["--max-model-len", str(self.max_model_len)]
        argv += ["--gpu-memory-utilization", _fmt_float(self.gpu_memory_utilization)]
        if self.kv_cache_dtype != "auto":
            argv += ["--kv-cache-dtype", self.kv_cache_dtype]
        if self.enforce_eager:
            argv.append("--enforce-eager")
        if self.max_num_seqs is not None:
            argv += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.max_num_batched_tokens is not None:
            argv += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.quantization is not None:
            argv += ["--quantization", self.quantization]
        if self.tensor_parallel_size != 1:
            argv += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.kv_cache_memory_bytes is not None:
            argv += ["--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes)]
        if self.cpu_offload_gb:
            argv += ["--cpu-offload-gb", _fmt_float(self.cpu_offload_gb)]
        return argv

    def describe_change(self, new: EngineFlags) -> str:
        """A short text of what differs, e.g. ``max_model_len 32768 -> 3712, kv_cache_dtype auto -> fp8``."""
        parts = []
        for f in dataclasses.fields(self):
            old_v, new_v = getattr(self, f.name), getattr(new, f.name)
            if old_v != new_v:
                parts.append(f"{f.name} {_show(old_v)} -> {_show(new_v)}")
        return ", ".join(parts) or "no change"


def short(flags: dict[str, Any]) -> str:
    """The flags a person needs to see: ``ctx=32768 util=0.9 kv=fp8 eager seqs=64 tp=2``."""
    parts = []
    if flags.get("max_model_len"):
        parts.append(f"ctx={flags['max_model_len']}")
    util = flags.get("gpu_memory_utilization")
    if util is not None:
        parts.append(f"util={_fmt_float(float(util))}")
    if flags.get("kv_cache_dtype") not in (None, "auto"):
        parts.append(f"kv={flags['kv_cache_dtype']}")
    if flags.get("enforce_eager"):
        parts.append("eager")
    if flags.get("max_num_seqs"):
        parts.append(f"seqs={flags['max_num_seqs']}")
    if flags.get("max_num_batched_tokens"):
        parts.append(f"batched={flags['max_num_batched_tokens']}")
    if flags.get("quantization"):
        parts.append(f"q={flags['quantization']}")
    if flags.get("tensor_parallel_size", 1) not in (1, None):
        parts.append(f"tp={flags['tensor_parallel_size']}")
    if flags.get("kv_cache_memory_bytes"):
        parts.append(f"kv_bytes={flags['kv_cache_memory_bytes']}")
    if flags.get("cpu_offload_gb"):
        parts.append(f"offload={_fmt_float(float(flags['cpu_offload_gb']))}G")
    return " ".join(parts)


def describe_dict_change(old: dict[str, Any], new: dict[str, Any]) -> str:
    """:meth:`EngineFlags.describe_change` for flag dicts (as logged): ``max_model_len 32768 -> 7680``."""
    parts = [
        f"{name} {_show(old.get(name))} -> {_show(new.get(name))}"
        for name in list(dict.fromkeys([*old, *new]))
        if old.get(name) != new.get(name)
    ]
    return ", ".join(parts) or "no change"


def _fmt_float(value: float) -> str:
    text = f"{value:.4f}".rstrip("0").rstrip(".")
    return text or "0"


def _show(value: Any) -> str:
    if value is None:
        return "default"
    if isinstance(value, float):
        return _fmt_float(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


# --- the flags a logged launch ran with (``r1sup diagnose``) -----------------------------------

# vLLM's argument names (as "non-default args" prints them) -> EngineFlags fields
_ARG_FIELDS = {
    "max_model_len": "max_model_len",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "kv_cache_dtype": "kv_cache_dtype",
    "enforce_eager": "enforce_eager",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "quantization": "quantization",
    "tensor_parallel_size": "tensor_parallel_size",
    "kv_cache_memory_bytes": "kv_cache_memory_bytes",
    "cpu_offload_gb": "cpu_offload_gb",
}
_TYPES: dict[str, type] = {
    "max_model_len": int,
    "gpu_memory_utilization": float,
    "kv_cache_dtype": str,
    "enforce_eager": bool,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "quantization": str,
    "tensor_parallel_size": int,
    "kv_cache_memory_bytes": int,
    "cpu_offload_gb": float,
}


def flags_from_log(
    args: Mapping[str, object], max_model_len: int | None, gpu_memory_utilization: float | None
) -> EngineFlags:
    """The flags a logged launch ran with: vLLM's "non-default args", then the figures its messages
    printed (the context and utilization of the failed check)."""
    values: dict[str, Any] = {}
    for arg, name in _ARG_FIELDS.items():
        value = args.get(arg)
        kind = _TYPES[name]
        if value is None or isinstance(value, bool) != (kind is bool):
            continue
        if kind is not str and not isinstance(value, (int, float)):
            continue
        values[name] = value if kind is str else kind(value)
    if "max_model_len" not in values and max_model_len:
        values["max_model_len"] = int(max_model_len)
    if "gpu_memory_utilization" not in values and gpu_memory_utilization:
        values["gpu_memory_utilization"] = float(gpu_memory_utilization)
    return EngineFlags(**values)
