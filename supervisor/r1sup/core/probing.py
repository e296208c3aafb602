"""What one load probe found: one frozen, typed value (:class:`ProbeResult`), its concurrency wave
(:class:`Wave`) and the fault of its own machinery (:class:`ProbeFault`).

Pure (core): no I/O. The probe (:mod:`r1sup.adapters.probe`) runs in a child process that writes
:meth:`ProbeResult.to_dict` as JSON; the parent reads it back once with :meth:`ProbeResult.from_dict`,
and the runner, the tuner, the capacity record, the daemon, the metrics and the report read its fields.
Where a probe result is persisted (a profile's and a run record's ``probe``, ``tune --json``),
:meth:`ProbeResult.to_dict` writes it: the keys are the field names, in the order declared (the bytes
r1sup wrote when the result was a dict).

:meth:`ProbeResult.from_dict` also reads stored records, which are untrusted and may be older than a
field: a number missing or of the wrong type is None, a flag False, never a crash.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from r1sup.core.failure import (
    ENGINE_DEAD,
    HANG,
    PHASE_SERVING,
    PROBE_CONNECTION,
    PROBE_REJECTED,
    PROBE_SERVER_ERROR,
    PROBE_TIMEOUT,
    Failure,
)
from r1sup.core.figures import known_numbers


@dataclass(frozen=True)
class Wave:
    """The concurrency wave: ``requests`` ordinary requests sent at once after the context requests
    passed, each of ``prompt_tokens`` of prompt and ``output_tokens`` of output; what ran at once
    (``running_peak``, ``streams_peak``, ``concurrency_proven``), what vLLM's figures allow at once as the
    wave found it (``limit``) and what it measured; or why it was ``skipped`` (then only ``requests``,
    ``output_tokens`` and perhaps ``limit`` are set)."""

    requests: int | None = None
    output_tokens: int | None = None
    sent: int | None = None
    prompt_tokens: int | None = None
    tokenize_calls: int | None = None
    succeeded: int | None = None
    running_peak: int | None = None
    waiting_peak: int | None = None
    streams_peak: int | None = None
    concurrency_proven: int | None = None
    queued: bool = False
    limit: int | None = None
    output_tokens_total: int | None = None
    output_tokens_per_s: float | None = None
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    duration_s: float | None = None
    skipped: str | None = None  # why no wave was sent

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Wave:
        """A wave record (the child's, or a stored one): numbers of known keys, ``queued`` when a
        boolean, ``skipped`` when a string; anything else is left out."""
        values: dict[str, Any] = known_numbers(data, _WAVE_NUMBERS)
        queued, skipped = data.get("queued"), data.get("skipped")
        return cls(
            **values,
            queued=queued if isinstance(queued, bool) else False,
            skipped=skipped if isinstance(skipped, str) else None,
        )

    def to_dict(self) -> dict[str, Any]:
        """The record: a skipped wave's ``requests``, ``output_tokens``, ``limit`` (when known) and
        ``skipped``; a wave that ran has every field but ``skipped``."""
        if self.skipped is not None:
            head: dict[str, Any] = {"requests": self.requests, "output_tokens": self.output_tokens}
            if self.limit is not None:
                head["limit"] = self.limit
            return {**head, "skipped": self.skipped}
        return {name: getattr(self, name) for name in _WAVE_FIELDS if name != "skipped"}

    def text(self) -> str:
        """``; wave: 16 of 16 ran at once, ~256 prompt tokens, 812.0 output tok/s, TTFT p50 0.05s p95
        0.09s`` (the figures the capacity line gives at these requests), or why it was skipped."""
        if self.skipped:
            return f"; no concurrency wave ({self.skipped})"
        ttft = f", TTFT p50 {self.ttft_p50_s:.2f}s" if self.ttft_p50_s is not None else ""
        if ttft and self.ttft_p95_s is not None:
            ttft += f" p95 {self.ttft_p95_s:.2f}s"
        return (
            f"; wave: {self.concurrency_proven} of {self.sent} ran at once, ~{self.prompt_tokens} prompt "
            f"tokens, {self.output_tokens_per_s or 0:.1f} output tok/s{ttft}"
        )


_WAVE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Wave))
_WAVE_NUMBERS: tuple[str, ...] = tuple(n for n in _WAVE_FIELDS if n not in ("queued", "skipped"))


@dataclass(frozen=True)
class ProbeFault:
    """The probe's own machinery failed (its child crashed, could not import, wrote no result):
    r1sup's fault, never the engine's. ``where``: the module and line; ``error``: the exception."""

    where: str
    error: str

    def to_dict(self) -> dict[str, str]:
        return {"where": self.where, "error": self.error}


@dataclass(frozen=True)
class ProbeResult:
    """What one load probe sent and found (see :mod:`r1sup.adapters.probe` for how it is measured).

    The probe sets every count; None where a stored record did not hold one (:meth:`from_dict`)."""

    ok: bool = False
    requests: int | None = 0
    succeeded: int | None = 0
    error_count: int | None = 0
    errors: tuple[str, ...] = ()  # the first few, one line each
    concurrency: int | None = 1
    prompt_tokens: int | None = 0  # measured with /tokenize (the largest prompt sent)
    prompt_tokens_estimated: bool = False
    # what the sizing found, for a later probe of the same flags (None: estimated, not measured): the
    # record the child reads back, kept as the child wrote it
    # {"model", "prompt_tokens" (the size asked for), "prompts": [{"words", "tokens", "sha256"}, ...]}
    sizing: Mapping[str, Any] | None = None
    sizing_reused: bool = False  # the prompts came from the spec's record (one /tokenize call checked it)
    tokenize_calls: int | None = 0
    output_tokens: int | None = 0  # per request (max_tokens), as the config's probe.output_tokens
    output_tokens_total: int | None = 0  # generated by all requests together, as counted
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    output_tokens_per_s: float | None = None
    duration_s: float | None = 0.0
    peak_kv_usage: float | None = None
    preemptions: int | None = None
    # requests at once: vLLM's gauges at their peak while the probe ran (None: /metrics said nothing),
    # the most streams delivering tokens at the same moment, and what that proves (<= concurrency)
    running_peak: int | None = None
    waiting_peak: int | None = None
    streams_peak: int | None = 0
    concurrency_proven: int | None = None
    queued: bool = False  # fewer requests ran at once than were sent at once
    timed_out: bool = False
    # requests that failed on the connection (refused, reset, before vLLM's answer or in its stream) and
    # were sent again, all requests together; those that still failed on it after their retries; those
    # vLLM answered with a 4xx (r1sup's own request was wrong: its context, its tokens); those answered
    # with a 5xx that is not vLLM's engine-dead reply (a proxy's 502/503, a server shutting down, an error
    # event in the stream) after their retries; vLLM's /health once requests still failed on the
    # connection or with such a 5xx (None: not asked); and the requests sent again after such a 5xx. None
    # in a record from before them (not written then, so old records keep their bytes)
    retried: int | None = 0
    connection_errors: int | None = 0
    rejected: int | None = 0
    health_ok: bool | None = None
    server_errors: int | None = 0
    server_retried: int | None = 0
    # requests that got no answer within probe.request_timeout_s (never sent again), and the fewest
    # prompt and generation tokens vLLM's counters moved by while one of them waited (None: not measured,
    # /metrics gave no two readings in any such wait); None in a record from before them
    request_timeouts: int | None = 0
    timeout_progress_tokens: int | None = None
    wave: Wave | None = None  # None when the probe was asked for none
    internal: ProbeFault | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> ProbeResult:
        """The child's result, or a stored ``probe`` record: the fields of the right type (numbers
        finite, not booleans); anything else keeps its default."""
        if not isinstance(data, Mapping):
            return cls()
        values: dict[str, Any] = dict.fromkeys(_NUMBERS)  # a record without a figure: None, not a count
        values.update(known_numbers(data, _NUMBERS))
        values.update((name, v) for name in _FLAGS if isinstance(v := data.get(name), bool))
        if isinstance(health := data.get("health_ok"), bool):
            values["health_ok"] = health
        errors = data.get("errors")
        if isinstance(errors, list):
            values["errors"] = tuple(str(e) for e in errors)
        if isinstance(sizing := data.get("sizing"), Mapping):
            values["sizing"] = sizing
        if isinstance(wave := data.get("wave"), Mapping):
            values["wave"] = Wave.from_dict(wave)
        internal = data.get("internal")
        if isinstance(internal, Mapping):
            values["internal"] = ProbeFault(str(internal.get("where")), str(internal.get("error")))
        return cls(**values)

    @classmethod
    def unanswered(cls, error: str, timed_out: bool = False) -> ProbeResult:
        """A probe that gave no result (its check failed, or it did not return in time): failed, with
        no figures (None, not zero) and ``error``."""
        figures: dict[str, Any] = dict.fromkeys(_NUMBERS)
        return cls(**figures, errors=(error,), timed_out=timed_out)

    def to_dict(self) -> dict[str, Any]:
        """The record, every field by its name in the order declared (the child's output, ``probe``);
        the connection's and the rejections' fields only when set (a record read from before them
        writes the bytes it was read from)."""
        out: dict[str, Any] = {}
        for name in _FIELDS:
            value = getattr(self, name)
            if value is None and name in _LATER:
                continue
            if isinstance(value, (Wave, ProbeFault)):
                value = value.to_dict()
            elif name == "errors":
                value = list(value)
            elif name == "sizing" and value is not None:
                value = dict(value)
            out[name] = value
        return out

    @property
    def first_error(self) -> str:
        return self.errors[0] if self.errors else ""

    @property
    def rejected_error(self) -> str:
        """The first error of a request vLLM answered with a 4xx, else the first error."""
        return next((e for e in self.errors if REJECTED_MARK in e), self.first_error)

    @property
    def connection_only(self) -> bool:
        """Every request that failed, failed on the connection (after its retries), none by vLLM's
        answer, and the probe did not time out."""
        lost = self.connection_errors or 0
        return lost > 0 and self.error_count == lost and not self.timed_out

    @property
    def without_engine_evidence(self) -> bool:
        """Every request that failed, failed on the connection (after its retries) or with a 5xx that is
        not vLLM's engine-dead reply, and the probe did not time out: nothing of it is the engine's
        evidence (``health_ok`` says whether /health is)."""
        failed = (self.connection_errors or 0) + (self.server_errors or 0)
        return failed > 0 and self.error_count == failed and not self.timed_out

    @property
    def timeouts_without_engine_evidence(self) -> bool:
        """Some requests got no answer within probe.request_timeout_s, and every other request that
        failed, failed on the connection or with a 5xx that is not vLLM's engine-dead reply, and the
        probe did not time out as a whole: whether the engine is busy or gone is for /health and vLLM's
        counters to say (``health_ok``, ``timeout_progress_tokens``), not for the timeout."""
        timeouts = self.request_timeouts or 0
        failed = timeouts + (self.connection_errors or 0) + (self.server_errors or 0)
        return timeouts > 0 and self.error_count == failed and not self.timed_out

    def queued_text(self) -> str:
        """`` (only N ran at once, W waited)`` when requests queued behind others, else nothing."""
        if not self.queued:
            return ""
        waited = f", {self.waiting_peak} waited" if self.waiting_peak else ""
        return f" (only {self.concurrency_proven} ran at once{waited})"

    def summary(self) -> str:
        """One line: how many passed at what concurrency, what ran at once, sizes, TTFT, tokens/s."""
        if not self.ok:
            return (
                f"{self.error_count}/{self.requests} requests failed: {self.first_error or 'no detail'}"
                + self.retried_text()
            )
        kv = f", peak KV {self.peak_kv_usage:.0%}" if self.peak_kv_usage is not None else ""
        return (
            f"{self.succeeded}/{self.requests} ok at concurrency {self.concurrency}{self.queued_text()}, "
            f"{self.prompt_tokens} prompt tokens, TTFT p50 {self.ttft_p50_s or 0:.2f}s "
            f"p95 {self.ttft_p95_s or 0:.2f}s, {self.output_tokens_per_s or 0:.1f} tok/s{kv}"
            + (self.wave.text() if self.wave is not None else "")
            + self.retried_text()
        )

    def retried_text(self) -> str:
        """``; 1 request retried after its connection failed`` when any was, and ``; 2 requests retried
        after a 5xx answer`` when any was (vLLM's engine-dead reply is never retried), else nothing."""
        said = ""
        if n := self.retried or 0:
            said += f"; {_requests(n)} retried after {'its' if n == 1 else 'their'} connection failed"
        if n := self.server_retried or 0:
            said += f"; {_requests(n)} retried after a 5xx answer"
        return said


def _requests(n: int) -> str:
    return "1 request" if n == 1 else f"{n} requests"


_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(ProbeResult))
_FLAGS = ("ok", "prompt_tokens_estimated", "sizing_reused", "queued", "timed_out")
_NUMBERS: tuple[str, ...] = tuple(
    n for n in _FIELDS if n not in (*_FLAGS, "errors", "sizing", "wave", "internal", "health_ok")
)
# written only when set
_LATER = frozenset(
    {
        "retried",
        "connection_errors",
        "rejected",
        "health_ok",
        "server_errors",
        "server_retried",
        "request_timeouts",
        "timeout_progress_tokens",
    }
)
REJECTED_MARK = "rejected (HTTP 4"  # in the error line of a request vLLM answered with a 4xx


def probe_failure(result: ProbeResult, request_timeout_s: float, timeout_s: float) -> Failure:
    """What a failed probe was, from its own evidence, once the engine's process is known to be up and
    its log shows no failure (the runner decides those first): a 4xx is r1sup's own request
    (``probe_rejected``); requests that failed on the connection or with a 5xx that is not vLLM's
    engine-dead reply are the probe's path while ``/health`` answers (``probe_connection``,
    ``probe_server_error``), the engine's death when it fails. Requests that got no answer within
    ``request_timeout_s`` (``probe.request_timeout_s``) are judged as the liveness judge judges a
    stall: ``/health`` failing is the engine's death (``engine_dead``); vLLM's counters frozen while
    they waited is a hang (``hang``); counters that moved, or that are unknown (no two ``/metrics``
    readings in a wait: never taken for a stall), make it a busy engine, ``probe_timeout`` (transient,
    never the engine's death). A probe that passed a deadline of its own (``timeout_s``,
    ``probe.timeout_s``; the concurrency wave's, at most ``request_timeout_s``) is judged so from the
    requests still in flight then, except that unknown progress stays a ``hang``; anything else is the
    engine's (``engine_dead``)."""
    if result.rejected:  # a 4xx: r1sup's own request was wrong, not the engine
        return Failure(
            PROBE_REJECTED,
            PHASE_SERVING,
            detail=f"vLLM rejected {result.rejected} probe request(s) with a 4xx",
            evidence=result.rejected_error,
        )
    if result.connection_only and result.health_ok:  # the engine answers: the connection failed
        return Failure(
            PROBE_CONNECTION,
            PHASE_SERVING,
            detail=f"{result.connection_errors} probe request(s) failed on the connection after "
            "their retries; vLLM's /health answers",
            evidence=result.first_error,
        )
    if result.without_engine_evidence and result.health_ok:  # a 5xx, not vLLM's engine-dead reply
        return Failure(
            PROBE_SERVER_ERROR,
            PHASE_SERVING,
            detail=f"{result.server_errors} probe request(s) answered with a 5xx that is not vLLM's "
            "engine-dead reply (a proxy, a server shutting down, an error in the stream) after their "
            "retries; vLLM's /health answers, so the engine is not taken for dead",
            evidence=result.first_error,
        )
    if result.without_engine_evidence:  # and /health failed: the engine's own evidence
        how = "failed on the connection" if result.connection_only else "failed"
        return Failure(
            ENGINE_DEAD,
            PHASE_SERVING,
            detail=f"probe requests {how} and vLLM's /health failed",
            evidence=result.first_error,
        )
    if result.timeouts_without_engine_evidence:
        return _timeout_failure(result, request_timeout_s)
    if result.timed_out:
        return _deadline_failure(result, request_timeout_s, timeout_s)
    return Failure(ENGINE_DEAD, PHASE_SERVING, detail="probe requests failed", evidence=result.first_error)


def _health_failed(result: ProbeResult, what: str) -> Failure:
    """``what`` went wrong and vLLM's /health failed after it: the engine's own evidence of death."""
    return Failure(
        ENGINE_DEAD, PHASE_SERVING, detail=f"{what} and vLLM's /health failed", evidence=result.first_error
    )


def _timeout_failure(result: ProbeResult, request_timeout_s: float) -> Failure:
    """Requests that got no answer within ``request_timeout_s``: /health and vLLM's counters decide."""
    waited = (
        f"{_requests(result.request_timeouts or 0)} got no answer within probe.request_timeout_s "
        f"({request_timeout_s:g}s)"
    )
    moved = result.timeout_progress_tokens
    if result.health_ok is False:  # the engine's own evidence
        return _health_failed(result, waited)
    if moved == 0:  # /health answers, yet nothing moved while they waited: the core is stuck
        return Failure(
            HANG,
            PHASE_SERVING,
            detail=f"{waited} and vLLM's token counters did not move while they waited (its /health answers)",
            evidence=result.first_error,
        )
    progress = (
        f"vLLM processed at least {moved} tokens while each waited"
        if moved is not None
        else "vLLM's /metrics gave no progress figures while they waited (unknown, not a stall)"
    )
    return Failure(
        PROBE_TIMEOUT,
        PHASE_SERVING,
        detail=f"{waited}; {progress} and its /health answers: the engine is busy, not dead (a larger "
        "probe.request_timeout_s waits it out)",
        evidence=result.first_error,
    )


def _deadline_failure(result: ProbeResult, request_timeout_s: float, timeout_s: float) -> Failure:
    """A probe that passed a deadline of its own: the requests in flight then are judged as timed-out
    ones, but without progress shown (frozen or unknown) it is a hang, as it always was."""
    late = (
        f"the probe timed out (its requests within probe.timeout_s, {timeout_s:g}s; the concurrency "
        f"wave's within probe.request_timeout_s, {request_timeout_s:g}s)"
    )
    moved = result.timeout_progress_tokens
    if result.health_ok is False:  # the engine's own evidence
        return _health_failed(result, late)
    if moved is None or moved == 0 or result.health_ok is not True:
        frozen = " and vLLM's token counters did not move while its requests waited" if moved == 0 else ""
        return Failure(HANG, PHASE_SERVING, detail=f"{late}{frozen}", evidence=result.first_error)
    return Failure(
        PROBE_TIMEOUT,
        PHASE_SERVING,
        detail=f"{late}; vLLM processed at least {moved} tokens while each request in flight waited and its "
        "/health answers: the engine is busy, not dead (larger probe.timeout_s and probe.request_timeout_s "
        "wait it out)",
        evidence=result.first_error,
    )
