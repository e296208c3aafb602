"""The launcher with real processes: process group, output pump, stop escalation, orphans, the port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from conftest import free_port, wait_until
from r1sup.adapters.launcher import Engine, LaunchSpec, build_spec, kill_leftovers, port_holder, port_in_use
from r1sup.core import config as cfg
from r1sup.core.events import ChildEOF, ChildOutput, EventQueue
from r1sup.core.flags import EngineFlags

CHILD = str(Path(__file__).resolve().parent / "procs" / "child.py")
PARENT = str(Path(__file__).resolve().parent / "procs" / "parent.py")
pytestmark = pytest.mark.timeout(60)


def spec_for(*args: str, env: dict[str, str] | None = None, port: int = 1) -> LaunchSpec:
    argv = (sys.executable, CHILD, *args)
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    return LaunchSpec(argv, {**base, **(env or {})}, argv, "127.0.0.1", port, "x", "test-instance")


def collect(events: EventQueue, launch: int, timeout: float = 20.0) -> list[str]:
    lines: list[str] = []

    def done() -> bool:
        event = events.get(0.1)
        if isinstance(event, ChildOutput) and event.launch == launch:
            lines.append(event.line)
        return isinstance(event, ChildEOF) and event.launch == launch

    wait_until(done, timeout, interval=0, what="child EOF")
    return lines


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_output_lines_own_group_and_closed_stdin():
    events = EventQueue()
    engine = Engine(spec_for("lines"), events, 1)
    engine.start()
    assert os.getpgid(engine.pid) == engine.pid  # its own process group
    lines = collect(events, 1)
    assert lines[0] == "first line"
    assert lines[1:4] == ["progress 10%", "progress 50%", "progress 100%"]  # \r counts as a line end
    long = [line for line in lines if line.startswith("xxx")]
    assert sum(len(x) for x in long) == 200_000 and max(len(x) for x in long) <= 64 * 1024
    assert "stdin=''" in lines
    wait_until(lambda: engine.poll() is not None, 10)
    assert engine.stop(5).escalated is False


def test_a_flood_of_output_never_stalls_the_child():
    events = EventQueue()
    engine = Engine(spec_for("flood", "20"), events, 1)
    engine.start()
    # nobody reads the queue meanwhile: the pump keeps the pipe empty, so the child finishes
    wait_until(lambda: engine.poll() is not None, 30, what="child to write 20 MiB and exit")
    assert engine.poll() == 0
    engine.stop(5)


def test_stop_escalates_to_sigkill_and_kills_the_group():
    events = EventQueue()
    engine = Engine(spec_for("stubborn"), events, 1)
    engine.start()
    line = wait_until(lambda: _line_starting(events, "pids"), 20)
    child, grandchild = (int(x) for x in str(line).split()[1:])
    engine.record_descendants()
    report = engine.stop(1.0)
    assert report.escalated
    assert not alive(child) and not alive(grandchild)
    assert report.memory_released and report.port_free


def test_recorded_descendant_that_left_the_group_is_killed():
    events = EventQueue()
    engine = Engine(spec_for("escape"), events, 1)
    engine.start()
    line = wait_until(lambda: _line_starting(events, "pids"), 20)
    _, grandchild = (int(x) for x in str(line).split()[1:])
    engine.record_descendants()
    report = engine.stop(2.0)
    assert grandchild in report.killed_descendants
    assert not alive(grandchild)


def test_sigkill_of_the_supervisor_leaves_no_child():
    proc = subprocess.Popen(
        [sys.executable, PARENT],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    child, grandchild = (int(x) for x in line.split()[1:])
    assert alive(child) and alive(grandchild)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    # the child dies at once (parent-death signal); the guard kills the rest of the group (SIGTERM
    # ignored there, so SIGKILL after its grace period)
    wait_until(lambda: not alive(child), 10, what="child to die with its parent")
    wait_until(lambda: not alive(grandchild), 30, what="grandchild to be killed by the guard")


def test_child_environment_is_clean(tmp_path: Path):
    config = cfg.build({"model": {"name": "m"}, "server": {"env": {"EXTRA": "1"}}}, env={})
    base = {
        "PATH": os.environ["PATH"],
        "NOTIFY_SOCKET": "/run/x",
        "WATCHDOG_USEC": "5",
        "VLLM_API_KEY": "outer",
    }
    spec = build_spec(config, EngineFlags(), api_key="sk-secret-123", base_env=base)
    assert "sk-secret-123" not in " ".join(spec.argv)
    child_spec = LaunchSpec((sys.executable, CHILD, "env"), spec.env, (), "127.0.0.1", 1, "x", spec.instance)
    events = EventQueue()
    engine = Engine(child_spec, events, 1)
    engine.start()
    lines = collect(events, 1)
    assert "NOTIFY_SOCKET=None" in lines and "WATCHDOG_USEC=None" in lines
    assert "VLLM_API_KEY=sk-secret-123" in lines  # the key travels in the environment only
    assert f"R1SUP_INSTANCE={spec.instance}" in lines and "EXTRA=1" in lines
    engine.stop(5)


def test_command_line_is_an_argument_list_with_managed_flags():
    config = cfg.build(
        {
            "model": {"name": "org/m", "served_name": "m"},
            "server": {"port": 8123, "extra_args": ["--seed", "1"]},
        },
        env={},
    )
    spec = build_spec(config, EngineFlags(max_model_len=4096, kv_cache_dtype="fp8"), base_env={})
    argv = list(spec.argv)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--port") + 1] == "8123" and argv[argv.index("--max-model-len") + 1] == "4096"
    assert argv[argv.index("--served-model-name") + 1] == "m"
    assert argv[-2:] == ["--seed", "1"]


def test_port_holder_foreign_and_ours():
    port = free_port()
    assert port_holder("127.0.0.1", port, "inst") is None
    foreign = subprocess.Popen(
        [sys.executable, CHILD, "listen", str(port)], stdout=subprocess.PIPE, text=True
    )
    ours = None
    try:
        assert foreign.stdout is not None and foreign.stdout.readline().startswith("listening")
        holder = port_holder("127.0.0.1", port, "inst")
        assert holder is not None and holder.pid == foreign.pid and not holder.ours
        assert "python" in holder.name
        foreign.terminate()
        foreign.wait(timeout=10)
        wait_until(lambda: not port_in_use("127.0.0.1", port), 10)
        env = {**os.environ, "R1SUP_INSTANCE": "inst"}
        ours = subprocess.Popen(
            [sys.executable, CHILD, "listen", str(port)], stdout=subprocess.PIPE, text=True, env=env
        )
        assert ours.stdout is not None and ours.stdout.readline().startswith("listening")
        holder = port_holder("127.0.0.1", port, "inst")
        assert holder is not None and holder.ours
        assert ours.pid in kill_leftovers("inst")
        ours.wait(timeout=10)
    finally:
        for p in (foreign, ours):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def _line_starting(events: EventQueue, prefix: str) -> str | None:
    event = events.get(0.1)
    if isinstance(event, ChildOutput) and event.line.startswith(prefix):
        return event.line
    return None
