"""Scenarios for the fake engine: the simulated box, the model, the clock and the injected faults.

Plain data only: :func:`load_scenario` turns a JSON-like mapping into a frozen :class:`Scenario`,
checking every key (an unknown key is an error, so a typo in a benchmark matrix cannot go unnoticed).
The field list with defaults is documented in :mod:`fakevllm.engine`.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

GIB = 1 << 30
MIB = 1 << 20

FP8_FAILS_AT = ("startup", "first_request")
RUNTIME_FAILURES = ("oom", "fp8", "die", "core_error")
HANG_PHASES = ("load_weights", "profile", "kv_cache", "cuda_graph", "serving")


class ScenarioError(ValueError):
    """A scenario that cannot be used (unknown key, wrong type, unknown catalog name)."""


# --- catalogs ------------------------------------------------------------------------------------

# GPUs as torch reports them (torch.cuda.get_device_properties().total_memory, in GiB) with their
# compute capability. Totals come from real vLLM/torch messages where one was at hand (H200 139.72,
# L4 22.05, A100 40GB 39.39, A100 80GB 79.15, H100 79.11, RTX 3090 23.69); the RTX 4090 uses 23.99
# (24564 MiB, what nvidia-smi shows and the default).
GPU_CATALOG: dict[str, tuple[str, float, tuple[int, int]]] = {
    "RTX 3090": ("NVIDIA GeForce RTX 3090", 23.69, (8, 6)),
    "RTX 4090": ("NVIDIA GeForce RTX 4090", 23.99, (8, 9)),
    "L4": ("NVIDIA L4", 22.05, (8, 9)),
    "L40S": ("NVIDIA L40S", 44.39, (8, 9)),
    "A10G": ("NVIDIA A10G", 22.06, (8, 6)),
    "A100 40GB": ("NVIDIA A100-SXM4-40GB", 39.39, (8, 0)),
    "A100 80GB": ("NVIDIA A100-SXM4-80GB", 79.15, (8, 0)),
    "H100": ("NVIDIA H100 80GB HBM3", 79.11, (9, 0)),
    "H200": ("NVIDIA H200", 139.72, (9, 0)),
    "T4": ("Tesla T4", 14.57, (7, 5)),
}
_GPU_ALIASES = {
    "3090": "RTX 3090",
    "4090": "RTX 4090",
    "A10": "A10G",
    "A100": "A100 80GB",
    "A100 40": "A100 40GB",
    "A100 80": "A100 80GB",
    "H100 80": "H100",
    "H200 141": "H200",
}
# Words in device names that do not tell cards apart ("NVIDIA A100-SXM4-80GB" is an "A100 80").
_NAME_NOISE = re.compile(r"nvidia|geforce|tesla|hbm\d?e?|sxm\d?|pcie|nvl|gb")


@dataclass(frozen=True)
class ModelSpec:
    """The config.json fields the memory accounting needs."""

    name: str
    architecture: str = "Qwen2ForCausalLM"
    hidden_size: int = 5120
    num_hidden_layers: int = 48
    num_attention_heads: int = 40
    num_key_value_heads: int = 8
    head_dim: int | None = None
    intermediate_size: int = 13824
    vocab_size: int = 152064
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 131072
    torch_dtype: str = "bfloat16"
    attention_bias: bool = True
    quantization: str | None = None  # the checkpoint's own method (an AWQ/GPTQ repository): awq, gptq

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def linear_params_per_layer(self) -> int:
        """q, k, v, o and the gated MLP (gate, up, down) of one decoder layer."""
        h, hd = self.hidden_size, self.head_size
        q = self.num_attention_heads * hd
        kv = self.num_key_value_heads * hd
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size

    @property
    def small_params_per_layer(self) -> int:
        """Biases of q/k/v (Qwen2) and the two RMSNorm weights."""
        hd = self.head_size
        bias = (self.num_attention_heads + 2 * self.num_key_value_heads) * hd if self.attention_bias else 0
        return bias + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        """Input embedding plus the LM head unless tied."""
        one = self.vocab_size * self.hidden_size
        return one if self.tie_word_embeddings else 2 * one

    @property
    def num_params(self) -> int:
        layers = self.num_hidden_layers * (self.linear_params_per_layer + self.small_params_per_layer)
        return layers + self.embedding_params + self.hidden_size

    @property
    def family(self) -> str:
        return "llama" if "llama" in self.architecture.lower() else "qwen2"


def _qwen(name: str, hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int) -> ModelSpec:
    return ModelSpec(
        name=name,
        architecture="Qwen2ForCausalLM",
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        vocab_size=vocab,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        torch_dtype="bfloat16",
        attention_bias=True,
    )


def _llama(name: str, hidden: int, inter: int, layers: int, heads: int, kv: int) -> ModelSpec:
    return ModelSpec(
        name=name,
        architecture="LlamaForCausalLM",
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        vocab_size=128256,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        torch_dtype="bfloat16",
        attention_bias=False,
    )


# The six DeepSeek-R1 distills with the values of their config.json files on the Hugging Face Hub.
MODEL_CATALOG: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _qwen("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", 1536, 8960, 28, 12, 2, 151936),
        _qwen("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", 3584, 18944, 28, 28, 4, 152064),
        _qwen("deepseek-ai/DeepSeek-R1-Distill-Qwen-14B", 5120, 13824, 48, 40, 8, 152064),
        _qwen("deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", 5120, 27648, 64, 40, 8, 152064),
        _llama("deepseek-ai/DeepSeek-R1-Distill-Llama-8B", 4096, 14336, 32, 32, 8),
        _llama("deepseek-ai/DeepSeek-R1-Distill-Llama-70B", 8192, 28672, 80, 64, 8),
    )
}
DEFAULT_MODEL = "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B"


@dataclass(frozen=True)
class Gpu:
    name: str = "NVIDIA GeForce RTX 4090"
    total_gib: float = 23.99
    compute_capability: tuple[int, int] = (8, 9)
    count: int = 1
    other_process_gib: tuple[float, ...] = (0.0,)  # memory held by other processes, one value per GPU

    @property
    def total_bytes(self) -> int:
        return int(round(self.total_gib * GIB))

    @property
    def capability(self) -> int:
        """As vLLM compares it: 8.9 -> 89."""
        return self.compute_capability[0] * 10 + self.compute_capability[1]

    def others_bytes(self, index: int) -> int:
        return int(round(self.other_process_gib[index] * GIB))


RESET_STATUSES = frozenset({0, 500, 502, 503})  # Runtime.reset_status
MIDSTREAM_STATUSES = frozenset({0, 500})  # Runtime.reset_status with reset_after_tokens


@dataclass(frozen=True)
class Runtime:
    """Faults while serving and the simulated speed of requests."""

    fail_after_requests: int | None = None  # the request after this many fails (None: never, unless a spike)
    failure: str | None = None  # oom | fp8 | die | core_error
    activation_spike_gib: float = 0.0  # extra activation a request needs; OOM if it does not fit physically
    exit_code: int = 1  # exit status after the engine died (vLLM can exit 0 there, issue 48966)
    linger_s: float = 2.0  # simulated seconds the API server keeps answering after the engine died
    health_while_dead: bool = False  # /health answers 200 after the engine died (vLLM issue 39863)
    decode_tokens_per_s: float = 60.0  # simulated generation speed of one request
    # that speed only at the first n launches counted in state_file, the default's after (0: every launch)
    slow_launches: int = 0
    prefill_tokens_per_s: float = 8000.0  # simulated prompt processing speed
    reset_every: int = 0  # every n-th generation request's connection is reset unanswered (0: none)
    reset_launches: int = 0  # resets only at the first n launches counted in state_file (0: every launch)
    # 0: those requests are reset unanswered; 500: answered as vLLM 0.32 answers while its executor shuts
    # down ("cannot schedule new futures after shutdown"); 502/503: a proxy's plain page before vLLM
    reset_status: int = 0
    # those requests, when streamed, first stream this many output tokens, then their fault comes in the
    # middle of the stream: the connection dropped (reset_status 0), or the error event vLLM 0.32 sends
    # after a 200 when a request fails in generation (500: its GenerationError, ``Internal server error``);
    # a request asking for fewer tokens passes. 0: the fault comes before any answer
    reset_after_tokens: int = 0
    # the latency model: each step (prefill or decode) takes this much longer per sequence running
    # beside the request's own (a step's time grows with the tokens of its batch); 0: no batch cost
    step_s_per_batch_seq: float = 0.0
    # the prefill budget: a prefill step takes this long (simulated seconds), and a request's prompt is
    # prefilled after ceil(prompt tokens being prefilled, its own and those that came before it still
    # in prefill, / max_num_batched_tokens) such steps (vLLM's chunked prefill, first come first
    # served); 0: no prefill steps
    prefill_step_s: float = 0.0


@dataclass(frozen=True)
class Scenario:
    gpu: Gpu = field(default_factory=Gpu)
    model: ModelSpec | None = None  # None: the catalog entry of --model, else the default (Qwen-14B)
    time_scale: float = 0.01
    fp8_fails_at: str = "startup"
    runtime: Runtime = field(default_factory=Runtime)
    state_file: str | None = None
    load_gib_per_s: float = 2.0
    compile_s: float | None = None
    # the profile run's activation peak (GiB) by the state of the engine's torch.compile cache, when set:
    # {"cold": 1.18, "warm": 0.19} is a real RTX 4090 / vLLM 0.27.1 pair (Qwen3-8B). The cache lives under
    # $VLLM_CACHE_ROOT/torch_compile_cache (else ~/.cache/vllm/...): empty or missing is cold, and a
    # compile fills it. None: the formula's peak whatever the cache holds.
    compile_activation_gib: dict[str, float] | None = None
    cudagraph_estimate_factor: float = 1.2
    engine_core_name: str = "EngineCore"
    vllm_version: str = "0.32.0"
    site_packages: str = "/usr/local/lib/python3.12/dist-packages"
    hang_at: str | None = None
    ignore_sigterm: bool = False
    # print uvicorn's "Application startup complete." once serving (False: an engine whose readiness
    # line r1sup does not know, so that only its polling sees it ready)
    ready_line: bool = True
    orphan_child: bool = False
    orphan_linger_s: float = 30.0
    gpu_lock_dir: str | None = None
    # GiB other processes hold on every GPU at each launch (the n-th value at the n-th launch counted in
    # state_file, the last one from then on): a tenant that comes or goes between launches
    other_process_schedule: tuple[float, ...] = ()

    def effective_model(self, cli_model: str | None = None) -> ModelSpec:
        """The architecture to simulate: the scenario's, else the catalog entry named by ``--model``."""
        if self.model is not None:
            return self.model
        if cli_model:
            found = find_model(cli_model)
            if found is not None:
                return found
        return MODEL_CATALOG[DEFAULT_MODEL]

    def with_others(self, gib: float) -> Scenario:
        """The same scenario with ``gib`` held by other processes on every GPU."""
        return replace(self, gpu=replace(self.gpu, other_process_gib=(float(gib),) * self.gpu.count))


# --- loading -------------------------------------------------------------------------------------


def _norm(text: str) -> str:
    return _NAME_NOISE.sub("", re.sub(r"[^a-z0-9]", "", text.lower()))


def find_gpu(name: str) -> tuple[str, float, tuple[int, int]] | None:
    """A catalog entry by key, alias or device name (case, punctuation and words like NVIDIA/SXM ignored)."""
    wanted = _norm(name)
    if not wanted:
        return None
    for key, entry in GPU_CATALOG.items():
        if wanted in (_norm(key), _norm(entry[0])):
            return entry
    for alias, key in _GPU_ALIASES.items():
        if wanted == _norm(alias):
            return GPU_CATALOG[key]
    return None


def find_model(name: str) -> ModelSpec | None:
    """A catalog model by its Hugging Face id or by the part after the slash (case ignored)."""
    wanted = name.lower().strip()
    for key, spec in MODEL_CATALOG.items():
        if wanted in (key.lower(), key.split("/", 1)[1].lower()):
            return spec
    return None


def _check_keys(where: str, data: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ScenarioError(
            f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(allowed))})"
        )


def _num(where: str, value: Any, *, minimum: float | None = None, integer: bool = False) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ScenarioError(f"{where}: expected a number, got {value!r}")
    if integer and (not float(value).is_integer()):
        raise ScenarioError(f"{where}: expected an integer, got {value!r}")
    if not math.isfinite(float(value)):
        raise ScenarioError(f"{where}: expected a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ScenarioError(f"{where}: must be >= {minimum}, got {value!r}")
    return int(value) if integer else float(value)


def _bool(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ScenarioError(f"{where}: expected true or false, got {value!r}")
    return value


def _str(where: str, value: Any, choices: tuple[str, ...] | None = None, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise ScenarioError(f"{where}: expected a string, got {value!r}")
    if choices is not None and value not in choices:
        raise ScenarioError(f"{where}: must be one of {', '.join(choices)}, got {value!r}")
    return value


def _load_gpu(value: Any) -> Gpu:
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, Mapping):
        raise ScenarioError(f"gpu: expected a name or an object, got {value!r}")
    _check_keys("gpu", value, {"name", "total_gib", "compute_capability", "count", "other_process_gib"})
    base = Gpu()
    name = _str("gpu.name", value.get("name", base.name))
    entry = find_gpu(name)
    full_name, total, cc = entry if entry else (name, base.total_gib, base.compute_capability)
    if entry is None and "name" in value and ("total_gib" not in value or "compute_capability" not in value):
        raise ScenarioError(
            f"gpu.name: {name!r} is not in the catalog ({', '.join(GPU_CATALOG)}); "
            "give total_gib and compute_capability too"
        )
    if "total_gib" in value:
        total = _num("gpu.total_gib", value["total_gib"], minimum=0.5)
    if "compute_capability" in value:
        raw = value["compute_capability"]
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            major = int(raw)
            cc = (major, int(round((float(raw) - major) * 10)))
        elif isinstance(raw, (list, tuple)) and len(raw) == 2 and all(isinstance(x, int) for x in raw):
            cc = (int(raw[0]), int(raw[1]))
        else:
            raise ScenarioError(f"gpu.compute_capability: expected [major, minor] or 8.9, got {raw!r}")
    count = _num("gpu.count", value.get("count", 1), minimum=1, integer=True)
    raw_others = value.get("other_process_gib", 0.0)
    if isinstance(raw_others, (list, tuple)):
        if len(raw_others) != count:
            raise ScenarioError(
                f"gpu.other_process_gib: expected {count} values (one per GPU), got {len(raw_others)}"
            )
        others = tuple(_num("gpu.other_process_gib", v, minimum=0.0) for v in raw_others)
    else:
        others = (_num("gpu.other_process_gib", raw_others, minimum=0.0),) * count
    if any(o >= total for o in others):
        raise ScenarioError("gpu.other_process_gib: must be below total_gib")
    return Gpu(
        name=full_name, total_gib=float(total), compute_capability=cc, count=count, other_process_gib=others
    )


_MODEL_FIELDS = {
    "name",
    "architecture",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
    "max_position_embeddings",
    "torch_dtype",
    "attention_bias",
    "quantization",
}


def _load_model(value: Any) -> ModelSpec:
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, Mapping):
        raise ScenarioError(f"model: expected a name or an object, got {value!r}")
    _check_keys("model", value, _MODEL_FIELDS)
    name = _str("model.name", value.get("name", DEFAULT_MODEL))
    base = find_model(name)
    overrides = {k: v for k, v in value.items() if k != "name"}
    if base is None:
        required = {
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
        }
        missing = sorted(required - set(overrides))
        if missing:
            raise ScenarioError(
                f"model.name: {name!r} is not in the catalog; give {', '.join(missing)} "
                f"(catalog: {', '.join(MODEL_CATALOG)})"
            )
        base = ModelSpec(name=name)
    else:
        base = replace(base, name=name if "/" in name else base.name)
    changes: dict[str, Any] = {}
    for key, raw in overrides.items():
        where = f"model.{key}"
        if key in ("architecture", "torch_dtype"):
            changes[key] = _str(where, raw)
        elif key == "quantization":
            changes[key] = _str(where, raw, ("awq", "gptq"), optional=True)
        elif key in ("tie_word_embeddings", "attention_bias"):
            changes[key] = _bool(where, raw)
        elif key == "head_dim":
            changes[key] = None if raw is None else _num(where, raw, minimum=1, integer=True)
        else:
            changes[key] = _num(where, raw, minimum=1, integer=True)
    if "num_key_value_heads" not in changes and "num_attention_heads" in changes and find_model(name) is None:
        changes["num_key_value_heads"] = changes["num_attention_heads"]
    spec = replace(base, **changes)
    if spec.torch_dtype not in ("bfloat16", "float16", "float32"):
        raise ScenarioError(
            f"model.torch_dtype: must be bfloat16, float16 or float32, got {spec.torch_dtype!r}"
        )
    if spec.num_attention_heads % spec.num_key_value_heads:
        raise ScenarioError("model.num_key_value_heads: must divide num_attention_heads")
    return spec


def _load_runtime(value: Any) -> Runtime:
    if value is None:
        return Runtime()
    if not isinstance(value, Mapping):
        raise ScenarioError(f"runtime: expected an object, got {value!r}")
    known = {f for f in Runtime.__dataclass_fields__}
    _check_keys("runtime", value, known)
    changes: dict[str, Any] = {}
    for key, raw in value.items():
        where = f"runtime.{key}"
        if key == "failure":
            changes[key] = _str(where, raw, RUNTIME_FAILURES, optional=True)
        elif key == "fail_after_requests":
            changes[key] = None if raw is None else _num(where, raw, minimum=0, integer=True)
        elif key in ("exit_code", "reset_every", "reset_launches", "reset_after_tokens", "slow_launches"):
            changes[key] = _num(where, raw, minimum=0, integer=True)
        elif key == "reset_status":
            changes[key] = _num(where, raw, minimum=0, integer=True)
            if changes[key] not in RESET_STATUSES:
                raise ScenarioError(f"{where}: must be one of {sorted(RESET_STATUSES)}, got {raw!r}")
        elif key == "health_while_dead":
            changes[key] = _bool(where, raw)
        elif key in ("decode_tokens_per_s", "prefill_tokens_per_s"):
            changes[key] = _num(where, raw, minimum=1e-6)
        else:
            changes[key] = _num(where, raw, minimum=0.0)
    runtime = Runtime(**changes)
    if runtime.reset_after_tokens and runtime.reset_status not in MIDSTREAM_STATUSES:
        raise ScenarioError(
            "runtime.reset_after_tokens: a fault in the middle of a stream is a dropped connection "
            f"(reset_status 0) or vLLM's error event (500), not {runtime.reset_status}"
        )
    return runtime


_TOP_KEYS = {f for f in Scenario.__dataclass_fields__}


def load_scenario(data: Mapping[str, Any] | None) -> Scenario:
    """Build a scenario from a JSON-like mapping; every key is optional."""
    data = dict(data or {})
    _check_keys("scenario", data, _TOP_KEYS)
    changes: dict[str, Any] = {}
    if "gpu" in data:
        changes["gpu"] = _load_gpu(data["gpu"])
    if data.get("model") is not None:
        changes["model"] = _load_model(data["model"])
    if "runtime" in data:
        changes["runtime"] = _load_runtime(data["runtime"])
    for key in ("time_scale", "load_gib_per_s", "cudagraph_estimate_factor", "orphan_linger_s"):
        if key in data:
            changes[key] = _num(key, data[key], minimum=0.0)
    if changes.get("load_gib_per_s", 1.0) <= 0:
        raise ScenarioError("load_gib_per_s: must be > 0")
    if "compile_s" in data:
        changes["compile_s"] = (
            None if data["compile_s"] is None else _num("compile_s", data["compile_s"], minimum=0.0)
        )
    if data.get("compile_activation_gib") is not None:
        raw = data["compile_activation_gib"]
        if not isinstance(raw, Mapping) or set(raw) != {"cold", "warm"}:
            raise ScenarioError(f"compile_activation_gib: expected {{'cold': GiB, 'warm': GiB}}, got {raw!r}")
        changes["compile_activation_gib"] = {
            k: _num(f"compile_activation_gib.{k}", v, minimum=0.0) for k, v in raw.items()
        }
    if "fp8_fails_at" in data:
        changes["fp8_fails_at"] = _str("fp8_fails_at", data["fp8_fails_at"], FP8_FAILS_AT)
    if "hang_at" in data:
        changes["hang_at"] = _str("hang_at", data["hang_at"], HANG_PHASES, optional=True)
    for key in ("state_file", "gpu_lock_dir"):
        if key in data:
            changes[key] = _str(key, data[key], optional=True)
    for key in ("engine_core_name", "vllm_version", "site_packages"):
        if key in data:
            changes[key] = _str(key, data[key])
    if "other_process_schedule" in data:
        raw = data["other_process_schedule"]
        if not isinstance(raw, (list, tuple)):
            raise ScenarioError(f"other_process_schedule: expected a list of GiB, got {raw!r}")
        changes["other_process_schedule"] = tuple(
            float(_num("other_process_schedule", v, minimum=0.0)) for v in raw
        )
    for key in ("ignore_sigterm", "orphan_child", "ready_line"):
        if key in data:
            changes[key] = _bool(key, data[key])
    return Scenario(**changes)


def scenario_from_env(environ: Mapping[str, str]) -> Scenario:
    """``FAKE_VLLM_SCENARIO`` (JSON text) wins over ``FAKE_VLLM_SCENARIO_FILE`` (a path); neither: "
    "defaults."""
    text = environ.get("FAKE_VLLM_SCENARIO")
    source = "FAKE_VLLM_SCENARIO"
    if not text and environ.get("FAKE_VLLM_SCENARIO_FILE"):
        path = environ["FAKE_VLLM_SCENARIO_FILE"]
        source = path
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise ScenarioError(f"FAKE_VLLM_SCENARIO_FILE: cannot read {path}: {exc.strerror}") from None
    if not text:
        return Scenario()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScenarioError(f"{source}: not valid JSON: {exc}") from None
    if not isinstance(data, Mapping):
        raise ScenarioError(f"{source}: expected a JSON object")
    return at_launch(load_scenario(data))


def launches_recorded(scenario: Scenario) -> int:
    """Launches the state file holds (0 without one)."""
    if not scenario.state_file or not os.path.exists(scenario.state_file):
        return 0
    with open(scenario.state_file, encoding="utf-8") as fh:
        return sum(1 for line in fh if '"event": "launch"' in line)


def at_launch(scenario: Scenario) -> Scenario:
    """The scenario as the next launch (and the NVML probe before it) sees it: the other processes'
    memory of ``other_process_schedule`` at that launch."""
    if not scenario.other_process_schedule:
        return scenario
    n = launches_recorded(scenario)
    schedule = scenario.other_process_schedule
    return scenario.with_others(schedule[min(n, len(schedule) - 1)])


def scenario_to_json(scenario: Scenario) -> str:
    """The scenario as JSON that :func:`load_scenario` reads back unchanged."""
    return json.dumps(scenario_to_dict(scenario), sort_keys=True)


def scenario_to_dict(scenario: Scenario) -> dict[str, Any]:
    gpu = scenario.gpu
    model = scenario.model
    out: dict[str, Any] = {
        "gpu": {
            "name": gpu.name,
            "total_gib": gpu.total_gib,
            "compute_capability": list(gpu.compute_capability),
            "count": gpu.count,
            "other_process_gib": list(gpu.other_process_gib),
        },
        "model": None if model is None else {k: getattr(model, k) for k in _MODEL_FIELDS},
        "runtime": dict(vars(scenario.runtime)),
    }
    for key in _TOP_KEYS - {"gpu", "model", "runtime"}:
        out[key] = getattr(scenario, key)
    return out


def environ_with_scenario(
    scenario: Scenario | Mapping[str, Any], base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """An environment for a child fake engine: ``base`` (default os.environ) plus FAKE_VLLM_SCENARIO."""
    env = dict(os.environ if base is None else base)
    env.pop("FAKE_VLLM_SCENARIO_FILE", None)
    text = scenario_to_json(scenario) if isinstance(scenario, Scenario) else json.dumps(dict(scenario))
    env["FAKE_VLLM_SCENARIO"] = text
    return env
