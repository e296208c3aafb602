"""``r1sup run``: bring vLLM up (saved profile or a search), then keep it serving.

One loop, one queue of events. Signals only append to deques: SIGTERM/SIGINT stop the child group
and exit 0 (a second one forces), SIGHUP reloads the config. While serving: ``/health`` every
``daemon.health_interval_s``, vLLM's progress figures (``/metrics``, its stats line) every
``daemon.liveness_interval_s`` and the engine's processes; :mod:`r1sup.core.liveness` decides from them
whether the engine is alive, idle or hung (a one-token completion breaks the tie when it is idle).
A memory failure takes the search's next flags and saves the new profile; a transient one restarts with
capped exponential backoff with jitter (tenacity), the budget reset after a stable period; beyond it
r1sup exits 5 for systemd's limits. A stop r1sup chooses (SIGTERM, a reload that changes flags)
first lets the requests in flight finish (state ``draining``).

Where the daemon is, is its :class:`State`. What happens is named as a :class:`Cause`; the state table
(:mod:`r1sup.supervision.states`) says which state follows, and each state the daemon waits in between two
facts has its step (:meth:`Daemon._run`). The serving phases it waits in are :mod:`r1sup.supervision.serving`.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Generator
from dataclasses import replace
from typing import Any

import tenacity

from r1sup import __version__
from r1sup.adapters import health, logs
from r1sup.adapters.notify import Notifier
from r1sup.adapters.statefiles import utc_now_iso
from r1sup.core import events as B  # the bus's events (r1sup.core.events; B.X reads: the event X)
from r1sup.core import failure as F
from r1sup.core import liveness, policy
from r1sup.core.capacity import Capacity
from r1sup.core.config import Config
from r1sup.core.errors import (
    EXIT_FATAL_FAILURE,
    EXIT_NO_WORKING_CONFIG,
    EXIT_OK,
    EXIT_RESTART_BUDGET,
    InternalError,
    PreflightError,
    R1supError,
)
from r1sup.core.events import (
    AttemptFailed,
    Launching,
    Probing,
    Retrying,
    SearchEvent,
    SearchGaveUp,
    SearchStepped,
)
from r1sup.core.failure import Failure
from r1sup.core.figures import Figures
from r1sup.core.flags import EngineFlags
from r1sup.core.probing import ProbeResult
from r1sup.core.profile_fit import Degraded
from r1sup.state import fleet
from r1sup.supervision.bus import Bus
from r1sup.supervision.footing import footing
from r1sup.supervision.loop import Phase, StopRequested
from r1sup.supervision.runner import Launch
from r1sup.supervision.serving import Draining, FirstRead, ServeEnd, Serving
from r1sup.supervision.session import Session
from r1sup.supervision.states import EXTENDING, TERMINAL, TRANSITIONS, Cause, IllegalTransition, State
from r1sup.supervision.subscribers import LogSink, MetricsSink, StatusFile, SystemdSink
from r1sup.supervision.tuner import (
    Tuner,
    TuneResult,
    launch_calibration,
    new_search,
)


class Daemon:
    def __init__(self, session: Session, notifier: Notifier | None = None) -> None:
        self.s = session
        self.config = session.config
        self.log = session.log
        self.events = session.events
        self.runner = session.runner
        self.notifier = notifier or Notifier()
        self.state = State.PLANNING
        self.status_text = ""  # the last STATUS= line, also in status.json
        self.since = utc_now_iso(zulu=False)
        self.flags: EngineFlags | None = None
        self.capacity: Capacity | None = None  # what the serving flags' probe proved
        # the saved profile's flags and the service level `tune` proved for them ([slo]), or None
        self.saved_slo: tuple[dict[str, Any], Any] | None = None
        self.profile_source: str | None = None
        self.last_failure: Failure | None = None
        self.history: Any = None  # the search (r1sup.core.search.Search) and its evidence, across restarts
        # serving a profile degraded by other processes' memory: the best profile's key, why, and whether
        # a re-tune back to it is planned (shown in status.json)
        self.degraded: Degraded | None = None
        self.next_memory_check = 0.0
        self.know: Any = None
        self.fingerprint: dict[str, Any] | None = None
        # the "does not fit" verdict: GPU memory free at the bring-up's start, and whether the verdict
        # came from the state directory (r1sup.state.nofit) instead of a search
        self._free_gib_at_start: float | None = None
        self._no_fit_remembered = False
        self._restarts = 0
        # what the state's step takes from the one before: the launch served, how serving ended, the
        # restart's wait, and whether a stop signal began the shutdown
        self._live: Launch | None = None
        self._ended: ServeEnd | None = None
        self._backoff_s = 0.0
        # what the next restart relaunches (None: the flags that served) and the failure it follows
        self._retry_flags: EngineFlags | None = None
        self._retry_failure: Failure | None = None
        self._stop_signalled = False
        self.started_at = utc_now_iso(zulu=False)
        self.record: Any = None  # r1sup.state.runrecord.RunLog of this run, for `r1sup report`
        self.clock: Callable[[], float] = lambda: self.runner.clock()
        self.heartbeat = self.clock()  # the loop's last turn, for /livez
        self.shared = fleet.Consulted()  # the fleet's store: a lease held while this replica tunes
        self.runner.tick = self._on_tick
        # each fact is published once; the subscribers write the sinks (metrics first, the log line
        # last: when it appears, status.json, /metrics and systemd already say so)
        self.bus = Bus(self.log)
        self.publish = self.bus.publish
        self.metrics_sink: MetricsSink | None = None
        if self.config.daemon.metrics_port:
            from r1sup.adapters.metrics import Metrics

            self.metrics_sink = MetricsSink(Metrics(), figures=self._served_figures)
            self.bus.subscribe(self.metrics_sink)
        self.systemd = SystemdSink(self.notifier)
        self.status_file = StatusFile(self, self.log)
        self.bus.subscribe(self.systemd)
        self.bus.subscribe(self.status_file)
        self.bus.subscribe(LogSink(self.log))

    # --- state and status ----------------------------------------------------------------------

    def advance(self, cause: Cause, status: str | None = None) -> None:
        """``cause`` happened: the state table says which state follows (a pair it lacks raises)."""
        new = TRANSITIONS.get((self.state, cause))
        if new is None:
            raise IllegalTransition(f"{cause.value} in state {self.state.value}")
        old, self.state = self.state, new
        if old is not new:
            self.since = utc_now_iso(zulu=False)
        if status:
            self.status_text = status
        self.publish(B.StateChanged(old.value, new.value, status))

    def set_status(self, text: str) -> None:
        """A new STATUS= line within the same state (e.g. the drain's figures)."""
        if text != self.status_text:
            self.status_text = text
            self.publish(B.StatusText(text))

    @property
    def api_key(self) -> str | None:
        return self.s.api_key

    @property
    def state_dir(self) -> str:
        return self.config.state.dir

    def status_fields(self, recent: list[dict[str, Any]]) -> dict[str, Any]:
        """status.json's document now, with the recent events the status file kept."""
        from r1sup.adapters import statefiles

        current = self.runner.current
        return {
            "schema_version": statefiles.SCHEMA_VERSION,
            "state": self.state.value,
            "status": self.status_text,
            "pid": os.getpid(),
            "child_pid": current.engine.pid if current and current.engine.alive() else None,
            "launches": self.runner.launches,
            "profile_source": self.profile_source,
            "degraded": self.degraded.to_dict() if self.degraded is not None else None,
            "flags": self.flags.to_dict() if self.flags else None,
            # what the serving flags' probe proved; none while nothing serves (launching, backoff, stopped)
            "capacity": (
                self.capacity.to_dict()
                if self.capacity is not None and self.state in (State.SERVING, State.DRAINING)
                else None
            ),
            "since": self.since,
            "updated_at": utc_now_iso(zulu=False),
            "last_failure": self.last_failure.to_dict() if self.last_failure else None,
            "config": os.path.abspath(self.config.source) if self.config.source else None,
            "served_model": self.config.served_name,
            "port": self.config.server.port,
            "url": self.record.data["url"] if self.record is not None else None,
            "started_at": self.started_at,
            "r1sup_version": __version__,
            "recent_events": recent,
            **self.runner.live_status(),
        }

    def watchdog(self, now: float) -> None:
        """The loop turned with the engine healthy: WATCHDOG=1 when due (the systemd sink keeps the pace,
        half systemd's interval); callers publish it only while healthy."""
        self.publish(B.Heartbeat(now))

    def _on_tick(self) -> None:
        """Each turn of the loop while a launch, a probe or a wait runs: the loop is alive and vLLM is
        making progress (a stall ends the launch), so the watchdog is fed and the start timeout extended."""
        now = self.clock()
        self.heartbeat = now
        self.publish(B.Heartbeat(now, starting=self.state in EXTENDING))
        self._show_progress(now)

    def _show_progress(self, now: float) -> None:
        """The loading phase, vLLM's percent, elapsed time and ETA (STATUS= and status.json pace it)."""
        shown = self.runner.progress_text() if self.state in (State.LAUNCHING, State.PROBING) else None
        if shown is not None:
            self.publish(B.LoadingProgress(now, *shown))

    def on_search(self, event: SearchEvent) -> None:
        """What the search reports: the daemon's state follows it, then it goes on the bus."""
        if isinstance(event, Launching):
            self.flags = event.flags
            self.capacity = None  # until this launch's probe proves what it serves
            self.advance(Cause.LAUNCH_STARTED, f"attempt {event.attempt}: launching vLLM")
        elif isinstance(event, Probing):
            self.advance(Cause.PROBE_STARTED, f"attempt {event.attempt}: load probe")
        elif isinstance(event, AttemptFailed):
            self.last_failure = event.failure
        elif isinstance(event, Retrying):
            self.advance(Cause.RETRYING, event.status)
        elif isinstance(event, SearchGaveUp) and event.failure_class in policy.PROBE_TRANSIENT:
            return  # not the daemon's end: it restarts within its budget (restart_backoff says when)
        self.publish(event)

    # --- main ----------------------------------------------------------------------------------

    def run(self) -> int:
        """The daemon's whole life in one run of the loop (:meth:`_lifetime` is its script)."""
        self.events.install_signal_handlers()
        try:
            code: int = self.runner.loop.run(self._lifetime())
            return code
        finally:
            self.shared.release()
            self.events.restore_signal_handlers()
            if self.metrics_sink is not None:
                self.metrics_sink.close()

    def _lifetime(self) -> Generator[Phase, Any, int]:
        """Bring-up, serving, recovering and the stop: each wait is a phase this script yields."""
        try:
            import signal

            self.events.install_signal_handlers((signal.SIGHUP,))
            self._start_metrics()
            self._clean_state_dir()
            self.advance(Cause.PLANNED, "planning")
            return (yield from self._run())
        except InternalError as exc:
            yield from self._internal(exc)
            raise
        except R1supError as exc:  # e.g. the preflight: status says failed, the CLI prints the line
            yield from self._fail(exc.exit_code, str(exc))
            raise
        except Exception as exc:  # r1sup's own failure: stop vLLM cleanly, say failed, exit 1
            internal = InternalError.from_exception(exc)
            yield from self._internal(internal)
            raise internal from None

    def _clean_state_dir(self) -> None:
        """Temp files of a write that crashed (status.json of a killed daemon) are removed."""
        from r1sup.adapters import statefiles

        try:
            directory = statefiles.ensure_state_dir(self.config.state.dir)
        except R1supError as exc:
            self.publish(B.StateDirUnusable(str(exc)))
            return
        statefiles.sweep_stale_temp_files(directory)

    def _start_metrics(self) -> None:
        d = self.config.daemon
        if self.metrics_sink is None:
            return
        try:
            self.metrics_sink.serve(d.metrics_host, d.metrics_port, view=self.endpoint_view, mask=logs.mask)
            self.publish(B.MetricsListening(d.metrics_host, d.metrics_port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                self.publish(B.MetricsUnavailable(d.metrics_host, d.metrics_port, str(exc)))
                return
            # another process answers on this port (another r1sup with the same daemon.metrics_port):
            # its /readyz would speak for this daemon, so this one does not start, as for server.port
            holder = self.runner.world.port_holder(d.metrics_host, d.metrics_port, "")
            who = "another process"
            if holder is not None:
                who = f"pid {holder.pid} ({holder.name})" if holder.pid else holder.name
                who += f": {holder.cmdline[:200]}" if holder.cmdline else ""
            raise PreflightError(
                "daemon.metrics_port", f"port {d.metrics_port} on {d.metrics_host} is held by {who}"
            ) from None

    def _served_figures(self) -> Figures:
        current = self.runner.current
        return current.figures if current is not None else Figures()

    def endpoint_view(self) -> Any:
        """The daemon as r1sup's HTTP endpoint sees it (read from the endpoint's thread)."""
        from r1sup.adapters.endpoint import View, loop_limit_s

        server = self.config.server
        return View(
            state=self.state.value,
            loop_age_s=self.clock() - self.heartbeat,
            loop_limit_s=loop_limit_s(server.stop_timeout_s, server.memory_release_timeout_s),
            status=self.status_file.doc,
        )

    def _run(self) -> Generator[Phase, Any, int]:
        """Where the daemon is, is its state: each turn runs the step of that state, which waits in its
        phases and names what happened (:meth:`advance`), and the state table says where the daemon is
        next. A step returns the exit code once the daemon is done. The first stop signal a step's phase
        does not take begins the shutdown from the state it came in; the shutdown's own phases take the
        signals that follow (a second one forces the stop)."""
        steps: dict[State, Callable[[], Generator[Phase, Any, int | None]]] = {
            State.PLANNING: self._plan,
            State.SERVING: self._serve,
            State.BACKOFF: self._wait_to_restart,
            State.DRAINING: self._draining,
            State.STOPPING: self._stopping,
        }
        while True:
            try:
                code = yield from steps[self.state]()
            except StopRequested as stop:
                if self._stop_signalled:
                    raise
                self._stop_signal(stop.signum)
                continue
            if code is not None:
                return code

    def _plan(self) -> Generator[Phase, Any, int | None]:
        """Planning: a saved profile or a search brings vLLM up (serving), or the daemon gives up."""
        result = yield from self._bring_up()
        return (yield from self._take(result))

    def _take(self, result: TuneResult) -> Generator[Phase, Any, int | None]:
        """A bring-up's outcome: its launch is the one served, or the daemon fails (the exit code)."""
        if result.ok and result.live is not None:
            self._live = result.live
            return None
        failure = result.failure
        if failure is not None and failure.cls in policy.PROBE_TRANSIENT and self.flags is not None:
            # the probe's path to vLLM failed, not vLLM (its /health answered): the same flags again
            # after a backoff, within the restart budget, never the daemon's end
            return (yield from self._restart_later(self.flags, failure))
        reason = result.reason or "no working configuration"
        if result.exit_code == EXIT_NO_WORKING_CONFIG and not self._no_fit_remembered:
            self._remember_no_fit(reason)
        return (yield from self._fail(result.exit_code, reason))

    def _fail(self, code: int, reason: str) -> Generator[Phase, Any, int]:
        from r1sup.adapters import termination

        self.publish(B.DaemonFailed(code, reason))
        termination.write(termination.path_from(self.config.daemon.termination_log), code, reason)
        yield from self.runner.stop_current(reason="failed")
        if self.state not in TERMINAL:
            self.advance(Cause.GAVE_UP, f"failed: {reason[:200]}")
        if self.record is not None:
            self.record.stopped(self.state.value)
        return code

    def _internal(self, fault: InternalError) -> Generator[Phase, Any, None]:
        """r1sup's own failure: vLLM stopped cleanly, status failed with ``internal_error``."""
        self.publish(B.InternalFault(fault.where, fault.error, fault.trace or ""))
        self.last_failure = Failure(F.INTERNAL_ERROR, evidence=fault.error, detail=fault.where)
        yield from self.runner.stop_current(reason="internal error")
        yield from self._fail(fault.exit_code, str(fault))

    def _stop_signal(self, signum: int) -> None:
        """SIGTERM/SIGINT: where vLLM serves, the requests in flight finish first (within the stop grace
        period, so that a systemctl restart does not cut answers in half); then vLLM is stopped."""
        self.publish(B.StopSignalled(signum))
        self._stop_signalled = True
        current = self.runner.current
        drains = (
            self.state in (State.SERVING, State.DRAINING)
            and current is not None
            and self._drains(current, self._drain_plan()[0])
        )
        if not drains:
            self.advance(Cause.STOP_REQUESTED, "stopping vLLM")
        elif self.state is State.SERVING:  # a drain under way (a reload's) turns into the shutdown's
            self.advance(Cause.DRAIN_REQUESTED, liveness.drain_status(None))

    def _stopping(self) -> Generator[Phase, Any, int]:
        """Stopping (the shutdown): vLLM stopped, then r1sup exits 0."""
        self.publish(B.Stopping())
        yield from self.runner.stop_current(reason="shutdown")
        self.advance(Cause.ENGINE_STOPPED, "stopped")
        if self.record is not None:
            self.record.stopped(self.state.value)
        return EXIT_OK

    # --- bringing up ---------------------------------------------------------------------------

    def _tuner(self) -> Tuner:
        return Tuner(
            self.config, self.runner, self.log, know=self.know, publish=self.on_search, record=self.record
        )

    def _bring_up(self, start: EngineFlags | None = None) -> Generator[Phase, Any, TuneResult]:
        from r1sup.state import runrecord

        if self.know is None:
            checked = yield from self.s.preflight()  # once per process; again after a reload that changed it
            self.know = self.runner.world.knowledge(self.config, self.log, engine=checked.engine)
        else:
            # what is free now (another tenant may have come or gone)
            yield from self._tuner().refresh_device()
        if self.record is None:
            self.record = runrecord.RunLog(self.config.state.dir, "run", self.config, self.know.device)
        base = footing(self.config, self.know)
        self.runner.expected_phases = base.expected_phases
        self.fingerprint = base.fingerprint
        d = self.config.daemon
        self.runner.managed_args = liveness.drain_args(
            self.know.vllm_version,  # the fingerprint's, adopted by footing() when nothing better knew it
            self.config.server.extra_args,
            max(d.drain_timeout_s, self.config.server.stop_timeout_s) if d.drain_timeout_s > 0 else 0,
        )
        key, store = base.key, base.store
        from r1sup.core import search

        at_start = search.conditions(self.know.device)
        self._free_gib_at_start = at_start.free_gib if at_start is not None else None
        saved = store.load(key) if start is None else None
        why = ""
        shared = (
            (yield from self._consult_fleet(key)) if saved is None and start is None else fleet.Consulted()
        )
        saved = saved or shared.profile
        self.runner.prober.prove_with(None)
        if start is None:  # the flags of a saved profile, unless a reload named the flags
            saved = self._launchable(saved, store, key)
        if saved is not None and self.degraded is not None:
            start = EngineFlags.from_dict(saved.flags)
            self.runner.prober.prove_with(start, ProbeResult.from_dict(saved.probe), saved.observations)
            why = f"degraded profile {saved.key}: {self.degraded.reason}"
            self.publish(B.ProfileFound(saved.key, saved.flags, degraded=True))
        elif saved is not None:
            self.saved_slo = (saved.flags, saved.slo_result)  # exported while these flags serve
            start = EngineFlags.from_dict(saved.flags)
            self.runner.prober.prove_with(start, ProbeResult.from_dict(saved.probe), saved.observations)
            where = "the fleet's profile" if shared.profile is not None else "saved profile"
            why = f"{where} {key} (tuned {saved.updated_at})"
            self.publish(B.ProfileFound(key, saved.flags, updated_at=saved.updated_at))
        measured = None
        if saved is None and start is None:
            self.publish(B.ProfileMissing(key))
            remembered = self._remembered_no_fit(key)
            if remembered is not None:
                shared.release()
                return remembered
            measured = base.calibration(self.publish)
        tuner = self._tuner()
        result = yield from tuner.run(
            start, keep_running=True, history=self.history, calibration=measured, why=why
        )
        self.history = result.history or self.history
        if result.ok:
            persisted = saved is not None and result.launches == 1
            self.profile_source = ("shared" if shared.profile else "persisted") if persisted else "tuned"
            if not persisted or shared.profile is not None:  # the fleet's copy: kept once it passed here
                result.profile_path = self._keep(result, key)
            self._served(result)
            self._forget_no_fit()
        shared.release()  # after the publish: the replicas waiting on this key find the profile
        return result

    def _remembered_no_fit(self, key: str) -> TuneResult | None:
        """The "does not fit" verdict a previous run left for this fingerprint, when it still holds (no
        more memory free now): the same exit 3 at once, without a second search."""
        from r1sup.state import nofit

        verdict = nofit.load(self.config.state.dir)
        if verdict is None or not nofit.still_holds(verdict, key, self._free_gib_at_start):
            return None
        self._no_fit_remembered = True
        self.publish(B.NoFitRemembered(key, verdict.reason, verdict.written_at))
        return TuneResult(ok=False, exit_code=EXIT_NO_WORKING_CONFIG, reason=verdict.reason)

    def _remember_no_fit(self, reason: str) -> None:
        from r1sup.state import nofit, profiles

        if self.fingerprint is None:
            return
        key = profiles.fingerprint_key(self.fingerprint)
        try:
            nofit.remember(self.config.state.dir, key, reason, self._free_gib_at_start)
        except R1supError as exc:  # the verdict stands; a restart searches again
            self.publish(B.StateDirUnusable(str(exc)))
            return
        self.publish(B.NoFitRecorded(key, self._free_gib_at_start))

    def _forget_no_fit(self) -> None:
        from r1sup.state import nofit

        try:
            nofit.forget(self.config.state.dir)
        except OSError as exc:
            self.publish(B.StateDirUnusable(f"cannot remove {nofit.path_in(self.config.state.dir)}: {exc}"))

    def _launchable(self, saved: Any, store: Any, key: str) -> Any:
        """The profile to launch, picked as ``plan --config`` picks it: the saved (or the fleet's) profile
        ``saved`` when it fits what is free now; else the degraded one kept beside it when
        :func:`r1sup.core.profile_fit.spare_serves` says so (self.degraded says why; the daemon watches
        for the memory to come back); else None (the search sizes a configuration for what is free)."""
        from r1sup.core import profile_fit, search
        from r1sup.state import profiles

        self.degraded = None
        check = new_search(self.config, self.know)
        why = ""
        if saved is not None:
            if profile_fit.fits_now(check, EngineFlags.from_dict(saved.flags)):
                return saved
            now = search.conditions(self.know.device)
            self.publish(B.ProfileDoesNotFit(key, saved.flags, now))
            free = now.free_gib if now is not None else None
            why = f"the best profile {key} does not fit what is free now ({free} GiB)"
        spare = store.load(profiles.fingerprint_key(profiles.degraded_fingerprint(self.fingerprint or {})))
        if spare is None or not profile_fit.spare_serves(
            check, EngineFlags.from_dict(spare.flags), saved is not None
        ):
            return None
        if saved is None:  # the degraded one a tune (or an earlier run) kept, while nothing better fits
            reason = spare.conditions.get("reason") if isinstance(spare.conditions, dict) else None
            why = f"no best profile {key} yet; the degraded one kept beside it" + (
                f": {reason}" if reason else ""
            )
        self.degraded = Degraded(key, why, utc_now_iso(zulu=False))
        return spare

    def _keep(self, result: TuneResult, key: str) -> str | None:
        """Save a passed configuration (:func:`r1sup.supervision.bringup.keep`); one degraded by other
        processes' memory is served as such (kept beside the best, and the daemon watches for the memory
        to come back). The profile's path, None when saving failed."""
        from r1sup.supervision import bringup

        kept = bringup.keep(self.s, result, self.fingerprint or {}, self.know, key, tell=self.publish)
        self.degraded = Degraded(key, kept.degraded, utc_now_iso(zulu=False)) if kept.degraded else None
        return kept.path

    def memory_check_due(self, now: float) -> bool:
        """Serving a degraded profile: whether the device is to be looked at now (every
        ``daemon.memory_check_s``); the look is a check (:func:`r1sup.supervision.serving.device_check`),
        answered to :meth:`memory_back`."""
        if self.degraded is None or now < self.next_memory_check:
            return False
        self.next_memory_check = now + self.config.daemon.memory_check_s
        return True

    def memory_back(self, launch: Launch, device: Any, error: str = "") -> bool:
        """Serving a degraded profile: whether the best configuration fits once this engine is stopped
        (the other processes released their memory), by what the device check found (``device``; None:
        the probe failed with ``error``, which only delays the return)."""
        from r1sup.core import profile_fit
        from r1sup.state import profiles

        if device is None:
            self.publish(B.DeviceProbeFailed(error))
            return False
        if self.degraded is None:
            return False
        own = frozenset(launch.engine.all_pids())
        mine = sum(p.used_bytes for p in device.processes if p.pid in own)
        idle = profile_fit.idle_device(device, mine)
        idle = replace(idle, processes=tuple(p for p in device.processes if p.pid not in own))
        check = new_search(self.config, self.know)
        check.facts = replace(check.facts, device=idle)
        store = profiles.ProfileStore(self.config.state.dir)
        best = store.load(self.degraded.best_key)
        if best is not None:
            fits = profile_fit.fits_now(check, EngineFlags.from_dict(best.flags))
        else:  # no best profile yet: what the search would plan on the box as it is without this engine
            fits = self.flags is not None and profile_fit.better_than(check, self.flags) is not None
        if fits:
            self.degraded = replace(self.degraded, retune_planned=True)
            self.publish(B.RetunePlanned(self.degraded.best_key))
        return fits

    def _waiting(self, text: str) -> None:
        self.publish(B.ProfileStoreWaiting(text))

    def _consult_fleet(self, key: str) -> Generator[Phase, Any, fleet.Consulted]:
        """No profile here: ask the fleet's store (off the loop's thread), waiting while another
        replica tunes this key. The lease it may hand back is held until this bring-up ends (or the
        daemon does)."""
        if not self.config.state.profile_store:
            return fleet.Consulted()
        self.shared = yield from self.runner.consult_fleet(key, self.publish, status=self._waiting)
        if self.shared.profile is not None:  # saved here only once it passed its probe (_bring_up)
            self.publish(B.ProfileStoreHit(key))
        return self.shared

    def _served(self, result: TuneResult) -> None:
        from r1sup.supervision.bringup import result_capacity

        self.flags = result.flags
        self.capacity = result_capacity(self.config, result)
        ctx = result.flags.max_model_len if result.flags else None
        text = f"serving {self.config.served_name} on port {self.config.server.port}" + (
            f" (context {ctx})" if ctx else ""
        )
        self.advance(Cause.READY, text)
        slo = getattr(result, "slo", None)
        if slo is None and self.saved_slo is not None and result.flags is not None:
            flags, saved = self.saved_slo
            slo = saved if flags == result.flags.to_dict() else None  # proven for these flags only
        self.publish(B.Serving(result.flags, self.profile_source, result.probe, text, self.capacity, slo))

    # --- serving -------------------------------------------------------------------------------

    def log_verdict(
        self, launch: Launch, verdict: liveness.Verdict, last: liveness.Verdict | None, sampled: bool
    ) -> liveness.Verdict:
        """Each decision as a ``liveness`` event with the figures it rested on: at info (error when
        hung) when the verdict changes, at debug after each new sample of vLLM's figures."""
        changed = last is None or (verdict.state, verdict.evidence) != (last.state, last.evidence)
        if not (changed or sampled or verdict.probe):
            return verdict
        self.publish(B.LivenessJudged(launch.number, verdict, changed))
        return verdict

    def hung_failure(self, launch: Launch, verdict: liveness.Verdict) -> Failure:
        """The failure a hung verdict stands for; vLLM's own account first (an OOM traceback, ...: the
        serving phase has flushed the output that explains a dead engine)."""
        if verdict.evidence in liveness.DEAD_EVIDENCE:
            seen = launch.reader.verdict(exit_code=launch.engine.poll())
            if seen.cls != F.NONE:
                return seen
        cls = F.ENGINE_DEAD if verdict.evidence in liveness.DEAD_EVIDENCE else F.HANG
        numbers = F.Numbers.from_dict(
            {k: float(v) for k, v in verdict.figures.items() if isinstance(v, (int, float)) and v is not None}
        )
        return Failure(cls, F.PHASE_SERVING, evidence=verdict.reason, numbers=numbers, detail=verdict.reason)

    # --- draining ------------------------------------------------------------------------------

    def _drain(
        self,
        launch: Launch,
        budget_s: float,
        reason: str,
        *,
        for_shutdown: bool = False,
        unready_s: float = 0.0,
    ) -> Generator[Phase, Any, None]:
        """Let the requests in flight finish, up to ``budget_s``, before a stop r1sup chose.

        First out of the load balancer: the state is ``draining`` already (:meth:`_drains` said it
        would drain, before anything is read), so ``/readyz`` says 503, while
        vLLM still takes every request (one a load balancer sent before it saw the 503 is served, not
        refused). That lasts ``unready_s`` at least, then until ``/metrics`` shows none running or
        waiting. A vLLM launched with ``--shutdown-timeout`` (0.18 and later; r1sup adds it) then gets a
        SIGTERM to its API server alone: it finishes what slipped in since the last read, refuses new
        requests and exits; past half the budget with requests still pending it gets that SIGTERM
        anyway, so that the rest of the budget goes to the requests in flight, not to new ones. An
        older vLLM takes requests until the budget runs out. A second SIGTERM ends the wait at once;
        the caller then stops vLLM as usual (group SIGTERM, grace, SIGKILL).
        """
        unready_s = min(max(unready_s, 0.0), budget_s)
        t0 = self.clock()
        ep = health.Endpoint(self.config.server.host, self.config.server.port, self.s.api_key)
        read, timeout = self.runner.world.read_metrics, min(2.0, budget_s)
        self.runner.run_check("drain", launch, lambda: (True, "", read(ep, timeout)))
        first = yield FirstRead(self.runner, launch)
        if unready_s <= 0 and (first is None or first.pending == 0):
            self.publish(B.DrainSkipped(reason, first.to_dict() if first else None))
            return
        itself = liveness.drains_itself(launch.spec.argv)
        deadline = t0 + budget_s
        if first is not None:
            self.set_status(liveness.drain_status(first))
        self.publish(B.DrainStarted(reason, budget_s, itself, first.to_dict() if first else {}, unready_s))
        phase = Draining(
            self, launch, ep, first, t0 + unready_s, deadline, itself=itself, for_shutdown=for_shutdown
        )
        yield phase
        figures = phase.figures.to_dict() if phase.figures else {}
        self.publish(B.DrainFinished(reason, self.clock() - t0, phase.complete, figures))

    def _drains(self, launch: Launch, budget_s: float) -> bool:
        """Whether a stop r1sup chose drains first: a budget for it, and a vLLM alive to finish requests."""
        return budget_s > 0 and launch.engine.alive()

    def _drain_plan(self) -> tuple[float, str, float]:
        """The drain before the stop under way: its budget, its reason, how long it is unready at least.
        The shutdown's stays within the stop grace period; a reload's follows the new config."""
        d = self.config.daemon
        if self._stop_signalled:
            return min(d.drain_timeout_s, self.config.server.stop_timeout_s), "shutdown", d.drain_unready_s
        end = self._ended
        if end is not None and end.reload is not None:
            return end.reload.daemon.drain_timeout_s, "config reloaded", end.reload.daemon.drain_unready_s
        return d.drain_timeout_s, "planned re-tune", d.drain_unready_s

    def _draining(self) -> Generator[Phase, Any, None]:
        """Draining: the requests in flight finish (or the budget ends), then the stop the drain came
        before: the shutdown, or a reload's or a re-tune's re-plan."""
        budget_s, reason, unready_s = self._drain_plan()
        if self._stop_signalled:
            current = self.runner.current
            assert current is not None  # the stop signal found it alive
            yield from self._drain(current, budget_s, reason, for_shutdown=True, unready_s=unready_s)
            self.advance(Cause.STOP_REQUESTED, "stopping vLLM")
            return
        assert self._live is not None and self._ended is not None
        yield from self._drain(self._live, budget_s, reason, unready_s=unready_s)
        yield from self._replan(self._live, self._ended)

    def serve_failure(self, launch: Launch, start: float, failure: Failure) -> ServeEnd:
        self.last_failure = failure
        served = self.clock() - start
        self.publish(B.ServingFailed(failure, served))
        return ServeEnd(failure, served)

    # --- serving and recovering ---------------------------------------------------------------

    def _serve(self) -> Generator[Phase, Any, int | None]:
        """Serving, until a failure, a reload that changes the flags, or the memory other processes held
        being back; the state that follows handles the rest (a restart's wait, a drain, a re-plan)."""
        launch = self._live
        assert launch is not None
        end = yield Serving(self, launch)
        self._ended = end
        if end.reload is None and not end.back_to_best:
            return (yield from self._recover(launch, end))
        if self._drains(launch, self._drain_plan()[0]):  # /readyz 503 from here on, before anything is read
            self.advance(Cause.DRAIN_REQUESTED, liveness.drain_status(None))
        else:
            yield from self._replan(launch, end)
        return None

    def _recover(self, launch: Launch, end: ServeEnd) -> Generator[Phase, Any, int | None]:
        """Serving failed: vLLM stopped; a memory failure takes the search's next flags (launched here),
        a transient one waits for a restart (backoff) within the budget; else the daemon fails."""
        failure = end.failure
        assert failure is not None
        yield from self.runner.stop(launch, reason=f"serving failed: {failure.cls}")
        flags = launch.flags
        if failure.memory:
            from r1sup.core import search as S

            search = self.history
            if not isinstance(search, S.Search):
                search = new_search(
                    self.config, self.know, launch_calibration(self.know, flags, launch.figures)
                )
            yield from self._tuner().refresh_device()
            decision = search.after(S.Outcome(flags, failure, launch.figures, self.know.device))
            if isinstance(decision, S.GiveUp):
                return (
                    yield from self._take(
                        TuneResult(
                            ok=False,
                            exit_code=decision.exit_code,
                            reason=decision.reason,
                            suggestions=list(decision.ways_out),
                        )
                    )
                )
            self.history = search
            step = SearchStepped(self.runner.launches + 1, flags, decision.flags, failure.cls)
            self.publish(B.StepAfterServing(step, failure.evidence, decision.reason))
            result = yield from self._tuner().run(
                decision.flags,
                keep_running=True,
                history=self.history,
                why=f"serving failed ({failure.cls}): {decision.reason}",
            )
            self.history = result.history or self.history
            if result.ok:
                from r1sup.state import profiles

                self.profile_source = "tuned"
                key = profiles.fingerprint_key(self.fingerprint or {})
                result.profile_path = self._keep(result, key)
                self._served(result)
            return (yield from self._take(result))
        if failure.cls not in policy.TRANSIENT:
            return (yield from self._fail(EXIT_FATAL_FAILURE, f"{failure.cls}: {failure.evidence}"))
        d = self.config.daemon
        if end.served_s >= d.stable_after_s:
            self._restarts = 0
        return (yield from self._restart_later(None, failure))

    def _restart_later(
        self, flags: EngineFlags | None, failure: Failure
    ) -> Generator[Phase, Any, int | None]:
        """A restart within the budget (``BACKOFF``; :meth:`_wait_to_restart` relaunches), or the
        daemon's end once the budget is spent (exit 5). ``flags``: those to relaunch where nothing
        serves (a bring-up whose probe failed on the connection); None: the flags that served."""
        d = self.config.daemon
        self._restarts += 1
        if self._restarts > d.restart_budget:
            reason = f"{self._restarts - 1} restarts without {d.stable_after_s:.0f}s of stable serving"
            return (yield from self._fail(EXIT_RESTART_BUDGET, reason))
        self._retry_flags, self._retry_failure = flags, failure
        self._backoff_s = backoff_delay(self._restarts, d.backoff_initial_s, d.backoff_max_s)
        status = f"restart {self._restarts}/{d.restart_budget} in {self._backoff_s:.1f}s"
        self.advance(Cause.CRASHED if flags is None else Cause.RETRYING, status)
        self.publish(B.RestartScheduled(self._restarts, d.restart_budget, self._backoff_s))
        return None

    def _wait_to_restart(self) -> Generator[Phase, Any, int | None]:
        """Backoff after a crash while serving: the wait, then the same flags launched again."""
        flags, failure = self._retry_flags, self._retry_failure
        if flags is None:  # serving ended: the flags that served
            launch = self._live
            assert launch is not None
            flags = launch.flags
        yield from self.runner.sleep(self._backoff_s)
        result = yield from self._tuner().run(
            flags,
            keep_running=True,
            history=self.history,
            why=f"restart {self._restarts} after {failure.cls if failure else 'a failure'}",
        )
        if result.ok:
            self._served(result)
        return (yield from self._take(result))

    # --- reloading -----------------------------------------------------------------------------

    def load_new_config(self) -> Config | None:
        """SIGHUP: the config read again. One that implies the same flags and server is applied at
        once; one that implies others is returned, for the caller to drain, stop and re-plan with;
        None when there is nothing to relaunch (applied, unreadable, or no file to read)."""
        from r1sup.core import config as cfg

        self.publish(B.Reloading())
        try:
            source = self.config.source
            new = cfg.load_bounded(source, overrides=self.s.overrides) if source else None
        except R1supError as exc:
            self.publish(B.ReloadFailed(str(exc)))
            return None
        for renamed in new.renamed if new is not None else ():
            self.publish(B.ConfigRenamed(renamed.old, renamed.new, renamed.where))
        if new is not None and os.path.realpath(new.state.dir) != os.path.realpath(self.config.state.dir):
            # the state directory's lock (one r1sup per state directory) stays with the one it took
            self.publish(B.ReloadFailed("state.dir: a new state directory takes a restart, not a reload"))
            return None
        changed = _implied_change(self.config, new) if new else False
        if new is not None and not changed:
            self.config = new
            self.runner.config = new
        self.publish(B.ConfigReloaded(changed, applied=new is not None and not changed))
        return new if changed else None

    def _replan(self, launch: Launch, end: ServeEnd) -> Generator[Phase, Any, None]:
        """The stop a reload that changes the flags, or the planned re-tune, chose (after its drain): vLLM
        stopped, then planning again (the re-tune brings the best configuration up: the saved best
        profile when there is one, else a new search)."""
        new = end.reload
        if new is None:
            yield from self.runner.stop(
                launch, reason="planned re-tune: the memory other processes held is back"
            )
            self.history = None
            self.advance(Cause.PLANNED, "re-tune: the memory other processes held is back")
            return
        yield from self.runner.stop(launch, reason="config reloaded")
        self.config = new
        self.s.config = new
        self.runner.config = new
        self.know = None
        self.history = None
        self.advance(Cause.PLANNED, "re-planning after reload")


def _implied_change(old: Config, new: Config) -> bool:
    """Whether the new config implies other flags or another server (then re-tune)."""
    return (
        old.model != new.model
        or old.start != new.start
        or old.search != new.search
        or old.target != new.target
        or old.server.host != new.server.host
        or old.server.port != new.server.port
        or old.server.python != new.server.python
        or old.server.launch != new.server.launch
        or old.server.extra_args != new.server.extra_args
        or old.server.env != new.server.env
    )


def backoff_delay(restart: int, initial: float, maximum: float) -> float:
    """Capped exponential backoff with jitter, as tenacity computes it: initial x 2^(n-1) + U(0, initial)."""
    wait = tenacity.wait_exponential_jitter(initial=initial, max=maximum, jitter=initial)
    state = tenacity.RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
    state.attempt_number = restart
    return float(wait(state))
