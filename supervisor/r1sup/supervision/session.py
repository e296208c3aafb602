"""Wiring shared by ``tune`` and ``run``: config, key, logging, signals, runner, hooks, profiles."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from r1sup.adapters import apikey as sec
from r1sup.adapters import logs
from r1sup.core.config import Config
from r1sup.core.events import EventQueue, FilePermissions, Publish
from r1sup.supervision.loop import Phase
from r1sup.supervision.runner import Hooks, Runner


@dataclass
class Session:
    config: Config
    api_key: str | None
    log: Any
    events: EventQueue
    runner: Runner
    overrides: dict[str, Any]
    checked: tuple[Any, Any] | None = None  # (preflight key, its result): once per process
    lock: Any = None  # statefiles.StateLock: one r1sup per state directory, held for the process's life

    def preflight(self) -> Generator[Phase, Any, Any]:
        """The preflight of the current config (:mod:`r1sup.adapters.preflight`), run once and again only when
        a reload changed what it checks; raises :class:`r1sup.core.errors.PreflightError`. Interruptible. The
        import of vLLM is skipped when the state directory remembers a check of the same install."""
        from r1sup.adapters import preflight

        key = preflight.key(self.config)
        if self.checked is None or self.checked[0] != key:
            # the import of vLLM takes up to minutes: a check off the loop's thread, the loop turning
            world, config, log = self.runner.world, self.config, self.log
            result = yield from self.runner.off_loop(
                "preflight", lambda cancelled: world.preflight(config, log, cancelled)
            )
            self.checked = (key, result)
        return self.checked[1]


def default_hooks() -> Hooks:
    from r1sup.adapters import devices

    def memory_released(pids: Any) -> bool:
        held = {p.pid for p in devices.gpu_processes()}
        return not held.intersection(pids)

    return Hooks(memory_released=memory_released, gpu_processes=devices.gpu_processes)


def open_session(
    args: argparse.Namespace,
    config: Config,
    *,
    overrides: dict[str, Any] | None = None,
) -> Session:
    api_key = sec.load_api_key(config)
    secrets = sec.secret_values(config, api_key)
    level = args.log_level or "info"
    logs.configure(level=level, fmt=args.log_format, stream=sys.stderr, secrets=secrets)
    log = logs.get_logger(command=args.command)
    lock = _lock(args, config)
    publish = log_only(log)  # no daemon and no bus yet: the log's sink writes these lines
    for warning in sec.permission_warnings(config):
        publish(FilePermissions(warning))
    events = EventQueue()
    console = logs.console_format(args.log_format, sys.stderr)
    runner = Runner(
        config,
        events,
        api_key=api_key,
        hooks=default_hooks(),
        log=log,
        relay_level="debug" if console else "info",
        display=logs.status_line(),
        fold_tracebacks=console,
    )
    return Session(config, api_key, log, events, runner, dict(overrides or {}), lock=lock)


def log_only(log: Any) -> Publish:
    """A ``publish`` for what happens where no daemon's bus is (a command's start, ``r1sup tune``): its
    events written by the log's sink alone (:func:`r1sup.supervision.subscribers.logging_bus`)."""
    from r1sup.supervision.subscribers import logging_bus

    return logging_bus(log).publish


def _lock(args: argparse.Namespace, config: Config) -> Any:
    """The state directory's lock (statefiles.lock_state_dir): a second ``run`` or ``tune`` on it ends
    here, before anything is launched or killed, with one line naming the holder (exit 2)."""
    from r1sup.adapters import statefiles

    what = f"r1sup {args.command}" + (f" --config {args.config}" if getattr(args, "config", None) else "")
    return statefiles.lock_state_dir(config.state.dir, logs.mask(what))
