"""The search's branch when the model's architecture is unknown: one step per failure class. Pure.

Without ``config.json`` (``r1sup diagnose`` on a bare log, an unreadable model config) or on the CPU
backend there is nothing to score candidates with, so :class:`r1sup.core.search.Search` (its only caller)
takes the step for the class that failed, from the figures vLLM printed (and the model's KV bytes per
token when known): it keeps what the user asked for when the figures say a lever suffices (more
utilization, then fp8 KV) and shortens the context only when those cannot reach it, straight to the
longest that fits. ``search.strategy = "naive"`` takes the hand walk instead (:mod:`r1sup.core.naive`).

A configuration that failed is never proposed again. What no flag fixes (fatal, transient, internal, the
attempt budget) is the policy's (:mod:`r1sup.core.policy`), which the search applies before it comes here; a
config error the search could fix with the architecture stops here as fatal.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace

from r1sup.core import failure as F
from r1sup.core import memmodel, naive, policy, vllmversion
from r1sup.core.bounds import (
    GIB,
    PINNED_RESERVE_FRACTION,
    PINNED_RESERVE_GIB,
    UTIL_STEP,
    BlindFacts,
    Bounds,
    ceil_util,
    how_to_allow,
)
from r1sup.core.errors import EXIT_FATAL_FAILURE, EXIT_NO_WORKING_CONFIG
from r1sup.core.failure import Failure
from r1sup.core.figures import EMPTY as NO_FIGURES
from r1sup.core.figures import Figures
from r1sup.core.flags import EngineFlags
from r1sup.core.memmodel import floor_util

MIB = 1024**2
KV_MARGIN = 0.02  # spare KV bytes when computing the utilization a context needs
MIN_BATCHED_TOKENS = 256


@dataclass(frozen=True)
class History:
    tried: frozenset[EngineFlags] = frozenset()
    banned: frozenset[str] = frozenset()  # fp8_e4m3_kv, fp8_kv, fp8_weights
    kv_bytes: float | None = None  # the KV budget last derived from vLLM's numbers (same for any KV dtype)

    def record(self, flags: EngineFlags) -> History:
        return replace(self, tried=self.tried | {flags})


@dataclass(frozen=True)
class Step:
    flags: EngineFlags
    reason: str
    history: History = field(default_factory=History, compare=False)


@dataclass(frozen=True)
class GiveUp:
    """Nothing more to launch, the one give-up of the search (its model branch and this one): why, the
    ways out (one line each), the exit code, and the bound that blocks (a ``[search]`` or ``[target]``
    setting) when one does."""

    reason: str
    ways_out: tuple[str, ...] = ()
    exit_code: int = EXIT_NO_WORKING_CONFIG
    bound: str = ""

    @property
    def suggestions(self) -> tuple[str, ...]:
        return self.ways_out


Decision = Step | GiveUp


# --- KV arithmetic ----------------------------------------------------------------------------------


def kv_bpt(flags: EngineFlags, facts: BlindFacts) -> float | None:
    """KV bytes per token per device for these flags, from the model's (memmodel.kv_bytes_per_token_as)."""
    if not facts.kv_bytes_per_token:
        return None
    dtype_bytes = facts.arch.dtype_bytes if facts.arch is not None else 2
    return memmodel.kv_bytes_per_token_as(facts.kv_bytes_per_token, dtype_bytes, flags.kv_cache_dtype)


def max_len_for(kv_bytes: float, bpt: float, block: int, facts: BlindFacts) -> int:
    """vLLM's estimated maximum model length for a KV budget (memmodel: all blocks but the null block)."""
    blocks = memmodel.num_blocks(kv_bytes, bpt, block)
    return memmodel.estimated_max_model_len(blocks, block, 1 << 62, facts.version())


def bytes_for_len(length: int, bpt: float, block: int) -> float:
    """KV bytes vLLM needs for one request of ``length`` tokens (plus the null block)."""
    return memmodel.kv_bytes_for_context(length, bpt, block)


def kv_bytes_available(flags: EngineFlags, failure: Failure, facts: BlindFacts, obs: Figures) -> float | None:
    """The KV budget of the failed launch, from the most precise source at hand."""
    if flags.kv_cache_memory_bytes:
        return float(flags.kv_cache_memory_bytes)
    n = failure.numbers
    bpt = kv_bpt(flags, facts)
    if bpt and n.estimated_max_model_len:
        # the estimate is (blocks - 1) x block: the budget holds at least that many blocks plus one
        return (n.estimated_max_model_len / facts.block_size + 1) * facts.block_size * bpt
    if n.kv_available_gib:
        return n.kv_available_gib * GIB
    if n.figures.kv_cache_gib:
        return n.figures.kv_cache_gib * GIB
    if obs.kv_cache_gib:
        return obs.kv_cache_gib * GIB
    tokens = n.kv_capacity_tokens or obs.kv_cache_tokens
    if bpt and tokens:
        return tokens * bpt
    return None


def floor_block(length: float, block: int) -> int:
    return int(length // block) * block


# --- the decision -----------------------------------------------------------------------------------


def next_step(
    flags: EngineFlags,
    failure: Failure,
    history: History,
    bounds: Bounds,
    facts: BlindFacts,
    obs: Figures = NO_FIGURES,
) -> Decision:
    """What to launch next after ``failure`` with ``flags`` (``history`` does not include it yet)."""
    history = history.record(flags)
    if failure.cls == F.KV_INSUFFICIENT:
        kv = kv_bytes_available(flags, failure, facts, obs)
        if kv is not None:
            history = replace(history, kv_bytes=kv)
    if failure.cls in policy.FATAL:  # a config error only the architecture could fix
        return GiveUp(policy.fatal_reason(failure), exit_code=EXIT_FATAL_FAILURE)

    candidates: Iterable[Step | GiveUp]
    if failure.cls == F.FP8_UNSUPPORTED:
        history, candidates = _fp8_unsupported(flags, facts, bounds, history)
    elif bounds.strategy == "naive":
        candidates = [Step(new, why) for new, why in naive.walk(flags, facts, bounds)]
    else:
        handler = _SMART.get(failure.cls)
        if handler is None:
            return GiveUp(f"no rule for {failure.cls}", exit_code=EXIT_FATAL_FAILURE)
        candidates = handler(flags, failure, facts, bounds, obs, history)

    fallback_reason = ""
    for candidate in candidates:
        if isinstance(candidate, GiveUp):
            return replace(candidate, ways_out=candidate.ways_out or facts.suggestions)
        if candidate.flags in history.tried or not _within(candidate.flags, bounds, history):
            fallback_reason = fallback_reason or candidate.reason
            continue
        return replace(candidate, history=history)
    why = f"every change the search may make for {failure.cls} was tried or is out of bounds"
    if fallback_reason:
        why += f" (last idea: {fallback_reason})"
    return GiveUp(why, facts.suggestions, EXIT_NO_WORKING_CONFIG if failure.memory else EXIT_FATAL_FAILURE)


def _within(flags: EngineFlags, bounds: Bounds, history: History) -> bool:
    if flags.max_model_len is not None and flags.max_model_len < bounds.min_context:
        return False
    if flags.kv_cache_dtype in ("fp8", "fp8_e4m3") and "fp8_e4m3_kv" in history.banned:
        return False
    if flags.fp8_kv and "fp8_kv" in history.banned:
        return False
    return not (flags.quantization == "fp8" and "fp8_weights" in history.banned)


def _context(flags: EngineFlags, failure: Failure, facts: BlindFacts) -> int | None:
    return flags.max_model_len or facts.model_max_len or _int(failure.numbers.figures.max_model_len)


def _int(value: float | None) -> int | None:
    return int(value) if value else None


def _fp8_kv_dtype(facts: BlindFacts, history: History) -> str | None:
    """The fp8 KV dtype for this hardware: e4m3 from compute capability 8.9, e5m2 below."""
    if "fp8_kv" in history.banned or facts.fp8_kv_supported is False:
        return None
    cc = facts.compute_capability
    if facts.backend == "cuda" and cc is not None and cc < (8, 9):
        return "fp8_e5m2"
    return "fp8_e5m2" if "fp8_e4m3_kv" in history.banned else "fp8"


def _unseen_context(facts: BlindFacts, tp: int) -> int:
    """Bytes of ``facts.free_gib`` that vLLM's own free-memory check no longer sees: the CUDA context (and
    NCCL's communicators at ``tp`` > 1), which it creates before it measures what is free. A figure probed
    before the launch (``facts.box``) still counts them free, as the search's cap on a probed device does
    (memmodel.startable_utilization); a figure a log printed (no box) was measured after them: none."""
    if facts.box is None:
        return 0
    return memmodel.context_bytes(facts.box, tp, facts.version())


def _max_usable_util(flags: EngineFlags, bounds: Bounds, facts: BlindFacts) -> float:
    limit = bounds.max_gpu_memory_utilization
    if facts.free_gib is not None and facts.total_gib:
        context = _unseen_context(facts, flags.tensor_parallel_size)
        limit = min(limit, memmodel.free_allows(facts.free_gib * GIB, facts.total_gib * GIB, context))
    return limit


def _util_for_bytes(flags: EngineFlags, have: float, need: float, facts: BlindFacts) -> float | None:
    """Utilization that turns a KV budget of ``have`` bytes into ``need`` (plus a margin)."""
    if not facts.total_gib:
        return None
    extra = need * (1 + KV_MARGIN) - have
    return ceil_util(flags.gpu_memory_utilization + max(0.0, extra) / (facts.total_gib * GIB))


def _kv_options(
    flags: EngineFlags,
    failure: Failure,
    facts: BlindFacts,
    bounds: Bounds,
    obs: Figures,
    history: History,
    need_len: int | None,
    need_tokens: int | None,
) -> Iterator[Step | GiveUp]:
    """Ways to give the KV cache room for one request of ``need_len`` and ``need_tokens`` at once."""
    block = facts.block_size
    have = kv_bytes_available(flags, failure, facts, obs)
    bpt = kv_bpt(flags, facts)
    pinned = flags.kv_cache_memory_bytes is not None
    fp8 = None if flags.fp8_kv or not bounds.allow_fp8_kv else _fp8_kv_dtype(facts, history)
    max_util = _max_usable_util(flags, bounds, facts)

    def need_bytes(b: float) -> float:
        total = 0.0
        if need_len:
            total = bytes_for_len(need_len, b, block)
        if need_tokens:
            total = max(total, bytes_for_len(need_tokens, b, block))
        return total

    fp8_bpt = kv_bpt(flags.replace(kv_cache_dtype=fp8), facts) if fp8 else None
    graphs = 0.0 if pinned else _charged_graphs(flags, failure, facts, bounds, obs)

    if have is not None and bpt:
        # 1. more utilization keeps everything else as asked
        if not pinned:
            util = _util_for_bytes(flags, have, need_bytes(bpt), facts)
            if util is not None and flags.gpu_memory_utilization < util <= max_util:
                yield Step(
                    flags.replace(gpu_memory_utilization=util),
                    f"KV needs {need_bytes(bpt) / GIB:.2f} GiB, has {have / GIB:.2f} GiB: "
                    f"utilization {flags.gpu_memory_utilization:g} -> {util:g} keeps the context",
                )
        # 2. fp8 KV halves the bytes per token
        if fp8 and fp8_bpt:
            if need_bytes(fp8_bpt) <= have:
                yield Step(
                    flags.replace(kv_cache_dtype=fp8), f"fp8 KV ({fp8}) doubles the KV capacity; context kept"
                )
            elif not pinned:
                util = _util_for_bytes(flags, have, need_bytes(fp8_bpt), facts)
                if util is not None and flags.gpu_memory_utilization < util <= max_util:
                    yield Step(
                        flags.replace(kv_cache_dtype=fp8, gpu_memory_utilization=util),
                        f"fp8 KV ({fp8}) and utilization {flags.gpu_memory_utilization:g} -> {util:g} "
                        "keep the context",
                    )
        # 2b. eager mode: from 0.20 vLLM takes its CUDA-graph estimate out of the KV budget; without graphs
        # that memory is the KV cache's (the estimate the failed launch printed)
        if graphs and need_len:
            eager = flags.replace(enforce_eager=True)
            options = [(eager, bpt, have)]
            if fp8 and fp8_bpt:
                options.append((eager.replace(kv_cache_dtype=fp8), fp8_bpt, have))
            if facts.total_gib and max_util > flags.gpu_memory_utilization:
                extra = (max_util - flags.gpu_memory_utilization) * facts.total_gib * GIB
                options += [
                    (f.replace(gpu_memory_utilization=max_util), b, h + extra / (1 + KV_MARGIN))
                    for f, b, h in list(options)
                ]
            for f, b, h in options:
                if need_bytes(b) <= h + graphs:
                    yield Step(
                        f,
                        f"vLLM charged {graphs / GIB:.2f} GiB of CUDA-graph estimate to the KV budget: "
                        f"{flags.describe_change(f)} keeps the context",
                    )
                    break
        # 3. the longest context that fits, with every lever the bounds allow
        if need_len:
            best_util = flags.gpu_memory_utilization
            budget = have
            if not pinned and facts.total_gib and max_util > best_util:
                budget = have + (max_util - best_util) * facts.total_gib * GIB
                best_util = max_util
            best_bpt = fp8_bpt if fp8 and fp8_bpt else bpt
            longest = max_len_for(
                budget / (1 + KV_MARGIN) if budget != have else budget, best_bpt, block, facts
            )
            use_eager = False
            if graphs:
                with_eager = max_len_for((budget + graphs) / (1 + KV_MARGIN), best_bpt, block, facts)
                use_eager = with_eager >= memmodel.EAGER_MIN_GAIN * longest  # clearly longer: no graphs
                if use_eager:
                    budget, longest = budget + graphs, with_eager
            if facts.model_max_len:
                longest = min(longest, facts.model_max_len)
            longest = min(longest, need_len)
            new = flags.replace(
                max_model_len=longest, gpu_memory_utilization=best_util, enforce_eager=use_eager
            )
            if fp8:
                new = new.replace(kv_cache_dtype=fp8)
            if longest >= bounds.min_context and (
                not need_tokens or _capacity(budget, best_bpt, block, facts) >= need_tokens
            ):
                yield Step(
                    new,
                    f"{need_len} tokens cannot fit; the longest context that fits is {longest}"
                    + (f" with fp8 KV ({fp8})" if fp8 else "")
                    + (f" at utilization {best_util:g}" if best_util != flags.gpu_memory_utilization else "")
                    + (" in eager mode" if use_eager else ""),
                )
            elif longest >= bounds.min_context and need_tokens:
                # one request fits; target.concurrency x target.context does not: the KV cache needs room
                stages = [
                    (flags, _tokens_bytes(need_tokens, bpt, block) - have),
                    (new, _tokens_bytes(need_tokens, best_bpt, block) - budget),
                ]
                yield from _room_levers(flags, facts, bounds, history, obs, stages)
                yield _capacity_give_up(bounds, _capacity(budget, best_bpt, block, facts), fp8, best_util)
            else:
                bound = (
                    f"target.context {bounds.target_context}"
                    if bounds.target_context and bounds.target_context >= bounds.min_max_model_len
                    else f"search.min_max_model_len {bounds.min_max_model_len}"
                )
                yield GiveUp(
                    f"the longest context that fits is {longest} tokens"
                    + (f" even with fp8 KV ({fp8})" if fp8 else "")
                    + f", below {bound}"
                )
        return

    # Without the model's KV size: work from vLLM's estimate alone.
    estimate = _int(failure.numbers.estimated_max_model_len or failure.numbers.kv_capacity_tokens)
    if fp8 and estimate and need_len and 2 * estimate >= need_len:
        yield Step(
            flags.replace(kv_cache_dtype=fp8), f"fp8 KV ({fp8}) about doubles vLLM's estimate {estimate}"
        )
    if not pinned and flags.gpu_memory_utilization + UTIL_STEP <= max_util:
        util = ceil_util(flags.gpu_memory_utilization + UTIL_STEP)
        yield Step(
            flags.replace(gpu_memory_utilization=util), f"more room for the KV cache: utilization -> {util:g}"
        )
    if estimate and need_len:
        longest = floor_block(estimate, block)
        if longest >= bounds.min_context:
            yield Step(flags.replace(max_model_len=longest), f"context to vLLM's estimate {longest}")
        else:
            yield GiveUp(
                f"vLLM's estimate {estimate} is below the smallest context allowed ({bounds.min_context})"
            )


def _charged_graphs(
    flags: EngineFlags, failure: Failure, facts: BlindFacts, bounds: Bounds, obs: Figures
) -> float:
    """Bytes of CUDA-graph estimate the failed launch's vLLM took out of the KV budget (0: none, or eager
    mode is not a lever here)."""
    if flags.enforce_eager or not bounds.allow_eager or facts.backend != "cuda":
        return 0.0
    if not vllmversion.rules(facts.version()).graph_estimate_charged:
        return 0.0
    gib = failure.numbers.figures.cudagraph_estimated_gib or obs.cudagraph_estimated_gib
    return float(gib) * GIB if gib else 0.0


def _capacity(kv_bytes: float, bpt: float, block: int, facts: BlindFacts) -> int:
    return max_len_for(kv_bytes, bpt, block, facts)


# --- smart rules per class -------------------------------------------------------------------------


def _kv_insufficient(
    flags: EngineFlags,
    failure: Failure,
    facts: BlindFacts,
    bounds: Bounds,
    obs: Figures,
    history: History,
) -> Iterator[Step | GiveUp]:
    if failure.detail.startswith("target"):
        # started, but the KV cache cannot hold target.concurrency x target.context
        yield from _kv_options(flags, failure, facts, bounds, obs, history, None, bounds.target_tokens())
        yield from _target_room(flags, failure, facts, bounds, obs, history)
        return
    need_len = _context(flags, failure, facts)
    yield from _kv_options(flags, failure, facts, bounds, obs, history, need_len, bounds.target_tokens())


def _tokens_bytes(tokens: int, bpt: float, block: int) -> float:
    """KV bytes ``tokens`` tokens at once need (whole blocks, the null block, the search's margin)."""
    return bytes_for_len(tokens, bpt, block) * (1 + KV_MARGIN)


def _capacity_give_up(bounds: Bounds, capacity: int, fp8: str | None, util: float) -> GiveUp:
    return GiveUp(
        f"the KV cache holds at most {capacity} tokens"
        + (f" even with fp8 KV ({fp8})" if fp8 else "")
        + f" at utilization {util:g}; target.concurrency x target.context needs "
        f"{bounds.target_concurrency} x {bounds.target_context} tokens and no other lever within the bounds "
        "covers the rest"
    )


def _target_room(
    flags: EngineFlags,
    failure: Failure,
    facts: BlindFacts,
    bounds: Bounds,
    obs: Figures,
    history: History,
) -> Iterator[Step | GiveUp]:
    """Levers beyond utilization and fp8 KV for a KV cache too small for the target, or give up."""
    tokens = bounds.target_tokens()
    have = kv_bytes_available(flags, failure, facts, obs)
    bpt = kv_bpt(flags, facts)
    if not tokens or have is None or not bpt:
        yield from _room_levers(flags, facts, bounds, history, obs)
        return
    block = facts.block_size
    best, budget, best_bpt = flags, have, bpt
    max_util = _max_usable_util(flags, bounds, facts)
    if flags.kv_cache_memory_bytes is None and facts.total_gib and max_util > flags.gpu_memory_utilization:
        budget = have + (max_util - flags.gpu_memory_utilization) * facts.total_gib * GIB
        best = best.replace(gpu_memory_utilization=max_util)
    fp8 = None if flags.fp8_kv or not bounds.allow_fp8_kv else _fp8_kv_dtype(facts, history)
    if fp8:
        best = best.replace(kv_cache_dtype=fp8)
        best_bpt = kv_bpt(best, facts) or bpt
    stages = [
        (flags, _tokens_bytes(tokens, bpt, block) - have),
        (best, _tokens_bytes(tokens, best_bpt, block) - budget),
    ]
    yield from _room_levers(flags, facts, bounds, history, obs, stages)
    yield _capacity_give_up(
        bounds, _capacity(budget, best_bpt, block, facts), fp8, best.gpu_memory_utilization
    )


def _room_levers(
    flags: EngineFlags,
    facts: BlindFacts,
    bounds: Bounds,
    history: History,
    obs: Figures = NO_FIGURES,
    stages: list[tuple[EngineFlags, float]] | None = None,
) -> Iterator[Step]:
    """Levers that leave more memory for the KV cache without touching the context.

    ``stages``: (flags, KV bytes still missing with them), mildest first. With the failed run's own
    figures a lever comes on the first stage whose shortfall its whole gain covers, and not at all when
    none: eager mode frees at most the CUDA-graph memory vLLM took (or estimated), fp8 weights what the
    memory model says they save (unknown without the model's config: proposed on ``flags``). More tensor
    parallelism (the next size the GPUs allow and vLLM accepts) splits the weights and KV heads; it is
    proposed on ``flags`` as they are.
    """

    def placed(change: dict[str, object], gain_gib: float | None) -> EngineFlags | None:
        if not stages or gain_gib is None:
            return flags.replace(**change)
        for base, short in stages:
            if gain_gib * GIB >= short:
                return base.replace(**change)
        return None

    graphs = max(obs.cudagraph_gib or 0.0, obs.cudagraph_estimated_gib or 0.0) or None
    saving = None
    if facts.arch is not None:
        saving = memmodel.fp8_weight_saving_gib(facts.arch, flags, obs.weights_gib)
    if bounds.allow_eager and not flags.enforce_eager and facts.backend == "cuda":
        new = placed({"enforce_eager": True}, graphs)
        if new is not None:
            yield Step(new, "eager mode frees the CUDA-graph memory for the KV cache")
    tp = flags.tensor_parallel_size
    wider = facts.next_tensor_parallel(tp)
    if bounds.allow_tensor_parallel and facts.backend == "cuda" and wider is not None:
        yield Step(
            flags.replace(tensor_parallel_size=wider),
            f"more room on each GPU: tensor parallel {tp} -> {wider} splits the weights over more GPUs",
        )
    if (
        bounds.allow_weight_quantization
        and flags.quantization is None
        and "fp8_weights" not in history.banned
    ):
        cc = facts.compute_capability
        if cc is None or cc >= (8, 0):
            new = placed({"quantization": "fp8"}, saving)
            if new is not None:
                yield Step(new, "fp8 weights take a byte per parameter of the linear layers")


def _no_kv_memory(
    flags: EngineFlags,
    failure: Failure,
    facts: BlindFacts,
    bounds: Bounds,
    obs: Figures,
    history: History,
) -> Iterator[Step | GiveUp]:
    max_util = _max_usable_util(flags, bounds, facts)
    need_len = _context(flags, failure, facts)
    bpt = kv_bpt(flags, facts)
    total = facts.total_gib * GIB if facts.total_gib else 0.0
    need_kv = bytes_for_len(need_len, bpt, facts.block_size) * (1 + KV_MARGIN) if bpt and need_len else None
    n = failure.numbers
    # vLLM's "Available KV cache memory", may be < 0
    avail = n.kv_available_gib if n.kv_available_gib is not None else n.figures.kv_cache_gib
    used = sum(
        v or 0.0 for v in (obs.weights_gib, obs.non_torch_gib, obs.peak_activation_gib, obs.cudagraph_gib)
    )
    short: float | None = None  # KV bytes missing at these flags
    why = ""
    if flags.kv_cache_memory_bytes is None and total and need_kv is not None:
        if avail is not None:
            short = need_kv - avail * GIB
            why = f"vLLM had {avail:.2f} GiB for the KV cache"
        elif used:
            short = used * GIB + need_kv - flags.gpu_memory_utilization * total
            why = f"weights and activations take {used:.2f} GiB"
    if short is not None:
        util = ceil_util(flags.gpu_memory_utilization + short / total)
        if flags.gpu_memory_utilization < util <= max_util:
            yield Step(
                flags.replace(gpu_memory_utilization=util),
                f"{why}: utilization -> {util:g} leaves room for the KV cache",
            )
        if util > max_util:
            # the most utilization allowed cannot reach it: other levers, on top of it when needed
            stages = [(flags, short)]
            if max_util > flags.gpu_memory_utilization:
                extra = (max_util - flags.gpu_memory_utilization) * total
                stages.append((flags.replace(gpu_memory_utilization=max_util), short - extra))
            yield from _room_levers(flags, facts, bounds, history, obs, stages)
            return
    elif flags.kv_cache_memory_bytes is None and max_util > flags.gpu_memory_utilization:
        util = min(max_util, ceil_util(flags.gpu_memory_utilization + 2 * UTIL_STEP))
        yield Step(
            flags.replace(gpu_memory_utilization=util),
            f"no memory left for the KV cache: utilization -> {util:g}",
        )
    yield from _room_levers(flags, facts, bounds, history, obs)


def _free_mem_below_util(
    flags: EngineFlags,
    failure: Failure,
    facts: BlindFacts,
    bounds: Bounds,
    obs: Figures,
    history: History,
) -> Iterator[Step | GiveUp]:
    n = failure.numbers
    printed = n.figures.free_gib is not None
    free = n.figures.free_gib if printed else facts.free_gib
    total = n.figures.total_gib if n.figures.total_gib is not None else facts.total_gib
    if not free or not total:
        util = floor_util(flags.gpu_memory_utilization - UTIL_STEP)
        if util >= bounds.min_gpu_memory_utilization:
            yield Step(flags.replace(gpu_memory_utilization=util), f"less utilization: -> {util:g}")
        return
    context = 0 if printed else _unseen_context(facts, flags.tensor_parallel_size)
    util = memmodel.free_allows(free * GIB, total * GIB, context)
    util = min(util, bounds.max_gpu_memory_utilization)
    if util >= flags.gpu_memory_utilization:
        util = floor_util(flags.gpu_memory_utilization - 0.01)
    holders = f"; memory held by: {', '.join(facts.holders)}" if facts.holders else ""
    if util < bounds.min_gpu_memory_utilization:
        yield GiveUp(
            f"only {free:.2f} of {total:.2f} GiB is free: utilization {util:g} would be below "
            f"search.min_gpu_memory_utilization {bounds.min_gpu_memory_utilization:g}{holders}"
        )
        return
    yield Step(
        flags.replace(gpu_memory_utilization=util),
        f"{free:.2f} of {total:.2f} GiB free: utilization {flags.gpu_memory_utilization:g} -> "
        f"{util:g}{holders}",
    )


def _oom_weights(
    flags: EngineFlags,
    failure: Failure,
    facts: BlindFacts,
    bounds: Bounds,
    obs: Figures,
    history: History,
) -> Iterator[Step | GiveUp]:
    tp = flags.tensor_parallel_size
    wider = facts.next_tensor_parallel(tp)
    if bounds.allow_tensor_parallel and facts.backend == "cuda" and wider is not None:
        yield Step(
            flags.replace(tensor_parallel_size=wider),
            f"weights do not fit one GPU: tensor parallel {tp} -> {wider}",
        )
    cc = facts.compute_capability
    if (
        bounds.allow_weight_quantization
        and flags.quantization is None
        and "fp8_weights" not in history.banned
        and (cc is None or cc >= (8, 0))
    ):
        yield Step(
            flags.replace(quantization="fp8"), "weights do not fit: fp8 weight quantization halves them"
        )
    yield GiveUp(
        "the weights alone do not fit the device"
        + (
            ""
            if bounds.allow_weight_quantization
            else "; search.allow_weight_quantization is off ("
            + how_to_allow("search.allow_weight_quantization")
            + ")"
        )
    )


def _oom_profile(
    flags: EngineFlags,
    failure: Failure,
    facts: BlindFacts,
    bounds: Bounds,
    obs: Figures,
    history: History,
) -> Iterator[Step | GiveUp]:
    n = failure.numbers
    sampler = "sampler" in failure.evidence.lower() or "dummy requests" in failure.evidence.lower()
    default_seqs, default_batched = facts.batch(flags)
    seqs = flags.max_num_seqs or _int(n.dummy_requests) or default_seqs
    batched = flags.max_num_batched_tokens or _int(n.figures.max_num_batched_tokens) or default_batched
    factor = 0.5
    tried, free = n.tried_to_allocate_mib, n.device_free_mib
    if tried and free is not None and tried > 0:
        factor = min(0.5, max(0.05, 0.8 * free / tried))
    new_seqs = max(bounds.min_seqs, int(seqs * factor))
    new_batched = max(MIN_BATCHED_TOKENS, int(batched * factor))
    if sampler and new_seqs < seqs:
        yield Step(
            flags.replace(max_num_seqs=new_seqs),
            f"sampler warm-up ran out of memory: max_num_seqs {seqs} -> {new_seqs}",
        )
    if new_batched < batched:
        yield Step(
            flags.replace(
                max_num_batched_tokens=new_batched, max_num_seqs=min(seqs, max(new_seqs, bounds.min_seqs))
            ),
            f"profile run ran out of memory: max_num_batched_tokens {batched} -> {new_batched}, "
            f"max_num_seqs {seqs} -> {min(seqs, max(new_seqs, bounds.min_seqs))}",
        )
    if new_seqs < seqs:
        yield Step(flags.replace(max_num_seqs=new_seqs), f"max_num_seqs {seqs} -> {new_seqs}")
    yield from _room_levers(flags, facts, bounds, history)


def _oom_cudagraph(
    flags: EngineFlags,
    failure: Failure,
    facts: BlindFacts,
    bounds: Bounds,
    obs: Figures,
    history: History,
) -> Iterator[Step | GiveUp]:
    if bounds.allow_eager and not flags.enforce_eager:
        yield Step(flags.replace(enforce_eager=True), "CUDA-graph capture ran out of memory: eager mode")
    util = floor_util(flags.gpu_memory_utilization - UTIL_STEP)
    if util >= bounds.min_gpu_memory_utilization:
        yield Step(
            flags.replace(gpu_memory_utilization=util),
            f"leave more room for the graph pool: utilization -> {util:g}",
        )


def _oom_kv_alloc(
    flags: EngineFlags,
    failure: Failure,
    facts: BlindFacts,
    bounds: Bounds,
    obs: Figures,
    history: History,
) -> Iterator[Step | GiveUp]:
    n = failure.numbers
    tried, free = n.tried_to_allocate_mib, n.device_free_mib
    if flags.kv_cache_memory_bytes:
        # vLLM takes a pinned KV size as given, whatever the utilization: only a smaller size helps. The
        # CUDA-graph capture and the sampler warm-up allocate after the KV cache, so part of what was
        # free stays free for them.
        if free is not None and free > 0:
            room = free * MIB
            new = int(room - max(PINNED_RESERVE_GIB * GIB, PINNED_RESERVE_FRACTION * room))
            if 0 < new < flags.kv_cache_memory_bytes:
                yield Step(
                    flags.replace(kv_cache_memory_bytes=new),
                    f"the pinned KV cache does not fit the {free / 1024:.2f} GiB free: "
                    f"--kv-cache-memory-bytes -> {new} ({new / GIB:.2f} GiB)",
                )
        return
    step = UTIL_STEP
    if tried and free is not None and facts.total_gib:
        step = max(0.02, ceil_util((tried - free) / 1024 / facts.total_gib + 0.01))
    util = floor_util(flags.gpu_memory_utilization - step)
    if util >= bounds.min_gpu_memory_utilization:
        yield Step(
            flags.replace(gpu_memory_utilization=util),
            f"KV allocation ran out of memory: utilization -> {util:g}",
        )


def _oom_runtime(
    flags: EngineFlags,
    failure: Failure,
    facts: BlindFacts,
    bounds: Bounds,
    obs: Figures,
    history: History,
) -> Iterator[Step | GiveUp]:
    seqs = flags.max_num_seqs or facts.batch(flags)[0]
    if seqs > bounds.min_seqs:
        new = max(bounds.min_seqs, seqs // 2)
        yield Step(
            flags.replace(max_num_seqs=new), f"out of memory while serving: max_num_seqs {seqs} -> {new}"
        )
    util = floor_util(flags.gpu_memory_utilization - UTIL_STEP)
    if util >= bounds.min_gpu_memory_utilization and flags.kv_cache_memory_bytes is None:
        yield Step(
            flags.replace(gpu_memory_utilization=util),
            f"more headroom for activations: utilization -> {util:g}",
        )
    length = _context(flags, failure, facts)
    if length:
        shorter = floor_block(length * 0.75, facts.block_size)
        if shorter >= bounds.min_context:
            yield Step(
                flags.replace(max_model_len=shorter), f"shorter context to cut activation peaks: -> {shorter}"
            )


def _host_oom(
    flags: EngineFlags,
    failure: Failure,
    facts: BlindFacts,
    bounds: Bounds,
    obs: Figures,
    history: History,
) -> Iterator[Step | GiveUp]:
    if flags.cpu_offload_gb:
        new = flags.cpu_offload_gb / 2 if flags.cpu_offload_gb >= 2 else None
        yield Step(flags.replace(cpu_offload_gb=new), "host memory ran out: less CPU offload")
    if facts.backend == "cpu" and flags.kv_cache_memory_bytes is None:
        util = floor_util(flags.gpu_memory_utilization - 2 * UTIL_STEP)
        if util >= bounds.min_gpu_memory_utilization:
            yield Step(
                flags.replace(gpu_memory_utilization=util), f"host memory ran out: utilization -> {util:g}"
            )
    seqs = flags.max_num_seqs or facts.batch(flags)[0]
    if seqs > bounds.min_seqs:
        yield Step(
            flags.replace(max_num_seqs=max(bounds.min_seqs, seqs // 2)),
            "host memory ran out: fewer sequences",
        )


def _fp8_unsupported(
    flags: EngineFlags, facts: BlindFacts, bounds: Bounds, history: History
) -> tuple[History, list[Step | GiveUp]]:
    if flags.fp8_kv:
        e4m3 = flags.kv_cache_dtype in ("fp8", "fp8_e4m3")
        cc = facts.compute_capability
        if e4m3 and facts.backend == "cuda" and (cc is None or cc >= (8, 0)):
            history = replace(history, banned=history.banned | {"fp8_e4m3_kv"})
            return history, [
                Step(flags.replace(kv_cache_dtype="fp8_e5m2"), "fp8 e4m3 is not supported here: fp8_e5m2 KV")
            ]
        # no fp8 KV at all here (the CPU backend without AVX-512/AMX, or e5m2 failed too)
        history = replace(history, banned=history.banned | {"fp8_kv", "fp8_e4m3_kv"})
        return history, [_without_fp8_kv(flags, facts, bounds, history)]
    if flags.quantization == "fp8":
        history = replace(history, banned=history.banned | {"fp8_weights"})
        return history, [Step(flags.replace(quantization=None), "fp8 weights are not supported here")]
    return history, [
        GiveUp(
            "fp8 failed although r1sup set no fp8 flag; check server.extra_args", exit_code=EXIT_FATAL_FAILURE
        )
    ]


def _without_fp8_kv(flags: EngineFlags, facts: BlindFacts, bounds: Bounds, history: History) -> Step | GiveUp:
    """Back to the model's KV dtype; if the context was sized for fp8, to the longest that fits now."""
    new = flags.replace(kv_cache_dtype="auto")
    reason = "fp8 KV is not supported here: model-dtype KV"
    if history.kv_bytes and facts.kv_bytes_per_token and flags.max_model_len:
        longest = max_len_for(history.kv_bytes, facts.kv_bytes_per_token, facts.block_size, facts)
        if longest < flags.max_model_len:
            if longest < bounds.min_context:
                return GiveUp(
                    "fp8 KV is not supported here, and without it the longest context that fits is "
                    f"{longest} tokens, below the smallest allowed ({bounds.min_context})"
                )
            new = new.replace(max_model_len=longest)
            reason += f", context to the longest that fits without fp8 ({longest})"
    return Step(new, reason)


_SMART = {
    F.KV_INSUFFICIENT: _kv_insufficient,
    F.NO_KV_MEMORY: _no_kv_memory,
    F.FREE_MEM_BELOW_UTIL: _free_mem_below_util,
    F.OOM_WEIGHTS: _oom_weights,
    F.OOM_PROFILE: _oom_profile,
    F.OOM_CUDAGRAPH: _oom_cudagraph,
    F.OOM_KV_ALLOC: _oom_kv_alloc,
    F.OOM_RUNTIME: _oom_runtime,
    F.HOST_OOM: _host_oom,
}
