"""r1sup's one event vocabulary: every fact that travels between its parts, as a frozen dataclass.

Three families, all here and nowhere else:

- **the loop's queue** (:class:`EventQueue`, read by :mod:`r1sup.supervision.loop` alone): a child's output
  and exit, the result of a check that ran off the loop, and what the signal handlers queued
  (:class:`Signalled`, :class:`ReloadRequested`);
- **the search's** (:data:`SearchEvent`): what a bring-up (:class:`r1sup.supervision.tuner.Tuner`) reports as
  it happens: its first flags, a launch, its probe, a failure, the search's next flags
  (:class:`SearchStepped`), a retry, a refinement, the success or giving up;
- **the daemon's** (:data:`DaemonEvent`, which includes the search's): the facts it publishes on its bus
  (:mod:`r1sup.supervision.bus`), which only the subscribers (:mod:`r1sup.supervision.subscribers`) turn into
  log lines, ``status.json``, the Prometheus metrics and sd_notify. A part that has no bus at hand (the
  preflight, the fleet's store, what is known before a search, ``r1sup tune``) is handed a
  :data:`Publish`: the daemon's bus, or one whose only subscriber is the log's sink.

Events are frozen: whoever receives one reads it, never changes it, so a run can be replayed. This module
is a leaf: it imports the standard library and the core's value types (:class:`r1sup.core.failure.Failure`,
:class:`r1sup.core.flags.EngineFlags`, :class:`r1sup.core.liveness.Verdict`), nothing of r1sup's shell
(``tests/test_events.py`` holds it to that).
"""

from __future__ import annotations

import collections
import queue
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from r1sup.core.capacity import Capacity, Reduction
from r1sup.core.failure import Failure
from r1sup.core.flags import EngineFlags
from r1sup.core.hardware import Conditions
from r1sup.core.liveness import Verdict
from r1sup.core.probing import ProbeResult
from r1sup.core.slo import Level, SloResult

# --- the loop's queue: a child's output, a check's result, a signal


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


@dataclass(frozen=True)
class Signalled:
    """SIGTERM/SIGINT queued by the handler: the first one's number and how many came so far."""

    signum: int
    count: int


@dataclass(frozen=True)
class ReloadRequested:
    """SIGHUP queued by the handler (given only to a phase that takes reloads)."""


QueueEvent = ChildOutput | ChildEOF | CheckDone  # what the queue carries (signals wait beside it)


class EventQueue:
    """The loop's queue plus signals. Signal handlers only append to a deque (no locks taken)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[QueueEvent] = queue.Queue()
        self.signals: collections.deque[int] = collections.deque()  # SIGINT/SIGTERM: stop
        self.reloads: collections.deque[int] = collections.deque()  # SIGHUP: reload the config
        self._installed: dict[int, Any] = {}
        self.hangup_stops = False  # SIGHUP asks for a stop (``tune``: no config to reload) instead

    def put(self, event: QueueEvent) -> None:
        self._queue.put(event)

    def get(self, timeout: float) -> QueueEvent | None:
        try:
            return self._queue.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None

    def queued(self) -> int:
        """How many events wait in the queue now (approximate while producers run)."""
        return self._queue.qsize()

    def _handler(self, signum: int, frame: Any) -> None:
        reload = signum == signal.SIGHUP and not self.hangup_stops
        (self.reloads if reload else self.signals).append(signum)

    def install_signal_handlers(self, signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
        for signum in signums:
            self._installed[signum] = signal.signal(signum, self._handler)

    def restore_signal_handlers(self) -> None:
        """Put back the handlers found when these were installed, unless a stop was signalled: then the
        process is ending with its code (0 for ``run``, 130/143/129 for ``tune``), and one more signal in
        its last moments (a second Ctrl-C, a supervisor's repeated SIGTERM) is ignored. Neither the
        default action nor this handler would do: the interpreter puts back the default action of every
        signal it handles as it finalizes, and a signal then ends the process by the signal instead."""
        for signum, previous in self._installed.items():
            signal.signal(signum, signal.SIG_IGN if self.signals else previous)
        self._installed.clear()

    def pending_signal(self) -> int | None:
        """The first unhandled signal, without consuming it."""
        return self.signals[0] if self.signals else None


# --- the search's: what a bring-up reports as it happens


@dataclass(frozen=True)
class Launching:
    attempt: int
    flags: EngineFlags


@dataclass(frozen=True)
class Probing:
    attempt: int
    flags: EngineFlags


@dataclass(frozen=True)
class AttemptFailed:
    attempt: int
    failure: Failure


@dataclass(frozen=True)
class SearchStepped:
    """After a failure the search chose the next launch's flags: ``attempt`` is the number of the launch
    they go to; ``evidence`` the failure's, ``reason`` the search's. Logged as ``search_step`` (the event
    name the README documents)."""

    attempt: int
    old: EngineFlags
    new: EngineFlags
    failure_class: str
    evidence: str = ""
    reason: str = ""

    @property
    def status(self) -> str:
        return status_line(self.attempt, self.old, self.new, self.failure_class)


@dataclass(frozen=True)
class Retrying:
    """A transient failure: the same flags again after ``seconds`` (launch ``attempt``)."""

    attempt: int
    seconds: float
    failure_class: str

    @property
    def status(self) -> str:
        return f"attempt {self.attempt}: retry in {self.seconds:.1f}s ({self.failure_class})"


@dataclass(frozen=True)
class FirstFlags:
    """The flags of a search's first launch and why (the plan, the config, a saved profile)."""

    flags: EngineFlags
    reason: str


@dataclass(frozen=True)
class CapacityShort:
    """Launch ``attempt`` started but gives less than the config's target (``failure``, before its probe)."""

    attempt: int
    failure: Failure


@dataclass(frozen=True)
class SearchRefined:
    """A launch passed and its own figures say a longer context fits: once more with ``new``."""

    old: EngineFlags
    new: EngineFlags


@dataclass(frozen=True)
class ColdCacheRelaunch:
    """A profile proven on a warm torch.compile cache failed on a cold one: the same flags again."""

    attempt: int
    failure_class: str
    flags: EngineFlags
    kv_cache_gib: float | None


@dataclass(frozen=True)
class ConfigReduced:
    """The flags found give up more than half the asked context or serve fewer sequences than asked:
    why and the ways out (``r1sup.core.search.Search.reduction``)."""

    reduction: Reduction


@dataclass(frozen=True)
class SearchSucceeded:
    launches: int
    flags: EngineFlags


@dataclass(frozen=True)
class SearchGaveUp:
    """No flags within the bounds (``fatal``: a failure no flags change, its own exit code); ``launches``
    is given when nothing was launched (the plan said it does not fit)."""

    failure_class: str
    reason: str
    suggestions: tuple[str, ...]
    exit_code: int
    fatal: bool = False
    launches: int | None = None


@dataclass(frozen=True)
class DeviceProbeFailed:
    """NVML could not be read: while serving a debug line; ``search``: the look before a search or before
    its next flags (a warning: they are chosen without what is free now)."""

    error: str
    search: bool = False


@dataclass(frozen=True)
class ColdCacheAhead:
    """Before a launch of a profile proven on a warm torch.compile cache, on a cold one: the memory
    model's prediction for the cold start against the proven context (vLLM decides)."""

    flags: EngineFlags
    proven_kv_cache_tokens: float | None
    predicted_kv_gib: float
    predicted_context: int
    context_fits: bool


@dataclass(frozen=True)
class EstimateUnavailable:
    """A figure the search shows but does not need could not be computed (``what``: ``compile_cache_check``
    or ``memory_chart``)."""

    what: str
    error: str


SearchEvent = (
    Launching
    | Probing
    | AttemptFailed
    | SearchStepped
    | Retrying
    | FirstFlags
    | CapacityShort
    | SearchRefined
    | ColdCacheRelaunch
    | ConfigReduced
    | SearchSucceeded
    | SearchGaveUp
    | ColdCacheAhead
    | EstimateUnavailable
    | DeviceProbeFailed
)


def status_line(attempt: int, old: EngineFlags, new: EngineFlags, failure_class: str) -> str:
    """``attempt 2: context 8192 -> 3712 (kv_insufficient)``: for systemd's STATUS= and humans."""
    return (
        f"attempt {attempt}: {old.describe_change(new).replace('max_model_len', 'context')} ({failure_class})"
    )


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
    probe: ProbeResult | None
    text: str  # the status line
    capacity: Capacity | None = None  # what the probe proved (r1sup.core.capacity.verified)
    slo: SloResult | None = None  # the service level the saved profile proved for these flags (core.slo)


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
    """A memory failure while serving: the search's next flags (its step) and why."""

    step: SearchStepped
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
class SloLevelMeasured:
    """One load level of the ``[slo]`` search ran on the serving engine (r1sup.core.slo.Level)."""

    level: Level


@dataclass(frozen=True)
class SloSearched:
    """The ``[slo]`` search ended: the highest concurrency that met the targets, or why none did."""

    result: SloResult


@dataclass(frozen=True)
class SloRelaunched:
    """The ``[slo]`` search relaunched the engine once with a flag changed (r1sup.core.slo.relaunch_step):
    ``outcome`` says what the relaunch proved, or why its first result was kept."""

    flag: str
    old: int
    new: int
    why: str
    outcome: str


@dataclass(frozen=True)
class NoFitRemembered:
    """A previous run's "does not fit" verdict for this fingerprint answers again (r1sup.state.nofit)."""

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
    conditions: Conditions | None  # what is free now (r1sup.core.search.conditions; None without a GPU)


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


# --- what is known before a search (r1sup.supervision.footing)


@dataclass(frozen=True)
class PlannerNote:
    """What the search goes without (the model's architecture unknown, its config.json not understood)."""

    note: str


@dataclass(frozen=True)
class PlanMade:
    """The search's recommendation for the first launch: its flags, verdict and change to the user's."""

    flags: EngineFlags
    verdict: str
    changed: str


@dataclass(frozen=True)
class PlannerCalibrated:
    """The memory model calibrated by an earlier launch on this box: its flags and printed figures."""

    flags: EngineFlags
    figures: Mapping[str, Any]


# --- before the daemon's bus exists or beside it: the preflight, a command's start, `r1sup tune`


@dataclass(frozen=True)
class PreflightPassed:
    python: str
    engine_package: str | None
    vllm_version: str | None
    torch_version: str | None
    model: str  # where the model is: local, hf-cache, download
    model_where: str
    seconds: float
    cached: bool  # vLLM's import skipped: the state directory remembered a check of the same install


@dataclass(frozen=True)
class PreflightFailed:
    field: str
    error: str
    exit_code: int


@dataclass(frozen=True)
class PreflightCacheUnusable:
    """``preflight.json`` could not be used (the full check runs)."""

    path: str
    reason: str


@dataclass(frozen=True)
class PreflightCacheNotSaved:
    path: str
    error: str


@dataclass(frozen=True)
class FilePermissions:
    """A file others can read or write (r1sup.adapters.apikey.permission_warnings: file, mode, why)."""

    warning: Mapping[str, Any]


@dataclass(frozen=True)
class ConfigRenamed:
    """A section or setting given under its old name (r1sup.core.config.RENAMED_SECTIONS): read as the new
    one for this release. ``old``/``new`` as ``[ladder]``/``[search]`` or dotted; ``where`` the file, the
    variable or the command line."""

    old: str
    new: str
    where: str


@dataclass(frozen=True)
class TuneInterrupted:
    """``r1sup tune`` stopped by a signal (vLLM stopped)."""

    signum: int


# --- the fleet's shared profile store (r1sup.state.fleet)


@dataclass(frozen=True)
class FleetHit:
    """The shared store holds ``key``'s profile (found after ``waited_s``)."""

    key: str
    store: str
    waited_s: float


@dataclass(frozen=True)
class FleetMiss:
    """A read-only store without ``key``'s profile: this replica tunes on its own."""

    key: str
    store: str


@dataclass(frozen=True)
class FleetUnavailable:
    store: str
    error: str


@dataclass(frozen=True)
class FleetLeaseAcquired:
    key: str
    store: str
    lease_s: float


@dataclass(frozen=True)
class FleetWaiting:
    """Another replica holds ``key``'s lease: waiting for its profile."""

    key: str
    holder_host: str
    holder_pid: int
    lease_expires_in_s: float


@dataclass(frozen=True)
class FleetWaitTimeout:
    key: str
    waited_s: float


@dataclass(frozen=True)
class FleetPublished:
    """``written``: the profile went to the store; else the store held the same flags already."""

    key: str
    store: str
    written: bool


@dataclass(frozen=True)
class FleetReadOnly:
    key: str
    store: str


@dataclass(frozen=True)
class FleetPublishFailed:
    key: str
    store: str
    error: str


@dataclass(frozen=True)
class FleetFileInvalid:
    """A profile in the shared store that cannot be read (left there: a replica replaces it)."""

    path: str
    reason: str


@dataclass(frozen=True)
class FleetLeaseTakenOver:
    """A stale lease moved aside (``why``): its holder stopped renewing or is gone."""

    key: str
    holder_host: str | None
    holder_pid: int | None
    why: str


@dataclass(frozen=True)
class FleetLeaseBreakFailed:
    path: str
    error: str | None


@dataclass(frozen=True)
class FleetLeaseLost:
    """Our lease could not be renewed: another replica may tune this key beside us."""

    key: str
    store: str


@dataclass(frozen=True)
class FleetLeaseReleaseFailed:
    key: str
    error: str


# every event the bus carries: the daemon's own and the search's
DaemonEvent = (
    Launching
    | Probing
    | AttemptFailed
    | SearchStepped
    | Retrying
    | FirstFlags
    | CapacityShort
    | SearchRefined
    | ColdCacheRelaunch
    | ConfigReduced
    | SearchSucceeded
    | SearchGaveUp
    | ColdCacheAhead
    | EstimateUnavailable
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
    | PlannerNote
    | PlanMade
    | PlannerCalibrated
    | PreflightPassed
    | PreflightFailed
    | PreflightCacheUnusable
    | PreflightCacheNotSaved
    | FilePermissions
    | ConfigRenamed
    | TuneInterrupted
    | FleetHit
    | FleetMiss
    | FleetUnavailable
    | FleetLeaseAcquired
    | FleetWaiting
    | FleetWaitTimeout
    | FleetPublished
    | FleetReadOnly
    | FleetPublishFailed
    | FleetFileInvalid
    | FleetLeaseTakenOver
    | FleetLeaseBreakFailed
    | FleetLeaseLost
    | FleetLeaseReleaseFailed
    | SloLevelMeasured
    | SloSearched
    | SloRelaunched
)

# how a part that has no bus of its own hands its events on: the bus's ``publish``, or a log-only one
Publish = Callable[[DaemonEvent], None]
