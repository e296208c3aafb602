"""Settings: one declaration per setting, strict loading, precedence defaults < file < env < CLI.

Every setting is a field of a frozen dataclass section. Its type comes from the annotation; its
default, help text and checks from :func:`setting`. Loading walks the declarations, so an unknown
key, a wrong type or an out-of-range value is reported with the dotted name of the field.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import stat
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from r1sup.core.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

ENV_PREFIX = "R1SUP_"
MAX_CONFIG_BYTES = 1024 * 1024  # a config is a few KiB; anything past 1 MiB is not one (or is /dev/zero)
STATE_ROOT = "/var/lib/r1sup"
SHARED_CONFIG_NAME = "r1sup"  # /etc/r1sup/r1sup.toml: r1sup.service, whose state is STATE_ROOT itself

# vLLM's --kv-cache-dtype choices that concern r1sup (CacheDType in vllm/config/cache.py), plus the
# common aliases that the planner understands.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc")
QUANTIZATIONS = (
    "fp8",
    "fp8_per_tensor",
    "fp8_per_block",
    "awq",
    "awq_marlin",
    "gptq",
    "gptq_marlin",
    "bitsandbytes",
    "compressed-tensors",
)
STRATEGIES = ("smart", "naive")

# Upper bounds of the settings, one definition: the config reader checks them (exit 2 naming the field),
# and so do the readers of profiles and of the fleet's store (:func:`check_start_value`), so that no value
# read from a file reaches a launch, a timer or the memory model out of these ranges.
MAX_DURATION_S = 7 * 24 * 3600.0  # every duration and timeout: a week (a timer of 1e10 s overflows)
MAX_CONTEXT_TOKENS = 1 << 24  # a context, a prompt, a batch: 16M tokens
MAX_SEQS = 1 << 16  # sequences or requests at once
MAX_KV_CACHE_BYTES = 1 << 50  # 1 PiB of KV cache on one device
MAX_OFFLOAD_GIB = float(1 << 16)  # 64 TiB of weights offloaded to host memory
MAX_COUNT = 1 << 16  # restarts, failed checks, nodes
FIRST_LAUNCH = ("planned", "as_configured")

# Flags r1sup sets itself; they may not appear in server.extra_args.
MANAGED_FLAGS = (
    "--model",
    "--host",
    "--port",
    "--served-model-name",
    "--revision",
    "--max-model-len",
    "--gpu-memory-utilization",
    "--kv-cache-dtype",
    "--enforce-eager",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--quantization",
    "-q",
    "--tensor-parallel-size",
    "-tp",
    "--kv-cache-memory-bytes",
    "--kv-cache-memory",
    "--cpu-offload-gb",
    "--api-key",
)


def setting(default: Any = dataclasses.MISSING, help: str = "", **checks: Any) -> Any:
    """Declare a setting: default, help text and checks in one place.

    Checks: ``minimum``/``maximum`` (inclusive), ``exclusive_minimum``, ``choices``,
    ``validate`` (a callable that raises ValueError with a message).
    """
    meta = {"help": help, **checks}
    if isinstance(default, (list, dict)):
        factory = default.copy
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _check_host(value: str) -> None:
    if not value or any(ch.isspace() for ch in value):
        raise ValueError("must be a host name or IP address")


def _check_not_managed(value: list[str]) -> None:
    for arg in value:
        name = arg.split("=", 1)[0]
        if name in MANAGED_FLAGS:
            raise ValueError(f"{name} is managed by r1sup; set it in [model], [server] or [start] instead")


def _check_env(value: dict[str, str]) -> None:
    for key in value:
        if key == "VLLM_API_KEY":
            raise ValueError("VLLM_API_KEY must not be written in the config; use server.api_key_file")
        if key == "NOTIFY_SOCKET" or key.startswith("WATCHDOG_"):
            raise ValueError(f"{key} belongs to systemd and is never passed to vLLM")


@dataclass(frozen=True)
class ModelSection:
    name: str = setting(help="Hugging Face id or local directory of the model (required)")
    served_name: str | None = setting(None, "name clients use; default: the model name")
    revision: str | None = setting(None, "model revision (branch, tag or commit)")


@dataclass(frozen=True)
class ServerSection:
    host: str = setting("127.0.0.1", "address vLLM binds to", validate=_check_host)
    port: int = setting(8000, "port vLLM listens on", minimum=1, maximum=65535)
    python: str | None = setting(None, "interpreter of the vLLM environment; default: r1sup's own")
    launch: list[str] = setting(
        ["-m", "vllm.entrypoints.openai.api_server"],
        "arguments after the interpreter that start the OpenAI-compatible server",
    )
    extra_args: list[str] = setting(
        [], "further vLLM arguments (not the managed ones)", validate=_check_not_managed
    )
    env: dict[str, str] = setting({}, "extra environment for vLLM", validate=_check_env)
    api_key_file: str | None = setting(None, "file holding the API key vLLM requires (mode 0600)")
    allow_public_bind: bool = setting(False, "allow a non-loopback host without an API key")
    startup_timeout_s: float = setting(
        1800.0, "longest start-up before giving up", exclusive_minimum=0, maximum=MAX_DURATION_S
    )
    stall_timeout_s: float = setting(
        600.0, "start-up with no output for this long is a hang", exclusive_minimum=0, maximum=MAX_DURATION_S
    )
    stop_timeout_s: float = setting(
        30.0, "grace between SIGTERM and SIGKILL", exclusive_minimum=0, maximum=MAX_DURATION_S
    )
    memory_release_timeout_s: float = setting(
        60.0, "wait for GPU memory and port to be free", minimum=0, maximum=MAX_DURATION_S
    )


@dataclass(frozen=True)
class StartSection:
    max_model_len: int | None = setting(
        None, "context length; default: the model's", minimum=1, maximum=MAX_CONTEXT_TOKENS
    )
    gpu_memory_utilization: float = setting(
        0.9, "fraction of device memory vLLM may use", exclusive_minimum=0.0, maximum=1.0
    )
    kv_cache_dtype: str = setting("auto", "KV cache dtype", choices=KV_CACHE_DTYPES)
    enforce_eager: bool = setting(False, "disable CUDA graphs")
    max_num_seqs: int | None = setting(None, "most sequences per batch", minimum=1, maximum=MAX_SEQS)
    max_num_batched_tokens: int | None = setting(
        None, "most tokens per batch", minimum=1, maximum=MAX_CONTEXT_TOKENS
    )
    quantization: str | None = setting(None, "weight quantization method", choices=QUANTIZATIONS)
    tensor_parallel_size: int = setting(1, "GPUs to shard the model over", minimum=1, maximum=64)
    kv_cache_memory_bytes: int | None = setting(
        None, "pin the KV cache size in bytes", minimum=1, maximum=MAX_KV_CACHE_BYTES
    )
    cpu_offload_gb: float | None = setting(
        None, "GiB of weights offloaded to host memory", minimum=0, maximum=MAX_OFFLOAD_GIB
    )


@dataclass(frozen=True)
class SearchSection:
    strategy: str = setting("smart", "how to search: smart or naive", choices=STRATEGIES)
    first_launch: str = setting(
        "planned",
        "planned: start from the planner's flags when [start] is predicted not to fit",
        choices=FIRST_LAUNCH,
    )
    min_max_model_len: int = setting(
        2048, "never shorten the context below this", minimum=1, maximum=MAX_CONTEXT_TOKENS
    )
    min_max_num_seqs: int = setting(
        16,
        "never lower max_num_seqs below this on its own (a lower start.max_num_seqs is kept as given)",
        minimum=1,
        maximum=65536,
    )
    min_gpu_memory_utilization: float = setting(
        0.5, "lowest utilization to try", exclusive_minimum=0.0, maximum=1.0
    )
    max_gpu_memory_utilization: float = setting(
        0.95, "highest utilization to try", exclusive_minimum=0.0, maximum=1.0
    )
    allow_fp8_kv: bool = setting(True, "may switch the KV cache to fp8")
    allow_eager: bool = setting(True, "may disable CUDA graphs")
    allow_weight_quantization: bool = setting(False, "may quantize weights to fp8 on the fly")
    allow_tensor_parallel: bool = setting(True, "may shard over more of the GPUs present")
    max_attempts: int = setting(8, "most launches in one search", minimum=1, maximum=100)


@dataclass(frozen=True)
class TargetSection:
    concurrency: int | None = setting(None, "requests that must fit at once", minimum=1, maximum=MAX_SEQS)
    context: int | None = setting(
        None, "tokens per request that must fit", minimum=1, maximum=MAX_CONTEXT_TOKENS
    )


@dataclass(frozen=True)
class ProbeSection:
    enabled: bool = setting(True, "run the load probe before a config counts")
    requests: int = setting(8, "chat completions to send", minimum=1, maximum=10000)
    concurrency: int | None = setting(
        None, "at a time; default: target.concurrency or 1", minimum=1, maximum=MAX_SEQS
    )
    prompt_tokens: int | None = setting(
        None, "prompt size; default: near the context limit", minimum=1, maximum=MAX_CONTEXT_TOKENS
    )
    output_tokens: int = setting(16, "max_tokens of each request", minimum=1, maximum=MAX_CONTEXT_TOKENS)
    request_timeout_s: float = setting(
        300.0, "timeout of one request", exclusive_minimum=0, maximum=MAX_DURATION_S
    )
    timeout_s: float = setting(
        900.0, "timeout of the whole probe", exclusive_minimum=0, maximum=MAX_DURATION_S
    )
    max_concurrency: int = setting(
        16,
        "most ordinary requests (~256 prompt tokens) the probe sends at once to prove the concurrency "
        "vLLM gives (fewer when max_num_seqs or vLLM's KV figure holds fewer); 1: none",
        minimum=1,
        maximum=256,
    )


@dataclass(frozen=True)
class DaemonSection:
    health_interval_s: float = setting(
        5.0, "seconds between /health checks", exclusive_minimum=0, maximum=MAX_DURATION_S
    )
    health_timeout_s: float = setting(
        5.0, "timeout of one health check", exclusive_minimum=0, maximum=MAX_DURATION_S
    )
    health_failures: int = setting(
        3,
        "consecutive failed /health checks, with no progress meanwhile, that count as a hang",
        minimum=1,
        maximum=MAX_COUNT,
    )
    liveness_interval_s: float = setting(
        60.0,
        "seconds between reads of vLLM's progress figures (/metrics); an idle server also gets a "
        "one-token completion this often",
        exclusive_minimum=0,
        maximum=MAX_DURATION_S,
    )
    progress_timeout_s: float = setting(
        300.0,
        "work pending and no token produced for this long is a hang (sized for a long prefill of a "
        "large model); a server whose token counters move is never restarted",
        exclusive_minimum=0,
        maximum=MAX_DURATION_S,
    )
    drain_timeout_s: float = setting(
        120.0,
        "a restart r1sup chooses (a reload that changes flags) first waits this long for the requests "
        "in flight (on SIGTERM: at most server.stop_timeout_s); 0 stops at once",
        minimum=0,
        maximum=MAX_DURATION_S,
    )
    drain_unready_s: float = setting(
        0.0,
        "a drain first answers /readyz 503 for at least this long while vLLM still takes requests, so "
        "that a load balancer that polls /readyz stops sending here before vLLM stops listening (part "
        "of the drain's budget; Kubernetes' preStop pause does this for a Service); 0: none",
        minimum=0,
        maximum=MAX_DURATION_S,
    )
    backoff_initial_s: float = setting(2.0, "first restart delay", minimum=0, maximum=MAX_DURATION_S)
    backoff_max_s: float = setting(120.0, "longest restart delay", minimum=0, maximum=MAX_DURATION_S)
    restart_budget: int = setting(5, "restarts allowed before exiting non-zero", minimum=0, maximum=MAX_COUNT)
    stable_after_s: float = setting(
        600.0, "serving this long resets the restart budget", exclusive_minimum=0, maximum=MAX_DURATION_S
    )
    metrics_host: str = setting("127.0.0.1", "address of the Prometheus endpoint", validate=_check_host)
    metrics_port: int = setting(0, "Prometheus metrics port; 0 disables", minimum=0, maximum=65535)
    memory_check_s: float = setting(
        30.0,
        "serving a profile degraded by other processes' memory: seconds between checks whether it is back",
        exclusive_minimum=0,
        maximum=MAX_DURATION_S,
    )
    termination_log: str = setting(
        "/dev/termination-log",
        "file that gets the one-line verdict of a non-zero exit (Kubernetes' terminationMessagePath), "
        "written only where it exists; empty: off",
    )


def _check_store(value: str) -> None:
    if not value.strip():
        raise ValueError("must not be empty (leave it unset for no shared store)")
    if "://" in value and not value.startswith(("http://", "https://")):
        scheme = value.split("://", 1)[0]
        raise ValueError(f"{scheme}:// is not supported; give a directory or an http(s) URL")


@dataclass(frozen=True)
class StateSection:
    dir: str = setting(
        "",
        "directory for profiles and status.json; default: /var/lib/r1sup/NAME for a config file "
        "NAME.toml (/var/lib/r1sup for r1sup.toml), as the systemd units use",
    )
    profile_store: str | None = setting(
        None,
        "profiles shared by a fleet: a directory (a ReadWriteMany volume) or an http(s) URL (read-only)",
        validate=_check_store,
    )
    profile_lease_s: float = setting(
        120.0,
        "a replica tuning for the fleet renews its lease every third of this",
        minimum=1.0,
        maximum=MAX_DURATION_S,
    )
    profile_wait_s: float = setting(
        3600.0,
        "longest wait for another replica's tune before tuning here",
        minimum=0,
        maximum=MAX_DURATION_S,
    )


def _check_master_addr(value: str) -> None:
    if any(ch.isspace() for ch in value):
        raise ValueError("must be a host name or IP address")


@dataclass(frozen=True)
class MultinodeSection:
    nnodes: int = setting(
        1,
        "nodes one vLLM instance spans; 1: one box, the rest of this section unused",
        minimum=1,
        maximum=MAX_COUNT,
    )
    backend: str = setting(
        "mp",
        "how the nodes meet: mp (vLLM's own --nnodes/--node-rank mode; the other nodes run `r1sup worker`) "
        "or ray (a Ray cluster over the nodes)",
        choices=("mp", "ray"),
    )
    node_rank: int = setting(
        0,
        "this node's rank: 0 on the leader (`r1sup run`), 1 to nnodes - 1 under `r1sup worker`",
        minimum=0,
        maximum=MAX_COUNT,
    )
    master_addr: str = setting(
        "",
        "the leader's address (mp: vLLM's rendezvous; `r1sup worker` reads the leader's /status there)",
        validate=_check_master_addr,
    )
    master_port: int = setting(29501, "mp: vLLM's rendezvous port on the leader", minimum=1, maximum=65535)
    worker_launch: list[str] = setting(
        ["-m", "vllm.entrypoints.cli.main", "serve"],
        "`r1sup worker`: arguments after server.python that start vLLM headless (`vllm serve`; the "
        "server.launch module has no --headless)",
    )
    leader_port: int | None = setting(
        None,
        "`r1sup worker`: the port of the leader's r1sup endpoint; default: daemon.metrics_port",
        minimum=1,
        maximum=65535,
    )
    leader_poll_s: float = setting(
        2.0,
        "`r1sup worker`: how often it reads the leader's /status",
        exclusive_minimum=0,
        maximum=MAX_DURATION_S,
    )


# --- [slo]: the service level `r1sup tune` proves after the memory search (issue 37) -----------------


def _check_prompts_file(value: str) -> None:
    if not value.strip():
        raise ValueError("must name a JSONL file of prompts, or be left out")


@dataclass(frozen=True)
class SloSection:
    ttft_p95_s: float | None = setting(
        None,
        "p95 time to first token to meet (seconds); with itl_p95_s or e2e_p95_s: tune proves the "
        "highest concurrency that meets them",
        exclusive_minimum=0,
        maximum=MAX_DURATION_S,
    )
    itl_p95_s: float | None = setting(
        None,
        "p95 inter-token latency to meet (seconds, the gaps between streamed chunks)",
        exclusive_minimum=0,
        maximum=MAX_DURATION_S,
    )
    e2e_p95_s: float | None = setting(
        None, "p95 end-to-end request time to meet (seconds)", exclusive_minimum=0, maximum=MAX_DURATION_S
    )
    prompt_tokens: int = setting(
        256, "prompt length in tokens (the low end of a range)", minimum=1, maximum=MAX_CONTEXT_TOKENS
    )
    prompt_tokens_max: int | None = setting(
        None,
        "with it: prompt lengths spread evenly from prompt_tokens to this",
        minimum=1,
        maximum=MAX_CONTEXT_TOKENS,
    )
    output_tokens: int = setting(
        64, "max_tokens of each request (the low end of a range)", minimum=2, maximum=MAX_CONTEXT_TOKENS
    )
    output_tokens_max: int | None = setting(
        None,
        "with it: output lengths spread evenly from output_tokens to this",
        minimum=2,
        maximum=MAX_CONTEXT_TOKENS,
    )
    prompts_file: str | None = setting(
        None,
        'JSONL of real prompts ({"prompt": ...} per line, optional "output_tokens"); "sample": the '
        "shipped sample; instead of generated prompts of prompt_tokens",
        validate=_check_prompts_file,
    )
    requests_per_level: int = setting(
        24,
        "requests measured at each load level, as vLLM's sweep's --num-prompts (at least its concurrency "
        "are sent; one unmeasured warm-up request goes first)",
        minimum=4,
        maximum=4096,
    )
    max_concurrency: int = setting(64, "highest load level tried", minimum=1, maximum=1024)
    level_timeout_s: float = setting(
        120.0, "longest one load level may take", exclusive_minimum=0, maximum=MAX_DURATION_S
    )
    budget_s: float = setting(
        600.0, "time budget of the whole service-level search", exclusive_minimum=0, maximum=MAX_DURATION_S
    )

    @property
    def enabled(self) -> bool:
        return any(v is not None for v in (self.ttft_p95_s, self.itl_p95_s, self.e2e_p95_s))


def _check_slo(slo: SloSection) -> None:
    for low, high in (("prompt_tokens", "prompt_tokens_max"), ("output_tokens", "output_tokens_max")):
        top = getattr(slo, high)
        if top is not None and top < getattr(slo, low):
            raise ConfigError(f"slo.{high}", f"({top}) is below slo.{low} ({getattr(slo, low)})")


@dataclass(frozen=True)
class Renamed:
    """A setting or section given under its old name (:data:`RENAMED_SECTIONS`), and where."""

    old: str  # "[ladder]" or "ladder.max_attempts"
    new: str  # "[search]" or "search.max_attempts"
    where: str  # the file, "the environment variable R1SUP_LADDER_...", "the command line"


@dataclass(frozen=True)
class Config:
    model: ModelSection
    server: ServerSection = field(default_factory=ServerSection)
    start: StartSection = field(default_factory=StartSection)
    search: SearchSection = field(default_factory=SearchSection)
    target: TargetSection = field(default_factory=TargetSection)
    probe: ProbeSection = field(default_factory=ProbeSection)
    daemon: DaemonSection = field(default_factory=DaemonSection)
    state: StateSection = field(default_factory=StateSection)
    multinode: MultinodeSection = field(default_factory=MultinodeSection)
    slo: SloSection = field(default_factory=SloSection)
    source: str | None = None  # the file it came from, for messages
    # the old names it used (:data:`RENAMED_SECTIONS`), each for one warning; not part of what it asks
    renamed: tuple[Renamed, ...] = field(default=(), compare=False)

    @property
    def served_name(self) -> str:
        return self.model.served_name or self.model.name

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in _sections()}


def _sections() -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(Config) if f.name in SECTIONS]


SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "server": ServerSection,
    "start": StartSection,
    "search": SearchSection,
    "target": TargetSection,
    "probe": ProbeSection,
    "daemon": DaemonSection,
    "state": StateSection,
    "multinode": MultinodeSection,
    "slo": SloSection,
}

# Sections read under an old name for one release: old -> new. The old name of a file's section, of an
# R1SUP_* variable or of a --set key is read as the new one, with a warning naming the new key
# (:class:`Renamed`); the old and the new section in one file is a config error.
RENAMED_SECTIONS: dict[str, str] = {"ladder": "search"}


def declarations() -> Iterable[tuple[str, dataclasses.Field[Any], Any]]:
    """Yield (dotted name, field, type) for every setting, in declaration order."""
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            yield f"{section}.{f.name}", f, hints[f.name]


# --- type conversion ---------------------------------------------------------------------------


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _type_name(tp: Any) -> str:
    base, optional = _unwrap_optional(tp)
    origin = typing.get_origin(base)
    name = {list: "a list of strings", dict: "a table of strings"}.get(origin) or {
        int: "an integer",
        float: "a number",
        bool: "true or false",
        str: "a string",
    }[base]
    return name + (" (or absent)" if optional else "")


def _coerce(dotted: str, tp: Any, value: Any) -> Any:
    """Check a TOML value against the declared type. TOML already gives typed values."""
    base, optional = _unwrap_optional(tp)
    if value is None and optional:
        return None
    origin = typing.get_origin(base)
    ok: bool
    if base is bool:
        ok = isinstance(value, bool)
    elif base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            value = float(value)
    elif base is str:
        ok = isinstance(value, str)
    elif origin is list:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    elif origin is dict:
        ok = isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
    else:  # pragma: no cover - a declaration with an unsupported type is a programming error
        raise TypeError(f"{dotted}: unsupported setting type {tp!r}")
    if not ok:
        raise ConfigError(dotted, f"expected {_type_name(tp)}, got {_describe(value)}")
    return value


def _describe(value: Any) -> str:
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "a list" if all(isinstance(v, str) for v in value) else "a list with non-strings"
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}"


def _parse_text(dotted: str, tp: Any, text: str) -> Any:
    """Parse a value given as text (environment or command line) according to the declared type."""
    base, optional = _unwrap_optional(tp)
    origin = typing.get_origin(base)
    if optional and text.strip().lower() in ("", "none", "null"):
        return None
    if base is str:
        return text
    if base is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(dotted, f"expected true or false, got {_clip(text)}")
    if base is int:
        try:
            return int(text.strip().replace("_", ""))
        except ValueError:
            raise ConfigError(dotted, f"expected an integer, got {_clip(text)}") from None
    if base is float:
        try:
            return float(text.strip())
        except ValueError:
            raise ConfigError(dotted, f"expected a number, got {_clip(text)}") from None
    if origin in (list, dict):
        try:
            return tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            kind = "list" if origin is list else "inline table"
            raise ConfigError(dotted, f"expected a TOML {kind}, got {_clip(text)}") from None
        except (RecursionError, ValueError, MemoryError) as exc:  # nested thousands deep, or huge
            raise ConfigError(dotted, f"TOML could not be parsed: {type(exc).__name__}") from None
    raise ConfigError(dotted, f"cannot be set from text ({_type_name(tp)})")  # pragma: no cover


def _clip(text: str, limit: int = 80) -> str:
    """``text`` quoted for a one-line message, cut after ``limit`` characters."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def _number(value: Any) -> str:
    """A number for a one-line message: an integer of hundreds of digits is shown by its size."""
    text = str(value)
    return text if len(text) <= 40 else f"{text[:12]}... ({len(text)} digits)"


def _check(dotted: str, f: dataclasses.Field[Any], value: Any) -> None:
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):  # nan passes every comparison below
        raise ConfigError(dotted, f"must be a finite number; got {value}")
    meta = f.metadata
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(dotted, f"must be one of {', '.join(meta['choices'])}; got {value!r}")
    if "minimum" in meta and value < meta["minimum"]:
        raise ConfigError(dotted, f"must be >= {meta['minimum']}; got {_number(value)}")
    if "maximum" in meta and value > meta["maximum"]:
        raise ConfigError(dotted, f"must be <= {meta['maximum']}; got {_number(value)}")
    if "exclusive_minimum" in meta and value <= meta["exclusive_minimum"]:
        raise ConfigError(dotted, f"must be > {meta['exclusive_minimum']}; got {_number(value)}")
    if "validate" in meta:
        validator: Callable[[Any], None] = meta["validate"]
        try:
            validator(value)
        except ValueError as exc:
            raise ConfigError(dotted, str(exc)) from None


def check_start_value(dotted: str, name: str, value: Any) -> None:
    """Check ``value`` as the ``[start]`` setting ``name`` would be checked (its declared range and
    choices: what vLLM accepts for that flag); raises :class:`ConfigError` on ``dotted``. Profiles and
    the fleet's store hold the same flags and are checked with this one declaration."""
    fields = {f.name: f for f in dataclasses.fields(StartSection)}
    if name not in fields:
        raise ConfigError(dotted, "unknown flag")
    _check(dotted, fields[name], value)


# --- sources -----------------------------------------------------------------------------------


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a TOML file; a missing file, one over 1 MiB or a syntax error is a ConfigError naming the file.

    The file is opened without blocking and must be a regular file: a FIFO (which would block until a
    writer comes), a device or a socket is refused (exit 2) before anything is read. At most
    ``MAX_CONFIG_BYTES + 1`` bytes are read, so a huge file cannot exhaust memory.
    """
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError("", f"config file not found: {p}") from None
    except IsADirectoryError:
        raise ConfigError("", f"config path is a directory: {p}") from None
    except OSError as exc:
        raise ConfigError("", f"cannot read config file {p}: {exc.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise ConfigError("", f"config path is a directory: {p}")
        if not stat.S_ISREG(mode):
            raise ConfigError("", f"config path is not a regular file ({_file_kind(mode)}): {p}")
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_CONFIG_BYTES:
            chunk = os.read(fd, MAX_CONFIG_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        data = b"".join(chunks)
    except OSError as exc:
        raise ConfigError("", f"cannot read config file {p}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError("", f"{p}: larger than {MAX_CONFIG_BYTES // 1024} KiB; not a config file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError("", f"{p}: not UTF-8 text (byte {exc.start})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # tomllib's message ends with "(at line N, column M)"
        raise ConfigError("", f"{p}: TOML syntax error: {exc}") from None
    except (RecursionError, ValueError) as exc:  # pathological input
        raise ConfigError("", f"{p}: TOML could not be parsed: {type(exc).__name__}") from None


def default_state_dir(source: str | os.PathLike[str] | None) -> str:
    """The state directory of a config that does not set ``state.dir``: derived from the file's name
    exactly as the systemd units lay it out, so a hand-run ``r1sup tune --config /etc/r1sup/NAME.toml``
    saves where ``r1sup@NAME`` looks (``/var/lib/r1sup/NAME``); ``r1sup.toml`` (``r1sup.service``) and
    a config without a file use ``/var/lib/r1sup``."""
    if not source:
        return STATE_ROOT
    name = Path(source).name
    stem = name[: -len(".toml")] if name.endswith(".toml") else name
    if stem in ("", ".", "..", SHARED_CONFIG_NAME):
        return STATE_ROOT
    return f"{STATE_ROOT}/{stem}"


def env_settings(environ: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """``R1SUP_<SECTION>_<KEY>`` variables: dotted name -> (variable name, value)."""
    out: dict[str, tuple[str, str]] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        section, _, key = rest.partition("_")
        if (section not in SECTIONS and section not in RENAMED_SECTIONS) or not key:
            continue  # not a setting (R1SUP_LOG_LEVEL, R1SUP_CONFIG, ...)
        out[f"{section}.{key}"] = (name, value)
    return out


def parse_assignments(items: Iterable[str]) -> dict[str, str]:
    """``--set section.key=value`` items as a mapping of dotted names to text."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or "." not in name:
            raise ConfigError("--set", f"expected section.key=value, got {item!r}")
        out[name.strip()] = value
    return out


def build(
    data: Mapping[str, Any],
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    source: str | None = None,
) -> Config:
    """Combine the layers and validate. ``overrides`` values may be text or typed values."""
    if not isinstance(data, Mapping):
        raise ConfigError("", "the config must be a TOML table")
    data, renamed = _read_renamed_sections(data, source)
    for section, body in data.items():
        if section not in SECTIONS:
            raise ConfigError(_printable(section), f"unknown section (known: {', '.join(SECTIONS)})")
        if not isinstance(body, Mapping):
            raise ConfigError(section, "must be a table ([" + section + "])")
        known = {f.name for f in dataclasses.fields(SECTIONS[section])}
        for key in body:
            if key not in known:
                raise ConfigError(f"{section}.{_printable(key)}", _unknown_key_message(section, key, known))

    # (layer, where each of its settings came from, for messages)
    text_layers: list[tuple[Mapping[str, Any], dict[str, str]]] = []
    if env:
        from_env = env_settings(env)
        text_layers.append(
            (
                {dotted: value for dotted, (_, value) in from_env.items()},
                {dotted: f"the environment variable {name}" for dotted, (name, _) in from_env.items()},
            )
        )
    if overrides:
        text_layers.append((overrides, dict.fromkeys(overrides, "the command line")))
    text_layers = [_read_renamed_settings(layer, where, renamed) for layer, where in text_layers]
    decls = {dotted: (f, tp) for dotted, f, tp in declarations()}
    for layer, where in text_layers:
        for dotted in layer:
            if dotted not in decls:
                section, _, key = dotted.partition(".")
                known = (
                    {f.name for f in dataclasses.fields(SECTIONS[section])} if section in SECTIONS else set()
                )
                hint = _unknown_key_message(section, key, known) if known else "unknown setting"
                raise ConfigError(_printable(dotted), f"{hint} (from {where[dotted]})")

    came_from: dict[str, str] = {}  # settings whose effective value came from a text layer
    try:
        sections: dict[str, Any] = {}
        for section, cls in SECTIONS.items():
            values: dict[str, Any] = {}
            body = data.get(section, {})
            for f in dataclasses.fields(cls):
                dotted = f"{section}.{f.name}"
                _, tp = decls[dotted]
                present = False
                if f.name in body:
                    values[f.name] = _coerce(dotted, tp, body[f.name])
                    present = True
                for layer, where in text_layers:
                    if dotted in layer:
                        came_from[dotted] = where[dotted]
                        raw = layer[dotted]
                        values[f.name] = (
                            _parse_text(dotted, tp, raw) if isinstance(raw, str) else _coerce(dotted, tp, raw)
                        )
                        values[f.name] = _coerce(dotted, tp, values[f.name])
                        present = True
                if not present:
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                        raise ConfigError(dotted, "required but not set")
                    continue
                _check(dotted, f, values[f.name])
            sections[section] = cls(**values)
        if not sections["state"].dir:
            sections["state"] = dataclasses.replace(sections["state"], dir=default_state_dir(source))
        config = Config(**sections, source=source, renamed=tuple(renamed))
        _cross_check(config, env or {})
    except ConfigError as exc:
        if exc.field in came_from:  # say where a value that is not in the file came from
            raise ConfigError(exc.field, f"{exc.message} (from {came_from[exc.field]})") from None
        raise
    return config


def _read_renamed_sections(
    data: Mapping[str, Any], source: str | None
) -> tuple[Mapping[str, Any], list[Renamed]]:
    """The file's sections with each old name (:data:`RENAMED_SECTIONS`) read as the new one; a file
    that has both is a config error."""
    renamed: list[Renamed] = []
    out = dict(data)
    for old, new in RENAMED_SECTIONS.items():
        if old not in out:
            continue
        if new in out:
            raise ConfigError(
                f"[{old}]", f"[{new}] is given too; [{old}] is the old name of [{new}]: keep [{new}] only"
            )
        out[new] = out.pop(old)
        renamed.append(Renamed(f"[{old}]", f"[{new}]", source or "the config"))
    return out, renamed


def _read_renamed_settings(
    layer: Mapping[str, Any], where: dict[str, str], renamed: list[Renamed]
) -> tuple[Mapping[str, Any], dict[str, str]]:
    """A text layer (environment, command line) with each ``old.key`` read as ``new.key``; one that
    gives both is a config error. Each one read so is added to ``renamed``."""
    out: dict[str, Any] = {}
    out_where: dict[str, str] = {}
    for dotted, value in layer.items():
        section, _, key = dotted.partition(".")
        new = RENAMED_SECTIONS.get(section)
        if new is None:
            name = dotted
        else:
            name = f"{new}.{key}"
            if name in layer:
                raise ConfigError(
                    _printable(dotted), f"{name} is given too (from {where[name]}); keep {name} only"
                )
            renamed.append(Renamed(dotted, name, where[dotted]))
        out[name] = value
        out_where[name] = where[dotted]
    return out, out_where


def _printable(name: str) -> str:
    """A key as it can stand in a one-line message: quoted when it holds odd characters."""
    return name if name.isprintable() and name.strip() == name and name else repr(name)


def _unknown_key_message(section: str, key: str, known: set[str]) -> str:
    import difflib

    close = difflib.get_close_matches(key, sorted(known), n=1)
    hint = f"; did you mean {section}.{close[0]}?" if close else ""
    return f"unknown setting{hint}"


def _cross_check(config: Config, env: Mapping[str, str]) -> None:
    lad = config.search
    if lad.min_gpu_memory_utilization > lad.max_gpu_memory_utilization:
        raise ConfigError(
            "search.min_gpu_memory_utilization",
            f"must be <= search.max_gpu_memory_utilization ({lad.max_gpu_memory_utilization})",
        )
    if config.daemon.backoff_initial_s > config.daemon.backoff_max_s:
        raise ConfigError("daemon.backoff_initial_s", "must be <= daemon.backoff_max_s")
    if not config.model.name.strip():
        raise ConfigError("model.name", "must not be empty")
    tgt = config.target
    if (tgt.concurrency is None) != (tgt.context is None):
        missing = "target.context" if tgt.context is None else "target.concurrency"
        raise ConfigError(missing, "set both target.concurrency and target.context, or neither")
    start = config.start
    if (
        start.max_model_len is not None
        and config.target.context
        and start.max_model_len < config.target.context
    ):
        raise ConfigError(
            "target.context",
            f"({config.target.context}) is longer than start.max_model_len ({start.max_model_len})",
        )
    if start.max_model_len is not None and start.max_model_len < lad.min_max_model_len:
        raise ConfigError(
            "start.max_model_len",
            f"({start.max_model_len}) is shorter than search.min_max_model_len ({lad.min_max_model_len}), "
            "the shortest context the search may use; lower search.min_max_model_len or raise the context",
        )
    probe = config.probe
    longest = start.max_model_len
    if probe.prompt_tokens is not None and longest and probe.prompt_tokens + probe.output_tokens > longest:
        raise ConfigError(
            "probe.prompt_tokens",
            f"({probe.prompt_tokens}) + probe.output_tokens ({probe.output_tokens}) do not fit in "
            f"start.max_model_len ({longest}): vLLM would refuse every probe request",
        )
    _check_multinode(config)
    _check_slo(config.slo)
    if config.daemon.metrics_port and config.daemon.metrics_port == config.server.port:
        raise ConfigError("daemon.metrics_port", f"is the same as server.port ({config.server.port})")
    if (
        not is_loopback(config.server.host)
        and not config.server.allow_public_bind
        and not _has_key_source(config, env)
    ):
        raise ConfigError(
            "server.host",
            f"{config.server.host} is not a loopback address and no API key is configured; "
            "set server.api_key_file (or VLLM_API_KEY) or server.allow_public_bind = true",
        )


def _check_multinode(config: Config) -> None:
    from r1sup.core.multinode import role_flags_in

    multi = config.multinode
    if multi.node_rank >= multi.nnodes:
        raise ConfigError(
            "multinode.node_rank", f"({multi.node_rank}) must be below multinode.nnodes ({multi.nnodes})"
        )
    if multi.nnodes <= 1:
        return
    taken = role_flags_in(config.server.extra_args)
    if taken:
        raise ConfigError(
            "server.extra_args",
            f"{taken[0]} is set by r1sup from [multinode] when multinode.nnodes > 1; remove it",
        )
    if multi.backend == "mp" and not multi.master_addr:
        raise ConfigError(
            "multinode.master_addr",
            "must be set (the leader's address) when multinode.nnodes > 1 with backend mp",
        )


def _has_key_source(config: Config, env: Mapping[str, str]) -> bool:
    return bool(config.server.api_key_file) or bool(env.get("VLLM_API_KEY"))


def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _file_kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a plain file"


RELOAD_READ_TIMEOUT_S = 10.0


def load_bounded(
    path: str | os.PathLike[str] | None,
    *,
    overrides: Mapping[str, Any] | None = None,
    timeout_s: float = RELOAD_READ_TIMEOUT_S,
) -> Config:
    """:func:`load` in a worker thread, waited for at most ``timeout_s``: a reload from the daemon's loop
    cannot wedge it on a file system that does not answer. ConfigError when the read took longer (the
    worker is left to finish on its own; its result is dropped)."""
    import threading

    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["config"] = load(path, overrides=overrides)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = exc

    worker = threading.Thread(target=work, name="config-read", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise ConfigError("", f"{path}: not read within {timeout_s:g} s (a stalled file system?)")
    if "error" in box:
        raise box["error"]
    config: Config = box["config"]
    return config


def load(
    path: str | os.PathLike[str] | None,
    *,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Load a config file with environment and command-line overrides, all validated."""
    data = read_toml(path) if path is not None else {}
    env = os.environ if environ is None else environ
    return build(data, env=env, overrides=overrides, source=str(path) if path else None)


def describe(config: Config) -> list[tuple[str, Any, str]]:
    """(dotted name, effective value, help) for every setting, for ``r1sup check``."""
    rows = []
    for dotted, f, _ in declarations():
        section, _, key = dotted.partition(".")
        rows.append((dotted, getattr(getattr(config, section), key), f.metadata.get("help", "")))
    return rows
