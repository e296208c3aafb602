"""What each change of ``plan``'s recommended flags is for and what it costs the user, from the plan's own
figures. Pure: a :class:`r1sup.core.planner.Plan` in, plain data out.

The reason is the memory a change frees or the limit it meets (as the plan computed it); the cost is
what the user gives up for it: context, concurrency, decode speed, accuracy, GPUs, room on the GPU
for anything else. Costs that the plan cannot put a number on (decode speed without CUDA graphs, the
accuracy of 8-bit values) are named, not guessed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from r1sup.core.flags import EngineFlags
from r1sup.core.planner import Plan, fp8_weights_note

# the order in which changes are listed: the context first (what the user asked for), then the rest as
# EngineFlags (and so vLLM's command line) orders them
_ORDER = tuple(f.name for f in dataclasses.fields(EngineFlags))

_GIB = 1024**3


@dataclass(frozen=True)
class Change:
    """One flag of the recommended flags that differs from the flags as given."""

    flag: str  # EngineFlags' field
    old: Any
    new: Any
    reason: str
    cost: str

    @property
    def title(self) -> str:
        """``kv_cache_dtype auto -> fp8``; a flag left to vLLM reads ``default``."""
        return f"{self.flag} {_show(self.old)} -> {_show(self.new)}"

    def to_dict(self) -> dict[str, Any]:
        return {"flag": self.flag, "from": self.old, "to": self.new, "reason": self.reason, "cost": self.cost}


def _show(value: Any) -> str:
    if value is None:
        return "default"
    if isinstance(value, bool):
        return str(value).lower()
    return (
        f"{value:,}" if isinstance(value, int) else f"{value:g}" if isinstance(value, float) else str(value)
    )


def recommended_changes(plan: Plan) -> list[Change]:
    """Each flag the recommended flags change, with its reason and its cost ([] without a recommendation,
    or when it is the flags as given)."""
    rec = plan.recommended
    if rec is None:
        return []
    given = plan.flags
    out: list[Change] = []
    for name in _ORDER:
        old, new = getattr(given, name), getattr(rec, name)
        if name == "max_model_len":
            old = plan.max_model_len if old in (None, -1) else old  # what vLLM would run with as given
        if old == new:
            continue
        reason, cost = _explain(plan, given, rec, name, old, new)
        out.append(Change(name, getattr(given, name), new, reason, cost))
    return out


def _budget_gib(total_gib: float, utilization: float) -> float:
    """vLLM's requested memory of a device of ``total_gib`` (``ceil(utilization x total)`` bytes)."""
    return math.ceil(round(total_gib * _GIB) * utilization) / _GIB


def _explain(
    plan: Plan, given: EngineFlags, rec: EngineFlags, name: str, old: Any, new: Any
) -> tuple[str, str]:
    b, rb = plan.breakdown, plan.recommended_breakdown
    total = b.total_gib
    if name == "max_model_len":
        asked = int(old)
        if int(new) < asked:
            given_up = 100 * (asked - int(new)) / asked
            return (
                f"one request of {asked:,} tokens does not fit with the other changes and the "
                f"{plan.recommended_margin_gib or 0:.2f} GiB kept spare: {int(new):,} is the longest "
                "that does",
                f"requests (prompt and output together) longer than {int(new):,} tokens are refused: "
                f"{given_up:.0f}% of the context asked is given up",
            )
        return (
            f"the target context of {int(new):,} tokens (longer than the {asked:,} given)",
            f"each request may hold {int(new) - asked:,} more tokens of KV cache, so fewer fit at once",
        )
    if name == "gpu_memory_utilization":
        # vLLM's budget as the plan's budget line gives it (ceil(utilization x total), whole bytes):
        # the product of the figures printed, so "0.9 x 79.15" reads the same 71.24 in both places
        before, after = _budget_gib(total, float(old)), _budget_gib(total, float(new))
        if float(new) > float(old):
            return (
                f"vLLM's budget grows from {float(old):g} x {total:.2f} = {before:.2f} GiB to "
                f"{after:.2f} GiB; the {after - before:.2f} GiB go to the KV cache",
                f"{total - after:.2f} GiB of the GPU stay outside vLLM (was {total - before:.2f}): less room "
                "for other processes on it and for memory vLLM does not count",
            )
        free = plan.device.free_gib
        why = (
            f"only {free:.2f} GiB is free at start-up and vLLM stops when {float(old):g} x {total:.2f} = "
            f"{before:.2f} GiB is more than that"
            if free is not None and free < before
            else f"vLLM's budget shrinks from {before:.2f} to {after:.2f} GiB to start"
        )
        return why, f"{before - after:.2f} GiB less budget, taken from the KV cache"
    if name == "kv_cache_dtype":
        if rec.fp8_kv and not given.fp8_kv:
            bpt = plan.kv_bytes_per_token
            return (
                f"half the KV bytes per token ({bpt:,} -> {bpt // 2:,}): twice the tokens in the same memory",
                "keys and values stored in 8 bits (scale 1.0 unless the checkpoint carries KV scales): a "
                "small loss of accuracy"
                + (
                    "; e4m3 can fail below compute capability 8.9 (unknown here): fp8_e5m2 is used there"
                    if new == "fp8" and not plan.device.compute_capability
                    else ""
                ),
            )
        if rec.fp8_kv and given.fp8_kv:
            cc = plan.device.compute_capability
            return (
                f"{old} (e4m3) KV can fail below compute capability 8.9 (this GPU: {cc}); {new} does not",
                "none in memory (both are 8 bits); e5m2 keeps fewer mantissa bits than e4m3",
            )
        return (f"KV cache dtype {new} instead of {old}", "twice the KV bytes per token of an fp8 cache")
    if name == "enforce_eager" and new:
        charged = b.cudagraph_charged_gib
        extra = (
            f" (and the {charged:.2f} GiB estimate vLLM {plan.vllm_version} charges to the KV budget)"
            if charged
            else ""
        )
        return (
            f"no CUDA graphs: their {b.cudagraph_gib:.2f} GiB{extra} go to the KV cache",
            "decoding is slower without CUDA graphs (each step launches its kernels one by one; the loss is "
            "largest at small batches); r1sup does not measure it before a launch",
        )
    if name == "max_num_seqs":
        default = plan.assumed_defaults.max_num_seqs if old is None else old
        target = plan.target_concurrency
        why = (
            f"vLLM's {_show(default)} sequences size the sampler warm-up and the CUDA-graph captures; "
            f"{new} frees that memory for the KV cache"
        )
        if target:
            why += f" and still runs the target's {target} requests at once"
        if isinstance(default, int) and default > 0 and int(new) < default:
            share = 100 * (1 - int(new) / default)
            cost = (
                f"at most {new} requests run at once where {default} could: {share:.0f}% of the "
                "concurrency is given up, and more requests wait in the queue"
            )
        else:
            cost = f"at most {new} requests run at once"
        return why, cost
    if name == "max_num_batched_tokens":
        return (
            "a smaller profile run: less peak activation memory, more for the KV cache",
            "long prompts are prefilled in smaller chunks: a longer time to the first token",
        )
    if name == "quantization":
        w_old, w_new = b.weights_gib, (rb.weights_gib if rb is not None else b.weights_gib)
        note = fp8_weights_note_for(plan) if new == "fp8" else None
        return (
            f"weights {w_old:.2f} -> {w_new:.2f} GiB per GPU, the rest goes to the KV cache",
            f"weights stored as {new}: a small loss of accuracy" + (f"; {note}" if note else ""),
        )
    if name == "tensor_parallel_size":
        w_old, w_new = b.weights_gib, (rb.weights_gib if rb is not None else b.weights_gib)
        return (
            f"the weights and the KV cache split over {new} GPUs ({w_old:.2f} -> {w_new:.2f} GiB of weights "
            "per GPU)",
            f"{new} GPUs instead of {old}, with an all-reduce between them in every layer",
        )
    if name == "cpu_offload_gb":
        return (
            f"{_show(new)} GiB of the weights per GPU stay in host memory",
            "slower: the offloaded weights cross PCIe at every forward pass",
        )
    return (
        "the planner's choice to fit",
        "not assessed",
    )


def fp8_weights_note_for(plan: Plan) -> str | None:
    from r1sup.core.vllmversion import Version

    return fp8_weights_note(Version.parse(plan.vllm_version))
