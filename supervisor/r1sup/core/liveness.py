"""Is the engine alive, idle or hung? Decided from vLLM's own account of its progress. Pure.

A busy server is not a dead one: vLLM says whether its engine works, through ``/metrics`` (requests
running and waiting, prompt and generation token counters, finished requests, KV usage) and the stats
line it logs every ``VLLM_LOG_STATS_INTERVAL`` seconds (``Engine 000: Avg prompt throughput: ...,
Running: N reqs, Waiting: M reqs, ...``). Those figures come from the engine core's own steps: when the
core stops (a hang, a SIGSTOP), they freeze, while ``/health`` and ``/metrics`` keep answering.

The rules (:func:`decide`):

- **Progress** is a token counter (prompt, generation) or the finished-request counter that moved, or
  a KV usage that changed while work was pending (a chunked prefill fills KV blocks before the prompt
  counter moves: vLLM counts a prompt's tokens only when its first output token is produced), or a
  successful one-token completion. A server that makes progress is alive, however long its queue.
- **Idle**: nothing running or waiting. Then, and only then (or while vLLM's figures are unavailable),
  the one-token completion is the tie-breaker, once per interval. It is also sent once when a stall
  begins (work pending, a sample without progress), so that an engine that answers it is not judged
  by the counters alone.
- **Hung**: work pending (vLLM's gauges, or r1sup's own completion that did not come back) and no
  progress for ``progress_timeout_s``; or an engine-dead reply (HTTP 500 with vLLM's EngineDeadError
  text); or the engine core's process gone; or ``/health`` failing ``health_failures`` times in a row
  with no progress since the first failure. One slow answer never decides anything.
- **Which source**: ``/metrics`` while it answers (its counters are exact). A read that failed, timed
  out, or has not come back for two intervals (stale) is *unknown*, never a stall: then vLLM's stats
  lines are the progress evidence (and their queue, when newer than the last sample), and without them
  r1sup's own completion and time. Every verdict names its source (``source`` in its figures).

Everything is a value: :class:`Track` is the memory of the decision, :func:`observe` folds one
observation (each stamped with a monotonic time by the caller) into it, :func:`decide` returns a
:class:`Verdict` for a given ``now``. No clock, no I/O: a whole serving period replays in a test.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ALIVE = "alive"
IDLE = "idle"
HUNG = "hung"

# What a verdict rests on; the daemon maps the hung ones to a failure class.
EVIDENCE_PROGRESS = "progress"
EVIDENCE_IDLE = "idle"
EVIDENCE_WAITING = "waiting"  # work pending, no progress yet, still within progress_timeout_s
EVIDENCE_STALL = "stall"
EVIDENCE_ENGINE_DEAD = "engine_dead"
EVIDENCE_CORE_GONE = "core_gone"
EVIDENCE_HEALTH = "health"
DEAD_EVIDENCE = frozenset({EVIDENCE_ENGINE_DEAD, EVIDENCE_CORE_GONE})

# What a verdict's progress rests on (``source`` in its figures)
SOURCE_METRICS = "metrics"  # /metrics answers: its counters decide
SOURCE_STATS = "stats_line"  # /metrics unknown: vLLM's stats lines decide
SOURCE_COMPLETION = "completion"  # neither: r1sup's one-token completion and time decide
# How /metrics stands (``metrics_state`` in a verdict's figures)
METRICS_ANSWERS = "answers"
METRICS_FAILING = "failing"  # the last read failed or timed out (``metrics_error`` says how)
METRICS_STALE = "stale"  # no answer for more than two intervals: a read that has not come back
METRICS_NONE = "none"  # no sample yet

# --- vLLM's figures ------------------------------------------------------------------------------

# Series names in vLLM V1 (0.32/0.33 vllm/v1/metrics/loggers.py) and the older names V0 and early V1
# used. A counter is exposed with the ``_total`` suffix; ``_created`` samples are ignored.
_RUNNING = ("vllm:num_requests_running",)
_WAITING = ("vllm:num_requests_waiting", "vllm:num_requests_swapped")  # swapped: V0's preempted ones
_PROMPT = ("vllm:prompt_tokens_total",)
_GENERATION = ("vllm:generation_tokens_total",)
_FINISHED = ("vllm:request_success_total",)
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_WANTED = frozenset(_RUNNING + _WAITING + _PROMPT + _GENERATION + _FINISHED + _KV_USAGE)


@dataclass(frozen=True)
class Figures:
    """vLLM's own figures from ``/metrics``, summed over engines (KV usage: the fullest engine)."""

    running: float
    waiting: float
    prompt_tokens: float
    generation_tokens: float
    finished: float
    kv_usage: float | None = None  # 0..1

    @property
    def pending(self) -> float:
        return self.running + self.waiting

    def to_dict(self) -> dict[str, float | None]:
        return dataclasses.asdict(self)


def parse_metrics(text: str) -> Figures | None:
    """The figures in a Prometheus text exposition; None when it holds none of vLLM's series.

    vLLM started with ``--disable-log-stats`` (or anything that is not vLLM) exposes none of them.
    Only the few series needed are read; every other line is skipped without being parsed.
    """
    sums: dict[str, float] = {}
    kv: list[float] = []
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        cut = line.find("{")
        space = line.find(" ")
        if cut < 0 or (0 <= space < cut):
            name, rest = line[:space], line[space:] if space > 0 else ""
        else:
            name, rest = line[:cut], _after_labels(line, cut)
        if name not in _WANTED:
            continue
        value = _first_float(rest)
        if value is None:
            continue
        if name in _KV_USAGE:
            kv.append(value)
        else:
            sums[name] = sums.get(name, 0.0) + value
    if not sums and not kv:
        return None

    def total(names: tuple[str, ...]) -> float:
        return sum(sums.get(n, 0.0) for n in names)

    return Figures(
        running=total(_RUNNING),
        waiting=total(_WAITING),
        prompt_tokens=total(_PROMPT),
        generation_tokens=total(_GENERATION),
        finished=total(_FINISHED),
        kv_usage=max(kv) if kv else None,
    )


def _after_labels(line: str, start: int) -> str:
    """The text after the closing brace of a label set that starts at ``start`` (quotes respected)."""
    quoted = escaped = False
    for i in range(start + 1, len(line)):
        ch = line[i]
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == "}" and not quoted:
            return line[i + 1 :]
    return ""


def _first_float(rest: str) -> float | None:
    parts = rest.split()
    if not parts:
        return None
    try:
        value = float(parts[0])
    except ValueError:
        return None
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class StatsLine:
    """vLLM's periodic stats line: throughput over the last interval and the scheduler's queue."""

    prompt_tps: float
    generation_tps: float
    running: int
    waiting: int
    kv_usage: float | None = None  # 0..1

    @property
    def progress(self) -> bool:
        return self.prompt_tps > 0 or self.generation_tps > 0


_NUM = r"[0-9]+(?:\.[0-9]+)?"
_STATS_RE = re.compile(
    rf"Avg prompt throughput: (?P<prompt>{_NUM}) tokens/s, Avg generation throughput: (?P<gen>{_NUM}) "
    r"tokens/s, Running: (?P<running>[0-9]+) reqs"
    # V1: "Waiting: M reqs"; V0: "Swapped: S reqs, Pending: P reqs"
    r"(?:, Swapped: (?P<swapped>[0-9]+) reqs)?, (?:Waiting|Pending): (?P<waiting>[0-9]+) reqs"
    rf"(?:.*?KV cache usage: (?P<kv>{_NUM})%)?"
)


def parse_stats_line(text: str) -> StatsLine | None:
    """The figures of one ``Avg prompt throughput: ...`` line (any prefix), else None."""
    if "Avg prompt throughput" not in text:
        return None
    m = _STATS_RE.search(text)
    if m is None:
        return None
    kv = m.group("kv")
    return StatsLine(
        prompt_tps=float(m.group("prompt")),
        generation_tps=float(m.group("gen")),
        running=int(m.group("running")),
        waiting=int(m.group("waiting")) + int(m.group("swapped") or 0),
        kv_usage=float(kv) / 100 if kv is not None else None,
    )


# The texts vLLM answers a request with once its engine is dead: V1's EngineDeadError (HTTP 500,
# "EngineCore encountered an issue. See stack trace (above) for the root cause."), V0's
# AsyncEngineDeadError ("Background loop has errored already." / "... is stopped").
_ENGINE_DEAD_RE = re.compile(
    r"EngineDeadError|EngineCore encountered an issue|engine is dead"
    r"|Background loop (?:has errored|is stopped)",
    re.IGNORECASE,
)


def engine_dead_reply(status: int, body: str) -> bool:
    """Whether an HTTP answer is vLLM saying its engine is dead (not a slow or refused request)."""
    return status >= 500 and _ENGINE_DEAD_RE.search(body) is not None


# --- observations --------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetricsSample:
    """One read of ``/metrics``: ``figures`` None with ``error`` set when it failed or held no figures."""

    at: float
    figures: Figures | None
    error: str = ""
    # the server answered (an HTTP status, or a page without vLLM's series): it is up, only the figures
    # are missing; False when the read got no answer (refused, reset, timed out)
    answered: bool = False


@dataclass(frozen=True)
class StatsSeen:
    at: float
    stats: StatsLine


@dataclass(frozen=True)
class HealthResult:
    at: float
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class ProbeSent:
    """r1sup sent its one-token completion."""

    at: float


@dataclass(frozen=True)
class ProbeResult:
    """The one-token completion came back (or failed): ``status`` 0 when it timed out or was unreachable."""

    at: float
    ok: bool
    status: int = 0
    body: str = ""
    detail: str = ""

    @property
    def engine_dead(self) -> bool:
        return not self.ok and engine_dead_reply(self.status, self.body)

    @property
    def unanswered(self) -> bool:
        return not self.ok and self.status == 0


@dataclass(frozen=True)
class CoreGone:
    """An engine process (EngineCore, a worker) ended while the API server lives."""

    at: float
    detail: str


Observation = MetricsSample | StatsSeen | HealthResult | ProbeSent | ProbeResult | CoreGone


# --- the decision --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    interval_s: float  # daemon.liveness_interval_s: /metrics sampling and the idle completion
    progress_timeout_s: float  # daemon.progress_timeout_s
    health_failures: int  # daemon.health_failures

    @classmethod
    def from_config(cls, daemon: Any) -> Policy:
        return cls(
            interval_s=float(daemon.liveness_interval_s),
            progress_timeout_s=float(daemon.progress_timeout_s),
            health_failures=int(daemon.health_failures),
        )


@dataclass(frozen=True)
class Track:
    """What the decision remembers. Times are the caller's monotonic seconds."""

    started_at: float
    last_progress_at: float
    progress: str = "serving began"  # what moved last
    figures: Figures | None = None  # the latest sample's
    figures_at: float | None = None
    metrics_error: str = ""  # the last /metrics failure, while it fails
    metrics_answered: bool = False  # that failure was an answer (MetricsSample.answered)
    stats: StatsLine | None = None
    stats_at: float | None = None
    stats_progress_at: float | None = None  # the last stats line that showed throughput
    stats_progress: str = ""
    pending_since: float | None = None  # vLLM's gauges showed work since then (None: idle)
    own_pending_since: float | None = None  # r1sup's completion unanswered since then, no progress after
    probe_sent_at: float | None = None  # the last completion sent
    probe_outstanding: bool = False
    probe_after_progress: bool = False  # a completion was sent since the last progress
    health_failures: int = 0
    health_failing_since: float | None = None
    health_detail: str = ""
    dead: str = ""  # engine-dead evidence, once seen
    dead_evidence: str = ""


@dataclass(frozen=True)
class Verdict:
    state: str  # ALIVE, IDLE or HUNG
    evidence: str  # EVIDENCE_*
    reason: str  # one line for logs and status
    probe: bool = False  # send the one-token completion now
    figures: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def hung(self) -> bool:
        return self.state == HUNG


def start(now: float) -> Track:
    """The track of a serving period that begins at ``now`` (the progress clock starts here)."""
    return Track(started_at=now, last_progress_at=now)


def observe(track: Track, obs: Observation) -> Track:
    """``track`` with one more observation folded in."""
    r = dataclasses.replace
    if isinstance(obs, MetricsSample):
        if obs.figures is None:
            return r(track, metrics_error=obs.error or "no figures", metrics_answered=obs.answered)
        moved = _moved(track.figures, obs.figures)
        t = _pending(
            r(track, figures=obs.figures, figures_at=obs.at, metrics_error="", metrics_answered=False),
            obs.figures.pending > 0,
            obs.at,
        )
        return _progressed(t, obs.at, moved) if moved else t
    if isinstance(obs, StatsSeen):
        # kept, not counted here: whether it counts depends on /metrics at the time of the verdict
        # (:func:`with_stats_lines`): a read that has not come back is known only then
        st = obs.stats
        t = r(track, stats=st, stats_at=obs.at)
        if st.progress:
            what = f"stats line: {st.prompt_tps:g} prompt, {st.generation_tps:g} generation tokens/s"
            t = r(t, stats_progress_at=obs.at, stats_progress=what)
        return t
    if isinstance(obs, HealthResult):
        if obs.ok:
            return r(track, health_failures=0, health_failing_since=None, health_detail="")
        since = track.health_failing_since if track.health_failing_since is not None else obs.at
        return r(
            track,
            health_failures=track.health_failures + 1,
            health_failing_since=since,
            health_detail=obs.detail,
        )
    if isinstance(obs, ProbeSent):
        # r1sup's own request is work the engine has to do, whatever the gauges say, until it is answered
        own = track.own_pending_since if track.own_pending_since is not None else obs.at
        return r(
            track,
            probe_sent_at=obs.at,
            probe_outstanding=True,
            probe_after_progress=True,
            own_pending_since=own,
        )
    if isinstance(obs, ProbeResult):
        t = r(track, probe_outstanding=False)
        if obs.ok:
            return _progressed(t, obs.at, "one-token completion answered")
        if obs.engine_dead:
            return r(t, dead=f"completion {obs.status}: {obs.body[:200]}", dead_evidence=EVIDENCE_ENGINE_DEAD)
        if obs.unanswered:
            return t  # still work the engine did not do: it stays pending until progress shows
        return r(t, own_pending_since=None)  # refused (4xx, a 5xx that is not engine death): no evidence
    if isinstance(obs, CoreGone):
        return r(track, dead=obs.detail, dead_evidence=EVIDENCE_CORE_GONE)
    raise TypeError(f"not an observation: {obs!r}")


def _pending(track: Track, pending: bool, at: float) -> Track:
    """Work pending since the first sample that showed it; none once a sample shows none."""
    since = (track.pending_since if track.pending_since is not None else at) if pending else None
    return dataclasses.replace(track, pending_since=since)


def _moved(old: Figures | None, new: Figures) -> str:
    """What moved between two samples, as text ('' when nothing did)."""
    if old is None:
        return ""
    parts = []
    for name in ("prompt_tokens", "generation_tokens", "finished"):
        a, b = getattr(old, name), getattr(new, name)
        if b != a:  # a counter that went down was reset: the engine is another one, and it works
            parts.append(f"{name} {b - a:+g}")
    if (
        old.kv_usage is not None
        and new.kv_usage is not None
        and abs(new.kv_usage - old.kv_usage) > 1e-9
        and (old.pending > 0 or new.pending > 0)
    ):
        parts.append(f"kv_usage {old.kv_usage:.4f} -> {new.kv_usage:.4f}")
    return ", ".join(parts)


def _progressed(track: Track, at: float, what: str) -> Track:
    return dataclasses.replace(
        track,
        last_progress_at=max(track.last_progress_at, at),
        progress=what,
        own_pending_since=None,
        probe_after_progress=False,
        health_failures=0,  # "in a row, with no progress in between"
        health_failing_since=None,
    )


def metrics_state(track: Track, now: float, policy: Policy) -> str:
    """How ``/metrics`` stands at ``now``: METRICS_ANSWERS, _FAILING, _STALE or _NONE."""
    if track.metrics_error:
        return METRICS_FAILING
    if track.figures is None or track.figures_at is None:
        return METRICS_NONE
    if now - track.figures_at > 2 * policy.interval_s:
        return METRICS_STALE
    return METRICS_ANSWERS


def with_stats_lines(track: Track) -> Track:
    """``track`` as vLLM's stats lines tell it, for a verdict while ``/metrics`` is unknown: their
    throughput is progress at the line's time, and the latest line's queue stands for the gauges when
    it is newer than the last sample."""
    t = track
    st, at = track.stats, track.stats_at
    if st is not None and at is not None and (track.figures_at is None or at > track.figures_at):
        t = _pending(t, st.running + st.waiting > 0, at)
    moved = track.stats_progress_at
    if moved is None or moved <= track.last_progress_at:
        return t
    own = t.own_pending_since
    return dataclasses.replace(
        t,
        last_progress_at=moved,
        progress=track.stats_progress,
        # r1sup's completion sent after the line is still its own open question
        own_pending_since=own if own is not None and own > moved else None,
        probe_after_progress=t.probe_sent_at is not None
        and t.probe_sent_at > moved
        and t.probe_after_progress,
    )


def figures_of(track: Track, now: float) -> dict[str, Any]:
    """The figures a verdict rests on, for logs (rounded, None where unknown)."""
    f = track.figures
    out: dict[str, Any] = {
        "running": f.running if f else None,
        "waiting": f.waiting if f else None,
        "prompt_tokens": f.prompt_tokens if f else None,
        "generation_tokens": f.generation_tokens if f else None,
        "finished": f.finished if f else None,
        "kv_usage": round(f.kv_usage, 4) if f and f.kv_usage is not None else None,
        "since_progress_s": round(now - track.last_progress_at, 1),
        "last_progress": track.progress,
        "metrics_age_s": round(now - track.figures_at, 1) if track.figures_at is not None else None,
        "health_failures": track.health_failures,
    }
    if track.metrics_error:
        out["metrics_error"] = track.metrics_error
    if track.stats is not None and track.stats_at is not None:
        out["stats_line_age_s"] = round(now - track.stats_at, 1)
        out["stats_running"] = track.stats.running
        out["stats_waiting"] = track.stats.waiting
    if track.own_pending_since is not None:
        out["own_completion_unanswered_s"] = round(now - track.own_pending_since, 1)
    return out


def stall_reference(track: Track) -> float | None:
    """Since when work has been pending without progress, or None when nothing is pending."""
    starts = [s for s in (track.pending_since, track.own_pending_since) if s is not None]
    if not starts:
        return None
    return max(track.last_progress_at, min(starts))


def decide(track: Track, now: float, policy: Policy) -> Verdict:
    """The verdict at ``now`` from everything observed so far."""
    state = metrics_state(track, now, policy)
    unknown = state != METRICS_ANSWERS
    if unknown:
        track = with_stats_lines(track)
    source = SOURCE_METRICS if not unknown else SOURCE_STATS if track.stats is not None else SOURCE_COMPLETION
    figures = figures_of(track, now)
    figures["source"] = source
    figures["metrics_state"] = state
    if track.dead:
        what = "engine process gone" if track.dead_evidence == EVIDENCE_CORE_GONE else "engine-dead reply"
        return Verdict(HUNG, track.dead_evidence, f"{what}: {track.dead}", figures=figures)
    if (
        track.health_failures >= policy.health_failures
        and track.health_failing_since is not None
        and track.last_progress_at < track.health_failing_since
    ):
        reason = (
            f"/health failed {track.health_failures} times in a row ({track.health_detail}) "
            f"and no progress for {now - track.last_progress_at:.0f}s"
        )
        return Verdict(HUNG, EVIDENCE_HEALTH, reason, figures=figures)
    last_probe = track.probe_sent_at if track.probe_sent_at is not None else track.started_at
    due = not track.probe_outstanding and now - last_probe >= policy.interval_s
    ref = stall_reference(track)
    if ref is None:
        # the engine proved itself within the last interval: no need to ask it
        probe = due and now - track.last_progress_at >= policy.interval_s
        return Verdict(IDLE, EVIDENCE_IDLE, "nothing running or waiting", probe=probe, figures=figures)
    figures["stalled_s"] = round(now - ref, 1)
    # While /metrics answers, a stall is judged on a sample taken after the deadline: progress made
    # since the last sample shows only in the next one. While it is unknown (failing, timed out, or no
    # sample for two intervals: nothing more is coming to wait for), the stats lines' progress is
    # folded in above and the time since decides.
    seen_until = track.figures_at if not unknown and track.figures_at is not None else now
    # Without /metrics figures, a stall needs the engine's word: a stats line written since the work began
    # that shows it not moving, or a /metrics that answers (the server is up: r1sup's completion it does
    # not answer is the engine's). With neither (vLLM's API server too starved to answer or to log, on a
    # loaded box), the time that passed is no evidence; a wedged server shows in /health instead.
    evidence = not unknown or track.metrics_answered or (track.stats_at is not None and track.stats_at > ref)
    if seen_until - ref >= policy.progress_timeout_s and not evidence:
        reason = (
            f"work pending for {now - ref:.0f}s with no evidence either way (progress timeout "
            f"{policy.progress_timeout_s:g}s); {_last_progress(track, now)}"
            f"{_basis(track, now, state, source)}; no stats line since: unknown, not a stall"
        )
        probe = due and now - ref >= policy.interval_s
        return Verdict(ALIVE, EVIDENCE_WAITING, reason, probe=probe, figures=figures)
    if seen_until - ref >= policy.progress_timeout_s:
        reason = (
            f"work pending for {now - ref:.0f}s with no progress (progress timeout "
            f"{policy.progress_timeout_s:g}s); {_last_progress(track, now)}"
            f"{_basis(track, now, state, source)}"
        )
        return Verdict(HUNG, EVIDENCE_STALL, reason, figures=figures)
    latest_moved = not unknown and track.figures_at is not None and track.figures_at <= track.last_progress_at
    if track.own_pending_since is None and (latest_moved or now - track.last_progress_at < policy.interval_s):
        return Verdict(ALIVE, EVIDENCE_PROGRESS, f"progress: {track.progress}", figures=figures)
    # work pending and a sample an interval later showed nothing new: a stall may be beginning. The
    # completion goes once per stall (it would only queue behind the work); without figures, once per
    # interval.
    if unknown:
        probe = due and now - ref >= policy.interval_s
    else:
        stalled_sample = track.figures_at is not None and track.figures_at - ref >= policy.interval_s
        probe = due and stalled_sample and not track.probe_after_progress
    reason = (
        f"work pending for {now - ref:.0f}s of {policy.progress_timeout_s:g}s with no progress; "
        f"{_last_progress(track, now)}{_basis(track, now, state, source)}"
    )
    return Verdict(ALIVE, EVIDENCE_WAITING, reason, probe=probe, figures=figures)


def _basis(track: Track, now: float, state: str, source: str) -> str:
    """What a stall is judged on when it is not /metrics ('' while /metrics answers)."""
    if source == SOURCE_METRICS:
        return ""
    if state == METRICS_FAILING:
        why = f"/metrics failing ({track.metrics_error})"
    elif state == METRICS_STALE and track.figures_at is not None:
        why = f"/metrics unanswered for {now - track.figures_at:.0f}s"
    else:
        why = "no /metrics figures"
    if source == SOURCE_STATS and track.stats_at is not None:
        return f"; {why}: judged on vLLM's stats lines (the last {now - track.stats_at:.0f}s ago)"
    return f"; {why}: judged on r1sup's completion and time"


def _last_progress(track: Track, now: float) -> str:
    """How long ago anything moved, the same figure as ``since_progress_s`` (the stall clock above starts
    only when work is pending, which can be long after the last progress of an idle server)."""
    return f"last progress {now - track.last_progress_at:.0f}s ago ({track.progress})"


# --- draining ------------------------------------------------------------------------------------

# vLLM's own drain: with --shutdown-timeout N (vLLM 0.18 and later, PR 34730), a SIGTERM to the API
# server refuses new requests and lets the ones in flight (running and waiting) finish for up to N s.
SHUTDOWN_TIMEOUT_FLAG = "--shutdown-timeout"
SHUTDOWN_TIMEOUT_SINCE = (0, 18)


def _version_tuple(version: str | None) -> tuple[int, ...] | None:
    m = re.match(r"\s*(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def drain_args(vllm_version: str | None, extra_args: Sequence[str], seconds: float) -> tuple[str, ...]:
    """The flag that makes vLLM drain on SIGTERM, for a version that has it; () when the version is
    older or unknown, when ``seconds`` is 0, or when ``server.extra_args`` already sets it."""
    version = _version_tuple(vllm_version)
    if version is None or version < SHUTDOWN_TIMEOUT_SINCE or seconds <= 0:
        return ()
    if any(a == SHUTDOWN_TIMEOUT_FLAG or a.startswith(SHUTDOWN_TIMEOUT_FLAG + "=") for a in extra_args):
        return ()
    return (SHUTDOWN_TIMEOUT_FLAG, str(math.ceil(seconds)))


# What vLLM's engine core prints once its drain has nothing left in flight (vLLM 0.32's
# EngineCore._handle_shutdown); an older vLLM without the line is waited for until it exits.
DRAINED_LINE = "[shutdown] EngineCore: request processing complete"


def drained_line(line: str) -> bool:
    """Whether a line of vLLM's output says its own drain has finished the requests in flight."""
    return DRAINED_LINE in line


def drains_itself(argv: Sequence[str]) -> bool:
    """Whether a vLLM command line asks vLLM to drain on SIGTERM (``--shutdown-timeout`` above 0)."""
    for i, arg in enumerate(argv):
        value = None
        if arg == SHUTDOWN_TIMEOUT_FLAG and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(SHUTDOWN_TIMEOUT_FLAG + "="):
            value = arg.split("=", 1)[1]
        if value is not None:
            try:
                return float(value) > 0
            except ValueError:
                return False
    return False


def drain_status(figures: Figures | None) -> str:
    """The status line while r1sup waits for the requests in flight."""
    if figures is None:
        return "draining: waiting for the requests in flight"
    return f"draining: {figures.running:g} running, {figures.waiting:g} waiting"
