"""The daemon's serving phases: :class:`FirstRead` (the first read of vLLM's figures once it serves),
:class:`Serving` (``/health``, vLLM's progress figures and its processes, judged by
:mod:`r1sup.core.liveness`, until a failure, a reload that changes the flags or the memory other processes
held being back: a :class:`ServeEnd`) and :class:`Draining` (the requests in flight finish before a stop
r1sup chose). What they need of the daemon is :class:`ServingHost`; the decisions stay the daemon's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from r1sup.adapters import health, watch
from r1sup.core import events as B  # the bus's events (r1sup.core.events; B.X reads: the event X)
from r1sup.core import failure as F
from r1sup.core import liveness
from r1sup.core.config import Config
from r1sup.core.events import (
    CheckDone,
    ChildEOF,
    ChildOutput,
    ReloadRequested,
    Signalled,
)
from r1sup.core.failure import Failure
from r1sup.supervision.launch import Flushing, Launch, LaunchHost
from r1sup.supervision.loop import Done, Phase, Stop
from r1sup.supervision.runner import EXIT_DRAIN_S
from r1sup.supervision.world import World

# A /metrics read not back after this many times its own timeout (daemon.health_timeout_s, which bounds
# the whole read) is recorded as unanswered: its thread starved, it is no sample, and the liveness
# judgement takes /metrics as unknown (vLLM's stats lines decide) until a read answers.
METRICS_OVERDUE = 2.0


@dataclass
class ServeEnd:
    """Why serving ended: a failure, a reload with changed flags, or the memory other processes held
    is back (a planned re-tune to the best profile)."""

    failure: Failure | None
    served_s: float
    reload: Config | None = None
    back_to_best: bool = False


def check(read: Callable[[], Any]) -> Callable[[], tuple[bool, str, Any]]:
    """A read as a runner check: the observation it returns travels as the payload."""

    def run() -> tuple[bool, str, Any]:
        obs = read()
        return bool(getattr(obs, "ok", True)), getattr(obs, "error", "") or getattr(obs, "detail", ""), obs

    return run


def device_check(probe: Callable[[], Any]) -> Callable[[], tuple[bool, str, Any]]:
    """The device probe (NVML) as a check: its facts, or (not ok) what made it fail."""

    def run() -> tuple[bool, str, Any]:
        try:
            return True, "", probe()
        except Exception as exc:  # noqa: BLE001 - a probe that fails only delays the return
            return False, f"{type(exc).__name__}: {exc}", None

    return run


class ServingRunner(LaunchHost, Protocol):
    """What the serving and draining phases use of the runner: a launch's host, and the world (the
    process watch, ``/metrics``, the device)."""

    world: World


class ServingHost(Protocol):
    """What :class:`Serving` and :class:`Draining` need of the daemon that owns them: its config, clock and
    bus, and the decisions that are the daemon's (a reload, a failure's record, a verdict's log, the
    watchdog, whether the memory other processes held is back)."""

    config: Config
    heartbeat: float
    clock: Callable[[], float]

    @property
    def runner(self) -> ServingRunner: ...

    @property
    def api_key(self) -> str | None: ...

    def publish(self, event: Any) -> None: ...

    def set_status(self, text: str) -> None: ...

    def load_new_config(self) -> Config | None: ...

    def serve_failure(self, launch: Launch, start: float, failure: Failure) -> ServeEnd: ...

    def hung_failure(self, launch: Launch, verdict: liveness.Verdict) -> Failure: ...

    def log_verdict(
        self, launch: Launch, verdict: liveness.Verdict, last: liveness.Verdict | None, sampled: bool
    ) -> liveness.Verdict: ...

    def watchdog(self, now: float) -> None: ...

    def memory_check_due(self, now: float) -> bool: ...

    def memory_back(self, launch: Launch, device: Any, error: str = "") -> bool: ...


class Serving(Phase):
    """The engine serves: ``/health`` every ``daemon.health_interval_s``, vLLM's progress figures every
    ``daemon.liveness_interval_s``, its processes; :mod:`r1sup.core.liveness` decides from them. Ends (a
    :class:`ServeEnd`) in a failure, a reload that changes the flags, or the memory being back for a
    degraded profile. Its own tick: the watchdog is fed only while the engine is healthy."""

    ticks = False
    reloads = True

    def __init__(self, daemon: ServingHost, launch: Launch) -> None:
        self.d = daemon
        self.launch = launch
        d = daemon.config.daemon
        self.cfg = d
        self.start = start = daemon.clock()
        ep = health.Endpoint(daemon.config.server.host, daemon.config.server.port, daemon.api_key)
        self.ep = ep
        self.policy = liveness.Policy.from_config(d)
        self.track = liveness.start(start)
        world = daemon.runner.world
        self.procs = world.process_watch(launch.engine.pid) if launch.engine.pid else None
        self.read = functools.partial(world.read_metrics, ep, d.health_timeout_s)
        # the completion may wait as long as a stall is tolerated: its answer, however late, is progress
        name, timeout = daemon.config.served_name, d.progress_timeout_s
        self.probe = check(lambda: watch.send_probe(ep, name, timeout))
        self.last: liveness.Verdict | None = None
        self.next_health = start + d.health_interval_s
        self.next_sample = start  # the first figures at once: the baseline progress is measured against
        self.next_record = start
        self.busy: set[str] = set()  # checks in flight
        self.healthy = True
        # the /metrics read in flight (one at most): asked then, and whether it was recorded as overdue
        self.metrics_asked: float | None = None
        self.metrics_overdue = False

    def on(self, event: Any, now: float) -> Any:
        daemon, launch, d, runner = self.d, self.launch, self.cfg, self.d.runner
        daemon.heartbeat = now
        if isinstance(event, ReloadRequested):
            new = daemon.load_new_config()
            return Done(ServeEnd(None, now - self.start, reload=new)) if new is not None else None
        sampled = False
        memory_back = False
        track = self.track
        if isinstance(event, CheckDone) and event.launch == launch.number:
            self.busy.discard(event.kind)
            sampled = event.kind == "metrics"
            if sampled:
                self.metrics_asked = None
            if event.kind == "devices":  # serving a degraded profile: what the device has free now
                memory_back = self.healthy and daemon.memory_back(launch, event.payload, event.detail)
            elif event.kind == "health":
                self.healthy = event.ok
                track = liveness.observe(track, liveness.HealthResult(now, event.ok, event.detail))
                if event.ok:
                    daemon.publish(B.HealthPassed())
            elif isinstance(event.payload, (liveness.MetricsSample, liveness.ProbeResult)):
                track = liveness.observe(track, event.payload)
            elif event.kind == "metrics":  # the read itself raised: no figures this time
                track = liveness.observe(track, liveness.MetricsSample(now, None, event.detail))
            elif event.kind == "liveness":
                track = liveness.observe(track, liveness.ProbeResult(now, False, detail=event.detail))
        elif isinstance(event, (ChildOutput, ChildEOF)):
            runner.handle_output(launch, event)
            stats = liveness.parse_stats_line(event.line) if isinstance(event, ChildOutput) else None
            if stats is not None:
                track = liveness.observe(track, liveness.StatsSeen(now, stats))
        overdue = METRICS_OVERDUE * d.health_timeout_s
        if (
            self.metrics_asked is not None
            and not self.metrics_overdue
            and now - self.metrics_asked >= overdue
        ):
            # the read bounds itself (its timeout); its thread not coming back is no sample either: unknown
            self.metrics_overdue = sampled = True
            error = f"/metrics unanswered after {now - self.metrics_asked:.0f}s (the read is still out)"
            track = liveness.observe(track, liveness.MetricsSample(now, None, error))
        self.track = track
        if launch.engine.poll() is not None:
            ended = runner.exit_failure(launch, now, F.PHASE_SERVING)
            if ended is not None:
                return Done(daemon.serve_failure(launch, self.start, ended))
            return None
        runner.record_descendants(launch, now)
        if now >= self.next_record:
            gone = self.procs.check() if self.procs else None
            if gone:
                self.track = liveness.observe(self.track, liveness.CoreGone(now, gone))
            self.next_record = now + 1.0
        if "health" not in self.busy and now >= self.next_health:
            self.busy.add("health")
            self.next_health = now + d.health_interval_s
            ep, timeout = self.ep, d.health_timeout_s
            runner.run_check("health", launch, lambda: (*health.check_health(ep, timeout), None))
        if "metrics" not in self.busy and now >= self.next_sample:
            self.busy.add("metrics")
            due, self.next_sample = self.next_sample, self.next_sample + d.liveness_interval_s
            if self.next_sample <= now:  # fell behind (a slow read): a new grid from now
                due, self.next_sample = now, now + d.liveness_interval_s
            self.metrics_asked, self.metrics_overdue = now, False
            runner.run_check("metrics", launch, check(functools.partial(self.read, at=due)))
        verdict = liveness.decide(self.track, now, self.policy)
        self.last = daemon.log_verdict(launch, verdict, self.last, sampled)
        if verdict.hung:
            start = self.start

            def hung_end() -> Done:
                return Done(daemon.serve_failure(launch, start, daemon.hung_failure(launch, verdict)))

            if verdict.evidence not in liveness.DEAD_EVIDENCE:
                return hung_end()
            # the traceback that explains it may still be in the pipe; the process may linger (a
            # teardown stuck on the device), so a quiet pipe ends the wait, not the end of the output
            return Flushing(runner, launch, now + EXIT_DRAIN_S, until_quiet=True, then=hung_end)
        if verdict.probe and "liveness" not in self.busy:
            self.busy.add("liveness")
            self.track = liveness.observe(self.track, liveness.ProbeSent(now))
            runner.run_check("liveness", launch, self.probe)
        if self.healthy or verdict.evidence == liveness.EVIDENCE_PROGRESS:
            daemon.watchdog(now)
        if memory_back and self.healthy:
            return Done(ServeEnd(None, now - self.start, back_to_best=True))
        if self.healthy and "devices" not in self.busy and daemon.memory_check_due(now):
            self.busy.add("devices")
            runner.run_check("devices", launch, device_check(runner.world.device))
        return None


class FirstRead(Phase):
    """The drain's first read of ``/metrics`` (its ``drain`` check): until it answers (its figures, None
    when it had none), vLLM's output taken meanwhile. A stop signal waits for the drain, which decides."""

    def __init__(self, runner: ServingRunner, launch: Launch) -> None:
        self.runner = runner
        self.launch = launch

    def on_signal(self, signal: Signalled, now: float) -> Any:
        return None

    def on(self, event: Any, now: float) -> Any:
        if isinstance(event, CheckDone) and event.launch == self.launch.number and event.kind == "drain":
            return Done(getattr(event.payload, "figures", None))
        if event is not None:
            self.runner.handle_output(self.launch, event)
        return None


class Draining(Phase):
    """A stop r1sup chose waits for the requests in flight (see :meth:`Daemon._drain`), in two steps.

    Open: vLLM takes requests; the step ends once ``QUIET_READS`` reads of ``/metrics`` in a row, begun
    after ``quiet_at``, show none pending (a request still in vLLM's HTTP layer is not in its figures
    yet). Closing (a vLLM that drains itself): SIGTERM to its API server, which
    finishes what it holds and exits. An older vLLM ends at the open step. Either ends at ``deadline``;
    a vLLM still open at the midpoint between ``quiet_at`` and ``deadline`` is closed then (the rest is
    for the requests in flight), and one closed at or after the deadline still gets ``CLOSE_S``. For a
    shutdown a second stop signal ends it; during a reload's drain a stop signal hands over to the
    shutdown."""

    READ_EVERY_S = 0.5
    QUIET_READS = 2
    CLOSE_S = 5.0  # the least a vLLM asked to close gets to finish what slipped in since the last read

    def __init__(
        self,
        daemon: ServingHost,
        launch: Launch,
        ep: health.Endpoint,
        first: liveness.Figures | None,
        quiet_at: float,
        deadline: float,
        *,
        itself: bool,
        for_shutdown: bool,
    ) -> None:
        self.d = daemon
        self.launch = launch
        self.ep = ep
        self.figures: liveness.Figures | None = first
        self.quiet_at = quiet_at
        self.close_at = quiet_at + (deadline - quiet_at) / 2 if itself else deadline
        self.deadline = deadline
        self.itself = itself
        self.for_shutdown = for_shutdown
        self.next_read = daemon.clock()
        self.read_since: float | None = None  # when the read in progress began
        self.quiet_reads = 0  # reads in a row begun after quiet_at that showed none pending
        self.closing = False
        self.complete = False

    def on_signal(self, signal: Signalled, now: float) -> Any:
        if not self.for_shutdown:
            return Stop(signal.signum)
        return Done() if signal.count >= 2 else None  # a second SIGTERM forces the stop

    def due(self, now: float) -> float:
        if self.closing:
            return self.deadline - now
        return max(
            0.0, min(self.next_read if self.read_since is None else self.deadline, self.close_at) - now
        )

    def _close(self, now: float) -> None:
        """vLLM's own drain: it stops taking requests and finishes the ones it holds, then exits."""
        self.closing = True
        self.deadline = max(self.deadline, now + self.CLOSE_S)
        self.launch.stopping = True  # what vLLM prints from now on is its teardown (relayed as such)
        self.launch.engine.terminate_leader()

    def on(self, event: Any, now: float) -> Any:
        launch, runner = self.launch, self.d.runner
        if isinstance(event, CheckDone) and event.launch == launch.number and event.kind == "drain":
            began, self.read_since = self.read_since, None
            read = event.payload
            if read is not None and read.figures is not None:
                self.figures = read.figures
                self.d.set_status(liveness.drain_status(read.figures))
                quiet = read.figures.pending == 0 and began is not None and began >= self.quiet_at
                self.quiet_reads = self.quiet_reads + 1 if quiet else 0
                if self.quiet_reads >= self.QUIET_READS and not self.closing:
                    if not self.itself:
                        self.complete = True
                        return Done()
                    self._close(now)
        elif event is not None:
            runner.handle_output(launch, event)
            if self.closing and isinstance(event, B.ChildOutput) and liveness.drained_line(event.line):
                # vLLM says its drain is over (nothing in flight); what is left is its teardown, which on
                # the CPU backend waits 30 s for a worker that ignores its SIGTERM: r1sup's stop does that
                self.complete = True
                return Done()
        if not launch.engine.alive():
            # closing: vLLM finished its drain and exited (else it crashed)
            self.complete = self.closing
            return Done()
        if now >= self.deadline:
            if self.itself and not self.closing:
                self._close(now)
                return None
            return Done()
        if self.closing:
            return None
        if now >= self.close_at and self.itself:
            self._close(now)
            return None
        if self.read_since is None and now >= self.next_read:
            self.read_since = now
            self.next_read = now + self.READ_EVERY_S
            ep, read = self.ep, runner.world.read_metrics
            runner.run_check("drain", launch, lambda: (True, "", read(ep, 2.0)))
        return None
