"""What the search may change and what it knows of the box before a launch. Pure.

:class:`Bounds`: the ``[search]`` and ``[target]`` limits of the config (what may change, within which
limits); :class:`BlindFacts`: the box and the model as figures (a probe, or what a log printed), for the
search's branch without the model's architecture (:mod:`r1sup.core.blind`); and the margins kept from the
memory measured free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from r1sup.core import memmodel, vllmversion
from r1sup.core.config import Config, SearchSection
from r1sup.core.flags import EngineFlags
from r1sup.core.hardware import DeviceFacts, GpuInfo

GIB = 1024**3
PINNED_RESERVE_GIB = 1.0  # a shrunk pinned KV cache leaves this much (or a fifth) of the free memory free
PINNED_RESERVE_FRACTION = 0.2
UTIL_STEP = 0.05  # blind utilization step, when no figure says better


_SEARCH = SearchSection()  # the defaults of [search], declared once in the config


@dataclass(frozen=True)
class Bounds:
    """What the search and the planner may change and within which limits ([search] and [target] of the
    config): the one shape of the bounds, from :meth:`from_config` or the defaults."""

    strategy: str = _SEARCH.strategy
    min_max_model_len: int = _SEARCH.min_max_model_len
    min_max_num_seqs: int = _SEARCH.min_max_num_seqs
    min_gpu_memory_utilization: float = _SEARCH.min_gpu_memory_utilization
    max_gpu_memory_utilization: float = _SEARCH.max_gpu_memory_utilization
    allow_fp8_kv: bool = _SEARCH.allow_fp8_kv
    allow_eager: bool = _SEARCH.allow_eager
    allow_weight_quantization: bool = _SEARCH.allow_weight_quantization
    allow_tensor_parallel: bool = _SEARCH.allow_tensor_parallel
    max_attempts: int = _SEARCH.max_attempts
    target_concurrency: int | None = None
    target_context: int | None = None

    @classmethod
    def from_config(cls, config: Config) -> Bounds:
        """The config's ``[search]`` and ``[target]``: the one place they become bounds."""
        lad, tgt = config.search, config.target
        return cls(
            strategy=lad.strategy,
            min_max_model_len=lad.min_max_model_len,
            min_max_num_seqs=lad.min_max_num_seqs,
            min_gpu_memory_utilization=lad.min_gpu_memory_utilization,
            max_gpu_memory_utilization=lad.max_gpu_memory_utilization,
            allow_fp8_kv=lad.allow_fp8_kv,
            allow_eager=lad.allow_eager,
            allow_weight_quantization=lad.allow_weight_quantization,
            allow_tensor_parallel=lad.allow_tensor_parallel,
            max_attempts=lad.max_attempts,
            target_concurrency=tgt.concurrency,
            target_context=tgt.context,
        )

    @property
    def min_context(self) -> int:
        return max(self.min_max_model_len, self.target_context or 0)

    @property
    def min_seqs(self) -> int:
        return self.target_concurrency or 1

    def target_tokens(self) -> int | None:
        """KV tokens the target needs at once, or None without a target."""
        if self.target_concurrency and self.target_context:
            return self.target_concurrency * self.target_context
        return None


@dataclass(frozen=True)
class BlindFacts:
    """What is known of the box and the model before the launch (measured, or read from a log)."""

    backend: str = "cuda"  # or "cpu"
    total_gib: float | None = None  # one device (host memory node on the CPU backend)
    free_gib: float | None = None  # free on the most loaded device before the launch
    compute_capability: tuple[int, int] | None = None
    gpu_count: int = 1
    fp8_kv_supported: bool | None = None  # None: unknown (try it); False: never propose fp8 KV
    model_max_len: int | None = None  # max_position_embeddings
    kv_bytes_per_token: int | None = None  # model dtype, at the flags' tensor parallel size
    block_size: int = memmodel.CUDA_BLOCK_SIZE
    holders: tuple[str, ...] = ()  # other processes holding device memory, for messages
    suggestions: tuple[str, ...] = ()  # the planner's ways out, for a give-up message
    gpu_name: str | None = None  # for vLLM's batch defaults (A100s get the small ones)
    vllm_version: str | None = None  # None: the newest the memory model knows
    arch: Any = None  # modelarch.ModelArch when the model's config.json is known
    # the device as probed, kept as it is (the figures above are its view); None where they come from a
    # log (r1sup diagnose) or a test: then :meth:`device` builds one GPU of ``total_gib`` from them
    box: DeviceFacts | None = None

    @classmethod
    def of_device(
        cls,
        device: DeviceFacts | None,
        *,
        kv_bytes_per_token: int | None = None,
        model_max_len: int | None = None,
        suggestions: tuple[str, ...] = (),
        vllm_version: str | None = None,
        arch: Any = None,
    ) -> BlindFacts:
        """The facts of a probed box (None: not probed, a CUDA box of unknown size) and the model."""
        backend = device.backend if device else "cuda"
        holders: tuple[str, ...] = ()
        if device:
            holders = tuple(f"pid {p.pid} {p.name} ({p.used_bytes / GIB:.1f} GiB)" for p in device.processes)
        return cls(
            backend=backend,
            total_gib=(device.total_bytes / GIB) if device and device.total_bytes else None,
            free_gib=(device.free_bytes / GIB) if device and device.free_bytes else None,
            compute_capability=device.compute_capability if device else None,
            gpu_count=max(1, device.count) if device else 1,
            fp8_kv_supported=device.fp8_kv_supported if device else None,
            model_max_len=model_max_len,
            kv_bytes_per_token=kv_bytes_per_token,
            block_size=memmodel.block_size(backend),
            holders=holders,
            suggestions=suggestions,
            gpu_name=memmodel.gpu_name(device) if device else None,
            vllm_version=vllm_version,
            arch=arch,
            box=device,
        )

    def version(self) -> vllmversion.Version:
        try:
            return vllmversion.as_version(self.vllm_version)
        except ValueError:
            return vllmversion.NEWEST_KNOWN

    def device(self) -> DeviceFacts:
        """The box as the memory model reads it: the probed one, else one GPU of ``total_gib`` (``gpu_count``
        alike; the host's memory on the CPU backend)."""
        if self.box is not None:
            return self.box
        total = int((self.total_gib or 0) * GIB)
        free = int((self.free_gib if self.free_gib is not None else self.total_gib or 0) * GIB)
        if self.backend == "cpu":
            return DeviceFacts(backend="cpu", host_total_bytes=total, host_available_bytes=free)
        gpu = GpuInfo(0, self.gpu_name or "", total, free, self.compute_capability)
        return DeviceFacts(backend=self.backend, gpus=(gpu,) * max(1, self.gpu_count))

    def batch(self, flags: EngineFlags) -> tuple[int, int]:
        """(max_num_seqs, max_num_batched_tokens) vLLM runs ``flags`` with on this box and version."""
        if self.arch is not None:
            b = memmodel.resolve_batch(self.arch, self.device(), flags, self.version())
            return b.max_num_seqs, b.max_num_batched_tokens
        length = flags.max_model_len if flags.max_model_len not in (None, -1) else self.model_max_len
        d = memmodel.batch_defaults(self.device(), self.version(), flags.tensor_parallel_size, length)
        tokens = flags.max_num_batched_tokens or d.max_num_batched_tokens
        seqs = flags.max_num_seqs or min(d.max_num_seqs, tokens)
        return seqs, tokens

    def next_tensor_parallel(self, tp: int) -> int | None:
        """The next tensor-parallel size up that the GPUs allow and vLLM accepts for this model."""
        if self.arch is None:
            return 2 * tp if self.gpu_count >= 2 * tp else None
        bigger = [t for t in memmodel.valid_tp_sizes(self.arch, self.gpu_count) if t > tp]
        return bigger[0] if bigger else None


def ceil_util(value: float) -> float:
    """A utilization rounded up to the hundredth."""
    return math.ceil(value * 100 - 1e-9) / 100


# How a person allows what a ``[search]`` bound forbids, for one who never wrote a config file as well
# as for one who did (issue 36: "blocked by search.allow_weight_quantization" told a ``--model`` user
# nothing): ``tune`` and ``run`` take ``--set``, a config file the ``[search]`` key; ``plan`` sizes the
# flag itself.
HOW_TO_ALLOW = {
    "search.allow_weight_quantization": (
        "r1sup quantizes weights only when allowed: allow it with --set "
        "search.allow_weight_quantization=true on tune and run, or with allow_weight_quantization = true "
        "under [search] in a config file; plan --quantization fp8 sizes it"
    ),
}


def how_to_allow(bound: str) -> str:
    """One phrase saying how to allow what the bound ``bound`` forbids; "" for one that allows nothing."""
    return HOW_TO_ALLOW.get(bound, "")
