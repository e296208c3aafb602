"""Run the real ``r1sup`` CLI as a subprocess and watch its JSON log events (for process tests)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from r1sup.adapters.launcher import instance_id, marked
from r1sup.core import config as cfg

ROOT = Path(__file__).resolve().parent.parent


def write_config(path: Path, body: dict[str, dict[str, Any]]) -> Path:
    """A TOML config from nested dicts (strings, numbers, booleans, lists of strings, tables)."""
    lines: list[str] = []
    for section, values in body.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {_toml(value)}")
        lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    raise TypeError(value)


# vLLM's own switch for its CPU test runs (vllm/platforms/cpu.py, v1/worker/cpu_worker.py): the model runs
# under Dynamo with the eager backend and the start-up skips the compile warm-up. On 2 cores that saves
# about a third of a launch (the warm-up's Inductor compile: 16 s of a 40 s start in
# tests/fixtures/logs/cpu/clean-startup-one-request.log), on every launch: vLLM
# 0.32's compile cache does not help, its saved artefact fails to load ("'function' object has no
# attribute 'finalize_loading'") and it compiles again. What changes is only what the engine does inside
# its start-up: the log has no "Warming up model" line (r1sup's "profiling" phase), and the first request
# pays for the trace (a few seconds). Tests that prove the compiled start-up itself (its phases, its system
# calls) pass compiled=True.
EAGER_ENGINE_ENV = {"VLLM_CPU_CI_ENV": "1"}


def tiny_engine_config(
    tmp_path: Path,
    model: Path,
    port: int,
    *,
    start: dict[str, Any] | None = None,
    compiled: bool = False,
    **sections: dict[str, Any],
) -> dict[str, dict[str, Any]]:
    body: dict[str, dict[str, Any]] = {
        "model": {"name": str(model), "served_name": "tiny"},
        "server": {
            "port": port,
            "extra_args": ["--load-format", "dummy"],
            "env": {} if compiled else dict(EAGER_ENGINE_ENV),
            "startup_timeout_s": 400,
            "stall_timeout_s": 240,
            "stop_timeout_s": 15,
            "memory_release_timeout_s": 20,
        },
        "start": {
            "max_model_len": 2048,
            "gpu_memory_utilization": 0.5,
            "kv_cache_memory_bytes": 4_000_000,
            **(start or {}),
        },
        "search": {"min_max_model_len": 1024, "first_launch": "as_configured"},
        "probe": {"requests": 4, "output_tokens": 8, "request_timeout_s": 120, "timeout_s": 300},
        "state": {"dir": str(tmp_path / "state")},
    }
    for name, values in sections.items():
        body.setdefault(name, {}).update(values)
    return body


class R1sup:
    """``python -m r1sup.cli.app ARGS``: its JSON log events (stderr) and its result (stdout) collected
    apart."""

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        cwd: Path = ROOT,
        preexec: Callable[[], None] | None = None,
    ) -> None:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        outer = os.environ.get("PYTHONPATH")
        if outer and env and "PYTHONPATH" in env:  # the caller's entries first, then the path pytest runs on
            full_env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], outer])
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "r1sup.cli.app", "--log-format", "json", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=full_env,
            cwd=cwd,
            text=True,
            preexec_fn=preexec,  # noqa: PLW1509 - a setrlimit, for the tests that need one
        )
        self.events: list[dict[str, Any]] = []
        self.lines: list[str] = []
        self.stderr: list[str] = []
        self._threads = [
            threading.Thread(target=self._read, args=(self.proc.stdout, True), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, False), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _read(self, stream: Any, is_stdout: bool) -> None:
        for line in stream:
            (self.lines if is_stdout else self.stderr).append(line)
            if not is_stdout and line.startswith("{"):
                try:
                    self.events.append(json.loads(line))
                except ValueError:
                    continue

    def named(self, event: str) -> list[dict[str, Any]]:
        return [e for e in list(self.events) if e.get("event") == event]

    def wait_event(
        self,
        event: str,
        timeout: float,
        count: int = 1,
        where: Callable[[dict[str, Any]], bool] = lambda e: True,
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.named(event) if where(e)]
            if len(found) >= count:
                return found[count - 1]
            if self.proc.poll() is not None:
                time.sleep(0.5)
                found = [e for e in self.named(event) if where(e)]
                if len(found) >= count:
                    return found[count - 1]
                raise AssertionError(f"r1sup exited ({self.proc.returncode}) before {event}: {self.tail()}")
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {event}: {self.tail()}")

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        for t in self._threads:
            t.join(timeout=5)
        return code

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def tail(self, n: int = 15) -> str:
        return "".join(self.lines[-n:]) + "".join(self.stderr[-n:])

    def stdout_text(self) -> str:
        return "".join(self.lines)


class NotifySocket:
    """A stand-in for systemd's notify socket: records every datagram r1sup sends."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                self.messages.append(self.sock.recv(65536).decode())
            except TimeoutError:
                continue
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


def engine_processes(config_path: Path) -> list[psutil.Process]:
    """vLLM processes (API server, engine core, workers) started for this config, still alive, whether
    the r1sup that launched them still runs or not."""
    config = cfg.load(config_path, environ={})
    return marked(instance_id(config))


def kill_engine_processes(config_path: Path) -> None:
    for proc in engine_processes(config_path):
        try:
            proc.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(engine_processes(config_path), timeout=10)


def sig(name: str) -> int:
    return int(getattr(signal, name))
