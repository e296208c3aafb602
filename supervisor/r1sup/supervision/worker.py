"""``r1sup worker``: a node other than the leader's in vLLM's own multi-node mode (``multinode.backend =
"mp"``). It runs vLLM headless (``--nnodes N --node-rank R --master-addr A --headless``) with the very
engine flags the leader's ``r1sup run`` launched with, read from the leader's ``/status``, and starts it
again for each new launch of the leader (a re-tune, a memory step, a restart): a headless node builds
its engine config from its own command line, so it must follow the leader's. What to do is
:func:`r1sup.core.multinode.decide`; this module reads the leader, runs the process and answers probes.

Its own endpoint (daemon.metrics_host:daemon.metrics_port): ``/livez`` while its loop turns,
``/readyz`` while a headless vLLM runs for the leader's current launch, ``/status`` what it runs.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Generator, Mapping
from typing import Any

from r1sup.adapters.endpoint import Endpoint, View, loop_limit_s
from r1sup.adapters.launcher import (
    CHILD_MARK_VAR,
    OWNER_VAR,
    Engine,
    LaunchSpec,
    engine_env,
    instance_id,
    mask,
    owner_mark,
    resolve_model,
)
from r1sup.adapters.logs import get_logger
from r1sup.core import multinode
from r1sup.core.config import Config
from r1sup.core.errors import ConfigError
from r1sup.core.events import CheckDone, ChildOutput, EventQueue, Signalled
from r1sup.core.flags import EngineFlags
from r1sup.supervision.loop import Done, Loop, Phase, StopRequested, Waiting

FETCH_TIMEOUT_S = 3.0
MAX_STATUS_BYTES = 1024 * 1024  # the leader's status document is a few KiB


def check_worker_config(config: Config) -> None:
    """``r1sup worker`` serves one node of an mp group other than the leader's; anything else is a
    config error naming the setting."""
    multi = config.multinode
    if multi.nnodes < 2:
        raise ConfigError(
            "multinode.nnodes", f"is {multi.nnodes}: `r1sup worker` serves a node of a group of 2 or more"
        )
    if multi.backend != "mp":
        raise ConfigError(
            "multinode.backend",
            f"is {multi.backend}: `r1sup worker` runs vLLM's own multi-node mode (mp); "
            "with ray the worker nodes are Ray nodes",
        )
    if multi.node_rank < 1:
        raise ConfigError(
            "multinode.node_rank",
            "is 0, the leader's (`r1sup run`); a worker's rank is 1 to multinode.nnodes - 1",
        )
    if not (multi.leader_port or config.daemon.metrics_port):
        raise ConfigError(
            "multinode.leader_port",
            "required when daemon.metrics_port is 0: the port of the leader's r1sup endpoint (/status)",
        )


def leader_status_url(config: Config) -> str:
    """The leader's ``/status``: its r1sup endpoint, on the port this node's config gives it."""
    host = config.multinode.master_addr
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address
    port = config.multinode.leader_port or config.daemon.metrics_port
    return f"http://{host}:{port}/status"


def fetch_status(url: str, timeout: float = FETCH_TIMEOUT_S) -> dict[str, Any] | None:
    """The leader's status document, or None when it cannot be read (not up yet, restarting)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - http(s) URL built above
            body = response.read(MAX_STATUS_BYTES + 1)
    except (OSError, urllib.error.URLError, ValueError):
        return None
    if len(body) > MAX_STATUS_BYTES:
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def worker_instance(config: Config) -> str:
    """The mark of this node's headless vLLM processes (the leader's instance id and the rank)."""
    return f"{instance_id(config)}-node{config.multinode.node_rank}"


def worker_spec(config: Config, flags: EngineFlags, base_env: Mapping[str, str] | None = None) -> LaunchSpec:
    """The headless vLLM of this node for the leader's ``flags``: the same model, flags and extra
    arguments as the leader's launch, this node's place in the group, no API server."""
    server, multi = config.server, config.multinode
    python = server.python or sys.executable
    argv = [python, *multi.worker_launch, "--model", resolve_model(config.model.name)]
    if config.model.revision:
        argv += ["--revision", config.model.revision]
    argv += flags.to_argv()
    argv += multinode.node_args(multi, multi.node_rank)
    argv += list(server.extra_args)
    env = engine_env(config, base_env)
    env[CHILD_MARK_VAR] = worker_instance(config)  # its processes are found again (leftover clean-up)
    env[OWNER_VAR] = owner_mark()
    return LaunchSpec(
        argv=tuple(argv),
        env=env,
        display=tuple(mask(a, []) for a in argv),
        host="127.0.0.1",
        port=server.port,  # a headless node binds no API port; the stop's port check passes at once
        served_name=config.served_name,
        instance=env[CHILD_MARK_VAR],
    )


class Worker:
    """The loop of ``r1sup worker``: read the leader, decide, stop or start the headless vLLM, forward
    its output, answer the probes; SIGTERM/SIGINT stop vLLM and end the loop (exit 0)."""

    def __init__(
        self,
        config: Config,
        *,
        events: EventQueue | None = None,
        fetch: Callable[[str], dict[str, Any] | None] = fetch_status,
        clock: Callable[[], float] = time.monotonic,
        out: Any = None,
    ) -> None:
        check_worker_config(config)
        self.config = config
        self.events = events or EventQueue()
        self.loop = Loop(self.events, clock=clock)
        self.fetch = fetch
        self.clock = clock
        self.out = out if out is not None else sys.stdout
        self.log = get_logger(command="worker")
        self.url = leader_status_url(config)
        self.engine: Engine | None = None
        self.running: tuple[str, int] | None = None  # the leader launch the running vLLM belongs to
        self.joined: tuple[str, int] | None = None  # the last leader launch a vLLM was started for
        self.leader_seen = False
        self.starts = 0
        self.last_turn = clock()
        self.endpoint: Endpoint | None = None

    # --- what the probes see --------------------------------------------------------------------

    def state(self) -> str:
        """``serving`` while a headless vLLM runs for the leader's launch (``/readyz`` 200), else
        ``waiting`` (for the leader's next launch)."""
        return "serving" if self.running is not None else "waiting"

    def status(self) -> dict[str, Any]:
        return {
            "role": "worker",
            "state": self.state(),
            "node_rank": self.config.multinode.node_rank,
            "nnodes": self.config.multinode.nnodes,
            "leader": self.url,
            "leader_launch": list(self.running) if self.running else None,
            "child_pid": self.engine.pid if self.engine is not None and self.engine.alive() else None,
            "starts": self.starts,
        }

    def view(self) -> View:
        server = self.config.server
        return View(
            state=self.state(),
            loop_age_s=self.clock() - self.last_turn,
            loop_limit_s=loop_limit_s(server.stop_timeout_s, server.memory_release_timeout_s),
            status=self.status(),
        )

    # --- the loop -------------------------------------------------------------------------------

    def run(self) -> int:
        daemon = self.config.daemon
        if daemon.metrics_port:
            self.endpoint = Endpoint(view=self.view)
            self.endpoint.serve(daemon.metrics_host, daemon.metrics_port)
        self.events.install_signal_handlers()
        self.log.info(
            "worker_started",
            node_rank=self.config.multinode.node_rank,
            nnodes=self.config.multinode.nnodes,
            leader=self.url,
        )
        try:
            self.loop.run(self._lifetime())  # the worker's whole life in one run of the loop
        finally:
            self.events.restore_signal_handlers()
            if self.endpoint is not None:
                self.endpoint.close()
        self.log.info("worker_stopped")
        return 0

    def _lifetime(self) -> Generator[Phase, Any, None]:
        """The loop's script: a turn, then the wait until the next, until a stop signal; then vLLM is
        stopped (after an error of r1sup's own too, which then goes on to the CLI)."""
        try:
            while not self.events.signals:
                yield from self.turn()
                yield from self.wait(self.config.multinode.leader_poll_s)
        except Exception:
            yield from self.stop_engine("signal" if self.events.signals else "exit")
            raise
        yield from self.stop_engine("signal" if self.events.signals else "exit")

    def turn(self) -> Generator[Phase, Any, None]:
        """One look at the leader and the child, and what follows from it."""
        self.last_turn = self.clock()
        if self.engine is not None and not self.engine.alive():
            self.log.warning("worker_vllm_exited", leader_launch=self.running, returncode=self.engine.poll())
            yield from self.stop_engine("exited")
        doc = self.fetch(self.url)
        leader = multinode.leader_launch(doc) if doc is not None else None
        if doc is None and self.leader_seen:
            self.log.warning("worker_leader_unreachable", leader=self.url)
        self.leader_seen = doc is not None
        flags: EngineFlags | None = None
        if leader is not None:
            try:
                flags = EngineFlags.from_dict(leader.flags)
            except (TypeError, ValueError) as exc:
                self.log.warning("worker_leader_flags_unreadable", error=str(exc))
                leader = None
        action = multinode.decide(leader, self.running, self.joined)
        if action.stop:
            yield from self.stop_engine("leader_changed")
        if action.join is not None and flags is not None:
            self.start_engine(action.join, flags)

    def start_engine(self, launch: multinode.LeaderLaunch, flags: EngineFlags) -> None:
        spec = worker_spec(self.config, flags)
        self.starts += 1
        self.joined = launch.key  # joined once, started or not: the next try is the leader's next launch
        engine = Engine(spec, self.events, self.starts)
        try:
            engine.start()
        except OSError as exc:  # server.python missing, not executable: the leader's launch fails too
            self.log.error("worker_vllm_start_failed", leader_launch=launch.launches, error=str(exc))
            return
        self.engine, self.running = engine, launch.key
        self.log.info(
            "worker_vllm_started",
            leader_launch=launch.launches,
            pid=self.engine.pid,
            argv=" ".join(spec.display),
        )

    def stop_engine(self, reason: str) -> Generator[Phase, Any, None]:
        engine, self.engine, self.running = self.engine, None, None
        if engine is None:
            return
        server = self.config.server
        grace, release, events = server.stop_timeout_s, server.memory_release_timeout_s, self.events

        def stop() -> None:  # on its own thread: SIGTERM, SIGKILL on its timer, the reaping
            try:
                answer: Any = engine.stop(grace, release_timeout=release)
            except Exception as exc:  # noqa: BLE001 - raised again in the loop's thread
                answer = exc
            events.put(CheckDone("stopped", engine.launch_id, True, "", answer))

        threading.Thread(target=stop, daemon=True, name="check-stopped").start()
        report = yield Stopping(engine.launch_id, self.forward)
        if isinstance(report, Exception):
            raise report
        yield from self.drain_output()
        self.log.info(
            "worker_vllm_stopped",
            reason=reason,
            escalated=report.escalated,
            seconds=round(report.seconds, 2),
            returncode=engine.poll(),
        )

    def wait(self, seconds: float) -> Generator[Phase, Any, None]:
        """Forward vLLM's output for ``seconds``; a signal ends the wait within the loop's turn."""
        try:
            yield Waiting(self.clock() + seconds, output=self.forward)
        except StopRequested:
            return

    def forward(self, event: Any) -> None:
        if isinstance(event, ChildOutput):
            self.out.write(event.line + "\n")
            self.out.flush()

    def drain_output(self) -> Generator[Phase, Any, None]:
        """Forward what vLLM printed and is still queued (after a stop), then return."""
        yield Flushing(self.forward)
        self.out.flush()


class Stopping(Phase):
    """Until the stop of launch ``number`` (a check on its own thread) answers with its report; vLLM's
    teardown lines go to ``output`` meanwhile. Signals and faults wait: the stop is under way."""

    ticks = False
    faults = False

    def __init__(self, number: int, output: Callable[[Any], None]) -> None:
        self.number = number
        self.output = output

    def on_signal(self, signal: Signalled, now: float) -> Any:
        return None

    def on(self, event: Any, now: float) -> Any:
        if isinstance(event, CheckDone) and event.kind == "stopped" and event.launch == self.number:
            return Done(event.payload)
        if event is not None:
            self.output(event)
        return None


class Flushing(Phase):
    """Hands what is queued to ``output`` until the queue is empty (a stop's last lines), signals or not."""

    ticks = False
    faults = False

    def __init__(self, output: Callable[[Any], None]) -> None:
        self.output = output

    def due(self, now: float) -> float:
        return 0.0

    def on_signal(self, signal: Signalled, now: float) -> Any:
        return None

    def on(self, event: Any, now: float) -> Any:
        if event is None:
            return Done()
        self.output(event)
        return None
