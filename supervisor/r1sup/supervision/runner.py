"""The imperative shell around one vLLM launch: start, watch, probe, stop.

Its waits are phases of the one loop (:mod:`r1sup.supervision.loop`): :class:`Starting` until vLLM is ready or
has failed, :class:`ProbeWait` until the probe returns, :class:`Stopping` (SIGTERM, SIGKILL on its timer,
the wait for the device memory), :class:`Flushing` for the output that follows an exit or a stop,
:class:`Awaiting` for blocking work of no launch (the preflight, the fleet's store, a launch's clean-up of
leftovers, NVML). The runner's waits are generators that yield these phases to the script of the
process (``launch = yield from runner.launch(...)``). Checks that block (readiness, the
probe, the stop's reaping and memory wait) run on threads and report back as events, so vLLM's output
is drained all the time. The phases reach the runner through :class:`LaunchHost` only; the runner
reaches the world (engine, probe child, device, ``/metrics``, clock) through its
:class:`r1sup.supervision.world.World`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from r1sup.adapters import health
from r1sup.adapters.launcher import Engine, LaunchSpec, StopReport, build_spec
from r1sup.adapters.logs import get_logger
from r1sup.core import failure as F
from r1sup.core import progress as P
from r1sup.core.config import Config
from r1sup.core.errors import InternalError, R1supError
from r1sup.core.events import CheckDone, ChildEOF, ChildOutput, EventQueue, Publish, Signalled
from r1sup.core.failure import Failure
from r1sup.core.figures import EMPTY as EMPTY_FIGURES
from r1sup.core.figures import Figures
from r1sup.core.flags import EngineFlags
from r1sup.core.logparse import LogLine, LogReader
from r1sup.core.probing import ProbeResult, probe_failure
from r1sup.supervision.loop import TURN_S, Done, Loop, Phase, Stop, StopRequested, Waiting
from r1sup.supervision.world import World

if TYPE_CHECKING:
    from r1sup.adapters.probe import Connection as ProbeConnection
    from r1sup.adapters.probe import ProbeProcess

READY_POLL_S = 1.0  # readiness polled this often until vLLM prints its readiness line (the fallback)
# after vLLM printed "Application startup complete." the check runs at once, and again this soon while
# it fails: uvicorn logs that line just before its socket listens
READY_RETRY_S = 0.05
# the probe's child is started with the engine (its imports and clients overlap vLLM's load) on a box
# with at least this many CPUs; on fewer, once vLLM's output shows it past its own imports (one of
# LOADED_PHASES): on 2 cores the child's import took CPU from vLLM's imports, while the load's rest (the
# weights, the memory profile, the warm-up) runs the model on one core (README, "Time to serve")
EARLY_PROBE_CORES = 4
LOADED_PHASES = (P.WEIGHTS, P.PROFILING, P.KV_CACHE, P.GRAPHS, P.API)
EXIT_DRAIN_S = 1.0  # after the child exits, wait this long for the rest of its output
EXIT_FLUSH_S = 0.5  # and then this much longer for what is still queued, unless its output ended
FLEET_WAITING = "profile_store_waiting"  # the fleet's wait, said on the loop's thread (a CheckDone's kind)
FLEET_TOLD = "profile_store_told"  # an event of the fleet's store, published on the loop's thread
DESCENDANTS_EVERY_S = 2.0  # the engine's processes are recorded this often (a scan of every process)


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
        self._probe_proc: ProbeProcess | None = None  # the probe's child process while it runs
        self.fault: InternalError | None = None  # an exception in one of r1sup's own checks
        self.endpoint = health.Endpoint(config.server.host, config.server.port, api_key)
        self.managed_args: tuple[str, ...] = ()  # further flags r1sup adds to each launch
        self.ready_poll_s = READY_POLL_S
        # the probe child started with the engine (its imports overlap the start-up), with its launch
        # number (none on a box of fewer than EARLY_PROBE_CORES CPUs)
        self._probe_next: tuple[int, ProbeProcess] | None = None
        # a saved profile that passed the full probe on a box of the same fingerprint: a launch with
        # its flags gets the short probe (probe.probe_requests); set by prove_with
        self.proven: Proven | None = None
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
            except (R1supError, _Cancelled) as exc:
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
                                self._start_probe_when_loaded(launch)
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
            "max_model_len": launch.flags.max_model_len or _int(figures.max_model_len),
            "kv_cache_tokens": _int(figures.kv_cache_tokens),
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
            self.log.error("failure_classified", attempt=attempt, **_failure_fields(blocked))
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
            self._start_probe_process(launch)
        yield Starting(self, launch)
        if launch.failure.cls != F.NONE:
            self.finish_progress(launch)
            self.log.error(
                "failure_classified", attempt=attempt, **_failure_fields(launch.failure), **_folded(launch)
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

    # --- probing -------------------------------------------------------------------------------

    def prove_with(
        self,
        flags: EngineFlags | None,
        probe: ProbeResult | None = None,
        figures: Figures = EMPTY_FIGURES,
    ) -> None:
        """A saved profile's flags, the record of its full probe and the figures vLLM printed when it
        passed (its KV cache): a launch with those flags gets the short probe; None forgets it."""
        if flags is None or probe is None:
            self.proven = None
            return
        self.proven = Proven(flags.to_dict(), probe, figures.kv_cache_tokens, figures.compile_cache_cold)

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

    def probe(self, launch: Launch) -> Generator[Phase, Any, Failure]:
        """Run the load probe against the launched server; NONE when it passed."""
        from r1sup.adapters.probe import (
            WAVE_PROMPT_TOKENS,
            ProbeSpec,
            default_prompt_tokens,
            probe_requests,
            proven_wave,
            short_prompt_tokens,
            wave_output_tokens,
            wave_size,
        )

        p = self.config.probe
        tgt = self.config.target
        context = tgt.context or launch.flags.max_model_len or int(launch.figures.max_model_len or 0) or 2048
        concurrency = p.concurrency or tgt.concurrency or 1
        prompt_tokens = p.prompt_tokens or default_prompt_tokens(context, p.output_tokens)
        same = (
            self.proven if self.proven is not None and self.proven.flags == launch.flags.to_dict() else None
        )
        proven = same.probe if same is not None else None
        requests, short = probe_requests(p.requests, concurrency, prompt_tokens, proven)
        brief = (
            short_prompt_tokens(prompt_tokens, same.kv_cache_tokens, launch.figures.kv_cache_tokens)
            if same is not None and short and not p.prompt_tokens
            else None
        )
        if brief is not None:
            prompt_tokens = brief
        # the concurrency wave: ordinary requests, as many at once as vLLM would run (bounded)
        wave_prompt = min(WAVE_PROMPT_TOKENS, default_prompt_tokens(context, p.output_tokens))
        wave = wave_size(
            p.max_concurrency,
            launch.flags.max_num_seqs,
            launch.figures.kv_cache_tokens,
            launch.reader.block_size,
            wave_prompt + wave_output_tokens(p.output_tokens),
        )
        # short prompts (vLLM allocated the KV cache the full probe passed with): that probe's wave
        # stands for this one's where it sent as many, all passed; the child sends none
        carried = proven_wave(proven.wave, wave) if brief is not None and proven is not None else None
        spec = ProbeSpec(
            base_url=self.endpoint.base,
            model=launch.spec.served_name,
            requests=requests,
            concurrency=concurrency,
            prompt_tokens=prompt_tokens,
            output_tokens=p.output_tokens,
            request_timeout_s=p.request_timeout_s,
            timeout_s=p.timeout_s,
            api_key=self.api_key,
            # the record sizes prompts of the full probe's length: short prompts are sized anew
            sizing=None if brief else _sizing(proven),
            wave_requests=0 if carried is not None else wave,
            wave_prompt_tokens=wave_prompt,
            context=context,
        )
        self.log.info(
            "probe_started",
            launch=launch.number,
            requests=spec.requests,
            concurrency=concurrency,
            prompt_tokens=prompt_tokens,
            output_tokens=spec.output_tokens,
            **({"short": "the profile passed the full probe"} if short else {}),
            **({"prompts": "short: vLLM allocated the KV cache the full probe passed with"} if brief else {}),
            **({"sizing": "the profile's record"} if spec.sizing else {}),
            wave_requests=spec.wave_requests,
            wave_prompt_tokens=wave_prompt,
            **(
                {"wave": "the profile's: vLLM allocated the KV cache its full probe passed with"}
                if carried
                else {}
            ),
        )
        child = self._take_probe_process(launch)
        self._probe_proc = child
        self.run_check("probe", launch, lambda: _probe_call(child.run, spec))
        result: ProbeResult = yield ProbeWait(self, launch, self.clock() + p.timeout_s + 30)
        if carried is not None and result.wave is None:
            result = replace(result, wave=carried)
        launch.probe = result
        launch.stands_on = proven if brief is not None else None
        internal = result.internal
        if internal:  # the probe child crashed or could not import: r1sup's fault, never the engine's
            fault = InternalError(internal.where, internal.error)
            failure = Failure(F.INTERNAL_ERROR, F.PHASE_SERVING, evidence=fault.error, detail=fault.where)
            self.log.error("failure_classified", launch=launch.number, **_failure_fields(failure))
            raise fault
        # what vLLM printed while the requests ran; after failed requests, give its traceback time
        yield from self.drain(launch, 0.3, until_quiet=result.ok)
        self.finish_progress(launch)
        code = launch.engine.poll()
        seen = launch.reader.verdict(exit_code=code)
        if result.ok and code is None and seen.cls == F.NONE:
            self.log.info("probe_passed", launch=launch.number, **_probe_fields(result))
            if result.queued:
                # every request succeeded, but fewer ran at once than were sent: the capacity recorded
                # is the proven figure, and this says why it is lower than asked
                self.log.warning(
                    "probe_queued",
                    launch=launch.number,
                    sent_at_once=min(concurrency, requests),
                    ran_at_once=result.concurrency_proven,
                    waiting_peak=result.waiting_peak,
                    max_num_seqs=launch.flags.max_num_seqs,
                    kv_cache_tokens=_int(launch.figures.kv_cache_tokens),
                )
            return F.NO_FAILURE
        if seen.cls != F.NONE or code is not None:
            failure = launch_verdict(launch, code, F.PHASE_SERVING, " during the probe")
        else:  # the engine is up and its log shows nothing: the probe's own evidence decides
            failure = probe_failure(result, p.request_timeout_s, p.timeout_s)
        self.log.error(
            "probe_failed", launch=launch.number, **_failure_fields(failure), **_probe_fields(result)
        )
        return failure

    # --- stopping ------------------------------------------------------------------------------

    def stop_current(self, reason: str) -> Generator[Phase, Any, None]:
        if self.current is not None and self.current.engine.proc is not None:
            yield from self.stop(self.current, reason=reason)
        self._kill_probe()
        self.current = None

    def _start_probe_process(self, launch: Launch) -> None:
        """Start the probe's child with the engine, so that its imports overlap the start-up (on a box
        of at least ``EARLY_PROBE_CORES`` CPUs; else :meth:`_take_probe_process` starts it at the probe)."""
        self._kill_probe()
        self._probe_next = (launch.number, self.world.probe_process(self._probe_connection()))

    def _start_probe_when_loaded(self, launch: Launch) -> None:
        """On a box of fewer than ``EARLY_PROBE_CORES`` CPUs, the probe's child of a launch that is
        still loading, once its phase is one of ``LOADED_PHASES`` (once per launch)."""
        if (
            self.config.probe.enabled
            and launch is self.current
            and not launch.ready
            and launch.progress is not None
            and launch.progress.phase in LOADED_PHASES
            and (self._probe_next is None or self._probe_next[0] != launch.number)
        ):
            self._start_probe_process(launch)

    def _take_probe_process(self, launch: Launch) -> ProbeProcess:
        """The child started with this launch, else (a second probe of it) a new one."""
        ahead, self._probe_next = self._probe_next, None
        if ahead is not None and ahead[0] == launch.number:
            return ahead[1]
        if ahead is not None:
            ahead[1].kill()
        probe: ProbeProcess = self.world.probe_process(self._probe_connection())
        return probe

    def _probe_connection(self) -> ProbeConnection:
        """What the probe's child builds its clients from while vLLM loads (the spec repeats it; a
        child told another connection builds its clients again)."""
        from r1sup.adapters.probe import Connection

        return Connection(self.endpoint.base, self.config.probe.request_timeout_s, self.api_key)

    def _kill_probe(self) -> None:
        """End the probe's children: the one running (its thread then returns) and the one waiting."""
        running, self._probe_proc = self._probe_proc, None
        if running is not None and running.proc.poll() is None:
            running.proc.kill()
        ahead, self._probe_next = self._probe_next, None
        if ahead is not None:
            ahead[1].kill()

    def stop(self, launch: Launch, *, reason: str) -> Generator[Phase, Any, StopReport]:
        self._kill_probe()
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


class _Cancelled(Exception):
    """Raised inside a check's work once the wait for it was given up."""


class Cancel:
    """What off-loop work calls while it waits: raises :class:`_Cancelled` once the loop gave the wait
    up (a stop signal), so that the work ends what it started; :meth:`sleep` waits on it."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.event = threading.Event()

    def __call__(self) -> None:
        if self.event.is_set():
            raise _Cancelled(self.kind)

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


def _probe_call(run: Callable[[Any], Any], spec: Any) -> tuple[bool, str, Any]:
    result = run(spec)
    return result.ok, result.summary(), result


def _sizing(proven: ProbeResult | None) -> dict[str, Any] | None:
    """The prompt sizing a proven profile's probe recorded (its flags are this launch's), else None."""
    return dict(proven.sizing) if proven is not None and proven.sizing is not None else None


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _folded(launch: Launch) -> dict[str, Any]:
    """On a console, how many vLLM error lines the verdict stands for (shown with --log-level debug)."""
    if not launch.folded_lines:
        return {}
    return {"vllm_error_lines": f"{launch.folded_lines} at --log-level debug"}


def _failure_fields(failure: Failure) -> dict[str, Any]:
    return {
        "failure_class": failure.cls,
        "phase": failure.phase,
        "memory": failure.memory,
        "evidence": failure.evidence[:500],
        "numbers": failure.numbers.to_dict(),
        "detail": failure.detail,
    }


def _probe_fields(result: ProbeResult) -> dict[str, Any]:
    keys = (
        "succeeded",
        "requests",
        "error_count",
        "concurrency",
        "concurrency_proven",
        "running_peak",
        "waiting_peak",
        "prompt_tokens",
        "ttft_p50_s",
        "ttft_p95_s",
        "output_tokens_per_s",
        "peak_kv_usage",
        "preemptions",
        "duration_s",
        "tokenize_calls",
    )
    fields = {k: getattr(result, k) for k in keys}
    # requests sent again after their connection failed, still failed on it, answered with a 4xx, sent
    # again after a 5xx that is not vLLM's engine-dead reply, still answered so, got no answer in time
    fields.update(
        (k, v)
        for k in (
            "retried",
            "connection_errors",
            "rejected",
            "server_retried",
            "server_errors",
            "request_timeouts",
        )
        if (v := getattr(result, k))
    )
    if result.request_timeouts and result.timeout_progress_tokens is not None:
        fields["timeout_progress_tokens"] = result.timeout_progress_tokens  # 0 too: nothing moved
    wave = result.wave
    if wave is not None:  # the concurrency wave: sent, ran at once, its size and tokens/s
        fields["wave"] = {
            k: v
            for k in ("sent", "concurrency_proven", "waiting_peak", "prompt_tokens", "output_tokens_per_s")
            if (v := getattr(wave, k)) is not None
        } | ({"skipped": wave.skipped} if wave.skipped else {})
    return fields
