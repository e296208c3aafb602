"""One vLLM launch: its record (:class:`Launch`), what the phases need of the runner (:class:`LaunchHost`),
and the phases of the one loop a launch waits in: :class:`Starting` until vLLM is ready or has failed,
:class:`ProbeWait` until the probe returns, :class:`Stopping` (SIGTERM, SIGKILL on its timer, the wait for
the device memory), :class:`Flushing` for the output that follows an exit or a stop, :class:`Awaiting` for
blocking work of no launch; and the verdict of a launch that ended (:func:`launch_verdict`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from r1sup.adapters import health
from r1sup.adapters.launcher import Engine, LaunchSpec, StopReport
from r1sup.core import failure as F
from r1sup.core import progress as P
from r1sup.core.config import Config
from r1sup.core.errors import InternalError
from r1sup.core.events import CheckDone, ChildOutput, Signalled
from r1sup.core.failure import Failure
from r1sup.core.figures import Figures
from r1sup.core.flags import EngineFlags
from r1sup.core.logparse import LogReader
from r1sup.core.probing import ProbeResult
from r1sup.supervision.loop import TURN_S, Done, Phase, Stop

if TYPE_CHECKING:
    pass

READY_RETRY_S = 0.05


@dataclass
class Launch:
    """One launch: its engine, its reader, and what it ended in."""

    number: int
    flags: EngineFlags
    spec: LaunchSpec
    engine: Engine
    reader: LogReader
    started: float
    ready: bool = False
    ready_after_s: float | None = None
    failure: Failure = F.NO_FAILURE
    exit_code: int | None = None
    probe: ProbeResult | None = None
    # the saved profile's full probe of these flags that this launch's capacity stands on: its short
    # probe sent short prompts, vLLM having allocated at least the KV cache that one passed with
    stands_on: ProbeResult | None = None
    stop_report: StopReport | None = None
    stopping: bool = False  # r1sup has asked the engine to stop: what it prints now is its teardown
    progress: P.LoadProgress | None = None  # phases, percent, elapsed time and ETA while it loads
    attempt: int = 0  # the tuner's attempt number (for the progress line)
    folded_lines: int = 0  # vLLM error lines shown at debug only (console), summed up by the verdict
    exited_at: float | None = None  # when the loop first saw the engine's exit
    recorded_at: float | None = None  # when the engine's processes were last recorded
    # vLLM's torch.compile cache as this launch found it: "cold" (nothing cached, the engine compiles
    # during its memory profile), "warm" (graphs cached), None before the launch looked
    compile_cache: str | None = None

    @property
    def started_engine(self) -> bool:
        return self.engine.proc is not None

    @property
    def figures(self) -> Figures:
        """What vLLM printed, and ``compile_cache_cold`` (1.0: this launch compiled from nothing)."""
        figures = self.reader.figures
        if self.compile_cache is not None:
            figures = replace(figures, compile_cache_cold=1.0 if self.compile_cache == "cold" else 0.0)
        return figures


@dataclass(frozen=True)
class Proven:
    """A saved profile whose full probe passed on a box of the same fingerprint: its flags, the record
    of that probe, and the KV cache (tokens, vLLM's figure) of the launch that passed it."""

    flags: dict[str, Any]
    probe: ProbeResult
    kv_cache_tokens: float | None = None
    # the torch.compile cache of the launch that passed (1.0 cold, 0.0 warm; None: not recorded)
    compile_cache_cold: float | None = None

    @property
    def proven_warm(self) -> bool:
        """Proven on a warm compile cache: a cold start may get less KV than that launch did."""
        return self.compile_cache_cold == 0.0


@dataclass
class Hooks:
    """Ways the runner looks at the device beyond the child, swappable in tests. (What the runner
    reports goes as events: :mod:`r1sup.core.events`; the daemon's heartbeat is :attr:`Runner.tick`.)"""

    memory_released: Callable[[Sequence[int]], bool] | None = None
    gpu_processes: Callable[[], list[Any]] = field(default=lambda: [])


CheckFn = Callable[[], tuple[bool, str, Any]]  # a check's work: (ok, detail, payload)


class LaunchHost(Protocol):
    """What the phases of a launch (:class:`Starting`, :class:`ProbeWait`, :class:`Flushing`,
    :class:`Stopping`) need of the runner that owns them, and nothing more: the clock and the config,
    the launch's output, its checks, and the two steps a phase makes happen (readiness announced, a
    fault of r1sup's own taken)."""

    config: Config
    endpoint: health.Endpoint
    hooks: Hooks
    ready_poll_s: float
    clock: Callable[[], float]

    def handle_output(self, launch: Launch, event: object) -> None: ...

    def show_progress(self, launch: Launch, force: bool = False) -> None: ...

    def record_descendants(self, launch: Launch, now: float) -> None: ...

    def exit_failure(self, launch: Launch, now: float, phase: str, when: str = "") -> Failure | None: ...

    def run_check(self, kind: str, launch: Launch | None, fn: CheckFn) -> None: ...

    def announce_ready(self, launch: Launch) -> None: ...

    def take_fault(self) -> InternalError | None: ...


class Stopping(Phase):
    """supervisord's STOPPING, driven by the loop's turns: SIGTERM to the engine's group when the phase
    begins; each turn looks whether the group has exited; at the grace deadline (``server.stop_timeout_s``)
    or on a second stop signal, SIGKILL. Then the reaping, the recorded descendants and the wait for the
    device memory and the port run as a check (``stopped``); with its :class:`StopReport` the phase
    hands over to a short :class:`Flushing` of the last lines, which ends with the report.
    vLLM's output (its teardown) is taken meanwhile. A first stop signal waits for the next phase; a
    fault of a check thread too, unless it is the stop's own (raised when its check answers)."""

    ticks = False
    faults = False
    POLL_S = 0.05  # the group is looked at this often while it has its grace period
    TAIL_S = 0.2  # after the stop, its last lines are taken this long at most (until their end)

    def __init__(self, runner: LaunchHost, launch: Launch, grace_s: float, release_timeout_s: float) -> None:
        self.runner = runner
        self.launch = launch
        self.started = runner.clock()
        self.deadline = self.started + grace_s
        self.release_timeout_s = release_timeout_s
        self.escalated = False
        self.forced = False  # a second SIGTERM/SIGINT: SIGKILL now
        self.terminating = launch.engine.begin_stop()  # SIGTERM sent: the grace period runs
        self.releasing = False  # the check that reaps and waits for the memory runs

    def due(self, now: float) -> float:
        if self.terminating:
            return min(self.POLL_S, self.deadline - now)
        return TURN_S if self.releasing else 0.0

    def on_signal(self, signal: Signalled, now: float) -> Any:
        # the first SIGTERM/SIGINT asks for a clean stop; a second one (even a quick one) forces it
        self.forced = self.forced or signal.count >= 2
        return None

    def on(self, event: Any, now: float) -> Any:
        runner, launch = self.runner, self.launch
        if isinstance(event, CheckDone) and event.launch == launch.number and event.kind == "stopped":
            if not event.ok:
                fault = runner.take_fault()
                if fault is not None:
                    raise fault
            report = event.payload if isinstance(event.payload, StopReport) else StopReport()
            report.escalated = self.escalated
            report.seconds = now - self.started
            # the lines that followed the exit, for a moment, then the report
            return Flushing(runner, launch, now + self.TAIL_S, until_quiet=False, then=lambda: Done(report))
        if event is not None:
            runner.handle_output(launch, event)
        if self.terminating:
            if launch.engine.group_exited():
                self.terminating = False
            elif self.forced or now >= self.deadline:
                self.escalated = launch.engine.kill_group()
                self.terminating = False
        if not self.terminating and not self.releasing:
            self.releasing = True
            engine, timeout, released = launch.engine, self.release_timeout_s, runner.hooks.memory_released
            runner.run_check("stopped", launch, lambda: (True, "", engine.finish_stop(timeout, released)))
        return None


class Awaiting(Phase):
    """Until the check ``kind`` of no launch answers (its :class:`CheckDone`); ``output`` takes the other
    events meanwhile. A stop signal sets ``cancel`` (the check's work then ends what it started) and
    ends the wait as StopRequested."""

    def __init__(
        self, kind: str, cancel: threading.Event, output: Callable[[Any], None] | None = None
    ) -> None:
        self.kind = kind
        self.cancel = cancel
        self.output = output

    def on_signal(self, signal: Signalled, now: float) -> Any:
        self.cancel.set()
        return Stop(signal.signum)

    def on(self, event: Any, now: float) -> Any:
        if isinstance(event, CheckDone) and event.launch == 0 and event.kind == self.kind:
            return Done(event)
        if event is not None and self.output is not None:
            self.output(event)
        return None


class Cancelled(Exception):
    """Raised inside a check's work once the wait for it was given up."""


class Cancel:
    """What off-loop work calls while it waits: raises :class:`Cancelled` once the loop gave the wait
    up (a stop signal), so that the work ends what it started; :meth:`sleep` waits on it."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.event = threading.Event()

    def __call__(self) -> None:
        if self.event.is_set():
            raise Cancelled(self.kind)

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` on the work's thread; a stop signal ends the wait (and the work) at once."""
        self.event.wait(seconds)
        self()


class Starting(Phase):
    """From the launch until vLLM answers as ready (``launch.ready``) or has failed (``launch.failure``).

    Readiness is checked the moment vLLM prints its readiness line, polled every ``ready_poll_s``
    until then; the start-up fails when the engine exits, prints nothing for
    ``server.stall_timeout_s`` or is not ready within ``server.startup_timeout_s``."""

    def __init__(self, runner: LaunchHost, launch: Launch) -> None:
        self.runner = runner
        self.launch = launch
        now = runner.clock()
        server = runner.config.server
        self.stall_s = server.stall_timeout_s
        self.startup_s = server.startup_timeout_s
        self.deadline = launch.started + server.startup_timeout_s
        self.last_activity = now
        self.checking = False  # a readiness check is in flight
        self.next_check = now + runner.ready_poll_s
        self.line_seen = False  # vLLM printed its readiness line: check now, not at the next poll

    def due(self, now: float) -> float:
        # no longer than until the next check is due (once the child exited, none is started)
        if self.checking or self.launch.exited_at is not None:
            return TURN_S
        return self.next_check - now

    def on(self, event: Any, now: float) -> Any:
        runner, launch = self.runner, self.launch
        runner.show_progress(launch)
        if isinstance(event, CheckDone) and event.launch == launch.number and event.kind == "ready":
            self.checking = False
            if event.ok and launch.engine.alive():
                launch.ready = True
                launch.ready_after_s = round(now - launch.started, 2)
                launch.reader.mark_ready()
                runner.announce_ready(launch)
                return Done()
            if self.line_seen:
                self.next_check = min(self.next_check, now + READY_RETRY_S)
        elif event is not None:
            if isinstance(event, ChildOutput) and event.launch == launch.number:
                self.last_activity = now
            runner.handle_output(launch, event)
            if not self.line_seen and launch.reader.ready_seen:
                self.line_seen = True
                self.next_check = now
        runner.record_descendants(launch, now)
        if launch.engine.poll() is not None:
            ended = runner.exit_failure(launch, now, F.PHASE_STARTUP, " before it was ready")
            if ended is None:
                return None
            launch.failure = ended
            return Done()
        if not self.checking and now >= self.next_check:
            self.checking = True
            self.next_check = now + runner.ready_poll_s
            runner.run_check(
                "ready", launch, lambda: (*health.check_ready(runner.endpoint, launch.spec.served_name), None)
            )
        stalled = now - self.last_activity > self.stall_s
        if stalled or now > self.deadline:
            seen = launch.reader.verdict(exit_code=None)
            if seen.cls != F.NONE:
                launch.failure = seen
            else:
                what = (
                    f"no output for {self.stall_s:.0f}s"
                    if stalled
                    else f"not ready after {self.startup_s:.0f}s (server.startup_timeout_s)"
                )
                launch.failure = Failure(F.HANG, launch.reader.startup_phase, detail=what, evidence=what)
            return Done()
        return None


class ProbeWait(Phase):
    """Until the probe's check returns (its :class:`ProbeResult`), or ``deadline`` (a probe that did not
    return)."""

    def __init__(self, runner: LaunchHost, launch: Launch, deadline: float) -> None:
        self.runner = runner
        self.launch = launch
        self.deadline = deadline

    def on(self, event: Any, now: float) -> Any:
        launch = self.launch
        self.runner.show_progress(launch)
        if isinstance(event, CheckDone) and event.launch == launch.number and event.kind == "probe":
            payload = event.payload
            return Done(payload if isinstance(payload, ProbeResult) else ProbeResult.unanswered(event.detail))
        if event is not None:
            self.runner.handle_output(launch, event)
        if now > self.deadline:
            return Done(ProbeResult.unanswered("the probe did not return", timed_out=True))
        return None


class Flushing(Phase):
    """The output still queued for a launch: until its end (EOF) or ``until``; with ``until_quiet``
    until nothing more came for 50 ms. Signals and faults wait for the next phase: the caller is
    already stopping or deciding."""

    ticks = False
    faults = False
    QUIET_S = 0.05

    def __init__(
        self,
        runner: LaunchHost,
        launch: Launch,
        until: float,
        until_quiet: bool,
        at_most: int | None = None,
        then: Callable[[], Any] | None = None,
    ) -> None:
        self.runner = runner
        self.launch = launch
        self.until = until
        self.until_quiet = until_quiet
        self.left = at_most  # events to take at most (what was queued when the flush began)
        # what the flush hands over to when it ends (a phase's outcome: a phase that handed over to this
        # flush goes on from there), else Done()
        self.then = then

    def due(self, now: float) -> float:
        return min(self.QUIET_S, self.until - now)

    def on_signal(self, signal: Signalled, now: float) -> Any:
        return None

    def on(self, event: Any, now: float) -> Any:
        if event is None:
            if self.launch.engine.eof or self.until_quiet or now >= self.until:
                return self._end()
            return None
        self.runner.handle_output(self.launch, event)
        if self.left is not None:
            self.left -= 1
            return self._end() if self.left <= 0 else None
        return self._end() if now >= self.until else None

    def _end(self) -> Any:
        return self.then() if self.then is not None else Done()


def compile_cache_now(env: Mapping[str, str]) -> str:
    """vLLM's torch.compile cache in the engine's environment: "cold" when it holds nothing (a new box, a
    wiped state dir, a new image), else "warm" (graphs cached; for this model once it has started here)."""
    from r1sup.state import profiles

    return "cold" if profiles.compile_cache_state(env) == "cold" else "warm"


def launch_verdict(launch: Launch, code: int | None, phase: str, when: str = "") -> Failure:
    """What vLLM's output says went wrong; if it says nothing and the engine exited (``code``), the
    exit itself: ``engine_dead`` in ``phase``. The one place an exit becomes engine death."""
    seen = launch.reader.verdict(exit_code=code)
    if seen.cls != F.NONE or code is None:
        return seen
    return Failure(F.ENGINE_DEAD, phase, detail=f"vLLM exited with code {code}{when}")


def progress_fields(launch: Launch, step: P.Step) -> dict[str, Any]:
    """An ``engine_progress`` event's fields: where the launch is, how long the last phase took, and
    the numbers vLLM printed in it."""
    snap = step.snapshot
    fields: dict[str, Any] = {"launch": launch.number, "attempt": launch.attempt, "phase": snap.phase}
    if snap.percent is not None:
        fields["percent"] = round(snap.percent, 1)
    fields["elapsed_s"] = round(snap.elapsed_s, 1)
    if snap.eta_s is not None:
        fields["eta_s"] = round(snap.eta_s, 1)
    if step.previous_phase is not None:
        fields["after"] = step.previous_phase
        fields["after_s"] = step.previous_phase_s
    fields.update(step.numbers)
    return fields


def int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def folded(launch: Launch) -> dict[str, Any]:
    """On a console, how many vLLM error lines the verdict stands for (shown with --log-level debug)."""
    if not launch.folded_lines:
        return {}
    return {"vllm_error_lines": f"{launch.folded_lines} at --log-level debug"}


def failure_fields(failure: Failure) -> dict[str, Any]:
    return {
        "failure_class": failure.cls,
        "phase": failure.phase,
        "memory": failure.memory,
        "evidence": failure.evidence[:500],
        "numbers": failure.numbers.to_dict(),
        "detail": failure.detail,
    }
