"""The figures of one launch as vLLM printed them: one frozen, typed value.

Pure (core): no I/O. The log reader (:mod:`r1sup.core.logparse`) produces a :class:`Figures`; the search,
the planner's calibration, the tuner, the daemon, the memory chart, the capacity record and the run
records read its fields. Where figures are persisted (profiles' and run records' ``observations``,
a calibration's ``figures``), :meth:`Figures.to_dict` and :meth:`Figures.from_dict` are the boundary,
and the keys on disk are the field names (the log reader's canonical keys).

Every field is optional (None: the launch did not print it); units are in the names: ``_gib``
(GiB), ``_bytes``, ``_s`` (seconds), ``_tokens``; counts (blocks, tokens per request, a pid) and
fractions (``gpu_memory_utilization``) are plain numbers. A number is kept as vLLM printed it (an int
when it had no decimals), so that a figure read back from disk writes out the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class Figures:
    """What one launch's log says about its memory, KV cache and start-up (see the module's docstring)."""

    # weights ("Model loading took 14.2 GiB and 3.1 s")
    weights_gib: float | None = None
    weights_load_s: float | None = None
    # the device as vLLM saw it at start-up (memory breakdown, init snapshot, the CPU build's KV line)
    total_gib: float | None = None
    node_total_gib: float | None = None
    free_gib: float | None = None
    init_free_gib: float | None = None
    init_cuda_gib: float | None = None
    # the budget: total x gpu_memory_utilization = requested
    gpu_memory_utilization: float | None = None
    requested_gib: float | None = None
    profiled_gpu_memory_utilization: float | None = None
    equivalent_gpu_memory_utilization: float | None = None
    # the memory profile: activation, non-torch, consumed (weights + non-torch)
    non_kv_total_gib: float | None = None
    peak_activation_gib: float | None = None
    breakdown_activation_gib: float | None = None  # 0.27 on: includes the charged CUDA-graph estimate
    non_torch_gib: float | None = None
    consumed_gib: float | None = None
    # CUDA graphs: the captured pool, vLLM's estimate, the capture's time
    cudagraph_gib: float | None = None
    cudagraph_estimated_gib: float | None = None
    cudagraph_capture_s: float | None = None
    # the KV cache
    kv_cache_gib: float | None = None
    kv_cache_tokens: int | None = None
    gpu_blocks: int | None = None
    cpu_blocks: int | None = None
    max_concurrency: float | None = None
    suggested_kv_cache_memory_bytes: int | None = None
    suggested_kv_cache_memory_bytes_full: int | None = None
    # the engine's configuration as it printed it
    max_model_len: int | None = None
    original_max_model_len: int | None = None  # before vLLM's auto-fit reduced it
    max_num_batched_tokens: int | None = None
    engine_init_s: float | None = None
    # the environment
    cuda_driver_version: int | None = None
    repeated_across_cluster: int | None = None  # Ray folded this many workers' same line into one
    port: int | None = None  # the API server's port another process holds ...
    holder_pid: int | None = None  # ... and that process
    # r1sup's own: 1.0 the launch found vLLM's torch.compile cache cold, 0.0 warm
    compile_cache_cold: float | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Figures:
        """From the log reader's keys or a persisted ``observations``/``figures`` object: the numbers of
        known keys (finite, not booleans, within :func:`out_of_bounds`); anything else is left out."""
        if not data:
            return EMPTY
        values = {k: v for k, v in known_numbers(data, FIELD_NAMES).items() if out_of_bounds(k, v) is None}
        return cls(**values) if values else EMPTY  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, float]:
        """The figures printed, by their keys (what profiles and run records store)."""
        return {name: v for name in FIELD_NAMES if (v := getattr(self, name)) is not None}

    def __bool__(self) -> bool:
        """True when the launch printed any figure."""
        return any(getattr(self, name) is not None for name in FIELD_NAMES)

    @property
    def measures_memory(self) -> bool:
        """Any of the memory terms a calibration takes (weights, KV cache, activation, CUDA graphs)."""
        return any(
            v is not None
            for v in (self.weights_gib, self.kv_cache_gib, self.peak_activation_gib, self.cudagraph_gib)
        )

    @property
    def device_total_gib(self) -> float | None:
        """The device's total memory as vLLM printed it (the CPU build's KV line names the node's)."""
        return self.total_gib or self.node_total_gib

    @property
    def non_torch_or_rest_gib(self) -> float | None:
        """Non-torch memory: printed, or consumed minus weights (0.27 on prints only the sum)."""
        if self.non_torch_gib is not None:
            return self.non_torch_gib
        if self.consumed_gib is not None and self.weights_gib is not None:
            return max(0.0, self.consumed_gib - self.weights_gib)
        return None

    def memory_in_use_gib(self, gpus: int = 1) -> float | None:
        """Device memory vLLM holds by its own account (weights, non-torch, CUDA graphs, KV cache,
        summed over the tensor-parallel GPUs); None before it printed its figures."""
        weights, kv = self.weights_gib, self.kv_cache_gib
        if weights is None or kv is None:
            return None
        per_gpu = weights + (self.non_torch_or_rest_gib or 0.0) + (self.cudagraph_gib or 0.0) + kv
        return round(per_gpu * max(1, gpus), 2)


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(Figures))
EMPTY = Figures()


# The largest magnitude of a figure, by its unit: far past any box, far below what the memory model's
# arithmetic overflows at (1e308 GiB in bytes is infinite, and int() of it raises).
LIMIT_GIB = float(1 << 20)  # a PiB
LIMIT_BYTES = float(1 << 60)
LIMIT_S = 7 * 24 * 3600.0  # a week, as the config's durations (r1sup.core.config.MAX_DURATION_S)
LIMIT_COUNT = float(1 << 40)  # blocks, tokens, a pid, a port, a driver version


def out_of_bounds(name: str, value: float) -> str | None:
    """Why the figure ``name`` cannot be ``value`` (None: it can): a magnitude past its unit's limit."""
    if name.endswith("_gib"):
        limit = LIMIT_GIB
    elif name.endswith("_bytes"):
        limit = LIMIT_BYTES
    elif name.endswith("_s"):
        limit = LIMIT_S
    else:
        limit = LIMIT_COUNT
    return None if abs(value) <= limit else f"{value:g} is past the largest {name} r1sup takes ({limit:g})"


def known_numbers(data: Mapping[str, Any], names: Iterable[str]) -> dict[str, float]:
    """The values of ``data`` under ``names`` that are numbers (finite, not booleans), ints kept as ints."""
    values: dict[str, float] = {}
    for key in names:
        v = data.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            values[key] = v
    return values
