"""The service-level judgement: percentiles of measured load levels, whether a level meets every target,
which level to try next (double until a target breaks, then bisect), the knee and the goodput.

Pure: measured samples in (:class:`Sample`, one per request, from :mod:`r1sup.adapters.loadlevel`), plain
results out (frozen dataclasses; dicts only where JSON is written: the profile's ``slo`` and the run
record). No clock, no network: the caller measures, this module judges.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# verdicts of a whole search
MET = "met"  # at least one level met every target: ``best`` is the highest such level
IMPOSSIBLE = "impossible"  # one request at a time already breaks a target: the measured floor is named
UNMEASURED = "unmeasured"  # the time budget ended (or the server failed) before one level was judged

KNEE_SHARE = 0.9  # the knee: the lowest concurrency reaching this share of the best request rate measured


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values``, linear between the closest ranks (numpy's default); None
    for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass(frozen=True)
class Targets:
    """The service level: p95 time to first token, p95 inter-token latency, optional p95 end to end
    (seconds); a target of None is not asked for."""

    ttft_p95_s: float | None = None
    itl_p95_s: float | None = None
    e2e_p95_s: float | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.ttft_p95_s, self.itl_p95_s, self.e2e_p95_s))

    def labels(self) -> dict[str, str]:
        """Prometheus labels: each target in seconds, an empty string for one not asked for."""
        return {
            "ttft_p95_s": _label(self.ttft_p95_s),
            "itl_p95_s": _label(self.itl_p95_s),
            "e2e_p95_s": _label(self.e2e_p95_s),
        }

    def describe(self) -> str:
        parts = [
            f"{name} p95 <= {_ms(value)}"
            for name, value in (("TTFT", self.ttft_p95_s), ("ITL", self.itl_p95_s), ("e2e", self.e2e_p95_s))
            if value is not None
        ]
        return ", ".join(parts) or "no target"

    def to_dict(self) -> dict[str, Any]:
        return {"ttft_p95_s": self.ttft_p95_s, "itl_p95_s": self.itl_p95_s, "e2e_p95_s": self.e2e_p95_s}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Targets:
        return cls(_opt_pos(data, "ttft_p95_s"), _opt_pos(data, "itl_p95_s"), _opt_pos(data, "e2e_p95_s"))


@dataclass(frozen=True)
class Sample:
    """One request of a load level: whether it completed, its time to first token, the gaps between its
    streamed chunks (inter-token latency), its end-to-end time and the tokens it produced."""

    ok: bool
    ttft_s: float | None = None
    itl_s: tuple[float, ...] = ()
    e2e_s: float | None = None
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first, as vLLM's benchmark computes it for goodput: the time
        from the first token's chunk to the last one's (the sum of the gaps) over the tokens after the
        first. Not the mean gap between chunks: a chunk can carry several tokens when the server's
        output falls behind the engine. 0 for a single token (vLLM's convention)."""
        if self.output_tokens <= 1:
            return 0.0
        return sum(self.itl_s) / (self.output_tokens - 1)

    def meets(self, targets: Targets) -> bool:
        """Whether this request alone met every target (vLLM's goodput counts requests this way: its
        TTFT, its time per output token against the ITL target, its end-to-end time)."""
        if not self.ok:
            return False
        if targets.ttft_p95_s is not None and (self.ttft_s is None or self.ttft_s > targets.ttft_p95_s):
            return False
        if targets.itl_p95_s is not None and self.tpot_s > targets.itl_p95_s:
            return False
        return not (targets.e2e_p95_s is not None and (self.e2e_s is None or self.e2e_s > targets.e2e_p95_s))


@dataclass(frozen=True)
class Level:
    """One load level judged: ``concurrency`` requests in flight at a time, ``requests`` sent."""

    concurrency: int
    requests: int
    completed: int
    errors: int
    duration_s: float
    ttft_p95_s: float | None
    itl_p95_s: float | None
    e2e_p95_s: float | None
    request_rate: float  # completed requests per second
    goodput: float  # completed requests per second that met every target each
    output_tokens_per_s: float
    broken: tuple[str, ...] = ()  # what failed: ttft, itl, e2e, errors

    @property
    def meets(self) -> bool:
        return not self.broken

    def to_dict(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "requests": self.requests,
            "completed": self.completed,
            "errors": self.errors,
            "duration_s": self.duration_s,
            "ttft_p95_s": self.ttft_p95_s,
            "itl_p95_s": self.itl_p95_s,
            "e2e_p95_s": self.e2e_p95_s,
            "request_rate": self.request_rate,
            "goodput": self.goodput,
            "output_tokens_per_s": self.output_tokens_per_s,
            "broken": list(self.broken),
            "meets": self.meets,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Level:
        broken = data.get("broken", [])
        if not isinstance(broken, list) or not all(b in BROKEN_KINDS for b in broken):
            raise ValueError(f"broken must be a list of {', '.join(BROKEN_KINDS)}")
        return cls(
            concurrency=_pos_int(data, "concurrency"),
            requests=_count(data, "requests"),
            completed=_count(data, "completed"),
            errors=_count(data, "errors"),
            duration_s=_num(data, "duration_s"),
            ttft_p95_s=_opt_num(data, "ttft_p95_s"),
            itl_p95_s=_opt_num(data, "itl_p95_s"),
            e2e_p95_s=_opt_num(data, "e2e_p95_s"),
            request_rate=_num(data, "request_rate"),
            goodput=_num(data, "goodput"),
            output_tokens_per_s=_num(data, "output_tokens_per_s"),
            broken=tuple(broken),
        )


BROKEN_KINDS = ("ttft", "itl", "e2e", "errors")


def judge(concurrency: int, samples: Sequence[Sample], duration_s: float, targets: Targets) -> Level:
    """A load level from its requests: the p95 of each latency over the completed requests, and which
    targets it broke (any failed request breaks the level: an error is no service)."""
    done = [s for s in samples if s.ok]
    ttft = percentile([s.ttft_s for s in done if s.ttft_s is not None], 0.95)
    itl = percentile([gap for s in done for gap in s.itl_s], 0.95)
    e2e = percentile([s.e2e_s for s in done if s.e2e_s is not None], 0.95)
    broken: list[str] = []
    for name, measured, target in (
        ("ttft", ttft, targets.ttft_p95_s),
        ("itl", itl, targets.itl_p95_s),
        ("e2e", e2e, targets.e2e_p95_s),
    ):
        if target is not None and measured is not None and measured > target:
            broken.append(name)
    if len(done) < len(samples) or not done:
        broken.append("errors")
    seconds = duration_s if duration_s > 0 else float("inf")
    return Level(
        concurrency=concurrency,
        requests=len(samples),
        completed=len(done),
        errors=len(samples) - len(done),
        duration_s=round(duration_s, 4),
        ttft_p95_s=_round(ttft),
        itl_p95_s=_round(itl),
        e2e_p95_s=_round(e2e),
        request_rate=round(len(done) / seconds, 4),
        goodput=round(sum(1 for s in done if s.meets(targets)) / seconds, 4),
        output_tokens_per_s=round(sum(s.output_tokens for s in done) / seconds, 2),
        broken=tuple(broken),
    )


def level_requests(concurrency: int, per_level: int) -> int:
    """Requests measured at a level: ``per_level`` at every level, as vLLM's sweep sends its
    ``--num-prompts`` at every ``--max-concurrency``; never fewer than ``concurrency``, so that the level
    fills every slot it names once (a level above ``per_level`` is one wave at its concurrency)."""
    return max(per_level, concurrency)


def next_concurrency(levels: Sequence[Level], cap: int) -> int | None:
    """The next load level to measure, or None when the search is done: 1 first; while every level met
    the targets, double (up to ``cap``); once one broke, bisect between the highest that met and the
    lowest that broke above it. One request at a time breaking a target ends it (nothing meets)."""
    if not levels:
        return 1
    met = [lv.concurrency for lv in levels if lv.meets]
    if not met:
        return None
    best = max(met)
    above = [lv.concurrency for lv in levels if not lv.meets and lv.concurrency > best]
    if not above:
        return None if best >= cap else min(cap, best * 2)
    low_broken = min(above)
    if low_broken - best <= 1:
        return None
    return (best + low_broken) // 2


def knee(levels: Sequence[Level]) -> int | None:
    """The concurrency past which more requests at once buy little: the lowest level whose request rate
    reaches ``KNEE_SHARE`` of the highest rate measured (levels with errors left out); None for none."""
    clean = [lv for lv in levels if "errors" not in lv.broken and lv.request_rate > 0]
    if not clean:
        return None
    top = max(lv.request_rate for lv in clean)
    return min(lv.concurrency for lv in clean if lv.request_rate >= KNEE_SHARE * top)


@dataclass(frozen=True)
class Workload:
    """What the load levels send: prompt and output lengths in tokens (a fixed value when low == high),
    or the prompts of a JSONL file (``source`` names it)."""

    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    source: str = ""  # "" for generated prompts, else the JSONL file's name

    def describe(self) -> str:
        out = _span(self.output_tokens)
        if self.source:
            return f"prompts of {self.source}, {out} output tokens"
        return f"{_span(self.prompt_tokens)} prompt tokens, {out} output tokens"

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": list(self.prompt_tokens),
            "output_tokens": list(self.output_tokens),
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Workload:
        return cls(_pair(data, "prompt_tokens"), _pair(data, "output_tokens"), str(data.get("source", "")))


@dataclass(frozen=True)
class SloResult:
    """What the service-level search proved for the flags it ran on."""

    targets: Targets
    workload: Workload
    verdict: str  # MET, IMPOSSIBLE, UNMEASURED
    levels: tuple[Level, ...] = ()
    reason: str = ""
    budget_ended: bool = False  # the time budget ended the search before it converged
    launches: int = 0  # relaunches the search itself made (flag changes); 0: load levels only
    seconds: float = 0.0
    flags: dict[str, Any] = field(default_factory=dict)  # the flags the levels ran on
    relaunch: str = ""  # the search's relaunch with a flag changed and what it proved; "" for none

    @property
    def best(self) -> Level | None:
        """The highest concurrency that met every target."""
        met = [lv for lv in self.levels if lv.meets]
        return max(met, key=lambda lv: lv.concurrency) if met else None

    @property
    def floor(self) -> Level | None:
        """The level of one request at a time: what the engine gives at best."""
        ones = [lv for lv in self.levels if lv.concurrency == 1]
        return ones[0] if ones else None

    @property
    def knee(self) -> int | None:
        return knee(self.levels)

    @property
    def requests(self) -> int:
        """The capacity for the autoscaler: requests at once within the service level (0 when none)."""
        best = self.best
        return best.concurrency if best is not None else 0

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        return {
            "targets": self.targets.to_dict(),
            "workload": self.workload.to_dict(),
            "verdict": self.verdict,
            "reason": self.reason,
            "levels": [lv.to_dict() for lv in self.levels],
            "concurrency": self.requests,
            "request_rate": best.request_rate if best is not None else None,
            "goodput": best.goodput if best is not None else None,
            "knee": self.knee,
            "budget_ended": self.budget_ended,
            "launches": self.launches,
            "seconds": self.seconds,
            "flags": dict(self.flags),
            "relaunch": self.relaunch,
        }

    @classmethod
    def from_dict(cls, data: Any) -> SloResult:
        """Validate and build (a profile is untrusted input); ValueError naming what is wrong."""
        if not isinstance(data, Mapping):
            raise ValueError("slo must be an object")
        verdict = data.get("verdict")
        if verdict not in (MET, IMPOSSIBLE, UNMEASURED):
            raise ValueError(f"slo.verdict must be one of {MET}, {IMPOSSIBLE}, {UNMEASURED}")
        levels = data.get("levels", [])
        if not isinstance(levels, list):
            raise ValueError("slo.levels must be a list")
        targets, workload, flags = data.get("targets"), data.get("workload"), data.get("flags", {})
        if (
            not isinstance(targets, Mapping)
            or not isinstance(workload, Mapping)
            or not isinstance(flags, dict)
        ):
            raise ValueError("slo.targets, slo.workload and slo.flags must be objects")
        try:
            built = tuple(Level.from_dict(lv) for lv in levels)
        except (TypeError, AttributeError) as exc:
            raise ValueError(f"slo.levels: {exc}") from None
        return cls(
            targets=Targets.from_dict(targets),
            workload=Workload.from_dict(workload),
            verdict=str(verdict),
            levels=built,
            reason=str(data.get("reason", "")),
            budget_ended=bool(data.get("budget_ended", False)),
            launches=_count(data, "launches") if "launches" in data else 0,
            seconds=_num(data, "seconds") if "seconds" in data else 0.0,
            flags=dict(flags),
            relaunch=str(data.get("relaunch", "")),
        )


@dataclass(frozen=True)
class Relaunch:
    """A flag the evidence says is the lever: relaunch once with ``flag`` at ``new`` instead of ``old``."""

    flag: str
    old: int
    new: int
    why: str


def relaunch_step(
    result: SloResult,
    max_num_seqs: int | None,
    max_concurrency: int,
    *,
    batched_tokens: int | None = None,
) -> Relaunch | None:
    """Whether a flag, not the engine's latency, ended the search, and the one relaunch that would lift it.

    ``max_num_seqs``: the levels stop at it (more requests at once would only wait behind it, their TTFT
    growing with the queue, not with the engine). When the level at ``max_num_seqs`` still met every
    target, no target broke: the flag is what bounds the proven capacity, and doubling it (up to
    ``slo.max_concurrency``) is worth one relaunch. None for it when ``max_num_seqs`` is vLLM's default
    (not known here).

    ``max_num_batched_tokens`` (``batched_tokens``: the budget the engine ran with): when the level that
    broke broke the TTFT target alone, its ITL within half its target, and its prompts arriving together
    (its concurrency x the workload's shortest prompt) need more than one step of that budget to be
    prefilled, the requests waited for their prefill's turn: :func:`prefill_step`.

    None when the budget ended the search, when nothing met, or when a target broke for another reason
    (the engine's own step time is the limit, and a relaunch would prove nothing more)."""
    best = result.best
    if result.verdict != MET or best is None or result.budget_ended:
        return None
    bounded = (
        max_num_seqs is not None
        and max_num_seqs < max_concurrency
        and best.concurrency >= max_num_seqs
        and all(lv.meets for lv in result.levels if lv.concurrency <= max_num_seqs)
    )
    if not bounded or max_num_seqs is None:
        return prefill_step(result, batched_tokens)
    return Relaunch(
        "max_num_seqs",
        max_num_seqs,
        min(max_concurrency, 2 * max_num_seqs),
        f"every level up to max_num_seqs {max_num_seqs} met {result.targets.describe()}: the flag, "
        f"not a target, bounded the search; more requests at once would wait behind it",
    )


def prefill_step(result: SloResult, batched_tokens: int | None) -> Relaunch | None:
    """The ``max_num_batched_tokens`` relaunch (see :func:`relaunch_step`): the budget doubled (the
    prompts' template tokens are not counted in the wave, so it is no ceiling). None where the evidence
    does not point at the prefill budget: no budget known, no level broke above the best, the break was
    not the TTFT's alone, its ITL had no room for longer steps (a larger budget makes the steps that
    carry prefill longer), the workload's prompts are a file's (their lengths are not known here), or
    one step already held every prompt of the level."""
    best = result.best
    broke = [
        lv for lv in result.levels if not lv.meets and best is not None and lv.concurrency > best.concurrency
    ]
    if batched_tokens is None or batched_tokens < 1 or not broke or result.workload.source:
        return None
    level = min(broke, key=lambda lv: lv.concurrency)
    itl_target = result.targets.itl_p95_s
    if level.broken != ("ttft",):
        return None
    if itl_target is not None and (level.itl_p95_s is None or level.itl_p95_s > itl_target / 2):
        return None
    wave = level.concurrency * result.workload.prompt_tokens[0]
    if wave <= batched_tokens:
        return None
    steps = math.ceil(wave / batched_tokens)
    ttft = _ms(level.ttft_p95_s) if level.ttft_p95_s is not None else "?"
    target = _ms(result.targets.ttft_p95_s) if result.targets.ttft_p95_s is not None else "?"
    return Relaunch(
        "max_num_batched_tokens",
        batched_tokens,
        2 * batched_tokens,
        f"{level.concurrency} requests at once broke the TTFT target alone ({ttft} > {target}, ITL within "
        f"half its target) and their prompts ({level.concurrency} x {result.workload.prompt_tokens[0]} = "
        f"{wave} tokens at least) take {steps} or more prefill steps of max_num_batched_tokens "
        f"{batched_tokens}: the "
        f"budget, not the engine, made them wait for their first token",
    )


def conclude(
    targets: Targets,
    workload: Workload,
    levels: Sequence[Level],
    *,
    budget_ended: bool = False,
    seconds: float = 0.0,
    flags: Mapping[str, Any] | None = None,
) -> SloResult:
    """The verdict of the levels measured: met (the best level named), impossible (one request at a time
    already breaks a target: the measured floor named) or unmeasured."""
    ordered = tuple(sorted(levels, key=lambda lv: lv.concurrency))
    common: dict[str, Any] = {
        "budget_ended": budget_ended,
        "seconds": round(seconds, 2),
        "flags": dict(flags or {}),
    }
    met = [lv for lv in ordered if lv.meets]
    if met:
        best = max(met, key=lambda lv: lv.concurrency)
        reason = (
            f"{best.concurrency} requests at once meet {targets.describe()} "
            f"({best.request_rate:g} requests/s, goodput {best.goodput:g}/s)"
        )
        if budget_ended:
            reason += "; the time budget ended the search before the level that breaks was bracketed"
        return SloResult(targets, workload, MET, ordered, reason, **common)
    floor = next((lv for lv in ordered if lv.concurrency == 1), None)
    if floor is None:
        return SloResult(
            targets,
            workload,
            UNMEASURED,
            ordered,
            "no load level was measured within the time budget",
            **common,
        )
    return SloResult(targets, workload, IMPOSSIBLE, ordered, floor_reason(floor, targets), **common)


def floor_reason(floor: Level, targets: Targets) -> str:
    """Why one request at a time already misses the service level, with the measured floor."""
    parts = []
    for name, label, measured, target in (
        ("ttft", "TTFT", floor.ttft_p95_s, targets.ttft_p95_s),
        ("itl", "ITL", floor.itl_p95_s, targets.itl_p95_s),
        ("e2e", "e2e", floor.e2e_p95_s, targets.e2e_p95_s),
    ):
        if name in floor.broken and measured is not None and target is not None:
            parts.append(f"{label} p95 target {_ms(target)} is below the measured floor {_ms(measured)}")
    if "errors" in floor.broken:
        parts.append(f"{floor.errors} of {floor.requests} requests failed at one request at a time")
    return "service level not met even at one request at a time: " + "; ".join(parts)


# --- small helpers -----------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _label(value: float | None) -> str:
    return "" if value is None else f"{value:g}"


def _span(pair: tuple[int, int]) -> str:
    return str(pair[0]) if pair[0] == pair[1] else f"{pair[0]}-{pair[1]}"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 5)


def _num(data: Mapping[str, Any], key: str) -> float:
    value = data.get(key)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{key} must be a finite number >= 0")
    return float(value)


def _opt_num(data: Mapping[str, Any], key: str) -> float | None:
    return None if data.get(key) is None else _num(data, key)


def _opt_pos(data: Mapping[str, Any], key: str) -> float | None:
    value = _opt_num(data, key)
    if value is not None and value <= 0:
        raise ValueError(f"{key} must be above 0")
    return value


def _count(data: Mapping[str, Any], key: str) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be an integer >= 0")
    return value


def _pos_int(data: Mapping[str, Any], key: str) -> int:
    value = _count(data, key)
    if value < 1:
        raise ValueError(f"{key} must be at least 1")
    return value


def _pair(data: Mapping[str, Any], key: str) -> tuple[int, int]:
    value = data.get(key)
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    ):
        raise ValueError(f"{key} must be a list of two integers >= 0")
    return (value[0], value[1])
