"""The imperative shell around one vLLM launch: start, watch, relay its output, stop; the probe is the
:class:`r1sup.supervision.prober.Prober`'s.

Its waits are phases of the one loop (:mod:`r1sup.supervision.loop`), defined with the launch's record in
:mod:`r1sup.supervision.launch`: ``Starting`` until vLLM is ready or has failed, ``ProbeWait`` until the
probe returns, ``Stopping`` (SIGTERM, SIGKILL on its timer, the wait for the device memory), ``Flushing``
for the output that follows an exit or a stop, ``Awaiting`` for blocking work of no launch (the
preflight, the fleet's store, a launch's clean-up of leftovers, NVML). The runner's waits are generators
that yield these phases to the script of the process (``launch = yield from runner.launch(...)``).
Checks that block (readiness, the probe, the stop's reaping and memory wait) run on threads and report
back as events, so vLLM's output is drained all the time. The phases reach the runner through
``LaunchHost`` only; the runner reaches the world (engine, probe child, device, ``/metrics``, clock)
through its :class:`r1sup.supervision.world.World`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from r1sup.adapters import health
from r1sup.adapters.launcher import Engine, LaunchSpec, StopReport, build_spec
from r1sup.adapters.logs import get_logger
from r1sup.core import failure as F
from r1sup.core import progress as P
from r1sup.core.config import Config
from r1sup.core.errors import InternalError, R1supError
from r1sup.core.events import CheckDone, ChildEOF, ChildOutput, EventQueue, Publish
from r1sup.core.failure import Failure
from r1sup.core.flags import EngineFlags
from r1sup.core.logparse import LogLine, LogReader
from r1sup.supervision.launch import (
    Awaiting,
    Cancel,
    Cancelled,
    Flushing,
    Hooks,
    Launch,
    Starting,
    Stopping,
    compile_cache_now,
    failure_fields,
    folded,
    int_or_none,
    launch_verdict,
    progress_fields,
)
from r1sup.supervision.loop import Loop, Phase, StopRequested, Waiting
from r1sup.supervision.prober import EARLY_PROBE_CORES, Prober
from r1sup.supervision.world import World

if TYPE_CHECKING:
    pass

READY_POLL_S = 1.0  # readiness polled this often until vLLM prints its readiness line (the fallback)
# after vLLM printed "Application startup complete." the check runs at once, and again this soon while
# it fails: uvicorn logs that line just before its socket listens
# the probe's child is started with the engine (its imports and clients overlap vLLM's load) on a box
# with at least this many CPUs; on fewer, once vLLM's output shows it past its own imports (one of
# LOADED_PHASES): on 2 cores the child's import took CPU from vLLM's imports, while the load's rest (the
# weights, the memory profile, the warm-up) runs the model on one core (README, "Time to serve")
EXIT_DRAIN_S = 1.0  # after the child exits, wait this long for the rest of its output
EXIT_FLUSH_S = 0.5  # and then this much longer for what is still queued, unless its output ended
FLEET_WAITING = "profile_store_waiting"  # the fleet's wait, said on the loop's thread (a CheckDone's kind)
FLEET_TOLD = "profile_store_told"  # an event of the fleet's store, published on the loop's thread
DESCENDANTS_EVERY_S = 2.0  # the engine's processes are recorded this often (a scan of every process)


class Runner:
    def __init__(
        self,
        config: Config,
        events: EventQueue,
        *,
        api_key: str | None = None,
        hooks: Hooks | None = None,
        log: Any = None,
        relay: bool = True,
        relay_level: str = "info",
        display: Any = None,
        fold_tracebacks: bool = False,
        world: World | None = None,
    ) -> None:
        self.config = config
        # the engine, probe, device and metrics factories, the clock and how checks run (production's
        # by default; a replay test passes its own)
        self.world = world or World()
        self.events = events
        self.api_key = api_key
        self.hooks = hooks or Hooks()
        self.log = log or get_logger()
        self.relay = relay
        # vLLM's lines: "info" for log shippers (JSON); a console shows vLLM's warnings and errors only,
        # the rest at debug (--log-level debug shows everything)
        self.relay_level = relay_level
        # on a terminal: the line that shows the loading phase, its percent, elapsed time and ETA
        # (r1sup.adapters.logs.StatusLine); elsewhere the progress goes to the log only
        self.display = display
        self.expected_phases: dict[str, float] = {}  # seconds per phase of an earlier launch (ETA)
        # a console shows vLLM's ERROR lines (its tracebacks) at debug only: the verdict that follows
        # names the root-cause line and where it was; the JSON log keeps them at error
        self.fold_tracebacks = fold_tracebacks
        self._shown_at = 0.0
        self.launches = 0  # vLLM processes started
        self._ids = 0  # launch ids (a launch refused before start-up gets one too)
        self.current: Launch | None = None  # the launch whose engine may be running
        self.fault: InternalError | None = None  # an exception in one of r1sup's own checks
        self.endpoint = health.Endpoint(config.server.host, config.server.port, api_key)
        self.managed_args: tuple[str, ...] = ()  # further flags r1sup adds to each launch
        self.ready_poll_s = READY_POLL_S
        # the load probe of a launch: its child process and the profile a short probe stands on
        self.prober = Prober(self)
        self.clock: Callable[[], float] = self.world.clock  # the loop's clock (a replay test's fake one)
        self.tick: Callable[[], None] = lambda: None  # each turn of a waiting loop (the daemon's heartbeat)
        self.loop = Loop(events, clock=lambda: self.clock(), tick=lambda: self.tick(), fault=self.take_fault)

    # --- waiting -------------------------------------------------------------------------------

    def check_signals(self) -> None:
        """Between waits (before a launch, inside the preflight's import): a pending stop signal ends
        the work as StopRequested, as the loop's phases do."""
        signum = self.events.pending_signal()
        if signum is not None:
            raise StopRequested(signum)

    def take_fault(self) -> InternalError | None:
        """A fault of r1sup's own from a check thread, taken once (the loop raises it)."""
        fault, self.fault = self.fault, None
        return fault

    def sleep(self, seconds: float, launch: Launch | None = None) -> Generator[Phase, Any, None]:
        """An interruptible wait (a stop signal ends it) that keeps taking the child's output."""
        output = (lambda event: self.handle_output(launch, event)) if launch is not None else None
        yield Waiting(self.clock() + seconds, output)

    def run_check(self, kind: str, launch: Launch | None, fn: Callable[[], tuple[bool, str, Any]]) -> None:
        """Run ``fn`` off the loop's thread; its answer comes back as a :class:`CheckDone` event (of launch
        0 for a check of no launch: the preflight)."""
        if self.world.checks is not None:
            self.world.checks(kind, launch, fn)
            return
        number = launch.number if launch is not None else 0

        def work() -> None:
            try:
                ok, detail, payload = fn()
            except Exception as exc:  # r1sup's own bug, not the engine's: the waiting loop raises it
                self.fault = InternalError.from_exception(exc)
                ok, detail, payload = False, str(self.fault), None
            self.events.put(CheckDone(kind, number, ok, detail, payload))

        threading.Thread(target=work, daemon=True, name=f"check-{kind}").start()

    def off_loop(
        self, kind: str, work: Callable[[Cancel], Any], output: Callable[[Any], None] | None = None
    ) -> Generator[Phase, Any, Any]:
        """Blocking work of no launch (the preflight's import of vLLM, the fleet's store) as a check,
        while the loop turns: returns what ``work`` returned, or raises the :class:`R1supError` it
        raised. ``work`` is given a :class:`Cancel` to call while it waits (and to sleep on): once a
        stop signal has ended the wait (StopRequested, raised here), it raises, so that the work ends
        what it started. ``output`` takes the other events that come meanwhile (what the work put on the
        queue for the loop's thread)."""
        cancelled = Cancel(kind)

        def run() -> tuple[bool, str, Any]:
            try:
                return True, "", work(cancelled)
            except (R1supError, Cancelled) as exc:
                return False, str(exc), exc

        self.run_check(kind, None, run)
        done: CheckDone = yield Awaiting(kind, cancelled.event, output)
        if not done.ok and isinstance(done.payload, R1supError):
            raise done.payload
        return done.payload

    def consult_fleet(
        self, key: str, tell: Publish, status: Callable[[str], None] = lambda text: None
    ) -> Generator[Phase, Any, Any]:
        """The fleet's store (:func:`r1sup.state.fleet.consult`) off the loop's thread: its reads, and
        its wait while another replica tunes ``key``, block. What it says while it waits (``status``)
        and what it tells (events for ``tell``) come back through the queue, to be said on the loop's
        thread; a stop signal ends the wait. What the lease it hands back tells later, from its own
        thread, goes to the log's sink alone (:func:`r1sup.supervision.subscribers.logging_bus`)."""
        from r1sup.state import fleet
        from r1sup.supervision.subscribers import logging_bus

        config, events = self.config, self.events
        later = logging_bus(self.log).publish
        consulting = threading.Event()
        consulting.set()

        def waiting(text: str) -> None:
            events.put(CheckDone(FLEET_WAITING, 0, True, text, None))

        def told(event: Any) -> None:
            if consulting.is_set():
                events.put(CheckDone(FLEET_TOLD, 0, True, "", event))
            else:
                later(event)

        def said(event: Any) -> None:
            if isinstance(event, CheckDone) and event.kind == FLEET_WAITING:
                status(event.detail)
            elif isinstance(event, CheckDone) and event.kind == FLEET_TOLD:
                tell(event.payload)

        def work(cancelled: Cancel) -> Any:
            try:
                return fleet.consult(config, key, sleep=cancelled.sleep, tell=told, status=waiting)
            finally:
                consulting.clear()

        return (yield from self.off_loop("fleet", work, said))

    def handle_output(self, launch: Launch, event: object) -> None:
        if isinstance(event, ChildOutput) and event.launch == launch.number:
            for item in launch.reader.feed(event.line):
                if isinstance(item, LogLine):
                    if self.relay:
                        self._relay(launch, item)
                else:
                    if launch.progress is not None:
                        step = launch.progress.observe(item.kind, item.numbers, self.clock())
                        if step is not None:
                            self._progress_step(launch, step)
                            if step.phase_changed:
                                self.prober.start_when_loaded(launch)
        elif isinstance(event, ChildEOF) and event.launch == launch.number:
            launch.engine.eof = True

    # --- progress --------------------------------------------------------------------------------

    def _progress_step(self, launch: Launch, step: P.Step, event: str = "engine_progress") -> None:
        """A new phase is logged (with the numbers gathered in the last one); a new percent is shown
        on the terminal line, or logged every few points where there is none."""
        assert launch.progress is not None
        log_it = step.phase_changed or (self.display is None and launch.progress.should_log_percent(step))
        if log_it:
            self.log.info(event, **progress_fields(launch, step))
        self.show_progress(launch, force=True)

    def show_progress(self, launch: Launch, force: bool = False) -> None:
        """Redraw the terminal line (at most twice a second unless ``force``)."""
        if self.display is None or launch.progress is None:
            return
        now = self.clock()
        if force or now - self._shown_at >= 0.5:
            self._shown_at = now
            self.display.set(f"attempt {launch.attempt}: {launch.progress.snapshot(now).text()}")

    def progress_text(self) -> tuple[str, str] | None:
        """(phase, ``attempt 2: loading weights 45%, 0:32 elapsed, ETA 1:10``) of the launch loading
        now; None when none is (serving, or between launches)."""
        launch = self.current
        if launch is None or launch.progress is None or launch.progress.ended:
            return None
        snap = launch.progress.snapshot(self.clock())
        return snap.phase, f"attempt {launch.attempt}: {snap.text()}"

    def live_status(self) -> dict[str, Any]:
        """What ``status.json`` shows of the current launch: the loading progress (with wall-clock
        times, so that ``r1sup status`` can count on), the context and the KV cache vLLM reported."""
        launch = self.current
        if launch is None:
            return {"progress": None}
        figures = launch.figures
        out: dict[str, Any] = {
            "attempt": launch.attempt,
            "max_model_len": launch.flags.max_model_len or int_or_none(figures.max_model_len),
            "kv_cache_tokens": int_or_none(figures.kv_cache_tokens),
            "memory_gib": figures.memory_in_use_gib(launch.flags.tensor_parallel_size),
            "progress": None,
        }
        if launch.progress is not None and not launch.progress.ended:
            from datetime import datetime, timezone

            from r1sup.adapters.statefiles import utc_now_iso

            snap = launch.progress.snapshot(self.clock())
            now = datetime.now(timezone.utc)  # one instant for the three stamps
            progress = snap.to_dict()
            progress["launch_started_at"] = utc_now_iso(-snap.elapsed_s, zulu=False, now=now)
            progress["phase_started_at"] = utc_now_iso(-snap.phase_elapsed_s, zulu=False, now=now)
            if snap.eta_s is not None:
                progress["eta_at"] = utc_now_iso(snap.eta_s, zulu=False, now=now)
            out["progress"] = progress
        return out

    def finish_progress(self, launch: Launch) -> dict[str, float]:
        """The launch is over (failed, or ready and probed): stop its clock, clear the terminal line;
        returns the numbers read since the last progress event."""
        if self.display is not None:
            self.display.clear()
        return launch.progress.finish(self.clock()) if launch.progress is not None else {}

    def _relay(self, launch: Launch, item: LogLine) -> None:
        """One vLLM line as a ``vllm`` event at vLLM's own level (warnings and errors stand out).

        Once r1sup has asked the engine to stop, vLLM tears down noisily (force-kill warnings, an
        EngineDeadError traceback from the API server): those lines are expected, so they keep their
        ``vllm_level`` but are relayed at the ordinary relay level with ``during_stop=True``, and an
        alert on ``level=error`` does not fire on every clean stop.
        """
        level = self.relay_level
        extra: dict[str, Any] = {}
        if launch.stopping:
            extra["during_stop"] = True
        elif item.level == "WARNING":
            level = "warning"
        elif item.level in ("ERROR", "CRITICAL"):
            if self.fold_tracebacks:
                launch.folded_lines += 1
            else:
                level = "error"
        getattr(self.log, level)(
            "vllm",
            source="vllm",
            proc=item.process,
            rank=item.rank,
            pid=item.pid,
            vllm_level=item.level,
            text=item.text,
            **extra,
        )

    # --- launching -----------------------------------------------------------------------------

    def preflight(self, spec: LaunchSpec) -> Generator[Phase, Any, Failure | None]:
        """Clean up our leftovers; a port held by anything else is fatal; log foreign GPU users. The
        looking and killing (processes, ports, NVML) is a check off the loop's thread."""
        world, gpu_processes = self.world, self.hooks.gpu_processes

        def clear(cancelled: Cancel) -> tuple[list[int], Any, list[Any]]:
            killed = world.kill_leftovers(spec.instance)
            holder = world.port_holder(spec.host, spec.port, spec.instance)
            if holder is not None and holder.ours and holder.pid:
                world.kill_leftovers(spec.instance)
                holder = world.port_holder(spec.host, spec.port, spec.instance)
            return killed, holder, gpu_processes() if holder is None else []

        killed, holder, foreign = yield from self.off_loop("leftovers", clear)
        if killed:
            self.log.warning("leftovers_killed", pids=killed)
        if holder is not None:
            who = f"pid {holder.pid} ({holder.name})" if holder.pid else holder.name
            detail = f"port {spec.port} on {spec.host} is held by {who}"
            if holder.cmdline:
                detail += f": {holder.cmdline[:200]}"
            return Failure(
                F.PORT_IN_USE,
                F.PHASE_STARTUP,
                evidence=detail,
                numbers=F.Numbers.from_dict({"port": float(spec.port)}),
            )
        for proc in foreign:
            self.log.warning(
                "foreign_gpu_process",
                pid=proc.pid,
                name=proc.name,
                used_gib=round(proc.used_bytes / 1024**3, 2),
            )
        return None

    def launch(self, flags: EngineFlags, *, attempt: int) -> Generator[Phase, Any, Launch]:
        """Start vLLM with ``flags`` and wait until it is ready or has failed."""
        self._ids += 1
        spec = build_spec(self.config, flags, api_key=self.api_key, managed=self.managed_args)
        engine: Engine = self.world.engine(spec, self.events, self._ids)
        launch = Launch(self._ids, flags, spec, engine, LogReader(), self.clock(), attempt=attempt)
        launch.progress = P.LoadProgress(launch.started, self.expected_phases)
        self.current = launch
        blocked = yield from self.preflight(spec)
        if blocked is not None:
            launch.failure = blocked
            self.log.error("failure_classified", attempt=attempt, **failure_fields(blocked))
            return launch
        launch.compile_cache = compile_cache_now(spec.env)
        self.log.info(
            "launch_started",
            attempt=attempt,
            launch=launch.number,
            flags=flags.to_dict(),
            command=list(spec.display),
            compile_cache=launch.compile_cache,
        )
        engine.start()
        self.launches += 1
        self.log.info("child_started", attempt=attempt, pid=engine.pid)
        if self.config.probe.enabled and self.world.cores() >= EARLY_PROBE_CORES:
            self.prober.start_child(launch)
        yield Starting(self, launch)
        if launch.failure.cls != F.NONE:
            self.finish_progress(launch)
            self.log.error(
                "failure_classified", attempt=attempt, **failure_fields(launch.failure), **folded(launch)
            )
        return launch

    def announce_ready(self, launch: Launch) -> None:
        """``engine_ready`` with what vLLM printed since the last phase; the probe's phase begins."""
        assert launch.progress is not None
        now = self.clock()
        if self.config.probe.enabled:
            step = launch.progress.enter(P.PROBE, now)
            fields = progress_fields(launch, step) if step is not None else {}
        else:
            fields = {"launch": launch.number, **self.finish_progress(launch)}
        fields.pop("launch", None)
        self.log.info("engine_ready", launch=launch.number, seconds=launch.ready_after_s, **fields)
        self.show_progress(launch, force=True)

    def drain(
        self, launch: Launch, limit_s: float = 0.5, *, until_quiet: bool = False
    ) -> Generator[Phase, Any, None]:
        """Take what output is still queued for this launch: until its end (EOF) or ``limit_s``, or
        with ``until_quiet`` as soon as nothing more came for 50 ms (an engine still running)."""
        yield Flushing(self, launch, self.clock() + limit_s, until_quiet)

    def record_descendants(self, launch: Launch, now: float) -> None:
        """Record the engine's processes (to kill them even if they leave the group), at most every
        DESCENDANTS_EVERY_S: while it starts and while it serves alike."""
        if launch.recorded_at is None or now - launch.recorded_at >= DESCENDANTS_EVERY_S:
            launch.recorded_at = now
            launch.engine.record_descendants()

    def exit_failure(self, launch: Launch, now: float, phase: str, when: str = "") -> Failure | None:
        """The engine has exited: once its output has ended (or EXIT_DRAIN_S and then EXIT_FLUSH_S after
        the exit was first seen), the failure it stands for: vLLM's own account, else ``engine_dead``.
        None while the rest of its output may still come: the calling phase goes on taking it (a phase
        never enters the loop itself)."""
        code = launch.engine.poll()
        assert code is not None
        if launch.exited_at is None:
            launch.exited_at = now
        if not launch.engine.eof and now - launch.exited_at < EXIT_DRAIN_S + EXIT_FLUSH_S:
            return None
        launch.exit_code = code
        return launch_verdict(launch, code, phase, when)

    # --- probing (r1sup.supervision.prober) --------------------------------------------------------

    def probe(self, launch: Launch) -> Generator[Phase, Any, Failure]:
        """Run the load probe against the launched server (:meth:`Prober.run`); NONE when it passed."""
        return (yield from self.prober.run(launch))

    def capacity_failure(self, launch: Launch) -> Failure | None:
        """The target needs concurrency x context tokens of KV at once; vLLM reported its capacity."""
        tgt = self.config.target
        figures = launch.figures
        tokens = figures.kv_cache_tokens
        if tgt.concurrency and tgt.context and tokens is not None:
            need = tgt.concurrency * tgt.context
            if tokens < need:
                return Failure(
                    F.KV_INSUFFICIENT,
                    F.PHASE_KV_CACHE,
                    evidence=f"KV cache holds {int(tokens)} tokens; the target needs {tgt.concurrency} x "
                    f"{tgt.context} = {need}",
                    numbers=F.Numbers.from_dict(
                        {"kv_capacity_tokens": tokens, "kv_cache_gib": figures.kv_cache_gib or 0.0}
                    ),
                    detail="target",
                )
        return None

    # --- stopping ------------------------------------------------------------------------------

    def stop_current(self, reason: str) -> Generator[Phase, Any, None]:
        if self.current is not None and self.current.engine.proc is not None:
            yield from self.stop(self.current, reason=reason)
        self.prober.kill()
        self.current = None

    def stop(self, launch: Launch, *, reason: str) -> Generator[Phase, Any, StopReport]:
        self.prober.kill()
        self.finish_progress(launch)
        server = self.config.server

        def stopping() -> Stopping:
            launch.stopping = True  # what vLLM prints from now on is its teardown
            return Stopping(self, launch, server.stop_timeout_s, server.memory_release_timeout_s)

        # one wait: what vLLM printed before the stop is relayed as it came, then the stop (SIGTERM,
        # SIGKILL on its timer, the wait for the memory), then the output that followed it
        queued = self.events.queued()
        flush = Flushing(self, launch, self.clock(), until_quiet=True, at_most=queued, then=stopping)
        report: StopReport = yield flush
        launch.stop_report = report
        if self.current is launch:
            self.current = None
        self.log.info(
            "engine_stopped",
            launch=launch.number,
            reason=reason,
            escalated=report.escalated,
            killed_descendants=report.killed_descendants,
            memory_released=report.memory_released,
            port_free=report.port_free,
            seconds=round(report.seconds, 2),
        )
        return report
