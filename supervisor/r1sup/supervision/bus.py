"""The daemon's small synchronous bus: each fact is published once, and the subscribers
(:mod:`r1sup.supervision.subscribers`) turn it into the log line, status.json, the Prometheus metrics and
systemd's STATUS=/READY=1/WATCHDOG=1.

What travels on it is :data:`r1sup.core.events.DaemonEvent`: the daemon's own facts and the search's
(``Launching``, ``Probing``, ``AttemptFailed``, ``SearchStepped``, ``Retrying``), all defined in
:mod:`r1sup.core.events`. Events are frozen: a subscriber reads them, never changes them.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

from r1sup.core.events import DaemonEvent

Subscriber = Callable[[DaemonEvent], None]


class Bus:
    """Synchronous: ``publish`` calls each subscriber in the order they subscribed, in the publishing
    thread, and returns when all have run. A subscriber that raises is logged (``subscriber_failed``,
    at error, with its traceback) and the others still get the event: a sink that breaks (a full disk,
    a bug in one renderer) must neither silence the other sinks nor stop the supervision."""

    def __init__(self, log: Any) -> None:
        self.log = log
        self._subscribers: list[Subscriber] = []

    def subscribe(self, subscriber: Subscriber) -> None:
        self._subscribers.append(subscriber)

    def publish(self, event: DaemonEvent) -> None:
        for subscriber in self._subscribers:
            try:
                subscriber(event)
            except Exception as exc:  # noqa: BLE001 - one sink's failure is logged, the rest go on
                self.log.error(
                    "subscriber_failed",
                    subscriber=type(subscriber).__name__,
                    published=type(event).__name__,
                    error=f"{type(exc).__name__}: {exc}",
                    traceback=traceback.format_exc(),
                )
