"""The one loop (r1sup.supervision.loop): how it turns phases, what it hands them, and that nothing else in
r1sup reads the event queue."""

from __future__ import annotations

import ast
import signal
from pathlib import Path
from typing import Any

import pytest

from r1sup.core.events import ChildOutput, EventQueue, ReloadRequested, Signalled
from r1sup.supervision.loop import Done, Loop, LoopReentered, Phase, StopRequested, Waiting
from replay import FakeClock, ScriptedQueue

PACKAGE = Path(__file__).resolve().parents[1] / "supervisor" / "r1sup"


class Recording(Phase):
    """Keeps what it was handed; done after ``turns`` turns."""

    def __init__(self, turns: int = 3, **attrs: Any) -> None:
        self.turns = turns
        self.seen: list[Any] = []
        for name, value in attrs.items():
            setattr(self, name, value)

    def on(self, event: Any, now: float) -> Any:
        self.seen.append((event, now))
        return Done(len(self.seen)) if len(self.seen) >= self.turns else None


def loop_on(clock: FakeClock | None = None) -> tuple[Loop, ScriptedQueue, FakeClock]:
    clock = clock or FakeClock()
    queue = ScriptedQueue(clock)
    return Loop(queue, clock=clock), queue, clock


def test_a_phase_gets_each_event_with_the_time_it_came() -> None:
    loop, queue, clock = loop_on()
    queue.at(1000.1, ChildOutput(1, "a"))
    queue.at(1000.15, ChildOutput(1, "b"))
    queue.at(1000.5, ChildOutput(1, "c"))
    phase = Recording(turns=4)
    assert loop.run(phase) == 4
    assert phase.seen == [
        (ChildOutput(1, "a"), 1000.1),
        (ChildOutput(1, "b"), 1000.15),
        (None, pytest.approx(1000.35)),  # nothing within a turn: the phase turns anyway
        (ChildOutput(1, "c"), 1000.5),
    ]


def test_without_events_the_phase_turns_at_least_every_turn_s_and_at_its_own_due_time() -> None:
    loop, _, clock = loop_on()
    phase = Recording(turns=3)
    loop.run(phase)
    assert [round(t - 1000, 3) for _, t in phase.seen] == [0.2, 0.4, 0.6]
    waits = Recording(turns=2, due=lambda now: 0.05)
    loop.run(waits)
    assert [round(t - 1000.6, 3) for _, t in waits.seen] == [0.05, 0.1]


def test_a_stop_signal_ends_a_phase_that_does_not_take_it_as_stop_requested() -> None:
    loop, queue, _ = loop_on()
    queue.signals.append(signal.SIGTERM)
    with pytest.raises(StopRequested) as stop:
        loop.run(Recording(turns=100))
    assert stop.value.signum == signal.SIGTERM


def test_a_phase_that_waits_through_a_signal_is_told_how_many_came() -> None:
    class Patient(Recording):
        def on_signal(self, sig: Signalled, now: float) -> Any:
            self.seen.append((sig, now))
            return Done("forced") if sig.count >= 2 else None

    loop, queue, _ = loop_on()
    queue.signals.append(signal.SIGTERM)
    phase = Patient(turns=100)
    queue.at(1001.0, _signal(signal.SIGTERM))
    assert loop.run(phase) == "forced"
    counts = [e.count for e, _ in phase.seen if isinstance(e, Signalled)]
    assert counts[0] == 1 and counts[-1] == 2


def _signal(signum: int) -> Any:
    from replay import Signal

    return Signal(signum)


def test_sighup_goes_only_to_a_phase_that_takes_reloads() -> None:
    loop, queue, _ = loop_on()
    queue.reloads.append(signal.SIGHUP)
    deaf = Recording(turns=2)
    loop.run(deaf)
    assert not any(isinstance(e, ReloadRequested) for e, _ in deaf.seen) and queue.reloads
    listening = Recording(turns=2, reloads=True)
    loop.run(listening)
    assert isinstance(listening.seen[0][0], ReloadRequested) and not queue.reloads


def test_a_fault_from_a_check_thread_is_raised_by_the_loop_unless_the_phase_defers_it() -> None:
    clock = FakeClock()
    faults = [RuntimeError("a check raised")]
    loop = Loop(ScriptedQueue(clock), clock=clock, fault=lambda: faults.pop() if faults else None)
    with pytest.raises(RuntimeError, match="a check raised"):
        loop.run(Recording(turns=5))
    faults.append(RuntimeError("later"))
    assert loop.run(Recording(turns=2, faults=False)) == 2 and faults


def test_a_phase_hands_over_to_the_next_and_the_tick_runs_for_phases_that_want_it() -> None:
    ticks: list[int] = []
    clock = FakeClock()
    loop = Loop(ScriptedQueue(clock), clock=clock, tick=lambda: ticks.append(1))

    class First(Phase):
        ticks = False

        def on(self, event: Any, now: float) -> Any:
            return Recording(turns=2)

    assert loop.run(First()) == 2
    assert len(ticks) == 2  # the second phase's two turns, none for the first


def test_a_phase_that_enters_the_loop_from_its_turn_is_a_bug_and_the_loop_runs_on_after_it() -> None:
    loop, _, _ = loop_on()

    class Nested(Phase):
        def on(self, event: Any, now: float) -> Any:
            return Done(loop.run(Recording(turns=1)))

    with pytest.raises(LoopReentered, match="Recording inside Nested"):
        loop.run(Nested())
    assert loop.run(Recording(turns=1)) == 1  # not left marked as running


def test_waiting_ends_at_its_moment_and_hands_on_what_came_meanwhile() -> None:
    loop, queue, clock = loop_on()
    queue.at(1000.3, ChildOutput(1, "x"))
    taken: list[Any] = []
    loop.run(Waiting(1001.0, taken.append))
    assert clock() == pytest.approx(1001.0) and taken == [ChildOutput(1, "x")]


def test_the_real_queue_wakes_the_loop_when_an_event_comes() -> None:
    import threading
    import time

    queue = EventQueue()
    threading.Timer(0.05, lambda: queue.put(ChildOutput(1, "late"))).start()
    t0 = time.monotonic()
    phase = Recording(turns=1, due=lambda now: 5.0)
    Loop(queue).run(phase)
    assert phase.seen[0][0] == ChildOutput(1, "late") and time.monotonic() - t0 < 0.2 + 0.15


def _queue_reads(path: Path) -> list[int]:
    """Lines of ``path`` that call ``.get(`` on something named ``events`` (the event queue)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            owner = node.func.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name in ("events", "queue"):
                found.append(node.lineno)
    return found


def test_the_loop_is_the_only_reader_of_the_event_queue() -> None:
    readers = {
        str(path.relative_to(PACKAGE)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if (lines := _queue_reads(path))
    }
    loop = "supervision/loop.py"
    assert readers == {loop: readers.get(loop, [])} and readers.get(loop)


def test_the_reader_check_finds_a_second_reader(tmp_path: Path) -> None:
    rogue = tmp_path / "rogue.py"
    rogue.write_text("def wait(self):\n    return self.events.get(0.2)\n", encoding="utf-8")
    assert _queue_reads(rogue) == [2]


# --- blocking work as checks off the loop's thread ---------------------------------------------------


class _Quiet:
    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def _session(tmp_path: Path, preflight: Any) -> Any:
    from r1sup.core import config as cfg
    from r1sup.supervision.runner import Runner
    from r1sup.supervision.session import Session
    from r1sup.supervision.world import World
    from r1sup_proc import write_config

    body = {"model": {"name": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"}, "state": {"dir": str(tmp_path)}}
    config = cfg.load(write_config(tmp_path / "r1sup.toml", body), environ={})
    events = EventQueue()
    runner = Runner(config, events, log=_Quiet(), world=World(preflight=preflight))
    return Session(config, None, _Quiet(), events, runner, {})


def test_the_preflight_runs_off_the_loops_thread_and_a_stop_signal_cancels_it(tmp_path: Path) -> None:
    import threading
    import time

    where: list[str] = []
    ended = threading.Event()

    def preflight(config: Any, log: Any, cancelled: Any) -> Any:
        where.append(threading.current_thread().name)
        try:
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline:  # the import of vLLM, as long as it takes
                cancelled()
                time.sleep(0.01)
            return "never cancelled"
        finally:
            ended.set()

    session = _session(tmp_path, preflight)
    threading.Timer(0.1, lambda: session.events.signals.append(signal.SIGTERM)).start()
    t0 = time.monotonic()
    with pytest.raises(StopRequested):
        session.runner.loop.run(session.preflight())
    assert time.monotonic() - t0 < 2.0  # the loop's turn, not the work, ended the wait
    assert ended.wait(2.0) and where == ["check-preflight"]
    assert session.checked is None  # nothing remembered: a later preflight runs again


def test_the_preflight_check_returns_its_result_once_and_raises_its_refusal_in_the_loops_thread(
    tmp_path: Path,
) -> None:
    from r1sup.core import errors
    from r1sup.core.errors import PreflightError

    calls: list[int] = []

    def passes(config: Any, log: Any, cancelled: Any) -> Any:
        calls.append(1)
        return "checked"

    session = _session(tmp_path, passes)
    run = session.runner.loop.run
    assert run(session.preflight()) == "checked" and run(session.preflight()) == "checked" and calls == [1]

    def refuses(config: Any, log: Any, cancelled: Any) -> Any:
        raise PreflightError("server.python", "No module named 'vllm'", exit_code=errors.EXIT_FATAL_FAILURE)

    with pytest.raises(PreflightError, match="No module named 'vllm'"):
        (refused := _session(tmp_path, refuses)).runner.loop.run(refused.preflight())
