"""The naive strategy: the fixed walk people do by hand, kept as the baseline the benchmarks compare
against (``search.strategy = "naive"``, ``r1sup tune --strategy naive``; ``benchmarks/bench_scenarios.py``
runs it beside the search). Pure.

After any memory failure: halve the context, then fp8 KV, then eager mode, then lower the utilization by
a step; the search's branch without an architecture (:mod:`r1sup.core.blind`) takes the first of these not
tried yet and within the bounds. Nothing is computed from the figures vLLM printed.
"""

from __future__ import annotations

from r1sup.core.bounds import UTIL_STEP, BlindFacts, Bounds
from r1sup.core.flags import EngineFlags
from r1sup.core.memmodel import floor_util


def walk(flags: EngineFlags, facts: BlindFacts, bounds: Bounds) -> list[tuple[EngineFlags, str]]:
    """The hand-made walk from ``flags``, in order: (the next flags, why)."""
    out: list[tuple[EngineFlags, str]] = []
    length = flags.max_model_len or facts.model_max_len
    if length and length // 2 >= bounds.min_context:
        out.append(
            (flags.replace(max_model_len=length // 2), f"halve the context: {length} -> {length // 2}")
        )
    if bounds.allow_fp8_kv and not flags.fp8_kv:
        out.append((flags.replace(kv_cache_dtype="fp8"), "fp8 KV"))
    if bounds.allow_eager and not flags.enforce_eager:
        out.append((flags.replace(enforce_eager=True), "eager mode"))
    util = floor_util(flags.gpu_memory_utilization - UTIL_STEP)
    if util >= bounds.min_gpu_memory_utilization:
        out.append((flags.replace(gpu_memory_utilization=util), f"lower utilization -> {util:g}"))
    return out
