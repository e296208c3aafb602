"""Ground truth for the benchmark: is a configuration feasible on a scenario, and what is the best one?

Both functions use :func:`fakevllm.memory.simulate`, the accounting the fake engine itself runs, so
"feasible" means exactly "the fake engine starts with these flags and survives requests".

A configuration *meets* a target of ``c`` requests of ``n`` tokens (project issue 6) when it starts
(so one request of its ``max_model_len`` fits: vLLM's own start-up check), ``max_model_len >= n``,
``max_num_seqs >= c`` and the KV cache holds ``c x n`` tokens at once: ``usable KV tokens >= c x n``,
where usable tokens are ``(num_gpu_blocks - 1) x block_size`` (vLLM keeps one null block back). The
context is not multiplied by the concurrency. A concurrency without a context means requests of the
full context: ``c x max_model_len`` tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping
from typing import Any

from fakevllm.memory import QUANT_MIN_CAPABILITY, Flags, Plan, simulate
from fakevllm.scenario import GIB, Scenario

# The fields r1sup's EngineFlags has: results use exactly these keys.
ENGINE_FLAG_FIELDS = (
    "max_model_len",
    "gpu_memory_utilization",
    "kv_cache_dtype",
    "enforce_eager",
    "max_num_seqs",
    "max_num_batched_tokens",
    "quantization",
    "tensor_parallel_size",
    "kv_cache_memory_bytes",
    "cpu_offload_gb",
)
SEARCHED_FIELDS = (
    "gpu_memory_utilization",
    "kv_cache_dtype",
    "enforce_eager",
    "max_num_seqs",
    "quantization",
    "tensor_parallel_size",
)
SEQS_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The search's limits (the same names as r1sup's ``[search]`` section, plus the search grid)."""

    min_max_model_len: int = 2048
    max_max_model_len: int | None = None  # default: the user's max_model_len, else the model's maximum
    min_gpu_memory_utilization: float = 0.5
    max_gpu_memory_utilization: float = 0.95
    util_step: float = 0.01
    allow_fp8_kv: bool = True
    allow_eager: bool = True
    allow_weight_quantization: bool = False
    allow_tensor_parallel: bool = True
    max_num_seqs_grid: tuple[int, ...] = SEQS_GRID

    @classmethod
    def from_any(cls, bounds: Any) -> Bounds:
        if bounds is None:
            return cls()
        if isinstance(bounds, Bounds):
            return bounds
        names = [f.name for f in dataclasses.fields(cls)]
        if isinstance(bounds, Mapping):
            data = {k: v for k, v in bounds.items() if k in names}
        else:
            data = {n: getattr(bounds, n) for n in names if hasattr(bounds, n)}
        if "max_num_seqs_grid" in data:
            data["max_num_seqs_grid"] = tuple(data["max_num_seqs_grid"])
        return cls(**data)


def engine_flags_dict(flags: Flags) -> dict[str, Any]:
    """``flags`` with the keys of r1sup's EngineFlags (``EngineFlags.from_dict`` accepts it)."""
    out = {name: getattr(flags, name) for name in ENGINE_FLAG_FIELDS}
    out["cpu_offload_gb"] = out["cpu_offload_gb"] or None  # EngineFlags' "not set"
    return out


def _outcome(plan: Plan) -> str:
    if not plan.ok:
        return plan.outcome
    if plan.fp8_first_request:
        return "fp8_unsupported"
    if plan.spike_oom:
        return "oom_runtime"
    return "ready"


def feasible(
    scenario: Scenario,
    flags: Any,
    *,
    env: Mapping[str, str] | None = None,
    cli_model: str | None = None,
) -> tuple[bool, dict[str, Any]]:
    """Whether the fake engine starts with ``flags`` and keeps serving; ``details`` says why or why not.

    ``flags``: a mapping or an object with EngineFlags-like attributes. Runtime faults that depend on the
    flags count (fp8 KV failing at the first request, an activation spike that does not fit); faults the
    scenario injects regardless of flags (``runtime.failure``) do not.
    """
    plan = simulate(scenario, flags, env=env, cli_model=cli_model)
    outcome = _outcome(plan)
    details: dict[str, Any] = {
        "outcome": outcome,
        "phase": plan.phase if not plan.ok else ("serving" if outcome != "ready" else "ready"),
        "message": plan.message,
        "flags": engine_flags_dict(plan.flags),
        **plan.numbers(),
    }
    return outcome == "ready", details


def _changes(candidate: Flags, user: Flags) -> list[str]:
    changed = []
    for name in SEARCHED_FIELDS:
        a, b = getattr(candidate, name), getattr(user, name)
        if name == "gpu_memory_utilization":
            if not math.isclose(a, b, abs_tol=1e-9):
                changed.append(name)
        elif a != b:
            changed.append(name)
    return changed


def _utils(bounds: Bounds, user: float) -> list[float]:
    lo, hi, step = bounds.min_gpu_memory_utilization, bounds.max_gpu_memory_utilization, bounds.util_step
    count = int(round((hi - lo) / step))
    values = {round(lo + i * step, 4) for i in range(count + 1)}
    values.update({round(hi, 4), user})
    return sorted(v for v in values if lo - 1e-9 <= v <= hi + 1e-9)


def _candidates(
    scenario: Scenario,
    user: Flags,
    bounds: Bounds,
    concurrency: int,
    cli_model: str | None,
    min_seqs: int = 0,
) -> dict[str, list[Any]]:
    gpu = scenario.gpu
    model = scenario.effective_model(cli_model)
    tps = [user.tensor_parallel_size]
    if bounds.allow_tensor_parallel:
        tps = sorted(
            {user.tensor_parallel_size}
            | {t for t in (1, 2, 4, 8) if t <= gpu.count and model.num_attention_heads % t == 0}
        )
    quants: list[str | None] = [user.quantization]
    if (
        bounds.allow_weight_quantization
        and model.quantization is None
        and gpu.capability >= QUANT_MIN_CAPABILITY["fp8"]
    ):
        quants = list(dict.fromkeys([user.quantization, "fp8"]))
    kvs = [user.kv_cache_dtype]
    if bounds.allow_fp8_kv:
        kvs = list(dict.fromkeys([user.kv_cache_dtype, "auto", "fp8", "fp8_e5m2"]))
    eagers = (
        [user.enforce_eager] if not bounds.allow_eager else list(dict.fromkeys([user.enforce_eager, True]))
    )
    seqs: list[int | None] = [user.max_num_seqs]
    seqs += [s for s in bounds.max_num_seqs_grid if s >= max(concurrency, min_seqs)]
    seqs = list(dict.fromkeys(seqs))
    if user.max_num_seqs is not None and user.max_num_seqs < concurrency:
        seqs.remove(user.max_num_seqs)
    return {
        "tensor_parallel_size": tps,
        "quantization": quants,
        "kv_cache_dtype": kvs,
        "enforce_eager": eagers,
        "max_num_seqs": seqs,
        "gpu_memory_utilization": _utils(bounds, user.gpu_memory_utilization),
    }


def optimum(
    scenario: Scenario,
    target_concurrency: int | None,
    target_context: int | None,
    bounds: Any = None,
    *,
    user_flags: Any = None,
    env: Mapping[str, str] | None = None,
    cli_model: str | None = None,
    min_seqs: int = 0,
) -> dict[str, Any] | None:
    """The best feasible configuration r1sup's search could reach, by exhaustive search; None if none fits.

    ``min_seqs``: the fewest sequences a configuration may run at once (the user's ``max_num_seqs`` or
    vLLM's default when lower); issue 29's optimum keeps at least 32 or the user's value.

    Searched: tensor parallel size (up to the GPU count), weight quantization (fp8, when allowed),
    KV dtype (auto, fp8, fp8_e5m2, when allowed), eager mode, max_num_seqs (the grid, never below the
    target concurrency), gpu_memory_utilization (the bounds' grid). For each that meets the target (see
    the module doc; the KV block count does not depend on max_model_len), the longest context is the
    longest one request fits (``usable KV tokens``), capped at ``bounds.max_max_model_len`` / the user's
    max_model_len / the model's maximum and never below ``bounds.min_max_model_len`` nor the target
    context. Best: the longest context, then the fewest changed flags against ``user_flags``, then the
    most KV, then the lower utilization. The user's other flags (max_num_batched_tokens,
    kv_cache_memory_bytes, cpu_offload_gb, ...) are kept.
    """
    b = Bounds.from_any(bounds)
    user = Flags.from_any(user_flags if user_flags is not None else {})
    conc = max(1, int(target_concurrency or 1))
    model = scenario.effective_model(cli_model)
    cap = b.max_max_model_len or (user.max_model_len if user.max_model_len not in (None, -1) else None)
    cap = min(cap or model.max_position_embeddings, model.max_position_embeddings)
    floor_len = max(b.min_max_model_len, int(target_context or 0), 1)
    if floor_len > cap:
        return None
    grid = _candidates(scenario, user, b, conc, cli_model, min_seqs)
    names = list(grid)
    best: tuple[Any, ...] | None = None
    best_flags: Flags | None = None
    searched = 0

    def longest(plan: Plan) -> int:
        """The longest context ``plan``'s KV cache holds for the target (0: the target does not fit)."""
        if target_context:
            if plan.usable_tokens < conc * int(target_context):
                return 0
            return min(cap, plan.usable_tokens)
        return min(cap, (plan.usable_blocks // conc) * plan.block_size)  # requests of the full context

    for values in itertools.product(*(grid[n] for n in names)):
        # vLLM caps its token default at max_num_seqs x max_model_len, so the KV cache can grow as the
        # context shrinks: size it at the model's whole context first (auto-fit: the fewest blocks),
        # then once more at the context that gives, and keep the longer one that still starts
        cand = dataclasses.replace(user, **dict(zip(names, values, strict=True)), max_model_len=-1)
        searched += 1
        plan = simulate(scenario, cand, env=env, cli_model=cli_model)
        if _outcome(plan) != "ready" or plan.max_num_seqs < conc:
            continue
        if plan.max_num_seqs < min_seqs and cand.max_num_seqs != user.max_num_seqs:
            continue
        length = longest(plan)
        if length < floor_len:
            continue
        again = simulate(
            scenario, dataclasses.replace(cand, max_model_len=length), env=env, cli_model=cli_model
        )
        if _outcome(again) != "ready":
            continue
        longer = longest(again)
        if longer > length:
            trial = simulate(
                scenario, dataclasses.replace(cand, max_model_len=longer), env=env, cli_model=cli_model
            )
            if _outcome(trial) == "ready" and longest(trial) >= longer:
                length, again = longer, trial
        changed = _changes(cand, user)
        key = (-length, len(changed), -again.usable_blocks, cand.gpu_memory_utilization)
        if best is None or key < best:
            best = key
            best_flags = dataclasses.replace(cand, max_model_len=length)
    if best_flags is None:
        return None
    ok, details = feasible(scenario, best_flags, env=env, cli_model=cli_model)
    plan = simulate(scenario, best_flags, env=env, cli_model=cli_model)
    if not ok:  # the search kept only configurations it saw start: a bug, not a search result
        raise AssertionError(
            f"optimum {best_flags} is not feasible: {details['outcome']}: {details['message']}"
        )
    changed = _changes(best_flags, user)
    each = int(target_context or plan.max_model_len)
    return {
        "flags": engine_flags_dict(best_flags),
        "max_model_len": plan.max_model_len,
        "concurrency": plan.usable_tokens // each,  # requests of the target's size that fit at once
        "meets_target": plan.usable_tokens >= conc * each and plan.max_model_len >= each,
        "kv_cache_tokens": plan.kv_tokens,
        "usable_kv_tokens": plan.usable_tokens,
        "num_gpu_blocks": plan.num_blocks,
        "kv_cache_gib": round(plan.kv_allocated / GIB, 2),
        "max_concurrency": round(plan.max_concurrency, 2),
        "changes": len(changed),
        "changed": changed,
        "simulated_startup_seconds": plan.simulated_seconds,
        "searched": searched,
    }
