"""The search: one pure search over all levers, scored by the memory model. No I/O, no clock.

r1sup's one recommender. ``Search(facts).recommend()`` answers "which flags" before any launch, the same
for ``r1sup plan`` and the first launch of ``tune``/``run`` (flags, verdict, and when nothing fits the
:class:`GiveUp`: then nothing is launched); ``Search.after(outcome)`` gives the next flags after a
failure, or :class:`GiveUp` with the bound that blocks and the ways out; ``Search.refine`` the one more
launch a passed launch's own KV figure allows. Every candidate is a set of flags over all the levers at
once (utilization, KV dtype, eager, ``max_num_batched_tokens``, tensor parallel, a pinned KV size, fp8
weights; for each, ``max_num_seqs`` from the sequences the user gets without r1sup down to
``search.min_max_num_seqs``; the context is then the longest that fits), evaluated by
:mod:`r1sup.core.memmodel` calibrated with every figure vLLM printed so far on this box, and ranked by one
objective (the README's "The search"):

1. it meets ``[target]`` (concurrency x context in the KV cache at once); never below ``target.context``
   nor ``search.min_max_model_len`` (a hard bound);
2. the context asked for; when nothing gives it, those within CONTEXT_SLACK of the longest that fits;
3. the cheapest set of changes against the user's flags, each costing what it takes from the user
   (:data:`COSTS`; fewer sequences and a shorter context in proportion to what is given up), then the
   fewest that cost something;
4. the longest context, the most sequences, the most KV capacity.

A failure adds evidence rather than a rule: the figures calibrate the model (``kv_insufficient``,
``no_kv_memory``: what is left for the KV cache, negative too), or add a constraint the model does not
hold (``free_mem_below_util``: utilization at most what is free; ``oom_profile``: the profile's peak needs
the bytes it missed; ``oom_cudagraph``, ``oom_runtime``: the memory outside vLLM's budget must grow by
what the allocation missed; ``oom_kv_alloc``: the budget shrinks by it; ``oom_weights``: weights of that
size per GPU do not load; ``fp8_unsupported``: that fp8 format is excluded on this box; a
``config_error`` over the model's context limit: the context is capped at it). A lever that was pulled
against a failure and left its figures where they were is marked ineffective for that failure and
credited with nothing afterwards; a configuration that failed is never launched again. The search gives
up only when no candidate within the bounds is predicted to fit even without the margin kept for the
model's error, and, once a launch calibrated it, none is predicted short by less than the calibrated
model's error (:meth:`Search.explore`: then one launch decides, not the prediction); what no flag
fixes (fatal, transient, internal, the attempt budget) is the policy's (:mod:`r1sup.core.policy`).

Explicit branches where there is nothing to score with: the CPU backend (:func:`assess` and its
recommender, :func:`recommend_flags`, size the first launch); without the model's architecture
(``r1sup diagnose`` on a bare log, an unreadable config.json) the first launch is the flags as given
and a failure takes one step per failure class (:mod:`r1sup.core.blind`); ``strategy = "naive"`` is
the hand walk kept as the benchmarks' baseline
(:mod:`r1sup.core.naive`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from r1sup.core import blind, modelarch, vllmversion
from r1sup.core import bounds as B
from r1sup.core import failure as F
from r1sup.core import memmodel as M
from r1sup.core import policy as P
from r1sup.core.blind import GiveUp
from r1sup.core.bounds import Bounds
from r1sup.core.capacity import Reduction
from r1sup.core.errors import EXIT_NO_WORKING_CONFIG
from r1sup.core.failure import Failure
from r1sup.core.figures import EMPTY as NO_FIGURES
from r1sup.core.figures import Figures
from r1sup.core.flags import FP8_KV_DTYPES, EngineFlags
from r1sup.core.hardware import Conditions, DeviceFacts, GpuInfo
from r1sup.core.memmodel import (  # the sizing arithmetic, beside the memory model (and named here too)
    ESTIMATE_MARGIN as ESTIMATE_MARGIN,
)
from r1sup.core.memmodel import (
    FOUR_BIT_METHODS,
    FP8_PER_TENSOR_SPELLING,
    FREE_MARGIN_GIB,
    Calibration,
    cdiv,
    error_bytes,
    estimated_max_model_len,
    free_allows,
    margin_bytes,
    request_blocks,
    startable_utilization,
    weight_method,
)
from r1sup.core.memmodel import MARGIN_FRACTION as MARGIN_FRACTION
from r1sup.core.memmodel import MEASURED_KV_ERROR_GIB as MEASURED_KV_ERROR_GIB
from r1sup.core.memmodel import PRINTED_GIB_STEP as PRINTED_GIB_STEP
from r1sup.core.modelarch import ModelArch
from r1sup.core.vllmversion import Version

GIB = 1024**3
MIB = 1024**2

# What each change to the user's flags costs (objective 3; lower is better; a candidate's cost is the sum
# over the flags it changes). Lowering max_num_seqs is never free: vLLM admits a request when the KV blocks
# it uses now are free, not max_model_len's worth, so a cache that holds one request of the full context
# holds many ordinary ones, and max_num_seqs caps how many run at once. It costs SEQS_COST in proportion
# to the concurrency given up (1024 -> 512 costs half of it); a shorter context costs CONTEXT_COST in
# proportion to the tokens given up.
COSTS: dict[str, float] = {
    "max_num_seqs": 6,  # x the fraction of the wanted concurrency given up
    "max_num_batched_tokens": 1,  # prefill in smaller chunks
    "gpu_memory_utilization": 1,  # more of the card (or less, when something else needs it)
    "kv_cache_memory_bytes": 1,
    "kv_cache_dtype": 2,  # fp8 KV: small accuracy cost
    "enforce_eager": 4,  # no CUDA graphs: slower decoding
    "tensor_parallel_size": 5,  # more GPUs
    "quantization": 8,  # fp8 weights, only where search.allow_weight_quantization
}
SEQS_COST = COSTS["max_num_seqs"]
CONTEXT_COST = 10  # x the fraction of the asked context given up
# When the asked context fits nowhere, candidates within this fraction of the longest context that fits
# compete on cost (so a few hundred tokens never cost the concurrency of hundreds of sequences)
CONTEXT_SLACK = 0.03
SEQS_STEP = 8  # vLLM captures CUDA graphs for batch sizes in steps of 8: max_num_seqs is searched on it
UNPIN_COST = 3  # dropping the user's pinned KV size (shrinking it costs kv_cache_memory_bytes')

UNCHANGED = 0.05  # a figure that moved less than 5% "did not move"
REFINE_GAIN = 1.05  # a passed launch is refined once when its own figures give a context this much longer
REFINE_SHORTFALL = 0.95  # and the refined launch takes at least this much of what vLLM's KV figure allows
MIN_BATCHED_TOKENS = 256


@dataclass(frozen=True)
class Facts:
    """What the search knows before the first launch (plain data)."""

    arch: modelarch.ModelArch | None
    device: DeviceFacts
    user: EngineFlags  # the user's [start]
    bounds: B.Bounds = field(default_factory=B.Bounds)
    version: vllmversion.Version = vllmversion.NEWEST_KNOWN
    calibration: M.Calibration | None = None  # from an earlier launch on this box (a saved profile)
    ladder_facts: B.BlindFacts | None = None  # for the branch without an architecture (r1sup.core.blind)
    suggestions: tuple[str, ...] = ()  # the planner's ways out, added to a give-up


@dataclass(frozen=True)
class Outcome:
    """One launch as r1sup saw it: its flags, the failure (class, phase, every figure vLLM printed) and
    the other figures of the launch (the log reader's); the box as probed after it."""

    flags: EngineFlags
    failure: Failure
    figures: Figures = NO_FIGURES
    device: DeviceFacts | None = None


@dataclass(frozen=True)
class Next:
    flags: EngineFlags
    reason: str
    retry: bool = False


Decision = Next | GiveUp


@dataclass(frozen=True)
class Evidence:
    """What the launches so far proved (each field is explained in the module doc)."""

    tried: frozenset[EngineFlags] = frozenset()
    retried: frozenset[str] = frozenset()
    banned_kv: frozenset[str] = frozenset()  # KV dtypes that failed here
    no_fp8_weights: bool = False
    util_cap: float | None = None
    context_cap: int | None = None
    weights_fail_bytes: int | None = None  # weights per GPU this large did not load
    profile_need: float = 0.0  # fraction the profile peak needs above the model's activation
    outside_need: dict[str, int] = field(default_factory=dict)  # oom_cudagraph/oom_runtime: bytes outside
    budget_cap: int | None = None  # oom_kv_alloc: the budget that does not fit physically
    pinned_cap: int | None = None  # oom_kv_alloc with a pinned KV size: the largest that may fit
    ineffective: frozenset[tuple[str, str]] = frozenset()  # (failure class, lever)
    last: dict[str, tuple[EngineFlags, tuple[float, ...]]] = field(default_factory=dict)
    calibration: M.Calibration | None = None
    calibrated: int = 0  # launches whose figures calibrated the model
    exact_kv: bool = False  # the KV budget of the calibration came from a token count, not 0.01 GiB
    attempts: int = 0
    explored: bool = False  # a launch predicted short within the model's error was made (Search.explore)


@dataclass(frozen=True)
class Candidate:
    flags: EngineFlags  # with the context set
    context: int
    meets_target: bool
    cost: float
    kv_tokens: int
    est: M.Estimate
    changes: tuple[str, ...]

    costed: int = 0  # changes that cost something (a free one does not count against a candidate)

    @property
    def seqs(self) -> int:
        """The sequences vLLM runs at once with these flags."""
        return self.est.batch.max_num_seqs

    def key(self) -> tuple[float, int, int, int, int]:
        return (self.cost, self.costed, -self.context, -self.seqs, -self.kv_tokens)


VERDICTS = ("fits", "fits_with_changes", "does_not_fit")


@dataclass(frozen=True)
class Recommendation:
    """The answer to "which flags" before any launch, the same for ``r1sup plan`` and the first launch of
    ``tune``/``run``: the flags, the verdict (``fits``: the user's flags as given; ``fits_with_changes``:
    only with ``flags``; ``does_not_fit``: nothing within the bounds, and ``give_up`` says why and the ways
    out: ``tune`` then launches nothing), why, and the search's candidate (None when the search has
    nothing to score with: the CPU backend, an unknown architecture)."""

    flags: EngineFlags
    verdict: str
    reason: str
    candidate: Candidate | None = None
    give_up: GiveUp | None = None


class Search:
    """The search over one bring-up (``r1sup tune``, ``r1sup run``'s start and its recovery)."""

    def __init__(self, facts: Facts, evidence: Evidence | None = None) -> None:
        self.facts = facts
        self.evidence = evidence or Evidence(
            calibration=facts.calibration, calibrated=int(bool(facts.calibration))
        )
        self._history = blind.History()  # the blind branch's own state (no architecture, naive)

    # --- the two questions -----------------------------------------------------------------------

    def recommend(self) -> Recommendation:
        """The first launch and its verdict (:class:`Recommendation`). Without an architecture the flags
        are the user's (nothing to score them with: the launch measures); on the CPU backend
        :func:`assess` (its recommender, :func:`recommend_flags`) sizes the context against the NUMA node."""
        user = self.facts.user
        if self.facts.arch is None or not self.facts.device.gpus and self.facts.device.backend != "cpu":
            return Recommendation(user, "fits", "the model's architecture is unknown: launched as given")
        if not self.usable:
            return self._recommend_cpu()
        best = self.best(margin=True) or self.best(margin=False)
        if best is None:
            give_up = self._give_up(None)
            return Recommendation(user, "does_not_fit", give_up.reason, None, give_up)
        as_given = user.replace(max_model_len=self.asked_context())
        if best.flags == as_given:
            why = f"as given: predicted KV {best.est.kv.gib:.2f} GiB = {best.kv_tokens} tokens"
            return Recommendation(best.flags, "fits", why, best)
        return Recommendation(best.flags, "fits_with_changes", self._explain(best), best)

    def _recommend_cpu(self) -> Recommendation:
        """The CPU backend (vLLM's KV cache in host memory, one NUMA node): :func:`assess`."""
        arch, user, b = self.facts.arch, self.facts.user, self.facts.bounds
        assert arch is not None
        plan = assess(
            arch,
            self.facts.device,
            user,
            target_concurrency=b.target_concurrency,
            target_context=b.target_context,
            calibration=self.evidence.calibration,
            bounds=b,
            version=self.facts.version,
        )
        if plan.fits or plan.recommended is None:
            verdict = "fits" if plan.fits else "does_not_fit"
            give_up = None if plan.fits else GiveUp(plan.reason, (), EXIT_NO_WORKING_CONFIG)
            return Recommendation(user, verdict, plan.reason, None, give_up)
        return Recommendation(plan.recommended, "fits_with_changes", plan.reason)

    def after(self, outcome: Outcome) -> Decision:
        """What to launch after ``outcome`` (which failed), or why to stop."""
        failure, flags = outcome.failure, outcome.flags
        ev = self.evidence
        ev = replace(ev, tried=ev.tried | {flags}, attempts=ev.attempts + 1)
        if outcome.device is not None:
            self.facts = replace(self.facts, device=outcome.device)
        b = self.facts.bounds
        ruled = P.decide(
            failure,
            retried=ev.retried,
            attempts=ev.attempts,
            max_attempts=b.max_attempts,
            fixable=self._context_error(flags, failure),
        )
        if isinstance(ruled, P.Retry):
            self.evidence = replace(ev, retried=ev.retried | {failure.cls})
            return Next(flags, ruled.reason, retry=True)
        if isinstance(ruled, P.Stop):
            ways = self.facts.suggestions if ruled.exit_code == EXIT_NO_WORKING_CONFIG else ()
            bound = "search.max_attempts" if "max_attempts" in ruled.reason else ""
            return self._stop(ev, GiveUp(ruled.reason, ways, ruled.exit_code, bound))
        if b.strategy == "naive" or not self.usable or failure.cls == F.HOST_OOM:
            return self._fallback(ev, outcome)
        ev, note = self._learn(ev, outcome)
        self.evidence = ev
        best = self.best(margin=True) or self.best(margin=False)
        why = f"{failure.cls}: {note}; " if note else f"{failure.cls}: "
        if best is None:
            near = self.explore()
            if near is None:
                return self._stop(ev, self._give_up(failure))
            self.evidence = replace(self.evidence, explored=True)
            return Next(near.flags, why + self._explain_near(near))
        return Next(best.flags, why + self._explain(best))

    def refine(self, flags: EngineFlags, figures: Figures) -> EngineFlags | None:
        """After a launch that passed below the asked context: one more launch when what it printed holds a
        context REFINE_GAIN longer (up to the one asked for); else None. vLLM's "GPU KV cache size: N
        tokens" alone is enough: the same flags hold one request of its usable blocks (the memory does not
        depend on ``max_model_len``), so the next launch reaches within REFINE_SHORTFALL of that figure;
        the calibrated model's best candidate is taken instead when it gives as much (the margin kept for
        the first launch was the model's error, and this launch measured it away). Not after a launch
        made within the model's error (:meth:`explore`): there vLLM decided, at the least the bounds
        accept, where the model's candidates are not to be trusted."""
        if not self.usable or self.facts.bounds.strategy == "naive" or self.evidence.explored:
            return None
        if figures.kv_cache_gib is None and not figures.kv_cache_tokens:
            return None
        context = flags.max_model_len or 0
        asked = self.asked_context()
        if not context or context >= asked:
            return None
        ok = Outcome(flags, Failure(F.NONE), figures)
        ev, _ = self._learn(replace(self.evidence, tried=self.evidence.tried | {flags}), ok)
        allowed = 0
        tokens = int(figures.kv_cache_tokens or 0)
        if tokens and flags.kv_cache_memory_bytes is None:
            block = M.block_size(self.facts.device.backend)
            allowed = min(asked, M.usable_blocks(tokens // block, self.facts.version) * block)
        trial = Search(self.facts, ev)
        best = trial.best(margin=True)
        if best is not None and best.context >= max(REFINE_GAIN * context, REFINE_SHORTFALL * allowed):
            self.evidence = ev
            return best.flags
        if allowed >= REFINE_GAIN * context:
            self.evidence = ev
            return flags.replace(max_model_len=allowed)
        return None

    # --- candidates ------------------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        d = self.facts.device
        return self.facts.arch is not None and d.backend != "cpu" and bool(d.gpus) and d.total_bytes > 0

    def asked_context(self) -> int:
        """The context the user asked for (the model's own limit when unset), within evidence."""
        arch = self.facts.arch
        assert arch is not None
        asked = self.facts.user.max_model_len
        if asked is None:
            # a target context sets the context (issue 36); without one, the model's own limit
            asked = self.facts.bounds.target_context or arch.max_position_embeddings
        elif asked == -1:
            asked = arch.max_position_embeddings
            target = self.facts.bounds.target_context
            if target and target > asked:
                asked = target
        asked = min(asked, arch.max_position_embeddings)  # vLLM refuses more (a config error)
        cap = self.evidence.context_cap
        return min(asked, cap) if cap else asked

    def min_context(self) -> int:
        b = self.facts.bounds
        return min(b.min_context, self.asked_context()) if not b.target_context else b.min_context

    def candidates(self) -> Iterable[EngineFlags]:
        """Every combination of the levers but ``max_num_seqs`` (the user's): :meth:`ranked` searches
        the sequences of each for the most that give its longest context."""
        arch, user, b, ev = self.facts.arch, self.facts.user, self.facts.bounds, self.evidence
        assert arch is not None
        device = self.facts.device
        cc = device.compute_capability
        # tensor parallel: the user's size when vLLM accepts it, larger ones when allowed and present
        valid = M.valid_tp_sizes(arch, max(device.count, user.tensor_parallel_size))
        tps = [t for t in valid if t == user.tensor_parallel_size]
        if not tps:
            tps = [max(t for t in valid if t <= user.tensor_parallel_size)]
        if b.allow_tensor_parallel and device.count > tps[0]:
            tps += [t for t in valid if t > tps[0] and t <= device.count]
        quants: list[str | None] = [user.quantization]
        if (
            b.allow_weight_quantization
            and not ev.no_fp8_weights
            and M.weight_method(arch, user) is None
            and (cc is None or cc >= (8, 0))
        ):
            quants.append("fp8")
        if user.quantization == "fp8" and ev.no_fp8_weights:
            quants = [None]
        kvs = [k for k in self._kv_dtypes() if k not in ev.banned_kv]
        eagers = [user.enforce_eager] + ([True] if b.allow_eager and not user.enforce_eager else [])
        for tp, quant, kv, eager in itertools.product(tps, quants, kvs, eagers):
            base = user.replace(
                tensor_parallel_size=tp, quantization=quant, kv_cache_dtype=kv, enforce_eager=eager
            )
            for util in self._utils(base):
                for batched in self._batched(base.replace(gpu_memory_utilization=util)):
                    f = base.replace(gpu_memory_utilization=util, max_num_batched_tokens=batched)
                    yield from self._pinned(f)

    def _kv_dtypes(self) -> list[str]:
        user, b, device = self.facts.user, self.facts.bounds, self.facts.device
        cc = device.compute_capability
        e4m3 = cc is None or cc >= (8, 9)
        out = [user.kv_cache_dtype]
        if user.kv_cache_dtype in ("fp8", "fp8_e4m3") and not e4m3:
            out = ["fp8_e5m2"]  # vLLM refuses e4m3 below compute capability 8.9
        if b.allow_fp8_kv and device.fp8_kv_supported is not False:
            # one fp8 format (the same bytes): e4m3 where the card is known to have it, e5m2 elsewhere
            # and once e4m3 failed here
            known = cc is not None and cc >= (8, 9)
            out.append("fp8" if known and "fp8" not in self.evidence.banned_kv else "fp8_e5m2")
        if user.kv_cache_dtype in FP8_KV_DTYPES:
            out.append("auto")  # when fp8 fails here
        return list(dict.fromkeys(out))

    def utilization_cap(self, tp: int) -> float:
        """The highest ``--gpu-memory-utilization`` this search launches on ``tp`` GPUs: the bounds', what
        the free memory allows, and what a failed launch showed."""
        b, device, ev = self.facts.bounds, self.facts.device, self.evidence
        cap = b.max_gpu_memory_utilization
        if device.free_bytes and device.total_bytes:
            cap = min(cap, startable_utilization(device, tp, self.facts.version))
        if ev.util_cap is not None:
            cap = min(cap, ev.util_cap)
        return cap

    def _utils(self, f: EngineFlags) -> list[float]:
        """The user's utilization, the highest allowed, and the highest that leaves outside vLLM's budget
        what a failure showed is needed there (or keeps the budget below what failed to allocate)."""
        b, device, ev = self.facts.bounds, self.facts.device, self.evidence
        cap = self.utilization_cap(f.tensor_parallel_size)
        total = device.total_bytes
        room = (device.free_bytes or total) - M.context_bytes(
            device, f.tensor_parallel_size, self.facts.version
        )
        wanted = [f.gpu_memory_utilization, cap]
        for need in ev.outside_need.values():
            wanted.append(math.floor((room - need) / total * 100) / 100)
        if ev.budget_cap is not None:
            wanted.append(math.floor(ev.budget_cap / total * 100) / 100)
        out = [u for u in wanted if b.min_gpu_memory_utilization <= u <= cap]
        if f.kv_cache_memory_bytes is not None:
            out = [min(f.gpu_memory_utilization, cap)] if out else []
        return sorted(set(out), reverse=True)

    def wanted_seqs(self) -> int:
        """The sequences the user gets without the search: ``start.max_num_seqs``, else vLLM's default for
        this version and GPU (clamped to its batched tokens, as vLLM does)."""
        arch = self.facts.arch
        assert arch is not None
        user = self.facts.user.replace(max_model_len=self.asked_context())
        return M.resolve_batch(arch, self.facts.device, user, self.facts.version).max_num_seqs

    def min_seqs(self) -> int:
        """The fewest sequences the search sets: ``search.min_max_num_seqs`` and the target's concurrency,
        never more than the user gets without the search."""
        b = self.facts.bounds
        return min(self.wanted_seqs(), max(b.min_max_num_seqs, b.target_concurrency or 1))

    def _batched(self, f: EngineFlags) -> list[int | None]:
        """``max_num_batched_tokens``: the user's; as many as the wanted sequences when vLLM's would be
        fewer (vLLM refuses fewer batched tokens than sequences); a half, a quarter, 2048 (a smaller
        profile peak)."""
        arch = self.facts.arch
        assert arch is not None
        want = self.wanted_seqs()
        batch = M.resolve_batch(arch, self.facts.device, f.replace(max_num_seqs=want), self.facts.version)
        tokens = batch.max_num_batched_tokens
        out: list[int | None] = [f.max_num_batched_tokens]
        if want > tokens:
            out.append(want)
        out += [t for t in (tokens // 2, tokens // 4, 2048) if MIN_BATCHED_TOKENS <= t < tokens]
        return list(dict.fromkeys(out))

    def _with_seqs(self, f: EngineFlags, seqs: int) -> EngineFlags:
        """``f`` running ``seqs`` sequences (unset when that is what vLLM would run anyway)."""
        if self.facts.user.max_num_seqs is None and seqs == self.wanted_seqs():
            return f.replace(max_num_seqs=None)
        return f.replace(max_num_seqs=seqs)

    def _seq_choices(self, f: EngineFlags, margin: bool) -> list[Candidate]:
        """``f`` with the most sequences that give the context asked for (from the wanted ones down to
        :meth:`min_seqs`, on vLLM's graph step of 8); when no number gives it, the fewest (the longest
        context), the wanted ones, and the most within CONTEXT_SLACK of that longest context."""
        arch = self.facts.arch
        assert arch is not None
        want = self.wanted_seqs()
        tokens = M.resolve_batch(arch, self.facts.device, f.replace(max_num_seqs=want), self.facts.version)
        hi = min(want, tokens.max_num_batched_tokens)
        lo = min(hi, self.min_seqs())
        asked = self.asked_context()
        cache: dict[int, Candidate | None] = {}

        def at(seqs: int) -> Candidate | None:
            if seqs not in cache:
                cache[seqs] = self.score(self._with_seqs(f, seqs), margin)
            return cache[seqs]

        top = at(hi)
        if top is not None and top.context >= asked or lo == hi:
            return [top] if top is not None else []
        bottom = at(lo)
        if bottom is None:
            return [top] if top is not None else []
        grid = [lo] + [n for n in range(M.cdiv(lo + 1, SEQS_STEP) * SEQS_STEP, hi, SEQS_STEP)] + [hi]

        def most(enough: int) -> Candidate:
            """The candidate with the most sequences whose context is at least ``enough`` (bisection:
            fewer sequences never give a shorter context; the fewest give ``bottom``'s)."""
            if top is not None and top.context >= enough:
                return top
            good, bad = 0, len(grid) - 1
            while bad - good > 1:
                mid = (good + bad) // 2
                c = at(grid[mid])
                if c is not None and c.context >= enough:
                    good = mid
                else:
                    bad = mid
            return at(grid[good]) or bottom

        if bottom.context >= asked:
            return [most(asked)]
        out = [bottom, most(int(bottom.context * (1 - CONTEXT_SLACK)))]
        return out + ([top] if top is not None else [])

    def _pinned(self, f: EngineFlags) -> Iterable[EngineFlags]:
        """A pinned KV size as given (or shrunk to what a failed allocation left), or not pinned."""
        cap = self.evidence.pinned_cap
        if f.kv_cache_memory_bytes is not None and cap is not None and f.kv_cache_memory_bytes > cap:
            if cap > 0:
                yield f.replace(kv_cache_memory_bytes=cap)
        else:
            yield f
        if f.kv_cache_memory_bytes is not None:
            yield f.replace(kv_cache_memory_bytes=None)

    # --- scoring ---------------------------------------------------------------------------------

    def margin(self, est: M.Estimate) -> int:
        """Bytes of KV kept spare for the model's error (:func:`margin_bytes`)."""
        return margin_bytes(est, self.evidence.calibrated, self.evidence.exact_kv)

    def score(self, flags: EngineFlags, margin: bool, explore: bool = False) -> Candidate | None:
        """``flags`` with the longest context that fits, or None when they cannot run within the bounds.
        ``explore``: with the KV the calibrated model's error allows above its figure (:func:`error_bytes`),
        at the shortest context the bounds accept (:meth:`explore`)."""
        arch, device, b, ev = self.facts.arch, self.facts.device, self.facts.bounds, self.evidence
        assert arch is not None
        asked = self.asked_context()
        f = flags.replace(max_model_len=asked)
        if M.tp_refusal(arch, f.tensor_parallel_size):
            return None
        est = M.evaluate(arch, device, f, self.facts.version, ev.calibration)
        if est.startup_problem is not None:
            return None
        if est.batch.max_num_seqs > est.batch.max_num_batched_tokens:
            return None  # vLLM's SchedulerConfig refuses it (max_num_batched_tokens >= max_num_seqs)
        if ev.weights_fail_bytes is not None and est.weights.bytes >= ev.weights_fail_bytes:
            return None
        tp = f.tensor_parallel_size
        free = (device.free_bytes or device.total_bytes) - est.context.bytes
        # the profile run's peak must fit physically (before the KV cache exists)
        peak = est.weights.bytes + est.non_torch.bytes + int(est.activation.bytes * (1 + ev.profile_need))
        if peak > free:
            return None
        budget = est.budget
        if ev.budget_cap is not None and budget > ev.budget_cap and f.kv_cache_memory_bytes is None:
            return None
        outside = free - budget
        for cls, need in ev.outside_need.items():
            if cls == F.OOM_CUDAGRAPH and f.enforce_eager:
                continue
            if outside < self._scaled_need(cls, need, est):
                return None
        kv = est.kv.bytes - (self.margin(est) if margin else 0)
        if explore:
            kv = est.kv.bytes + error_bytes(est, ev.calibrated)
        if f.kv_cache_memory_bytes is not None and kv > free - (budget - est.kv.bytes):
            return None
        usable = request_blocks(est, kv)
        if usable <= 0:
            return None
        context = min(asked, usable * est.block_size)
        if b.target_concurrency and not b.target_context:  # requests of the full context, all at once
            context = min(asked, usable // b.target_concurrency * est.block_size)
        if context < self.min_context():
            return None
        if explore:  # the least the bounds accept: the launch most likely to start
            predicted = request_blocks(est, est.kv.bytes) * est.block_size
            context = min(context, max(self.min_context(), predicted))
        if est.batch.max_num_seqs < min(b.min_seqs, self.wanted_seqs()):
            return None
        meets = True
        if b.target_concurrency:
            each = b.target_context or context
            meets = usable >= b.target_concurrency * M.cdiv(each, est.block_size)
            if not meets:  # r1sup's probe fails a launch that does not hold the target (kv_insufficient)
                return None
        final = f.replace(max_model_len=context)
        if final in ev.tried:
            return None
        changes, cost, costed = self._cost(final, est.batch.max_num_seqs, context)
        del tp
        return Candidate(final, context, meets, cost, usable * est.block_size, est, changes, costed)

    def _scaled_need(self, cls: str, need: int, est: M.Estimate) -> int:
        """Memory outside the budget a failure showed is needed, for this candidate. A runtime allocation
        no larger than the sampler's for the failed launch's sequences is taken to scale with max_num_seqs
        until a launch shows it does not (then it is fixed); a larger one never does."""
        if cls != F.OOM_RUNTIME or (cls, "max_num_seqs") in self.evidence.ineffective:
            return need
        last = self.evidence.last.get(cls)
        if last is None:
            return need
        arch = self.facts.arch
        assert arch is not None
        batch = M.resolve_batch(arch, self.facts.device, last[0], self.facts.version)
        then = batch.max_num_seqs
        sampler = M.sampler_bytes(
            arch, self.facts.device, then, batch.max_num_batched_tokens, self.facts.version
        )
        if last[1][0] * MIB > sampler:
            return need
        now = est.batch.max_num_seqs
        return int(need * min(1.0, now / then)) if then else need

    def _cost(self, f: EngineFlags, seqs: int, context: int) -> tuple[tuple[str, ...], float, int]:
        """The changes to the user's flags, their cost, and how many of them cost something. Fewer
        sequences than wanted cost SEQS_COST by the fraction given up; a shorter context than asked
        CONTEXT_COST by the fraction given up (not a change of flags: the context is always set)."""
        user = self.facts.user.replace(max_model_len=f.max_model_len)
        changes = tuple(name for name in COSTS if getattr(f, name) != getattr(user, name))
        cost = 0.0
        costed = 0
        for name in changes:
            each = COSTS[name]
            if name == "kv_cache_memory_bytes" and f.kv_cache_memory_bytes is None:
                each = UNPIN_COST  # the user's pinned KV size dropped for utilization's
            if name == "tensor_parallel_size":  # by the GPUs added
                each = (
                    COSTS[name]
                    * (f.tensor_parallel_size - user.tensor_parallel_size)
                    / max(1, user.tensor_parallel_size)
                )
            if name == "max_num_seqs":
                want = self.wanted_seqs()
                each = SEQS_COST * max(0, want - seqs) / want if want else 0.0
            cost += each
            costed += 1 if each else 0
        asked = self.asked_context()
        if context < asked:
            cost += CONTEXT_COST * (asked - context) / asked
        return changes, cost, costed

    def ranked(self, margin: bool) -> list[Candidate]:
        """The candidates, best first: those that give the asked context (or, when none does, those within
        CONTEXT_SLACK of the longest that fits) by :meth:`Candidate.key`, then the rest by context."""
        found: dict[EngineFlags, Candidate] = {}
        for f in dict.fromkeys(self.candidates()):
            for c in self._seq_choices(f, margin):
                found[c.flags] = c
        if not found:
            return []
        longest = max(c.context for c in found.values())
        asked = self.asked_context()
        enough = longest if longest >= asked else int(longest * (1 - CONTEXT_SLACK))
        near = sorted((c for c in found.values() if c.context >= enough), key=Candidate.key)
        rest = sorted((c for c in found.values() if c.context < enough), key=lambda c: (-c.context, c.key()))
        return near + rest

    def best(self, margin: bool) -> Candidate | None:
        ranked = self.ranked(margin)
        return ranked[0] if ranked else None

    def explore(self) -> Candidate | None:
        """When nothing within the bounds is predicted to fit after a launch calibrated the model: the
        candidate predicted short by the least KV, when that is within the calibrated model's error
        (:func:`error_bytes`), at the fewest sequences and the shortest context the bounds accept, so
        that vLLM's own figures decide rather than the prediction; None otherwise. Once per search (a
        second would stop on a prediction again), never on flags a launch already measured (whatever
        their context: the memory outside the KV cache does not depend on it)."""
        ev = self.evidence
        if ev.explored or not ev.calibrated:
            return None
        measured = {f.replace(max_model_len=None) for f in ev.tried}
        fewest = self.min_seqs()
        found: list[tuple[int, Candidate]] = []
        for f in dict.fromkeys(self.candidates()):
            c = self.score(self._with_seqs(f, fewest), margin=False, explore=True)
            if c is None or c.flags.replace(max_model_len=None) in measured:
                continue
            found.append((request_blocks(c.est, c.est.kv.bytes), c))
        if not found:
            return None
        return min(found, key=lambda pair: (-pair[0], pair[1].key()))[1]

    # --- evidence --------------------------------------------------------------------------------

    def _learn(self, ev: Evidence, outcome: Outcome) -> tuple[Evidence, str]:
        """The constraint or calibration ``outcome`` adds, and a note for the log."""
        failure, flags = outcome.failure, outcome.flags
        arch, device = self.facts.arch, self.facts.device
        assert arch is not None
        n = failure.numbers
        f = outcome.figures
        # the figures the failure printed where the launch's own do not have them
        f = replace(
            f,
            kv_cache_gib=_number(f.kv_cache_gib, n.figures.kv_cache_gib, n.kv_available_gib),
            weights_gib=_number(f.weights_gib, n.figures.weights_gib),
            requested_gib=_number(f.requested_gib, n.figures.requested_gib),
            total_gib=_number(f.total_gib, n.figures.total_gib),
            gpu_memory_utilization=_number(f.gpu_memory_utilization, n.figures.gpu_memory_utilization),
        )
        estimate = n.estimated_max_model_len
        tokens = f.kv_cache_tokens
        if tokens and flags.kv_cache_memory_bytes is None and failure.cls == F.NONE:
            # "GPU KV cache size: N tokens" is the block count times the block: exact where "Available KV
            # cache memory" is rounded to 0.01 GiB
            bpt = M.kv_bytes_per_token(arch, flags.kv_cache_dtype, flags.tensor_parallel_size)
            f = replace(f, kv_cache_gib=float(tokens) * bpt / GIB)
        elif estimate and flags.kv_cache_memory_bytes is None:
            # vLLM's estimated maximum model length is exact to a block where "Available KV cache memory"
            # is rounded to 0.01 GiB: the budget holds (estimate / block + 1) blocks (the null block)
            block = M.block_size(device.backend)
            bpt = M.kv_bytes_per_token(arch, flags.kv_cache_dtype, flags.tensor_parallel_size)
            f = replace(f, kv_cache_gib=(int(estimate) // block + 1) * block * bpt / GIB)
        budget_known = f.requested_gib is not None or (
            f.gpu_memory_utilization is not None and f.total_gib is not None
        )
        if f.kv_cache_gib is not None and not budget_known and flags.kv_cache_memory_bytes is None:
            # what vLLM requested: ceil(utilization x total) (its request_memory), so the KV figure
            # calibrates the whole non-KV share
            f = replace(f, requested_gib=M.requested_bytes(device, flags.gpu_memory_utilization) / GIB)
        note = ""
        # a launch that printed the KV memory calibrates the whole budget; one that printed only some
        # terms (the weights before a failed profile run) calibrates when nothing better is known
        if f.kv_cache_gib is not None or (f.weights_gib is not None and ev.calibration is None):
            cal = M.Calibration(flags=flags, figures=f, version=self.facts.version)
            exact = bool(
                flags.kv_cache_memory_bytes is None and (estimate or (tokens and failure.cls == F.NONE))
            )
            ev = replace(ev, calibration=cal, calibrated=ev.calibrated + 1, exact_kv=exact)
            if f.kv_cache_gib is not None:
                note = f"vLLM measured {f.kv_cache_gib:.2f} GiB for the KV cache"
        tried = n.tried_to_allocate_mib
        free_mib = n.device_free_mib
        need = int(max(0.0, (tried or 0) - (free_mib or 0)) * MIB) if tried else 0
        prior = M.evaluate(arch, device, flags, self.facts.version, ev.calibration)
        here = (device.free_bytes or device.total_bytes) - prior.context.bytes
        cls = failure.cls
        ev = self._mark_ineffective(ev, cls, flags, (float(tried or 0), float(free_mib or 0)))
        if cls == F.FREE_MEM_BELOW_UTIL:
            # what is free is a condition of the moment, not of the box: the probe after the launch says
            # what is free now; only without one does the printed figure cap utilization
            free_gib, total_gib = n.figures.free_gib, n.figures.total_gib
            if free_gib and total_gib and outcome.device is None:
                cap = free_allows(free_gib * GIB, total_gib * GIB)
                ev = replace(ev, util_cap=min(cap, ev.util_cap or 1.0))
            if free_gib and total_gib:
                note = f"{free_gib:.2f} of {total_gib:.2f} GiB were free"
            found = conditions(device)
            holders = found.holders if found is not None else ()
            if holders:
                note += f" (held: {', '.join(holders)})"
        elif cls == F.OOM_WEIGHTS:
            ev = replace(ev, weights_fail_bytes=min(prior.weights.bytes, ev.weights_fail_bytes or 1 << 62))
            note = f"{prior.weights.gib:.2f} GiB of weights per GPU do not load"
        elif cls == F.OOM_PROFILE:
            act = max(1, prior.activation.bytes)
            missing = need or act // 2
            ev = replace(ev, profile_need=max(ev.profile_need, (missing + act) / act - 1 + 0.05))
            text = failure.evidence.lower()
            what = (
                "the sampler warm-up" if "sampler" in text or "dummy requests" in text else "the profile run"
            )
            note = f"{what} missed {missing / GIB:.2f} GiB"
        elif cls in (F.OOM_CUDAGRAPH, F.OOM_RUNTIME):
            missing = need or int(0.05 * device.total_bytes)
            outside = max(0, here - prior.budget)
            total_need = outside + missing + int(FREE_MARGIN_GIB * GIB)
            ev = replace(
                ev, outside_need={**ev.outside_need, cls: max(total_need, ev.outside_need.get(cls, 0))}
            )
            note = f"{missing / GIB:.2f} GiB missing outside vLLM's budget"
        elif cls == F.OOM_KV_ALLOC:
            missing = need or int(0.05 * device.total_bytes)
            cap = prior.budget - missing - int(FREE_MARGIN_GIB * GIB)
            ev = replace(ev, budget_cap=min(cap, ev.budget_cap or 1 << 62))
            if flags.kv_cache_memory_bytes is not None:
                # vLLM takes a pinned size as given: only a smaller one fits (what was free, less a reserve
                # for the graphs and the sampler that allocate after it)
                room = flags.kv_cache_memory_bytes - missing
                shrunk = int(room - max(B.PINNED_RESERVE_GIB * GIB, B.PINNED_RESERVE_FRACTION * room))
                ev = replace(ev, pinned_cap=min(shrunk, ev.pinned_cap or 1 << 62))
            note = f"the KV allocation missed {missing / GIB:.2f} GiB"
        elif cls == F.FP8_UNSUPPORTED:
            if flags.fp8_kv:
                banned = {flags.kv_cache_dtype} | (
                    {"fp8", "fp8_e4m3"} if flags.kv_cache_dtype in ("fp8", "fp8_e4m3") else set()
                )
                if flags.kv_cache_dtype == "fp8_e5m2":
                    banned |= FP8_KV_DTYPES
                ev = replace(ev, banned_kv=ev.banned_kv | banned)
                note = f"{flags.kv_cache_dtype} KV is not supported here"
            elif flags.quantization == "fp8":
                ev = replace(ev, no_fp8_weights=True)
                note = "fp8 weights are not supported here"
        elif cls == F.CONFIG_ERROR and (flags.max_model_len or 0) > arch.max_position_embeddings:
            limit = int(n.derived_max_model_len or arch.max_position_embeddings)
            ev = replace(ev, context_cap=limit)
            note = f"the model's context limit is {limit}"
        elif cls == F.CONFIG_ERROR:
            note = "vLLM needs max_num_batched_tokens >= max_num_seqs"
        last = dict(ev.last)
        last[cls] = (flags, (float(tried or 0), float(free_mib or 0)))
        return replace(ev, last=last), note

    def _mark_ineffective(
        self, ev: Evidence, cls: str, flags: EngineFlags, figures: tuple[float, ...]
    ) -> Evidence:
        """The levers changed since the last failure of this class did not move its figures: ineffective."""
        last = ev.last.get(cls)
        if last is None or not any(figures):
            return ev
        before, then = last
        moved = any(
            abs(a - b) > UNCHANGED * max(abs(a), abs(b), 1.0) for a, b in zip(figures, then, strict=True)
        )
        if moved:
            return ev
        levers = {name for name in COSTS if getattr(flags, name) != getattr(before, name)}
        return replace(ev, ineffective=ev.ineffective | {(cls, lever) for lever in levers})

    def _context_error(self, flags: EngineFlags, failure: Failure) -> bool:
        """A config error with a fix: the context above the model's limit, or more sequences than batched
        tokens (vLLM's SchedulerConfig refuses both; the candidates never break the second rule)."""
        if failure.cls != F.CONFIG_ERROR or self.facts.arch is None:
            return False
        text = (failure.evidence + " " + failure.detail).lower().replace("-", "_")
        if "max_num_batched_tokens" in text and "max_num_seqs" in text:
            return True
        if "schedulerconfig" in text:  # its message can sit on a line the evidence does not hold
            batch = M.resolve_batch(self.facts.arch, self.facts.device, flags, self.facts.version)
            return batch.max_num_seqs > batch.max_num_batched_tokens
        limit = failure.numbers.derived_max_model_len or self.facts.arch.max_position_embeddings
        return "max_model_len" in text and (flags.max_model_len or 0) > limit

    # --- stopping --------------------------------------------------------------------------------

    def _give_up(self, failure: Failure | None) -> GiveUp:
        """Nothing within the bounds fits even without the margin: name the bound and the ways out
        (``failure``: the one that led here; None before any launch)."""
        after = f"after {failure.cls}, " if failure is not None else "before any launch, "
        b = self.facts.bounds
        ways: list[str] = []
        bound = ""
        cap = self.utilization_cap(self.facts.user.tensor_parallel_size)
        if cap < b.min_gpu_memory_utilization:
            found = conditions(self.facts.device)
            held = ", ".join(found.holders if found is not None else ()) or "nothing r1sup can name"
            free, total = (found.free_gib, found.total_gib) if found is not None else (None, None)
            ways.append(
                f"free GPU memory: {free} of {total} GiB (held: {held}); "
                f"utilization {cap:g} would be below search.min_gpu_memory_utilization "
                f"{b.min_gpu_memory_utilization:g}"
            )
            reason = (
                f"{after}what is free allows utilization {cap:g}, below "
                f"search.min_gpu_memory_utilization {b.min_gpu_memory_utilization:g} (held: {held})"
            )
            bound = "search.min_gpu_memory_utilization"
            return GiveUp(reason, tuple(ways + list(self.facts.suggestions)), EXIT_NO_WORKING_CONFIG, bound)
        relaxed = Search(
            replace(
                self.facts,
                bounds=replace(b, min_max_model_len=16, target_context=None, target_concurrency=None),
            ),
            self.evidence,
        )
        best = relaxed.best(margin=False)
        if best is not None:
            bound = (
                "target.context"
                if b.target_context and best.context < b.target_context
                else "search.min_max_model_len"
            )
            if b.target_concurrency and best.context >= b.min_context:
                bound = "target.concurrency"
            changed = self.facts.user.describe_change(best.flags)
            ways.append(
                f"the longest context that fits is {best.context} tokens with {changed} "
                f"(KV cache {best.kv_tokens} tokens); lower {bound} to accept it"
            )
        else:
            wider_bounds: tuple[tuple[str, bool, dict[str, Any]], ...] = (
                (
                    "search.allow_weight_quantization",
                    b.allow_weight_quantization,
                    {"allow_weight_quantization": True},
                ),
                (
                    "search.max_gpu_memory_utilization",
                    b.max_gpu_memory_utilization >= 0.98,
                    {"max_gpu_memory_utilization": 0.98},
                ),
            )
            for name, allowed, change in wider_bounds:
                if allowed:
                    continue
                wider = Search(replace(self.facts, bounds=replace(b, **change)), self.evidence).best(
                    margin=False
                )
                if wider is not None:
                    bound = bound or name
                    what = self.facts.user.describe_change(wider.flags)
                    ways.append(f"{name} = {list(change.values())[0]}: context {wider.context} with {what}")
            bound = bound or "the device"
            ways.append(
                "more GPU memory (a larger card, or more GPUs with tensor parallel), or a smaller model"
            )
        ways += list(self.facts.suggestions)
        reason = (
            f"{after}no configuration within the bounds is predicted to fit "
            f"(calibrated by {self.evidence.calibrated} launch(es)); blocked by {bound}"
            + (f" ({B.how_to_allow(bound)})" if B.how_to_allow(bound) else "")
        )
        return GiveUp(reason, tuple(dict.fromkeys(ways)), EXIT_NO_WORKING_CONFIG, bound)

    def _stop(self, ev: Evidence, give_up: GiveUp) -> GiveUp:
        self.evidence = ev
        return give_up

    def _fallback(self, ev: Evidence, outcome: Outcome) -> Decision:
        """The blind branch's per-class step (no architecture, the CPU backend, host OOM, naive)."""
        self.evidence = ev
        lf = self.facts.ladder_facts or B.BlindFacts()
        decision = blind.next_step(
            outcome.flags, outcome.failure, self._history, self.facts.bounds, lf, outcome.figures
        )
        if isinstance(decision, GiveUp):
            return decision
        self._history = decision.history
        if decision.flags in ev.tried:
            return GiveUp(f"{outcome.failure.cls}: the next step was already tried", self.facts.suggestions)
        return Next(decision.flags, decision.reason)

    # --- what a result gives up ----------------------------------------------------------------------

    def costs(self, flags: EngineFlags) -> list[str]:
        """What each change of ``flags`` against the user's costs the user, one phrase each (the context
        first); [] when nothing changed or nothing is known to score it with."""
        if not self.usable:
            return []
        arch, user = self.facts.arch, self.facts.user
        assert arch is not None
        out: list[str] = []
        asked, want = self.asked_context(), self.wanted_seqs()
        context = flags.max_model_len if flags.max_model_len not in (None, -1) else asked
        if context < asked:
            out.append(
                f"context {context} of the {asked} asked: "
                f"{100 * (asked - context) / asked:.0f}% of it given up"
            )
        seqs = M.resolve_batch(arch, self.facts.device, flags, self.facts.version).max_num_seqs
        if seqs < want:
            out.append(
                f"max_num_seqs {want} -> {seqs}: {seqs} requests run at once instead of {want} "
                f"({want - seqs} of {want} given up: requests beyond {seqs} queue)"
            )
        if flags.enforce_eager and not user.enforce_eager:
            out.append("enforce_eager: no CUDA graphs, slower decoding (most at small batches)")
        if flags.fp8_kv and not user.fp8_kv:
            out.append(f"kv_cache_dtype {flags.kv_cache_dtype}: KV cache in 8 bits, a small accuracy cost")
        if flags.gpu_memory_utilization > user.gpu_memory_utilization:
            out.append(
                f"gpu_memory_utilization {user.gpu_memory_utilization:g} -> "
                f"{flags.gpu_memory_utilization:g}: more of the card for vLLM, less left for anything else"
            )
        elif flags.gpu_memory_utilization < user.gpu_memory_utilization:
            out.append(
                f"gpu_memory_utilization {user.gpu_memory_utilization:g} -> "
                f"{flags.gpu_memory_utilization:g}: a smaller budget (what is free, or room a failure "
                "showed is needed outside it)"
            )
        tokens = M.resolve_batch(arch, self.facts.device, user, self.facts.version).max_num_batched_tokens
        if flags.max_num_batched_tokens is not None and flags.max_num_batched_tokens < tokens:
            out.append(
                f"max_num_batched_tokens {tokens} -> {flags.max_num_batched_tokens}: prompts prefill in "
                "smaller chunks (slower time to first token on long prompts)"
            )
        elif flags.max_num_batched_tokens is not None and flags.max_num_batched_tokens > tokens:
            out.append(
                f"max_num_batched_tokens {tokens} -> {flags.max_num_batched_tokens}: as many as the "
                "sequences (vLLM refuses fewer), more activation memory"
            )
        if flags.tensor_parallel_size > user.tensor_parallel_size:
            tp = flags.tensor_parallel_size
            out.append(f"tensor_parallel_size {user.tensor_parallel_size} -> {tp}: {tp} GPUs")
        if flags.quantization != user.quantization and flags.quantization:
            out.append(f"quantization {flags.quantization}: fp8 weights, a small accuracy cost")
        if flags.kv_cache_memory_bytes != user.kv_cache_memory_bytes and user.kv_cache_memory_bytes:
            out.append(
                "kv_cache_memory_bytes "
                + (f"shrunk to {flags.kv_cache_memory_bytes}" if flags.kv_cache_memory_bytes else "dropped")
            )
        return out

    def reduction(self, flags: EngineFlags) -> Reduction | None:
        """When ``flags`` give up more than half the asked context, or run fewer sequences at once than the
        user gets without r1sup (``start.max_num_seqs`` or vLLM's default): what they give, what was
        asked, the ways out that would give it, and ``reason``, one line saying so; else None."""
        if not self.usable:
            return None
        arch = self.facts.arch
        assert arch is not None
        asked, want = self.asked_context(), self.wanted_seqs()
        context = flags.max_model_len if flags.max_model_len not in (None, -1) else asked
        seqs = M.resolve_batch(arch, self.facts.device, flags, self.facts.version).max_num_seqs
        short, fewer = 2 * context < asked, seqs < want
        if not (short or fewer):
            return None
        ways = self.ways_to(asked, want)
        gives = []
        if short:
            gives.append(f"context {context} of the {asked} asked")
        if fewer:
            whose = "asked" if self.facts.user.max_num_seqs else "vLLM's default"
            gives.append(f"{seqs} requests at once of the {want} {whose}")
        reason = "reduced: " + " and ".join(gives) + "; "
        reason += "ways out: " + "; ".join(ways) if ways else f"no way out found ({WAYS_TRIED})"
        return Reduction(reason, context, asked, seqs, want, tuple(ways))

    def ways_to(self, context: int, seqs: int) -> list[str]:
        """The ways out that give ``context`` tokens with ``seqs`` sequences, each predicted by the same
        search with one thing changed: fp8 weights (as this vLLM version spells the flag), tensor parallel
        over more GPUs like these, a 4-bit checkpoint, a larger GPU of r1sup's catalog."""
        from r1sup.core import catalog

        arch, device, user, b = self.facts.arch, self.facts.device, self.facts.user, self.facts.bounds
        assert arch is not None
        plain = Evidence(calibration=self.evidence.calibration, calibrated=self.evidence.calibrated)

        def gives(facts: Facts) -> bool:
            best = Search(facts, plain).best(margin=True)
            return best is not None and best.context >= context and best.seqs >= seqs

        ways: list[str] = []
        unquantized = M.weight_method(arch, user) is None
        if unquantized and gives(replace(self.facts, bounds=replace(b, allow_weight_quantization=True))):
            ways.append(
                f"fp8 weights (--quantization {fp8_weights_flag(self.facts.version)}; "
                f"{B.how_to_allow('search.allow_weight_quantization')})"
            )
        bigger = [t for t in M.valid_tp_sizes(arch, 8) if t > max(device.count, user.tensor_parallel_size)]
        for tp in bigger:
            more = replace(device, gpus=(device.gpus[0],) * tp, processes=device.processes)
            if gives(replace(self.facts, device=more, bounds=replace(b, allow_tensor_parallel=True))):
                ways.append(f"tensor parallel over {tp} GPUs like this one (--tensor-parallel-size {tp})")
                break
        if unquantized and gives(replace(self.facts, user=user.replace(quantization="awq"))):
            ways.append("a 4-bit AWQ or GPTQ checkpoint of this model")
        total = device.total_bytes
        for name, spec in sorted(catalog.GPUS.items(), key=lambda kv: kv[1].total_gib):
            size = int(spec.total_gib * GIB)
            if size <= total or spec.platform != "cuda":
                continue
            gpu = GpuInfo(0, f"NVIDIA {name}", size, size, spec.compute_capability)
            card = replace(device, gpus=(gpu,) * max(1, device.count), processes=())
            if gives(replace(self.facts, device=card)):
                ways.append(f"a GPU with more memory ({name}, {spec.total_gib:g} GiB, gives it)")
                break
        return ways

    def _explain_near(self, c: Candidate) -> str:
        """Why a launch predicted short within the model's error (:meth:`explore`) is made."""
        est = c.est
        need = self.min_context()
        have = request_blocks(est, est.kv.bytes) * est.block_size
        error = error_bytes(est, self.evidence.calibrated)
        return (
            f"{self.facts.user.describe_change(c.flags) or 'the flags as given'}; predicted KV "
            f"{est.kv.gib:.2f} GiB = {have} tokens of the {need} needed, short by less than the "
            f"{error / GIB:.2f} GiB the calibrated model may err by: launched so that vLLM's figures decide"
        )

    def _explain(self, c: Candidate) -> str:
        est = c.est
        parts = [
            f"{self.facts.user.describe_change(c.flags) or 'the flags as given'}",
            f"predicted KV {est.kv.gib:.2f} GiB = {c.kv_tokens} tokens",
        ]
        if not c.meets_target:
            parts.append("the target is not met by any candidate")
        return "; ".join(parts)


def fp8_weights_flag(version: vllmversion.Version) -> str:
    """``--quantization`` for fp8 weights quantized on the fly from a 16-bit checkpoint, as ``version``
    spells it: ``fp8_per_tensor`` from :data:`FP8_PER_TENSOR_SPELLING`, ``fp8`` before."""
    return "fp8_per_tensor" if version >= FP8_PER_TENSOR_SPELLING else "fp8"


def conditions(device: DeviceFacts | None, own_pids: frozenset[int] = frozenset()) -> Conditions | None:
    """What the box looked like (kept with a profile): free and total memory of the most loaded GPU, the
    memory other processes (not ``own_pids``) held on it, and who they were; None without a GPU."""
    if device is None or not device.gpus:
        return None
    per_gpu: dict[int, int] = {}
    holders = []
    for p in device.processes:
        if p.pid in own_pids:
            continue
        per_gpu[p.gpu_index] = per_gpu.get(p.gpu_index, 0) + p.used_bytes
        holders.append(f"pid {p.pid} {p.name} ({p.used_bytes / GIB:.1f} GiB)")
    return Conditions(
        free_gib=round(device.free_bytes / GIB, 2),
        total_gib=round(device.total_bytes / GIB, 2),
        others_gib=round(max(per_gpu.values(), default=0) / GIB, 2),
        holders=tuple(holders[:5]),
    )


def _number(own: float | None, *printed: float | None) -> float | None:
    """A launch's own figure, else the first number its failure printed (as a float)."""
    if own is not None:
        return own
    for value in printed:
        if value is not None:
            return float(value)
    return None


# --- the first launch as the plan reports it: the verdict on the flags as given, and the recommender of
# the CPU backend, pipeline stages and auto-fit (where the search above has nothing to score with) ------

TARGET_SEQS_FLOOR = 16  # fewest sequences per batch the planner sets to make room (vLLM captures 1..2x of it)


@dataclass(frozen=True)
class Evaluation:
    """The memory model's estimate of one configuration, with the margin the planner keeps spare: what
    every verdict of :func:`plan` rests on (does it start, how long a context, how many requests)."""

    est: M.Estimate
    margin: int = 0  # bytes of KV kept spare for errors of the estimated parts (see _margin)

    @property
    def flags(self) -> EngineFlags:
        return self.est.flags

    @property
    def kv(self) -> int:
        return self.est.kv.bytes

    @property
    def weights(self) -> int:
        return self.est.weights.bytes

    @property
    def block(self) -> int:
        return self.est.block_size

    @property
    def kv_bpt(self) -> int:
        return self.est.kv_bytes_per_token

    @property
    def bytes_per_block(self) -> int:
        return self.est.bytes_per_block

    @property
    def num_blocks(self) -> int:
        return self.est.num_blocks

    @property
    def startup_ok(self) -> bool:
        return self.est.startup_problem is None

    @property
    def max_num_seqs(self) -> int:
        return self.est.batch.max_num_seqs

    def usable_blocks(self, margin: bool) -> int:
        """Blocks left for requests (V1 holds one back as the null block): the search's arithmetic."""
        return request_blocks(self.est, self.kv - self.margin if margin else self.kv)

    def context_for(self, concurrency: int, cap: int, margin: bool) -> int:
        """Largest block-aligned context where ``concurrency`` requests fit at once (0 if none)."""
        per_request = self.usable_blocks(margin) // max(1, concurrency)
        return max(0, min(cap, per_request * self.block))

    def fits_context(self, context: int, concurrency: int, margin: bool) -> bool:
        """``concurrency`` requests of ``context`` tokens each fit at once (and vLLM starts)."""
        return self.startup_ok and self.usable_blocks(margin) >= concurrency * cdiv(context, self.block)

    def holds(self, context: int, concurrency: int, per_request: int, margin: bool) -> bool:
        """vLLM starts with ``max_model_len`` = ``context`` (one request of it fits) and the KV cache holds
        ``concurrency`` requests of ``per_request`` tokens at once: issue 6's reading of a target."""
        return self.fits_context(context, 1, margin) and self.fits_context(per_request, concurrency, margin)

    def longest_context(self, concurrency: int, per_request: int, cap: int, margin: bool) -> int:
        """The longest block-aligned ``max_model_len`` (up to ``cap``) for :meth:`holds`; 0 if none."""
        if not self.fits_context(per_request, concurrency, margin):
            return 0
        return max(0, min(cap, self.usable_blocks(margin) * self.block))


def evaluate(
    arch: ModelArch,
    device: DeviceFacts,
    flags: EngineFlags,
    version: Version,
    calibration: Calibration | None = None,
) -> Evaluation:
    """``flags`` on ``device`` as the planner judges them: the memory model's estimate (with
    ``calibration``, a saved launch's figures, when there is one) and the margin kept for its error."""
    est = M.evaluate(arch, device, flags, version, calibration)
    return Evaluation(est, _margin(est, calibration is not None))


def _margin(est: M.Estimate, calibrated: bool = False) -> int:
    """KV bytes the recommended flags keep spare for the memory model's error: the search's margin
    (:func:`r1sup.core.memmodel.margin_bytes`), for a search that starts from ``calibration`` when one is
    given."""
    return margin_bytes(est, calibrated=int(calibrated))


def fp8_kv_choice(device: DeviceFacts) -> str:
    """``fp8`` (e4m3) from compute capability 8.9 and on the CPU backend, else ``fp8_e5m2``."""
    if device.backend == "cpu":
        return "fp8"
    cc = device.compute_capability
    return "fp8" if cc is not None and cc >= (8, 9) else "fp8_e5m2"


def _e4m3(dtype: str) -> bool:
    return dtype in ("fp8", "fp8_e4m3")


@dataclass(frozen=True)
class Choice:
    ev: Evaluation
    context: int


def recommend_flags(
    arch: ModelArch,
    device: DeviceFacts,
    flags: EngineFlags,
    *,
    concurrency: int,
    requested_context: int,
    min_context: int,
    version: Version,
    calibration: Calibration | None,
    bounds: Bounds,
    target_concurrency: int | None = None,
    per_request: int | None = None,
) -> Choice | None:
    """The best configuration predicted to start with a margin, or None.

    It must hold (:meth:`Evaluation.holds`, with the margin) one request of its ``max_model_len`` and
    ``concurrency`` requests of ``per_request`` tokens at once (None: requests of the full context).
    Preference (issues 4 and 6): the longest context up to the requested one, then the fewest and mildest
    changes: as given, then with fp8 KV when allowed, then at the highest allowed utilization (with and
    without fp8 KV), then, when a target concurrency is given and ``max_num_seqs`` is vLLM's default,
    with fewer sequences per batch (:func:`fewer_seqs`). When none keeps the requested context: the
    longest block-aligned context one request fits with all of those levers, never below ``min_context``,
    or without CUDA graphs when that keeps the requested context or gives a clearly longer one
    (``memmodel.EAGER_MIN_GAIN``).
    """
    base = flags.replace(max_model_len=requested_context)
    cc = device.compute_capability
    if device.backend != "cpu" and _e4m3(base.kv_cache_dtype) and cc is not None and cc < (8, 9):
        base = base.replace(kv_cache_dtype="fp8_e5m2")
    start_max = startable_utilization(device, base.tensor_parallel_size, version)
    lo, hi = bounds.min_gpu_memory_utilization, bounds.max_gpu_memory_utilization
    pinned = base.kv_cache_memory_bytes is not None
    if not pinned and base.gpu_memory_utilization > start_max:
        util = min(start_max, hi)
        if util < lo:
            return None
        base = base.replace(gpu_memory_utilization=util)

    def judged(f: EngineFlags) -> Evaluation:
        return evaluate(arch, device, f, version, calibration)

    def keeps(ev: Evaluation) -> bool:
        return ev.holds(requested_context, concurrency, per_request or requested_context, margin=True)

    def shrink(ev: Evaluation) -> Choice | None:
        if per_request is None:  # requests of the full context: it shrinks with them
            context = ev.context_for(concurrency, requested_context, margin=True)
        else:
            context = ev.longest_context(concurrency, per_request, requested_context, margin=True)
        if context <= 0 or context < min_context:
            return None
        return Choice(judged(ev.flags.replace(max_model_len=context)), context)

    # the ways to keep the requested context, the fewest and mildest changes first
    keep = [base]
    fp8_ok = bounds.allow_fp8_kv and device.fp8_kv_supported is not False
    if fp8_ok and base.kv_cache_dtype not in FP8_KV_DTYPES:
        keep.append(base.replace(kv_cache_dtype=fp8_kv_choice(device)))
    top_util = min(hi, start_max)
    if not pinned and top_util > base.gpu_memory_utilization:
        keep += [f.replace(gpu_memory_utilization=top_util) for f in list(keep)]
    seqs = fewer_seqs(arch, device, base, target_concurrency, version)
    if seqs is not None:
        keep.append(keep[-1].replace(max_num_seqs=seqs))
    evals = [judged(f) for f in keep]
    for ev in evals:
        if keeps(ev):
            return Choice(ev, requested_context)
    primary = evals[-1]  # every lever but eager mode: the most KV, so the longest context
    choice = shrink(primary)
    if bounds.allow_eager and not base.enforce_eager and device.backend != "cpu":
        # without CUDA graphs: their pool (and, from vLLM 0.20, the estimate vLLM charges to the KV
        # budget) goes to the KV cache; taken when that keeps the context or lengthens it by EAGER_MIN_GAIN
        ev = judged(primary.flags.replace(enforce_eager=True))
        if keeps(ev):
            return Choice(ev, requested_context)
        eager = shrink(ev)
        if eager is not None and (choice is None or eager.context >= M.EAGER_MIN_GAIN * choice.context):
            return eager
    return choice


def fewer_seqs(
    arch: ModelArch,
    device: DeviceFacts,
    flags: EngineFlags,
    target_concurrency: int | None,
    version: Version | str | None = None,
) -> int | None:
    """``max_num_seqs`` for a known target concurrency, when vLLM's default is larger; else None.

    vLLM sizes the sampler warm-up (``max_num_seqs`` dummy requests of vocabulary-wide logits) and the
    CUDA-graph captures (batch sizes up to ``min(2 x max_num_seqs, 512)``, vllm/config/vllm.py) from
    ``max_num_seqs``; its API-server default (256, or 1024 on large GPUs) is far above most targets,
    and both come out of the KV budget. The planner sets the target concurrency (at least
    ``TARGET_SEQS_FLOOR``, a multiple of 8 like vLLM's capture sizes) only when the user left the flag
    unset, so decoding keeps CUDA graphs for every batch the target needs.
    """
    if target_concurrency is None or flags.max_num_seqs is not None or device.backend == "cpu":
        return None
    seqs = max(TARGET_SEQS_FLOOR, cdiv(target_concurrency, 8) * 8)
    default = M.resolve_batch(arch, device, flags, vllmversion.as_version(version)).max_num_seqs
    return seqs if seqs < default else None


WAYS_TRIED = "fp8 weights, tensor parallel, a 4-bit checkpoint, a larger GPU"
"""The ways out a reduction's search tries on a GPU (:meth:`Search.ways_to`), named when none gives it."""


def _own_reduction(
    arch: ModelArch, device: DeviceFacts, choice: Choice, asked_context: int, v: Version
) -> Reduction | None:
    """The own branch's (CPU backend, pipeline stages, auto-fit) :class:`Reduction`: its recommendation
    gives up more than half the asked context, as :meth:`Search.reduction` says it of the search's (the
    sequences are vLLM's own there, never lowered); None when it does not."""
    context = choice.context
    if 2 * context >= asked_context:
        return None
    flags = choice.ev.flags
    seqs = M.resolve_batch(arch, device, flags, v).max_num_seqs
    ways: tuple[str, ...] = ()
    if device.backend == "cpu" and flags.kv_cache_memory_bytes is not None:
        # a pinned KV budget is the CPU backend's whole lever: the bytes one request of the asked context
        # takes (its blocks and the null block), where the node has them
        per_token = M.kv_bytes_per_token(arch, flags.kv_cache_dtype, flags.tensor_parallel_size)
        need = math.ceil(M.kv_bytes_for_context(asked_context, per_token, M.block_size(device.backend)))
        if need <= (device.free_bytes or device.total_bytes):
            ways = (
                f"--kv-cache-memory-bytes {need} (the KV cache of one request of {asked_context} tokens; "
                f"{flags.kv_cache_memory_bytes} now)",
            )
    if ways:
        reason = f"reduced: context {context} of the {asked_context} asked; ways out: {ways[0]}"
    else:
        budget = (
            "a larger KV budget: --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE or --gpu-memory-utilization"
            if device.backend == "cpu"
            else WAYS_TRIED
        )
        reason = f"reduced: context {context} of the {asked_context} asked; no way out found ({budget})"
    return Reduction(reason, context, asked_context, seqs, seqs, ways)


def _search_recommendation(
    arch: ModelArch,
    device: DeviceFacts,
    flags: EngineFlags,
    bounds: Bounds,
    version: Version,
    calibration: Calibration | None,
    target_concurrency: int | None,
    target_context: int | None,
    stages: int,
    auto_fit: bool,
) -> Any:
    """(the search, its recommendation) (:meth:`r1sup.core.search.Search.recommend`) for these flags on a GPU
    box, as the first launch of ``tune`` and ``run`` gets it; None where :func:`assess`'s own branch answers:
    the CPU backend, a model split over pipeline stages, ``--max-model-len -1`` (vLLM's auto-fit)."""
    if device.backend == "cpu" or not device.gpus or stages > 1 or auto_fit:
        return None
    limits = replace(bounds, target_concurrency=target_concurrency, target_context=target_context)
    facts = Facts(
        arch=arch, device=device, user=flags, bounds=limits, version=version, calibration=calibration
    )
    search = Search(facts)
    return search, search.recommend()


def why_not(
    ev: Evaluation,
    arch: ModelArch,
    *,
    requested_context: int,
    auto_fit: bool,
    refused: str | None,
    starts: bool,
    short_of_target: bool,
    meets_target: bool,
    concurrency: int,
    each: int,
    in_margin: bool,
) -> str:
    """The first reason vLLM would not run these flags as asked (what it checks first comes first), or
    what they hold when they fit."""
    cap = arch.max_position_embeddings
    est = ev.est
    if refused:
        return f"vLLM refuses it: {refused}"
    if requested_context > cap:
        return (
            f"vLLM refuses it: max_model_len {requested_context:,} is above the model's limit of {cap:,} "
            "tokens (max_position_embeddings)"
        )
    if est.startup_problem:
        return f"vLLM would not start: {est.startup_problem}"
    if est.flags.kv_cache_memory_bytes is None and ev.weights > est.budget:
        return (
            f"the weights alone ({ev.weights / GIB:.2f} GiB per GPU) exceed vLLM's budget "
            f"({est.budget / GIB:.2f} GiB)"
        )
    if ev.kv <= 0:
        return (
            f"vLLM would stop at start-up: no memory is left for the KV cache ({ev.kv / GIB:.2f} GiB after "
            "weights and overheads)"
        )
    if not starts:
        if auto_fit:
            return "vLLM would stop at start-up: not one block of KV cache fits"
        need = (cdiv(requested_context, ev.block) + 1) * ev.bytes_per_block
        return (
            f"vLLM would stop at start-up: one request of {requested_context:,} tokens needs "
            f"{need / GIB:.2f} GiB of KV cache and {max(0, ev.kv) / GIB:.2f} GiB is left (its estimated "
            f"maximum model length would be {est.max_model_len(cap):,})"
        )
    if short_of_target:
        return f"max_model_len {requested_context:,} is shorter than the target context"
    held = ev.usable_blocks(False) // max(1, cdiv(each, ev.block))
    if not meets_target:
        return (
            f"vLLM starts, but its KV cache holds {held} request(s) of {each:,} tokens at once where the "
            f"target is {concurrency}"
        )
    if in_margin:
        return (
            f"vLLM would start, but with less than the {ev.margin / GIB:.2f} GiB kept spare for errors of "
            "the estimated parts (non-torch, activation, CUDA graphs)"
        )
    return (
        f"KV cache holds {ev.num_blocks * ev.block:,} tokens ({ev.num_blocks:,} blocks): {held} request(s) "
        f"of {each:,} tokens at once"
    )


def changed_count(new: EngineFlags, old: EngineFlags) -> int:
    """How many flags other than the context differ: the recommendation's measure of "fewest changes"."""
    return sum(
        1
        for f in dataclasses.fields(EngineFlags)
        if f.name != "max_model_len" and getattr(new, f.name) != getattr(old, f.name)
    )


def normalize_flags(flags: EngineFlags) -> EngineFlags:
    changes: dict[str, Any] = {}
    if flags.quantization is not None and flags.quantization.lower() == "none":
        changes["quantization"] = None
    dtype = (flags.kv_cache_dtype or "auto").lower()
    aliases = {"bf16": "bfloat16", "fp16": "float16"}
    if dtype in aliases:
        changes["kv_cache_dtype"] = aliases[dtype]
    return flags.replace(**changes) if changes else flags


def fp8_weights_note(version: Version) -> str | None:
    """How ``version`` reads ``--quantization fp8`` on a 16-bit checkpoint, where it has its own spelling."""
    if version < FP8_PER_TENSOR_SPELLING:
        return None
    return (
        f"vLLM {version} runs --quantization fp8 on a 16-bit checkpoint as its online fp8_per_tensor and "
        "logs that this spelling is deprecated for it (use --quantization fp8_per_tensor); both start"
    )


def flag_notes(arch: ModelArch, device: DeviceFacts, flags: EngineFlags, version: Version) -> list[str]:
    notes: list[str] = []
    cc = device.compute_capability
    if device.backend != "cpu" and _e4m3((flags.kv_cache_dtype or "auto").lower()):
        if cc is not None and cc < (8, 9):
            notes.append(
                f"fp8 e4m3 KV is not recommended below compute capability 8.9 (this GPU: {cc[0]}.{cc[1]}); "
                "use --kv-cache-dtype fp8_e5m2"
            )
        elif cc is None:
            notes.append("compute capability unknown: below 8.9 use --kv-cache-dtype fp8_e5m2 instead of fp8")
    method = weight_method(arch, flags)
    if flags.quantization and flags.quantization.lower() == "fp8" and arch.quantization is None:
        note = fp8_weights_note(version)
        if note:
            notes.append(note)
    if method in FOUR_BIT_METHODS and arch.quantization not in FOUR_BIT_METHODS:
        notes.append(f"--quantization {method} needs a 4-bit {method.upper()} checkpoint of this model")
    if flags.max_model_len not in (None, -1) and int(flags.max_model_len) > arch.max_position_embeddings:
        notes.append(
            f"max_model_len {flags.max_model_len} is above the model's max_position_embeddings "
            f"({arch.max_position_embeddings}); vLLM refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"
        )
    if device.backend == "cuda" and device.count and flags.tensor_parallel_size > device.count:
        notes.append(
            f"tensor_parallel_size {flags.tensor_parallel_size} needs more GPUs than the "
            f"{device.count} present"
        )
    if flags.cpu_offload_gb:
        notes.append(
            f"--cpu-offload-gb {flags.cpu_offload_gb:g} keeps that much of the weights in host memory per "
            "GPU (slower: they cross PCIe every step)"
        )
    if device.backend == "cpu" and flags.kv_cache_memory_bytes is None:
        notes.append(
            "CPU backend: the KV cache is utilization x the NUMA node's memory minus the worker's RSS; "
            "pin it with --kv-cache-memory-bytes for a predictable size"
        )
    return notes


@dataclass(frozen=True)
class Assessment:
    """The first launch as the plan and the search's CPU/pipeline/auto-fit branch judge it (see
    :func:`assess`): the flags as given (normalized) and their estimate, what vLLM would do with them, and
    the recommendation (the search's on a GPU box, :func:`recommend_flags`' elsewhere)."""

    v: vllmversion.Version
    flags: EngineFlags
    stages: tuple[ModelArch, ...]
    ev: Evaluation
    auto_fit: bool
    concurrency: int
    requested_context: int  # capped at the model's limit
    asked_context: int
    min_context: int
    notes: list[str]
    note: str | None
    refused: str | None
    max_context: int
    starts: bool
    model_fits: bool
    max_for_target: int | None
    meets_target: bool
    fits: bool
    choice: Choice | None
    recommended: EngineFlags | None
    verdict: str
    reason: str
    costs: list[str]
    reduced: Reduction | None
    tp: int


def assess(
    arch: modelarch.ModelArch,
    device: DeviceFacts,
    flags: EngineFlags,
    *,
    target_concurrency: int | None = None,
    target_context: int | None = None,
    calibration: M.Calibration | None = None,
    bounds: B.Bounds | None = None,
    version: vllmversion.Version | str | None = None,
    proven: EngineFlags | None = None,
) -> Assessment:
    """What :func:`r1sup.core.planner.plan` reports and the CPU backend's first launch takes: the verdict
    on ``flags`` as given and the recommended flags (see the plan's doc for each term). ``proven``: a
    saved profile's flags that fit what is free now, which ``run`` launches instead of searching: they
    are the recommendation (issue 36)."""
    b = bounds if bounds is not None else B.Bounds()
    v = vllmversion.as_version(version)
    flags = normalize_flags(flags)
    if flags.max_model_len is None and target_context:
        # a target context sets the context (issue 36), as the search's asked context
        flags = flags.replace(max_model_len=min(target_context, arch.max_position_embeddings))
    stages = M.pipeline_stages(arch)
    ev = evaluate(arch, device, flags, v, calibration)
    auto_fit = flags.max_model_len == -1
    concurrency = max(1, target_concurrency or 1)
    requested_context = ev.est.batch.max_model_len
    if target_context and target_context > requested_context and flags.max_model_len in (None, -1):
        requested_context = min(target_context, arch.max_position_embeddings)
    min_context = min(b.min_max_model_len, requested_context)
    if target_context:
        min_context = max(min_context, min(target_context, requested_context))
    cap = arch.max_position_embeddings

    notes: list[str] = []
    note = vllmversion.version_note(v)
    if note:
        notes.append(note)
    notes += list(arch.approximations)
    notes += flag_notes(arch, device, flags, v)
    notes += list(ev.est.notes)
    refused = M.tp_refusal(arch, flags.tensor_parallel_size)
    if refused:
        notes.append(f"vLLM refuses this configuration: {refused}")
    if ev.est.startup_problem:
        notes.append(f"vLLM would stop at start-up: {ev.est.startup_problem}")

    max_context = estimated_max_model_len(ev.num_blocks, ev.block, cap, v)
    usable = ev.usable_blocks(margin=False)
    if auto_fit:
        starts = ev.startup_ok and max_context > 0
    else:
        starts = ev.startup_ok and ev.num_blocks > 0 and usable >= cdiv(requested_context, ev.block)
    model_fits = ev.startup_ok and ev.num_blocks > 0 and usable >= cdiv(min_context, ev.block)
    above_limit = requested_context > cap
    if refused or above_limit:
        starts = False
    max_for_target = (
        ev.context_for(concurrency, cap, margin=False) if target_concurrency is not None else None
    )
    # The target holds when ``concurrency`` requests of ``each`` tokens fit in the KV cache at once (the
    # target context; without one, the context vLLM runs with, which auto-fit sizes itself); never when
    # vLLM would not start with these flags.
    each = target_context or (max_context if auto_fit else requested_context)
    meets_target = each > 0 and ev.fits_context(each, concurrency, margin=False) and not refused
    short_of_target = bool(target_context and not auto_fit and requested_context < target_context)
    if short_of_target:
        meets_target = False
        notes.append(f"max_model_len {requested_context} is shorter than the target context {target_context}")
    fits = starts and meets_target
    in_margin = fits and not auto_fit and not ev.holds(requested_context, concurrency, each, margin=True)
    if in_margin:
        fits = False
        notes.append(
            f"as given it is predicted to fit by less than the {ev.margin / GIB:.2f} GiB kept spare for "
            "errors of the estimated parts (non-torch, activation, CUDA graphs)"
        )
    # what vLLM would do with these flags: the first reason they do not fit as given
    why = why_not(
        ev,
        arch,
        requested_context=requested_context,
        auto_fit=auto_fit,
        refused=refused,
        starts=starts,
        short_of_target=short_of_target,
        meets_target=meets_target,
        concurrency=concurrency,
        each=each,
        in_margin=in_margin,
    )
    # changes never go above the model's limit
    asked_context = requested_context
    requested_context = min(requested_context, cap)
    min_context = min(min_context, requested_context)

    def recommend(f: EngineFlags, conc: int) -> Choice | None:
        return recommend_flags(
            arch,
            device,
            f,
            concurrency=conc,
            requested_context=requested_context,
            min_context=min_context,
            version=v,
            calibration=calibration,
            bounds=b,
            target_concurrency=target_concurrency,
            per_request=target_context,
        )

    tp = flags.tensor_parallel_size
    found_by = _search_recommendation(
        arch, device, flags, b, v, calibration, target_concurrency, target_context, len(stages), auto_fit
    )
    costs: list[str] = []
    reduced: Reduction | None = None
    if found_by is not None:
        search, searched = found_by
        if proven is not None:  # run launches the saved profile's flags, not the search's
            searched = Recommendation(proven, "fits" if proven == flags else "fits_with_changes", why)
        if searched.verdict != "does_not_fit":
            costs, reduced = search.costs(searched.flags), search.reduction(searched.flags)
        # the search answers "which flags" (the first launch of tune and run, the same code path)
        recommended = searched.flags if searched.verdict != "does_not_fit" else None
        choice: Choice | None = None
        if recommended is not None:
            context = recommended.max_model_len or requested_context
            choice = Choice(evaluate(arch, device, recommended, v, calibration), context)
            if context < requested_context and proven is None:
                notes.append(
                    f"one request of {requested_context} tokens does not fit with "
                    f"{choice.ev.margin / GIB:.2f} GiB kept spare; recommended --max-model-len {context}"
                )
            if recommended.kv_cache_dtype != flags.kv_cache_dtype and recommended.fp8_kv:
                notes.append(
                    f"recommended KV cache dtype {recommended.kv_cache_dtype}: half the KV bytes per token"
                )
        else:
            notes.append("nothing within the bounds is predicted to fit; see the ways out")
        verdict = searched.verdict
        fits = verdict == "fits"
        reason = why or searched.reason
        if verdict == "does_not_fit" and why:
            reason = f"{why}; {searched.reason}"
    else:
        # The own branch (CPU backend, pipeline stages, auto-fit): :func:`recommend_flags`. Levers beyond
        # the flags themselves: more of the GPUs present, then fp8 weights. A tensor-parallel size vLLM
        # refuses is replaced by the sizes it accepts up to the same GPU count.
        tp = flags.tensor_parallel_size
        variants = [flags] if not refused else []
        if refused:
            variants += [flags.replace(tensor_parallel_size=t) for t in reversed(M.valid_tp_sizes(arch, tp))]
        if b.allow_tensor_parallel and device.source == "probe" and device.count > tp:
            variants += [
                flags.replace(tensor_parallel_size=t) for t in M.valid_tp_sizes(arch, device.count) if t > tp
            ]
        if b.allow_weight_quantization and weight_method(arch, flags) is None:
            variants.append(flags.replace(quantization="fp8"))

        # the longest context (the requested one when a variant keeps it), then the fewest changed flags,
        # then the earlier variant (fewer GPUs)
        found = [c for c in (recommend(variant, concurrency) for variant in variants) if c is not None]
        choice = min(
            found,
            key=lambda c: (-min(c.context, requested_context), changed_count(c.ev.flags, flags)),
            default=None,
        )
        target_missed = False
        if choice is None and concurrency > 1:
            for variant in variants:
                choice = recommend(variant, 1)
                if choice is not None:
                    target_missed = True
                    each = target_context or choice.context
                    served = choice.ev.usable_blocks(True) // cdiv(each, choice.ev.block)
                    notes.append(
                        f"the target of {concurrency} requests of {each} tokens at once is not met; the "
                        f"recommended flags hold {served} of them at once"
                    )
                    break

        recommended = choice.ev.flags if choice else None
        if choice is not None:
            if choice.context < requested_context:
                notes.append(
                    f"one request of {requested_context} tokens does not fit"
                    + ("" if target_context else f" {concurrency} times" if concurrency > 1 else "")
                    + f" with {choice.ev.margin / GIB:.2f} GiB kept spare; "
                    f"recommended --max-model-len {choice.context}"
                )
            if choice.ev.flags.kv_cache_dtype != flags.kv_cache_dtype and choice.ev.flags.fp8_kv:
                dtype = choice.ev.flags.kv_cache_dtype
                notes.append(f"recommended KV cache dtype {dtype}: half the KV bytes per token")
        else:
            notes.append("nothing within the bounds is predicted to fit; see the ways out")

        if fits:
            verdict, reason = "fits", why
        elif recommended is not None and not target_missed:
            verdict, reason = "fits_with_changes", why
        else:
            verdict = "does_not_fit"
            reason = why
            if target_missed and choice is not None and proven is None:
                served = choice.ev.usable_blocks(True) // cdiv(
                    target_context or choice.context, choice.ev.block
                )
                reason += (
                    f"; within the bounds the target is not met (the recommended flags hold {served} of the "
                    f"{concurrency} requests at once)"
                )

    if proven is not None and found_by is None:  # the own branch: the saved profile's flags all the same
        recommended = proven
        choice = Choice(
            evaluate(arch, device, proven, v, calibration), proven.max_model_len or requested_context
        )
        verdict, reason = ("fits" if proven == flags else "fits_with_changes"), why
        fits = verdict == "fits"
    if found_by is None and verdict == "fits_with_changes" and choice is not None:
        reduced = _own_reduction(arch, device, choice, asked_context, v)
    return Assessment(
        v=v,
        flags=flags,
        stages=stages,
        ev=ev,
        auto_fit=auto_fit,
        concurrency=concurrency,
        requested_context=requested_context,
        asked_context=asked_context,
        min_context=min_context,
        notes=notes,
        note=note,
        refused=refused,
        max_context=max_context,
        starts=starts,
        model_fits=model_fits,
        max_for_target=max_for_target,
        meets_target=meets_target,
        fits=fits,
        choice=choice,
        recommended=recommended,
        verdict=verdict,
        reason=reason,
        costs=costs,
        reduced=reduced,
        tp=tp,
    )
