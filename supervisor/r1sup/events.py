"""Typed events of the one loop: child output and exit, check results, timers. Frozen, replayable."""

from __future__ import annotations

import collections
import queue
import signal
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ChildOutput:
    launch: int
    line: str


@dataclass(frozen=True)
class ChildEOF:
    launch: int


@dataclass(frozen=True)
class CheckDone:
    """A check that ran off the loop (readiness, health, liveness, probe) finished."""

    kind: str
    launch: int
    ok: bool
    detail: str = ""
    payload: Any = None


Event = ChildOutput | ChildEOF | CheckDone


class EventQueue:
    """The loop's queue plus signals. Signal handlers only append to a deque (no locks taken)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Event] = queue.Queue()
        self.signals: collections.deque[int] = collections.deque()  # SIGINT/SIGTERM: stop
        self.reloads: collections.deque[int] = collections.deque()  # SIGHUP: reload the config
        self._installed: dict[int, Any] = {}

    def put(self, event: Event) -> None:
        self._queue.put(event)

    def get(self, timeout: float) -> Event | None:
        try:
            return self._queue.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None

    def queued(self) -> int:
        """How many events wait in the queue now (approximate while producers run)."""
        return self._queue.qsize()

    def _handler(self, signum: int, frame: Any) -> None:
        (self.reloads if signum == signal.SIGHUP else self.signals).append(signum)

    def install_signal_handlers(self, signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
        for signum in signums:
            self._installed[signum] = signal.signal(signum, self._handler)

    def restore_signal_handlers(self) -> None:
        for signum, previous in self._installed.items():
            signal.signal(signum, previous)
        self._installed.clear()

    def pending_signal(self) -> int | None:
        """The first unhandled signal, without consuming it."""
        return self.signals[0] if self.signals else None
