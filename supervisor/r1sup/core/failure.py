"""What a launch can end in: a failure class, a phase, evidence and numbers. Shared vocabulary.

The log reader produces :class:`Failure` values, the launcher and the probe add the ones only
they can see (a hang, a failed probe), the search keys on ``cls``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from r1sup.core.figures import EMPTY, Figures, known_numbers
from r1sup.core.figures import FIELD_NAMES as FIGURE_NAMES

# Memory classes: a different configuration can fix them.
OOM_WEIGHTS = "oom_weights"
OOM_PROFILE = "oom_profile"
OOM_CUDAGRAPH = "oom_cudagraph"
OOM_KV_ALLOC = "oom_kv_alloc"
OOM_RUNTIME = "oom_runtime"
KV_INSUFFICIENT = "kv_insufficient"
NO_KV_MEMORY = "no_kv_memory"
FREE_MEM_BELOW_UTIL = "free_mem_below_util"
HOST_OOM = "host_oom"

# Non-memory classes.
FP8_UNSUPPORTED = "fp8_unsupported"
CUDA_ERROR = "cuda_error"
PORT_IN_USE = "port_in_use"
MODEL_NOT_FOUND = "model_not_found"
CONFIG_ERROR = "config_error"
ENGINE_DEAD = "engine_dead"
HANG = "hang"  # seen by the launcher or the daemon: no output, no progress, no readiness
INTERNAL_ERROR = "internal_error"  # r1sup's own machinery failed (the probe child, a bug): never the engine
# The probe's own faults, seen only by the probe, never read from a log and never the engine's death:
# vLLM answered a probe request with a 4xx (r1sup's request is wrong: its context, its tokens), or probe
# requests failed on the connection after their retries while vLLM's /health answered, or they were
# answered with a 5xx that is not vLLM's engine-dead reply (a proxy's 502/503, a server shutting down)
# while vLLM's /health answered, or they got no answer within probe.request_timeout_s while vLLM's
# /health answered and its counters did not show a stall (a busy engine).
PROBE_REJECTED = "probe_rejected"
PROBE_CONNECTION = "probe_connection"
PROBE_SERVER_ERROR = "probe_server_error"
PROBE_TIMEOUT = "probe_timeout"
NONE = "none"

MEMORY_CLASSES = frozenset(
    {
        OOM_WEIGHTS,
        OOM_PROFILE,
        OOM_CUDAGRAPH,
        OOM_KV_ALLOC,
        OOM_RUNTIME,
        KV_INSUFFICIENT,
        NO_KV_MEMORY,
        FREE_MEM_BELOW_UTIL,
        HOST_OOM,
    }
)
NON_MEMORY_CLASSES = frozenset(
    {
        FP8_UNSUPPORTED,
        CUDA_ERROR,
        PORT_IN_USE,
        MODEL_NOT_FOUND,
        CONFIG_ERROR,
        ENGINE_DEAD,
        HANG,
        INTERNAL_ERROR,
        PROBE_REJECTED,
        PROBE_CONNECTION,
        PROBE_SERVER_ERROR,
        PROBE_TIMEOUT,
        NONE,
    }
)
ALL_CLASSES = MEMORY_CLASSES | NON_MEMORY_CLASSES

# Phases, in the order a start-up walks through them.
PHASE_STARTUP = "startup"  # before or outside the steps below (argument checks, model resolution)
PHASE_LOAD_WEIGHTS = "load_weights"
PHASE_PROFILE = "profile"  # profile / dummy run, sampler warm-up, determine_available_memory
PHASE_KV_CACHE = "kv_cache"  # KV sizing and allocation
PHASE_CUDA_GRAPH = "cuda_graph"
PHASE_SERVING = "serving"  # after the server was ready
PHASES = (PHASE_STARTUP, PHASE_LOAD_WEIGHTS, PHASE_PROFILE, PHASE_KV_CACHE, PHASE_CUDA_GRAPH, PHASE_SERVING)

# How far a start-up got: the milestones its log shows, in the order vLLM passes them, each with the
# phase that runs after it. A failure whose traceback names no step, and a hang, are in the phase after
# the last milestone passed. The profile phase comes twice: the profile run after the weights are
# loaded (the warm-up on CPU), and the sampler warm-up after the CUDA graphs are captured.
STARTUP_MILESTONES: tuple[tuple[str, str], ...] = (
    ("launched", PHASE_STARTUP),  # nothing yet: arguments, model resolution, the engine's processes
    ("weights_started", PHASE_LOAD_WEIGHTS),  # "Starting to load model", the checkpoint shards
    ("weights_loaded", PHASE_PROFILE),  # "Model loading took ...": the profile run is next
    ("kv_sized", PHASE_KV_CACHE),  # the KV cache's size printed: its allocation is next
    ("capture_started", PHASE_CUDA_GRAPH),  # "Capturing CUDA graphs ..."
    ("captured", PHASE_PROFILE),  # "Graph capturing finished": the sampler warm-up is next
)
MILESTONES = tuple(name for name, _ in STARTUP_MILESTONES)


def milestone(name: str) -> int:
    """The position of a start-up milestone (later milestones are larger)."""
    return MILESTONES.index(name)


def phase_after(reached: int) -> str:
    """The phase a start-up is in once it passed the milestone at position ``reached``."""
    return STARTUP_MILESTONES[reached][1]


@dataclass(frozen=True)
class Numbers:
    """The figures a launch's log printed up to its verdict: one frozen, typed value.

    ``figures``: the launch's own figures (the success path), with those a failure message printed
    again over them (the context, the free and total memory, the utilization and budget of a failed
    check, the port another process holds). The other fields are the figures only failure messages
    carry, then those a hung serving engine's verdict rests on. Every field is optional (None: not
    printed); units are in the names: ``_gib``, ``_mib``, ``_gb`` (decimal GB, as Ray prints them),
    ``_s``, ``_tokens``; lengths, counts and indices are plain numbers. A number is kept as vLLM printed
    it (an int when it had no decimals).

    Serialised (run records, ``diagnose --json``, events) by :meth:`to_dict`: one flat object whose keys
    are the field names (the log reader's canonical keys), in the order :meth:`from_dict` read them (the
    order the log printed them: records and ``--json`` output stay the bytes r1sup wrote when the
    numbers were a dict), then any other field set, in the order declared.
    """

    figures: Figures = EMPTY
    # the KV cache checks ("... X GiB KV cache is needed, ... the available KV cache memory (Y GiB)")
    kv_needed_gib: float | None = None
    kv_available_gib: float | None = None  # may be negative: the budget was spent before the KV cache
    estimated_max_model_len: int | None = None  # "the estimated maximum model length is N"
    kv_capacity_tokens: int | None = None  # v0's "tokens that can be stored in KV cache (N)"; blocks x block
    derived_max_model_len: int | None = None  # "greater than the derived max_model_len (N)"
    # the start-up's free-memory check
    initial_free_gib: float | None = None  # "Initial free memory X GiB, current free memory Y GiB"
    shortfall_gib: float | None = None  # r1sup's: requested minus free, what was missing
    # torch's out-of-memory message and its breakdown
    tried_to_allocate_mib: float | None = None
    device_index: int | None = None
    device_total_gib: float | None = None
    device_free_mib: float | None = None
    device_allocated_gib: float | None = None
    process_in_use_gib: float | None = None
    allocated_by_pytorch_gib: float | None = None
    private_pools_mib: float | None = None
    reserved_unallocated_mib: float | None = None
    dummy_requests: int | None = None  # the sampler's warm-up batch that ran out of memory
    # Ray's memory monitor
    host_used_gb: float | None = None
    host_total_gb: float | None = None
    # the device's compute capability an unsupported kernel named (7.5, 8.9)
    compute_capability: float | None = None
    # a serving engine judged hung or dead: the liveness figures the verdict rests on
    # (:func:`r1sup.core.liveness.figures_of`; requests and tokens are vLLM's /metrics counters)
    running: float | None = None
    waiting: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    finished: float | None = None
    kv_usage: float | None = None  # 0..1, the fullest engine's
    since_progress_s: float | None = None
    stalled_s: float | None = None
    metrics_age_s: float | None = None
    health_failures: float | None = None  # in a row
    stats_line_age_s: float | None = None
    stats_running: float | None = None
    stats_waiting: float | None = None
    own_completion_unanswered_s: float | None = None
    # the keys in the order they were read: serialisation only, not part of the value
    key_order: tuple[str, ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Numbers:
        """From the log reader's flat keys or a serialised ``numbers`` object: the numbers of known keys
        (finite, not booleans); anything else is left out."""
        if not data:
            return NO_NUMBERS
        values: dict[str, Any] = known_numbers(data, MESSAGE_NAMES)
        figures = Figures.from_dict(data)
        if not values and not figures:
            return NO_NUMBERS
        kept = {*values, *figures.to_dict()}
        order = tuple(key for key in data if key in kept)
        return cls(figures=figures, **values, key_order=order)

    def to_dict(self) -> dict[str, float]:
        """The numbers printed, by their keys (None left out): the serialised form."""
        flat = self.figures.to_dict()
        flat.update((name, v) for name in MESSAGE_NAMES if (v := getattr(self, name)) is not None)
        out = {key: flat.pop(key) for key in self.key_order if key in flat}
        out.update(flat)
        return out

    def __bool__(self) -> bool:
        """True when the log printed any number."""
        return bool(self.figures) or any(getattr(self, name) is not None for name in MESSAGE_NAMES)


MESSAGE_NAMES: tuple[str, ...] = tuple(
    f.name for f in fields(Numbers) if f.name not in ("figures", "key_order")
)
NUMBER_NAMES: tuple[str, ...] = FIGURE_NAMES + MESSAGE_NAMES
"""Every key :meth:`Numbers.to_dict` can write."""
NO_NUMBERS = Numbers()


@dataclass(frozen=True)
class Failure:
    """The verdict on a launch or a serving period; ``numbers``: what its log printed (:class:`Numbers`)."""

    cls: str
    phase: str = PHASE_STARTUP
    evidence: str = ""
    numbers: Numbers = NO_NUMBERS
    detail: str = ""  # free text: who holds the port, which request failed, ...

    @property
    def memory(self) -> bool:
        return self.cls in MEMORY_CLASSES

    @property
    def ok(self) -> bool:
        return self.cls == NONE

    def to_dict(self) -> dict[str, Any]:
        return {
            "class": self.cls,
            "phase": self.phase,
            "memory": self.memory,
            "evidence": self.evidence,
            "numbers": self.numbers.to_dict(),
            "detail": self.detail,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Failure:
        return cls(
            cls=str(data.get("class", NONE)),
            phase=str(data.get("phase", PHASE_STARTUP)),
            evidence=str(data.get("evidence", "")),
            numbers=Numbers.from_dict(data.get("numbers")),
            detail=str(data.get("detail", "")),
        )


NO_FAILURE = Failure(NONE)
