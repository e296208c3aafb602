"""What a launch can end in: a failure class, a phase, evidence and numbers. Shared vocabulary.

The log reader produces :class:`Failure` values, the launcher and the probe add the ones only
they can see (a hang, a failed probe), the search keys on ``cls``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

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
class Failure:
    """The verdict on a launch or a serving period.

    ``numbers`` uses the canonical keys: max_model_len, estimated_max_model_len, kv_capacity_tokens,
    kv_needed_gib, kv_available_gib, free_gib, total_gib, requested_gib, gpu_memory_utilization,
    tried_to_allocate_mib, device_free_mib, device_total_gib, and on the success path weights_gib,
    kv_cache_gib, kv_cache_tokens, max_concurrency, cudagraph_gib, peak_activation_gib.
    """

    cls: str
    phase: str = PHASE_STARTUP
    evidence: str = ""
    numbers: Mapping[str, float] = field(default_factory=dict)
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
            "numbers": dict(self.numbers),
            "detail": self.detail,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Failure:
        return cls(
            cls=str(data.get("class", NONE)),
            phase=str(data.get("phase", PHASE_STARTUP)),
            evidence=str(data.get("evidence", "")),
            numbers={k: float(v) for k, v in dict(data.get("numbers") or {}).items()},
            detail=str(data.get("detail", "")),
        )


NO_FAILURE = Failure(NONE)
