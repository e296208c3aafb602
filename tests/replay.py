"""Replay: the daemon's one loop driven in process by a fake clock and a scripted history.

No process is started and no time passes. The queue (:class:`ScriptedQueue`) hands the loop the events
of a timeline in the order of their moments; a read with nothing due within its timeout moves the clock
by that timeout. Each launch is a :class:`FakeEngine` that replays vLLM's output (the log fixtures of
``tests/fixtures/logs``: GPU start-ups and failures in vLLM's own message formats) and exits when its
script says; the checks the runner would run on threads
(readiness, the probe, ``/health``, ``/metrics``, the liveness completion, the drain's reads) are answered
by the script at the moment they are asked, a little later on the timeline (the liveness completion as late
as its script says, or never). What the daemon does is then read from what it wrote: its log events,
sd_notify's lines, status.json.
"""

from __future__ import annotations

import heapq
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from r1sup.adapters.launcher import StopReport
from r1sup.adapters.notify import Notifier
from r1sup.core import catalog, liveness, modelarch
from r1sup.core import config as cfg
from r1sup.core.events import CheckDone, ChildEOF, ChildOutput, EventQueue
from r1sup.core.hardware import GIB, DeviceFacts, GpuInfo
from r1sup.core.probing import ProbeResult
from r1sup.supervision.daemon import Daemon
from r1sup.supervision.runner import Runner
from r1sup.supervision.session import Session
from r1sup.supervision.states import Cause, State
from r1sup.supervision.tuner import ModelKnowledge
from r1sup.supervision.world import World
from r1sup_proc import write_config

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
MODEL = "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
TURNS_LIMIT = 200_000  # a replay that turns this often has run away (a phase that never ends)
CHECK_LATENCY_S = 0.05  # a check's answer lands on the timeline this long after it was asked


def log_lines(name: str, *, after: str | None = None) -> list[str]:
    """A log fixture (``gpu/success-v1-full.log``); with ``after``, the lines that follow the first
    line containing it."""
    lines = (FIXTURES / name).read_text(encoding="utf-8").splitlines()
    if after is not None:
        start = next(i for i, line in enumerate(lines) if after in line)
        lines = lines[start + 1 :]
    return lines


STARTUP = log_lines("gpu/success-v1-full.log")
RUNTIME_OOM = log_lines("gpu/oom-runtime-v1.log", after="Application startup complete")
STATS_LINE = (
    "(APIServer pid=1) INFO 06-02 09:15:10 [loggers.py:127] Engine 000: Avg prompt throughput: 0.0 "
    "tokens/s, Avg generation throughput: 0.0 tokens/s, Running: 0 reqs, Waiting: 0 reqs, GPU KV cache "
    "usage: 0.0%, Prefix cache hit rate: 0.0%"
)


def stats_line(generation_tps: float, running: int, waiting: int, prompt_tps: float = 0.0) -> str:
    """vLLM's periodic stats line (V1's loggers.py format) with these figures."""
    return (
        f"(APIServer pid=1) INFO 06-02 09:15:10 [loggers.py:127] Engine 000: Avg prompt throughput: "
        f"{prompt_tps:.1f} tokens/s, Avg generation throughput: {generation_tps:.1f} tokens/s, Running: "
        f"{running} reqs, Waiting: {waiting} reqs, GPU KV cache usage: 12.5%, Prefix cache hit rate: 0.0%"
    )


IDLE = liveness.Figures(running=0, waiting=0, prompt_tokens=0, generation_tokens=0, finished=0)


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t


class ScriptedQueue(EventQueue):
    """The loop's queue on a timeline of the fake clock. Signals are scheduled too: at their moment
    they join the deques the signal handlers fill."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock
        self._timeline: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()
        self.turns = 0

    def at(self, when: float, item: Any) -> None:
        heapq.heappush(self._timeline, (when, next(self._seq), item))

    def put(self, event: Any) -> None:
        self.at(self.clock(), event)

    def get(self, timeout: float) -> Any:
        self.turns += 1
        if self.turns > TURNS_LIMIT:
            raise RuntimeError(f"the replay ran away at t={self.clock():.1f}")
        limit = self.clock() + max(0.0, timeout)
        if self._timeline and self._timeline[0][0] <= limit:
            when, _, item = heapq.heappop(self._timeline)
            self.clock.t = max(self.clock.t, when)
            if isinstance(item, Signal):
                (self.reloads if item.reload else self.signals).append(item.signum)
                return None
            if isinstance(item, Action):
                item.run()
                return None
            return item
        self.clock.t = limit
        return None

    def queued(self) -> int:
        now = self.clock()
        return sum(
            1 for when, _, item in self._timeline if when <= now and not isinstance(item, (Signal, Action))
        )

    def install_signal_handlers(self, signums: tuple[int, ...] = ()) -> None:
        pass

    def restore_signal_handlers(self) -> None:
        pass


@dataclass(frozen=True)
class Signal:
    signum: int
    reload: bool = False


@dataclass(frozen=True)
class Action:
    """Something the test does at a moment of the timeline (edit the config, read status.json)."""

    run: Callable[[], None]


@dataclass
class Script:
    """What one launch does, in seconds after its start."""

    lines: list[str] = field(default_factory=lambda: list(STARTUP))
    line_every_s: float = 0.5
    ready: bool = True  # readiness checks pass once the lines are out
    exit_at: float | None = None  # the engine exits by itself then (code ``exit_code``)
    exit_code: int = 1
    later: list[tuple[float, str]] = field(default_factory=list)  # (seconds after start, line)
    probe_ok: bool = True
    probe_s: float = CHECK_LATENCY_S  # how long the probe takes
    probe_internal: bool = False  # the probe's child crashed (r1sup's own failure)
    health: Callable[[float], bool] = lambda s: True  # /health at s seconds after the start
    figures: Callable[[float], liveness.Figures | None] = lambda s: IDLE
    completion: Callable[[float], tuple[int, str]] = lambda s: (200, "")  # the liveness completion
    # how long the completion asked at s takes to come back; None: not within the request's own timeout
    # (progress_timeout_s), which then ends it unanswered (status 0), as a stopped engine core leaves it
    completion_s: Callable[[float], float | None] = lambda s: CHECK_LATENCY_S
    # how long the serving phase's /metrics read asked at s takes to come back (its figures are those
    # of the moment it was asked); None: never (its thread hangs)
    metrics_s: Callable[[float], float | None] = lambda s: CHECK_LATENCY_S
    drain_s: float | None = None  # asked to drain (SIGTERM to its leader): exits this much later
    # (None: once its figures show nothing pending)
    # with drain_s: vLLM's "request processing complete" line this long after it is asked to drain
    drained_line_s: float | None = None
    term_ignored: bool = False  # SIGTERM to its group does nothing: only SIGKILL ends it
    teardown: list[str] = field(default_factory=list)  # lines it prints after SIGTERM, 0.5 s apart


class FakeEngine:
    """A launched vLLM as the runner sees it (launcher.Engine's interface), replaying a script."""

    def __init__(self, harness: Replay, spec: Any, events: Any, launch_id: int) -> None:
        self.h = harness
        self.spec = spec
        self.launch_id = launch_id
        self.script = harness.script_for(launch_id)
        self.proc: Any = None
        self.eof = False
        self.started_at = 0.0
        self.exit_at: float | None = None
        self.code: int | None = None
        self.stopped_by: str | None = None

    @property
    def pid(self) -> int | None:
        return 40000 + self.launch_id if self.proc is not None else None

    def start(self) -> None:
        q, now = self.h.queue, self.h.clock()
        self.proc = SimpleNamespace(pid=self.pid)
        self.started_at = now
        self.h.engines.append(self)
        s = self.script
        for i, line in enumerate(s.lines):
            q.at(now + (i + 1) * s.line_every_s, ChildOutput(self.launch_id, line))
        for after, line in s.later:
            q.at(now + after, ChildOutput(self.launch_id, line))
        if s.exit_at is not None:
            self._exit(now + s.exit_at, s.exit_code)

    @property
    def out_at(self) -> float:
        """When its start-up lines are all out."""
        return self.started_at + (len(self.script.lines) + 1) * self.script.line_every_s

    def _exit(self, when: float, code: int) -> None:
        if self.exit_at is None or when < self.exit_at:
            self.exit_at, self.code = when, code
            self.h.queue.at(when, ChildEOF(self.launch_id))

    def poll(self) -> int | None:
        if self.exit_at is not None and self.h.clock() >= self.exit_at:
            return self.code
        return None

    def alive(self) -> bool:
        return self.proc is not None and self.poll() is None

    def record_descendants(self) -> None:
        pass

    def all_pids(self) -> list[int]:
        return [self.pid] if self.pid else []

    def terminate_leader(self) -> None:
        """Asked to drain (vLLM's own drain, ``--shutdown-timeout``): it exits ``drain_s`` later where the
        script says, else once its figures show nothing pending (looked at every 0.5 s, for an hour)."""
        s, now = self.script, self.h.clock()
        if s.drain_s is not None:
            if s.drained_line_s is not None:
                line = "(EngineCore pid=7) INFO [shutdown] EngineCore: request processing complete"
                self.h.queue.at(now + s.drained_line_s, ChildOutput(self.launch_id, line))
            self._exit(now + s.drain_s, 0)
            return
        for step in range(1, 7201):
            at = now + step * 0.5
            figures = s.figures(at - self.started_at)
            if figures is not None and figures.pending == 0:
                self._exit(at, 0)
                return

    def begin_stop(self) -> bool:
        """SIGTERM to its group: it prints its teardown lines and exits (unless the script ignores it)."""
        self.stopped_by = "stop"
        if not self.alive():
            return False
        now, s = self.h.clock(), self.script
        for i, line in enumerate(s.teardown):
            self.h.queue.at(now + (i + 1) * 0.5, ChildOutput(self.launch_id, line))
        if not s.term_ignored:
            self._exit(now + 0.5 * len(s.teardown), -15)
        return True

    def group_exited(self) -> bool:
        return not self.alive()

    def kill_group(self) -> bool:
        """SIGKILL to its group: gone at once."""
        if not self.alive():
            return False
        self.stopped_by = "sigkill"
        self.exit_at = None
        self._exit(self.h.clock(), -9)
        return True

    def finish_stop(self, release_timeout: float = 60.0, memory_released: Any = None) -> StopReport:
        return StopReport()


class FakeProbeProcess:
    def __init__(self, connection: Any = None) -> None:  # the runner tells the real one its connection
        self.proc = SimpleNamespace(poll=lambda: 0, kill=lambda: None)

    def kill(self) -> None:
        pass

    def run(self, spec: Any) -> Any:  # never called: the harness answers the probe's check
        raise AssertionError("the replay answers the probe")


class Events:
    """structlog as a list of (event, fields); ``t`` is the fake clock's time of each."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.items: list[tuple[str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Callable[..., None]:
        def emit(event: str, **fields: Any) -> None:
            self.items.append((event, {"level": level, "t": self.clock(), **fields}))

        return emit

    def bind(self, **fields: Any) -> Events:
        return self

    def names(self, *only: str) -> list[str]:
        return [name for name, _ in self.items if not only or name in only]

    def named(self, name: str) -> list[dict[str, Any]]:
        return [fields for n, fields in self.items if n == name]


class Recorded(Notifier):
    """sd_notify's lines, kept instead of sent."""

    def __init__(self) -> None:
        super().__init__({})
        self.sent: list[str] = []

    def send(self, *lines: str) -> bool:
        self.sent.extend(lines)
        return True


def h100() -> DeviceFacts:
    gpu = GpuInfo(0, "NVIDIA H100 80GB HBM3", int(79.1 * GIB), int(78.6 * GIB), (9, 0))
    return DeviceFacts(backend="cuda", gpus=(gpu,), driver="550.54.15")


class Replay:
    """One daemon in process: ``run()`` turns its loop on the fake clock until it exits."""

    def __init__(self, tmp_path: Path, scripts: list[Script], **sections: dict[str, Any]):
        self.tmp = tmp_path
        self.scripts = scripts
        self.clock = FakeClock()
        self.queue = ScriptedQueue(self.clock)
        self.engines: list[FakeEngine] = []
        self.log = Events(self.clock)
        self.notifier = Recorded()
        self.transitions: list[tuple[State, State]] = []
        daemon = {
            "health_interval_s": 5.0,
            "health_failures": 3,
            "liveness_interval_s": 10.0,
            "progress_timeout_s": 60.0,
            "backoff_initial_s": 1.0,
            "backoff_max_s": 8.0,
            "restart_budget": 3,
            "stable_after_s": 300.0,
            "metrics_port": 0,
            **sections.pop("daemon", {}),
        }
        body = {
            "model": {"name": MODEL},
            "state": {"dir": str(tmp_path / "state")},
            "server": {"port": 18000, **sections.pop("server", {})},
            "daemon": daemon,
            **sections,
        }
        self.config_path = write_config(tmp_path / "r1sup.toml", body)
        config = cfg.load(self.config_path, environ={})
        know = ModelKnowledge(
            device=h100(), arch=modelarch.arch_from_config(catalog.MODELS[MODEL]), vllm_version="0.33.0"
        )
        # what the preflight answers (a test may make it raise)
        self.preflight: Callable[[], Any] = lambda: SimpleNamespace(engine=None)
        # the world as the daemon reaches it: fake engines on the timeline, checks answered by the script
        self.world = World(
            engine=lambda spec, events, n: FakeEngine(self, spec, events, n),
            kill_leftovers=lambda instance: [],
            port_holder=lambda host, port, instance: None,
            probe_process=FakeProbeProcess,
            device=h100,
            process_watch=lambda pid: None,
            read_metrics=self._read_metrics,
            knowledge=lambda config, log, engine=None: know,
            preflight=lambda config, log, check: self.preflight(),
            clock=self.clock,
            checks=self._check,
        )
        runner = Runner(config, self.queue, log=self.log, world=self.world)
        session = Session(config, None, self.log, self.queue, runner, {})
        self.daemon = Daemon(session, notifier=self.notifier)
        self.hooks: list[tuple[State, int, Callable[[], None]]] = []
        self.watchers: list[Callable[[State, State], None]] = []
        self.causes: list[tuple[State, Cause, State]] = []  # each transition with what caused it
        original = self.daemon.advance

        def advance(cause: Cause, status: str | None = None) -> None:
            old = self.daemon.state
            original(cause, status)
            new = self.daemon.state
            self.transitions.append((old, new))
            self.causes.append((old, cause, new))
            for watcher in self.watchers:
                watcher(old, new)
            if old is not new:
                entered = sum(1 for a, b in self.transitions if b is new and a is not b)
                for state, count, action in self.hooks:
                    if state is new and count == entered:
                        action()

        self.daemon.advance = advance  # type: ignore[method-assign]

    def script_for(self, launch_id: int) -> Script:
        return self.scripts[min(launch_id, len(self.scripts)) - 1]

    def engine(self, number: int) -> FakeEngine:
        return next(e for e in self.engines if e.launch_id == number)

    # --- what the script makes happen -------------------------------------------------------------

    def signal(self, after: float, signum: int) -> None:
        """A signal ``after`` seconds from now (SIGHUP joins the reloads, the others the stops)."""
        self.queue.at(self.clock() + after, Signal(signum, reload=signum == 1))

    def after(self, seconds: float, action: Callable[[], None]) -> None:
        """Run ``action`` (in the daemon's thread) ``seconds`` from now."""
        self.queue.at(self.clock() + seconds, Action(action))

    def edit_config(self, **sections: dict[str, Any]) -> None:
        """Change sections of the config file (for a reload), keeping the rest."""
        import tomllib

        body = tomllib.loads(self.config_path.read_text(encoding="utf-8"))
        for name, values in sections.items():
            body.setdefault(name, {}).update(values)
        write_config(self.config_path, body)

    def on_entering(self, state: State, action: Callable[[], None], count: int = 1) -> None:
        """Run ``action`` (in the daemon's thread) right after its ``count``-th transition into ``state``."""
        self.hooks.append((state, count, action))

    def on_transition(self, action: Callable[[State, State], None]) -> None:
        """Call ``action(old, new)`` (in the daemon's thread) right after every transition."""
        self.watchers.append(action)

    def at_serving(self, count: int, action: Callable[[], None]) -> None:
        """Run ``action`` the moment the daemon reaches serving for the ``count``-th time."""
        self.on_entering(State.SERVING, action, count)

    def _check(self, kind: str, launch: Any, fn: Callable[[], Any]) -> None:
        now = self.clock()
        # the fakes answer these: what fn returns
        if kind in ("preflight", "leftovers", "stopped", "devices"):
            number = launch.number if launch is not None else 0
            self.queue.at(now + CHECK_LATENCY_S, CheckDone(kind, number, *fn()))
            return
        engine = self.engine(launch.number)
        s = engine.script
        since = now - engine.started_at
        ok, detail = True, ""
        payload: Any = None
        if kind == "ready":
            ok = s.ready and engine.alive() and now >= engine.out_at
            detail = "" if ok else "connection refused"
        elif kind == "probe":
            payload = {"ok": s.probe_ok, "requests": 1, "succeeded": 1 if s.probe_ok else 0, "concurrency": 1}
            if s.probe_ok:  # what a passed probe measured: one request at once, its tokens/s
                payload.update(
                    concurrency_proven=1, output_tokens=16, output_tokens_per_s=40.0, ttft_p50_s=0.1
                )
            if not s.probe_ok:
                payload["errors"] = ["500 Internal Server Error"]
            if s.probe_internal:
                payload["internal"] = {
                    "where": "r1sup.adapters.probe",
                    "error": "ImportError: no module named openai",
                }
            ok = s.probe_ok
            # the probe child's JSON, read back as the runner reads it
            result = ProbeResult.from_dict(payload)
            self.queue.at(now + s.probe_s, CheckDone(kind, launch.number, ok, detail, result))
            return
        elif kind == "health":
            ok = engine.alive() and s.health(since)
            detail = "" if ok else "connection refused"
        elif kind == "metrics":  # the daemon's own read (watch.read_metrics: _read_metrics here)
            latency = s.metrics_s(since)
            if latency is None:
                return
            ok, detail, payload = fn()
            self.queue.at(now + latency, CheckDone(kind, launch.number, ok, detail, payload))
            return
        elif kind == "liveness":
            latency = s.completion_s(since)
            status, body = s.completion(since) if engine.alive() else (0, "")
            if latency is None:  # the request's timeout ends it, unanswered
                latency, status, body = self.daemon.config.daemon.progress_timeout_s, 0, ""
            ok = status == 200
            payload = liveness.ProbeResult(now + latency, ok, status, body)
            self.queue.at(now + latency, CheckDone(kind, launch.number, ok, detail, payload))
            return
        elif kind == "drain":
            payload = SimpleNamespace(figures=s.figures(since) if engine.alive() else None)
        else:
            raise AssertionError(f"unexpected check {kind}")
        self.queue.at(now + CHECK_LATENCY_S, CheckDone(kind, launch.number, ok, detail, payload))

    def _read_metrics(self, endpoint: Any, timeout: float, at: float | None = None) -> liveness.MetricsSample:
        """``/metrics`` of the running engine now, stamped as watch.read_metrics stamps it (``at``: the
        time the sample was due). The serving phase's samples and the drain's first read."""
        now = self.clock()
        at = now if at is None else at
        live = [e for e in self.engines if e.alive()]
        if not live:
            return liveness.MetricsSample(at, None, "/metrics unanswered")
        engine = live[-1]
        return liveness.MetricsSample(at, engine.script.figures(now - engine.started_at))

    # --- running and reading ----------------------------------------------------------------------

    def run(self) -> int:
        return self.daemon.run()

    def status_lines(self) -> list[str]:
        return [line.removeprefix("STATUS=") for line in self.notifier.sent if line.startswith("STATUS=")]

    def status_json(self) -> dict[str, Any]:
        path = self.tmp / "state" / "status.json"
        return dict(json.loads(path.read_text(encoding="utf-8")))

    def states(self) -> list[str]:
        """The state after each of the daemon's transitions, a same-state one (the first plan, a relaunch)
        included; the log's ``state_changed`` events are the transitions that change the state."""
        changes = [(fields["old"], fields["new"]) for fields in self.log.named("state_changed")]
        assert changes == [(a.value, b.value) for a, b in self.transitions if a is not b]
        return [new.value for _, new in self.transitions]
