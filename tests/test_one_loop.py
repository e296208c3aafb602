"""One loop per process: ``r1sup run``, ``tune`` and ``worker`` each enter :meth:`Loop.run` once, with a
script that yields every wait as a phase (issue 28: "one loop, entered once per process, drives every
phase")."""

from __future__ import annotations

import ast
import signal
from pathlib import Path
from typing import Any

import pytest

from r1sup.core import config as cfg
from r1sup.core import errors
from r1sup.core import failure as F
from r1sup.supervision import launch, loop, serving, worker
from r1sup.supervision.loop import Loop, Phase
from replay import STARTUP, FakeClock, Replay, Script, ScriptedQueue, Signal, log_lines

PACKAGE = Path(__file__).resolve().parents[1] / "supervisor" / "r1sup"

# where each process enters the loop: the one call of Loop.run of r1sup run, r1sup tune, r1sup worker
ENTRIES = {
    ("supervision/daemon.py", "Daemon.run"),
    ("cli/commands/tune.py", "main"),
    ("supervision/worker.py", "Worker.run"),
}


def _loop_runs(path: Path) -> list[tuple[str, int]]:
    """The calls ``<...>loop.run(...)`` in ``path``: the function (Class.method) each is in, its line."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, child.name)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{where}.{child.name}" if where and "." not in where else child.name)
            else:
                if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute):
                    owner = child.func.value
                    name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                    if child.func.attr == "run" and name == "loop":
                        found.append((where, child.lineno))
                visit(child, where)

    visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return found


def test_each_process_enters_the_loop_at_one_place() -> None:
    calls = [
        (str(path.relative_to(PACKAGE)), where)
        for path in sorted(PACKAGE.rglob("*.py"))
        for where, _ in _loop_runs(path)
    ]
    assert sorted(calls) == sorted(ENTRIES), "Loop.run is entered once per process, by its supervisor"


def test_the_entry_check_finds_a_wait_that_enters_the_loop_itself(tmp_path: Path) -> None:
    rogue = tmp_path / "rogue.py"
    rogue.write_text(
        "class Runner:\n    def sleep(self, s):\n        return self.loop.run(Waiting(s))\n", encoding="utf-8"
    )
    assert _loop_runs(rogue) == [("Runner.sleep", 3)]


def test_a_script_that_enters_the_loop_again_is_a_bug() -> None:
    clock = FakeClock()
    looped = Loop(ScriptedQueue(clock), clock=clock)

    def script() -> Any:
        yield loop.Waiting(clock() + 1.0)
        looped.run(loop.Waiting(clock() + 1.0))  # a wait that forgot to be a phase of the script

    with pytest.raises(loop.LoopReentered, match="Waiting inside Waiting"):
        looped.run(script())

    def first() -> Any:  # before its first wait too
        looped.run(loop.Waiting(clock() + 1.0))
        yield loop.Waiting(clock() + 1.0)

    with pytest.raises(loop.LoopReentered, match="Waiting inside a script"):
        looped.run(first())
    assert looped.run(loop.Waiting(clock() + 1.0)) is None  # not left marked as running


class _Entries:
    """Counts the runs of the loop and the kinds of phase that turned in them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.runs = 0
        self.phases: set[str] = set()
        run, turn = Loop.run, Loop._turn

        def counted(me: Loop, work: Any) -> Any:
            self.runs += 1
            return run(me, work)

        def seen(me: Loop, phase: Phase) -> Any:
            self.phases.add(type(phase).__name__)
            return turn(me, phase)

        monkeypatch.setattr(Loop, "run", counted)
        monkeypatch.setattr(Loop, "_turn", seen)


def test_a_whole_run_is_one_run_of_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # bring-up with a failed launch and a relaunch on new flags, serving, a crash, the backoff and the
    # restart, serving again, SIGTERM: the drain and the stop
    oom = log_lines("gpu/oom-cudagraph-capture-frames-v1.log")
    crash = Script(exit_at=len(STARTUP) * 0.5 + 20, exit_code=1)  # 20 s into serving
    r = Replay(tmp_path, [Script(lines=oom, exit_at=len(oom) * 0.5 + 1), crash, Script()])
    r.at_serving(2, lambda: r.signal(30.0, signal.SIGTERM))
    entries = _Entries(monkeypatch)
    assert r.run() == errors.EXIT_OK
    assert r.states() == [
        *("planning", "launching", "launching", "probing", "serving"),
        *("backoff", "launching", "probing", "serving"),
        *("draining", "stopping", "stopped"),
    ]
    assert r.log.named("failure_classified")[0]["failure_class"] == F.OOM_CUDAGRAPH
    assert r.log.named("serving_failed")[0]["failure_class"] == F.ENGINE_DEAD
    assert entries.runs == 1
    waits = {
        launch.Awaiting,  # the preflight
        launch.Starting,
        launch.ProbeWait,
        launch.Flushing,
        launch.Stopping,
        serving.Serving,
        loop.Waiting,  # the backoff
    }
    assert {w.__name__ for w in waits} <= entries.phases, entries.phases


def test_a_worker_is_one_run_of_the_loop_until_a_stop_signal(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    queue = ScriptedQueue(clock)
    queue.at(clock() + 30.0, Signal(signal.SIGTERM))
    group = {"nnodes": 2, "backend": "mp", "master_addr": "10.0.0.5", "master_port": 29555}
    config = cfg.build(
        {"model": {"name": "org/m"}, "multinode": {**group, "node_rank": 1, "leader_port": 9}}, env={}
    )
    asked: list[float] = []

    def fetch(url: str) -> None:  # the leader is not up: the worker polls it until the signal
        asked.append(clock())
        return None

    entries = _Entries(monkeypatch)
    assert worker.Worker(config, events=queue, fetch=fetch, clock=clock).run() == 0
    assert entries.runs == 1 and len(asked) >= 3 and asked[-1] <= 1030.0
