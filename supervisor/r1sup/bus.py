"""The daemon's facts as typed events, published once on a small synchronous bus.

The daemon publishes; subscribers (:mod:`r1sup.subscribers`) turn each event into the log line,
status.json, the Prometheus metrics and systemd's STATUS=/READY=1/WATCHDOG=1. The search's own events
(``Launching``, ``Probing``, ``AttemptFailed``, ``LadderStepped``, ``Retrying``, in
:mod:`r1sup.tuner`) travel on the same bus. Events are frozen: a subscriber reads them, never
changes them.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from r1sup.failure import Failure
from r1sup.flags import EngineFlags
from r1sup.liveness import Verdict
from r1sup.tuner import AttemptFailed, LadderStepped, Launching, Probing, Retrying

# --- the daemon's state and status


@dataclass(frozen=True)
class StateChanged:
    """A transition of the state table (``old`` may equal ``new``: the status line changed)."""

    old: str
    new: str
    status: str | None = None


@dataclass(frozen=True)
class StatusText:
    """A new status line within the same state (e.g. the drain's figures)."""

    text: str


@dataclass(frozen=True)
class LoadingProgress:
    """vLLM's loading phase and progress while launching or probing, at each turn of the loop;
    subscribers decide how often to show it. ``now`` is monotonic."""

    now: float
    phase: str
    text: str


@dataclass(frozen=True)
class Heartbeat:
    """The loop turned with the engine healthy or starting; ``starting`` while systemd's start
    timeout should be extended (planning, launching, probing). ``now`` is monotonic."""

    now: float
    starting: bool = False


# --- serving


@dataclass(frozen=True)
class Serving:
    """The engine passed its start-up and probe and serves ``flags``."""

    flags: EngineFlags | None
    source: str | None  # persisted, shared or tuned
    probe: Mapping[str, Any] | None
    text: str  # the status line
    capacity: Mapping[str, Any] | None = None  # what the probe proved (r1sup.capacity.verified)


@dataclass(frozen=True)
class HealthPassed:
    """``/health`` answered while serving."""


@dataclass(frozen=True)
class LivenessJudged:
    """A liveness verdict worth telling: it changed, new figures were sampled, or a probe is due."""

    launch: int
    verdict: Verdict
    changed: bool


@dataclass(frozen=True)
class ServingFailed:
    failure: Failure
    served_s: float


@dataclass(frozen=True)
class StepAfterServing:
    """A memory failure while serving stepped down the ladder: the search's step and why."""

    step: LadderStepped
    evidence: str
    reason: str


@dataclass(frozen=True)
class RestartScheduled:
    """A transient failure: restart number ``restart`` of ``budget`` after ``seconds`` of backoff."""

    restart: int
    budget: int
    seconds: float


# --- draining


@dataclass(frozen=True)
class DrainSkipped:
    reason: str
    figures: Mapping[str, Any] | None


@dataclass(frozen=True)
class DrainStarted:
    reason: str
    budget_s: float
    vllm_drains: bool
    figures: Mapping[str, Any]
    unready_s: float = 0.0  # /readyz 503 this long at least before vLLM stops taking requests


@dataclass(frozen=True)
class DrainFinished:
    reason: str
    seconds: float
    complete: bool
    figures: Mapping[str, Any] = field(default_factory=dict)


# --- reloading and stopping


@dataclass(frozen=True)
class Reloading:
    """SIGHUP: the config is being read again."""


@dataclass(frozen=True)
class ReloadFailed:
    error: str


@dataclass(frozen=True)
class ConfigReloaded:
    changed: bool  # it implies other flags or another server (a re-tune follows)
    applied: bool  # taken as it is, nothing relaunched


@dataclass(frozen=True)
class StopSignalled:
    signum: int


@dataclass(frozen=True)
class Stopping:
    """r1sup is stopping vLLM for good (the shutdown)."""


@dataclass(frozen=True)
class DaemonFailed:
    exit_code: int
    reason: str


@dataclass(frozen=True)
class InternalFault:
    """r1sup's own failure (a bug): where, the error, and the traceback when there is one."""

    where: str
    error: str
    trace: str = ""


# --- profiles and the fleet's store


@dataclass(frozen=True)
class ProfileFound:
    key: str
    flags: Mapping[str, Any]
    updated_at: str | None = None
    degraded: bool = False  # the degraded profile kept beside the best one


@dataclass(frozen=True)
class ProfileMissing:
    key: str


@dataclass(frozen=True)
class NoFitRemembered:
    """A previous run's "does not fit" verdict for this fingerprint answers again (r1sup.nofit)."""

    key: str
    reason: str
    written_at: str


@dataclass(frozen=True)
class NoFitRecorded:
    key: str
    free_gib: float | None


@dataclass(frozen=True)
class ProfileDoesNotFit:
    key: str
    flags: Mapping[str, Any]
    conditions: Mapping[str, Any]  # what is free now (r1sup.search.conditions)


@dataclass(frozen=True)
class ProfileDegraded:
    key: str
    reason: str


@dataclass(frozen=True)
class RetunePlanned:
    """The memory other processes held is back: a re-tune to the best profile follows."""

    best_key: str


@dataclass(frozen=True)
class ProfileStoreWaiting:
    """Waiting while another replica tunes this key (the text says for what)."""

    text: str


@dataclass(frozen=True)
class ProfileStoreHit:
    key: str


# --- the daemon's own plumbing


@dataclass(frozen=True)
class DeviceProbeFailed:
    error: str


@dataclass(frozen=True)
class MetricsListening:
    host: str
    port: int


@dataclass(frozen=True)
class MetricsUnavailable:
    host: str
    port: int
    error: str


@dataclass(frozen=True)
class StateDirUnusable:
    error: str


DaemonEvent = (
    Launching
    | Probing
    | AttemptFailed
    | LadderStepped
    | Retrying
    | StateChanged
    | StatusText
    | LoadingProgress
    | Heartbeat
    | Serving
    | HealthPassed
    | LivenessJudged
    | ServingFailed
    | StepAfterServing
    | RestartScheduled
    | DrainSkipped
    | DrainStarted
    | DrainFinished
    | Reloading
    | ReloadFailed
    | ConfigReloaded
    | StopSignalled
    | Stopping
    | DaemonFailed
    | InternalFault
    | ProfileFound
    | ProfileMissing
    | NoFitRemembered
    | NoFitRecorded
    | ProfileDoesNotFit
    | ProfileDegraded
    | RetunePlanned
    | ProfileStoreWaiting
    | ProfileStoreHit
    | DeviceProbeFailed
    | MetricsListening
    | MetricsUnavailable
    | StateDirUnusable
)

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
