"""What the supervisor touches beyond its own state, as one bundle of factories.

The runner, the daemon and the tuner reach the world only through a :class:`World`: the engine's
process (:class:`r1sup.adapters.launcher.Engine`), the cleanup of leftovers and the port's holder, the probe's
child, the device (NVML), vLLM's processes and ``/metrics``, what is known of the model, the
preflight, the clock, and how a blocking check runs (a thread that answers on the event queue). The
defaults are production's; a replay test passes its own (a fake engine, a fake clock, checks answered
on a scripted timeline) instead of patching modules.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from r1sup.adapters import launcher

if TYPE_CHECKING:
    from r1sup.adapters.health import Endpoint
    from r1sup.adapters.probe import Connection
    from r1sup.core.config import Config
    from r1sup.core.hardware import DeviceFacts
    from r1sup.core.liveness import MetricsSample


class Checks(Protocol):
    """Runs ``fn`` (which may block) off the loop's thread; its answer comes back as a ``CheckDone`` of
    ``kind`` for ``launch`` on the loop's queue."""

    def __call__(self, kind: str, launch: Any, fn: Callable[[], tuple[bool, str, Any]]) -> None: ...


def _probe_process(connection: Connection) -> Any:
    from r1sup.adapters.probe import ProbeProcess

    return ProbeProcess(connection=connection)


def _cores() -> int:
    """The CPUs this process may run on (its affinity, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _device() -> DeviceFacts:
    from r1sup.adapters import devices

    return devices.probe()


def _process_watch(pid: int) -> Any:
    from r1sup.adapters import watch

    return watch.ProcessWatch(pid)


def _read_metrics(endpoint: Endpoint, timeout: float, at: float | None = None) -> MetricsSample:
    from r1sup.adapters import watch

    return watch.read_metrics(endpoint, timeout, at=at)


def _knowledge(config: Config, log: Any, engine: Any = None) -> Any:
    """What is known of the box and the model (:func:`r1sup.adapters.knowledge.gather`), what was missing
    written by the log's sink."""
    from r1sup.adapters.knowledge import gather
    from r1sup.supervision.subscribers import logging_bus

    return gather(config, logging_bus(log).publish, engine=engine)


def _preflight(config: Config, log: Any, check: Callable[[], None]) -> Any:
    """The preflight (the session's, for ``tune`` and ``run`` alike), its events written by the log's sink."""
    from r1sup.adapters import preflight
    from r1sup.supervision.subscribers import logging_bus

    return preflight.run(config, publish=logging_bus(log).publish, check=check, cache=True)


@dataclass(frozen=True)
class World:
    """The factories (production's by default). ``checks`` None: each check runs on its own thread."""

    # (LaunchSpec, EventQueue, launch id) -> the engine's process, started by its ``start()``
    engine: Callable[[Any, Any, int], Any] = launcher.Engine
    kill_leftovers: Callable[[str], list[int]] = launcher.kill_leftovers
    port_holder: Callable[[str, int, str], launcher.PortHolder | None] = launcher.port_holder
    # the probe's child, started ahead of its use (r1sup.adapters.probe.ProbeProcess)
    probe_process: Callable[[Connection], Any] = _probe_process
    cores: Callable[[], int] = _cores  # the CPUs r1sup and vLLM share (the probe child's early start)
    device: Callable[[], DeviceFacts] = (
        _device  # NVML, else the CPU backend's view (r1sup.adapters.devices.probe)
    )
    process_watch: Callable[[int], Any] = _process_watch  # vLLM's engine processes (r1sup.adapters.watch)
    read_metrics: Callable[..., MetricsSample] = _read_metrics  # vLLM's /metrics (r1sup.adapters.watch)
    knowledge: Callable[..., Any] = _knowledge  # (config, log, engine) -> tuner.ModelKnowledge
    preflight: Callable[[Config, Any, Callable[[], None]], Any] = _preflight  # (config, log, check)
    clock: Callable[[], float] = time.monotonic
    checks: Checks | None = None
