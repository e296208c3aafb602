"""Whether a saved profile fits the box as it is now, and whether one found beside other processes is
worse than the box gives without them ("degraded"). Pure: the search's memory model and candidates
(:class:`r1sup.core.search.Search`) answer, the daemon decides what to launch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from r1sup.core import memmodel as M
from r1sup.core.flags import EngineFlags
from r1sup.core.hardware import Conditions, DeviceFacts
from r1sup.core.search import FREE_MARGIN_GIB, GIB, Candidate, Evidence, Search, request_blocks

OTHERS_NOTICED_GIB = 0.5  # other processes holding less than this do not make a profile "degraded"
DEGRADED_KV_RATIO = 1.05  # without them, 5% more KV tokens (or a longer context) makes it degraded


def fits_now(search: Search, flags: EngineFlags) -> bool:
    """Whether ``flags`` (a saved profile's) is predicted to start on the box as it is now: vLLM's
    free-memory check, and one request of its context in the KV cache (no margin: it worked before)."""
    device = search.facts.device
    if device.backend == "cpu" or not device.gpus or not device.total_bytes:
        return True
    if search.facts.arch is None:
        need = M.requested_bytes(device, flags.gpu_memory_utilization)
        return (device.free_bytes or device.total_bytes) >= need + FREE_MARGIN_GIB * GIB
    est = M.evaluate(search.facts.arch, device, flags, search.facts.version, search.evidence.calibration)
    if est.startup_problem is not None or est.kv.bytes <= 0:
        return False
    return request_blocks(est) >= M.cdiv(est.batch.max_model_len, est.block_size)


def degraded_by_others(search: Search, flags: EngineFlags, found: Conditions | None) -> str | None:
    """Why ``flags``, found while other processes held GPU memory (``found``:
    :func:`r1sup.core.search.conditions`), is worse than what the box gives without them; None when it
    is not (or nothing else held memory)."""
    others = found.others_gib if found is not None else 0.0
    if others < OTHERS_NOTICED_GIB or not search.usable:
        return None
    idle = Search(
        replace(search.facts, device=idle_device(search.facts.device, int(others * GIB))),
        Evidence(calibration=search.evidence.calibration, calibrated=search.evidence.calibrated),
    )
    best = better_than(idle, flags)
    if best is None:
        return None
    return (
        f"other processes held {others:.1f} GiB: without them the box gives context {best.context} "
        f"and {best.kv_tokens} KV tokens ({search.facts.user.describe_change(best.flags)})"
    )


def better_than(search: Search, flags: EngineFlags) -> Candidate | None:
    """The best candidate on this box when it gives a longer context than ``flags`` or
    DEGRADED_KV_RATIO more KV tokens; else None."""
    best = search.best(margin=True)
    if best is None or search.facts.arch is None:
        return None
    mine = M.evaluate(
        search.facts.arch, search.facts.device, flags, search.facts.version, search.evidence.calibration
    )
    tokens = M.num_blocks(max(0, mine.kv.bytes), mine.kv_bytes_per_token, mine.block_size) * mine.block_size
    if best.context > (flags.max_model_len or 0) or best.kv_tokens > DEGRADED_KV_RATIO * tokens:
        return best
    return None


def spare_serves(search: Search, flags: EngineFlags, best_saved: bool) -> bool:
    """Whether the degraded profile kept beside the best one (``flags``) is the one to launch on the box
    as it is now: it fits (:func:`fits_now`), and either the best one is saved (and does not fit now) or
    none is and nothing better fits what is free (:func:`better_than`: a search would find more). What
    ``run`` launches and ``plan --config`` recommends."""
    return fits_now(search, flags) and (best_saved or better_than(search, flags) is None)


def idle_device(device: DeviceFacts, others: int) -> DeviceFacts:
    """The box with ``others`` bytes more free on every GPU (up to its total): as it is without them."""
    gpus = tuple(replace(g, free_bytes=min(g.total_bytes, g.free_bytes + others)) for g in device.gpus)
    return replace(device, gpus=gpus, processes=())


@dataclass(frozen=True)
class Degraded:
    """Serving a profile degraded by other processes' memory: the best profile's key (the one to go back
    to), why this one is degraded, since when (ISO 8601 UTC), and whether a re-tune back to the best is
    planned. status.json shows it as its ``degraded`` object (:meth:`to_dict`)."""

    best_key: str
    reason: str
    since: str
    retune_planned: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "best_key": self.best_key,
            "reason": self.reason,
            "since": self.since,
            "retune_planned": self.retune_planned,
        }
