"""The bus's subscribers: each turns the daemon's events (:mod:`r1sup.core.events`, published on
:mod:`r1sup.supervision.bus`) into one sink's form.

- :class:`LogSink`: the structlog line (the event names and fields the README documents);
- :class:`StatusFile`: ``status.json`` (and the same document for r1sup's ``/status``), with the
  recent events it lists;
- :class:`MetricsSink`: the Prometheus metrics (subscribed only when ``daemon.metrics_port`` is set);
- :class:`SystemdSink`: sd_notify's STATUS=, READY=1 (once), WATCHDOG=1, EXTEND_TIMEOUT_USEC,
  RELOADING=1 and STOPPING=1.

The daemon subscribes them in the order metrics, systemd, status.json, log: when an event's log line
appears, the other sinks already show it (a test or an operator waiting on ``serving`` in the log
finds status.json and ``/metrics`` saying so).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from r1sup.adapters.notify import Notifier
from r1sup.adapters.statefiles import utc_now_iso
from r1sup.core import liveness
from r1sup.core.errors import R1supError
from r1sup.core.events import (
    AttemptFailed,
    CapacityShort,
    ColdCacheAhead,
    ColdCacheRelaunch,
    ConfigReduced,
    ConfigReloaded,
    ConfigRenamed,
    DaemonEvent,
    DaemonFailed,
    DeviceProbeFailed,
    DrainFinished,
    DrainSkipped,
    DrainStarted,
    EstimateUnavailable,
    FilePermissions,
    FirstFlags,
    FleetFileInvalid,
    FleetHit,
    FleetLeaseAcquired,
    FleetLeaseBreakFailed,
    FleetLeaseLost,
    FleetLeaseReleaseFailed,
    FleetLeaseTakenOver,
    FleetMiss,
    FleetPublished,
    FleetPublishFailed,
    FleetReadOnly,
    FleetUnavailable,
    FleetWaiting,
    FleetWaitTimeout,
    HealthPassed,
    Heartbeat,
    InternalFault,
    Launching,
    LivenessJudged,
    LoadingProgress,
    MetricsListening,
    MetricsUnavailable,
    NoFitRecorded,
    NoFitRemembered,
    PlanMade,
    PlannerCalibrated,
    PlannerNote,
    PreflightCacheNotSaved,
    PreflightCacheUnusable,
    PreflightFailed,
    PreflightPassed,
    ProfileDegraded,
    ProfileDoesNotFit,
    ProfileFound,
    ProfileMissing,
    ProfileStoreHit,
    ProfileStoreWaiting,
    ReloadFailed,
    Reloading,
    RestartScheduled,
    Retrying,
    RetunePlanned,
    SearchGaveUp,
    SearchRefined,
    SearchStepped,
    SearchSucceeded,
    Serving,
    ServingFailed,
    SloLevelMeasured,
    SloRelaunched,
    SloSearched,
    StateChanged,
    StateDirUnusable,
    StatusText,
    StepAfterServing,
    Stopping,
    StopSignalled,
    TuneInterrupted,
)
from r1sup.core.figures import Figures
from r1sup.supervision.bus import Bus

STATUS_FILE = "status.json"
RECENT_EVENTS = 20
STATUS_RETRY_S = 5.0  # a status.json that could not be written is tried again this often
EXTEND_EVERY_S = 10.0  # systemd's start timeout is extended this often, by three times as much
PROGRESS_STATUS_S = 2.0  # systemd's STATUS= shows the loading progress at most this often
PROGRESS_WRITE_S = 5.0  # status.json is rewritten with it at phase changes and at most this often


class LogSink:
    """Each fact as one structlog event: the JSON log's event names and fields (README, "Logs")."""

    def __init__(self, log: Any) -> None:
        self.log = log

    def __call__(self, event: DaemonEvent) -> None:
        log = self.log
        match event:
            case StateChanged(old, new, status):
                if old != new:  # the same state with a new status line is no change of state
                    log.info("state_changed", old=old, new=new, status=status)
            case Serving(flags, source, _, _):
                log.info("serving", flags=flags.to_dict() if flags else None, source=source)
            case ServingFailed(failure, served_s):
                log.error(
                    "serving_failed",
                    served_s=round(served_s, 1),
                    failure_class=failure.cls,
                    phase=failure.phase,
                    evidence=failure.evidence[:300],
                    detail=failure.detail,
                )
            case LivenessJudged(launch, verdict, changed):
                level = "error" if verdict.hung else "info" if changed else "debug"
                getattr(log, level)(
                    "liveness",
                    launch=launch,
                    verdict=verdict.state,
                    evidence=verdict.evidence,
                    reason=verdict.reason,
                    probe=verdict.probe,
                    **dict(verdict.figures),
                )
            case SearchStepped(attempt, old, new, failure_class, evidence, reason):
                log.info(
                    "search_step",
                    attempt=attempt - 1,  # the launch that failed (the step's flags go to the next)
                    failure_class=failure_class,
                    evidence=evidence[:300],
                    old=old.to_dict(),
                    new=new.to_dict(),
                    change=old.describe_change(new),
                    reason=reason,
                )
            case Retrying(_, seconds, failure_class):
                log.info("retry_backoff", seconds=seconds, failure_class=failure_class)
            case FirstFlags(flags, reason):
                log.info("first_flags", flags=flags.to_dict(), reason=reason)
            case CapacityShort(attempt, failure):
                fields = {"failure_class": failure.cls, "evidence": failure.evidence}
                log.error("failure_classified", attempt=attempt, **fields)
            case SearchRefined(old, new):
                log.info("search_refined", old=old.to_dict(), new=new.to_dict())
            case ColdCacheRelaunch(attempt, failure_class, flags, kv_cache_gib):
                log.warning(
                    "compile_cache_cold_relaunch",
                    attempt=attempt,
                    failure_class=failure_class,
                    flags=flags.to_dict(),
                    kv_cache_gib=kv_cache_gib,
                )
            case ConfigReduced(reduction):
                log.warning("config_reduced", **reduction.to_dict())
            case SearchSucceeded(launches, flags):
                log.info("tune_succeeded", launches=launches, flags=flags.to_dict())
            case SearchGaveUp(failure_class, reason, suggestions, exit_code, fatal, launches):
                log.error(
                    "fatal_failure" if fatal else "search_exhausted",
                    failure_class=failure_class,
                    reason=reason,
                    suggestions=list(suggestions),
                    exit_code=exit_code,
                    **({} if launches is None else {"launches": launches}),
                )
            case StepAfterServing(step, evidence, reason):
                log.info(
                    "search_step",
                    failure_class=step.failure_class,
                    evidence=evidence[:300],
                    old=step.old.to_dict(),
                    new=step.new.to_dict(),
                    reason=reason,
                )
            case RestartScheduled(restart, budget, seconds):
                log.info("restart_backoff", restart=restart, budget=budget, seconds=round(seconds, 2))
            case DrainSkipped(reason, figures):
                log.info(
                    "drain_skipped", reason=reason, figures=dict(figures) if figures is not None else None
                )
            case DrainStarted(reason, budget_s, vllm_drains, figures, unready_s):
                log.info(
                    "drain_started",
                    reason=reason,
                    budget_s=budget_s,
                    vllm_drains=vllm_drains,
                    unready_s=unready_s,
                    **figures,
                )
            case DrainFinished(reason, seconds, complete, figures):
                log.info(
                    "drain_finished", reason=reason, seconds=round(seconds, 1), complete=complete, **figures
                )
            case ReloadFailed(error):
                log.error("reload_failed", error=error)
            case ConfigReloaded(changed, _):
                log.info("config_reloaded", changed=changed)
            case StopSignalled(signum):
                log.info("stop_requested", signal=signum)
            case DaemonFailed(exit_code, reason):
                log.error("daemon_failed", exit_code=exit_code, reason=reason)
            case InternalFault(where, error, trace):
                log.error("internal_error", where=where, error=error)
                if trace:
                    log.debug("internal_error_traceback", traceback=trace)
            case ProfileFound(key, flags, updated_at, degraded):
                if degraded:
                    log.info("profile_found", key=key, flags=dict(flags), degraded=True)
                else:
                    log.info("profile_found", key=key, flags=dict(flags), updated_at=updated_at)
            case SloLevelMeasured(level):
                log.info("slo_level", **{k: v for k, v in level.to_dict().items() if k != "requests"})
            case SloSearched(searched):
                log.info(
                    "slo_searched",
                    verdict=searched.verdict,
                    concurrency=searched.requests,
                    reason=searched.reason,
                )
            case SloRelaunched(flag, old, new, why, outcome):
                log.info("slo_relaunched", flag=flag, old=old, new=new, why=why, outcome=outcome)
            case ProfileMissing(key):
                log.info("profile_missing", key=key)
            case NoFitRemembered(key, reason, written_at):
                log.warning("no_fit_remembered", key=key, reason=reason, written_at=written_at)
            case NoFitRecorded(key, free_gib):
                log.info("no_fit_recorded", key=key, free_gib=free_gib)
            case ProfileDoesNotFit(key, flags, conditions):
                found = conditions.to_dict() if conditions is not None else {}
                log.warning("profile_does_not_fit_now", key=key, flags=dict(flags), **found)
            case ProfileDegraded(key, reason):
                log.warning("profile_degraded", key=key, reason=reason)
            case RetunePlanned(best_key):
                log.info("retune_planned", best_key=best_key, reason="memory is back")
            case DeviceProbeFailed(error, search):
                (log.warning if search else log.debug)("device_probe_failed", error=error)
            case ColdCacheAhead(flags, proven_kv_cache_tokens, predicted_kv_gib, predicted_context, fits):
                log.warning(
                    "compile_cache_cold",
                    flags=flags.to_dict(),
                    proven_kv_cache_tokens=proven_kv_cache_tokens,
                    predicted_kv_gib=round(predicted_kv_gib, 2),
                    predicted_context=predicted_context,
                    context_fits=fits,
                    note="proven on a warm torch.compile cache; this start compiles from nothing",
                )
            case EstimateUnavailable(what, error):
                log.debug(f"{what}_unavailable", error=error)
            case MetricsListening(host, port):
                log.info("metrics_listening", host=host, port=port)
            case MetricsUnavailable(host, port, error):
                log.warning("metrics_unavailable", host=host, port=port, error=error)
            case StateDirUnusable(error):
                log.warning("state_dir_unusable", error=error)
            case PlannerNote(note):
                log.info("planner_note", note=note)
            case PlanMade(flags, verdict, changed):
                log.info("plan_made", flags=flags.to_dict(), verdict=verdict, changed=changed)
            case PlannerCalibrated(flags, figures):
                log.info("planner_calibrated", flags=flags.to_dict(), **figures)
            case PreflightPassed():
                log.info("preflight_passed", **vars(event))
            case PreflightFailed(field, error, exit_code):
                log.error("preflight_failed", field=field, error=error, exit_code=exit_code)
            case PreflightCacheUnusable(path, reason):
                log.debug("preflight_cache_unusable", path=path, reason=reason)
            case PreflightCacheNotSaved(path, error):
                log.debug("preflight_cache_not_saved", path=path, error=error)
            case FilePermissions(warning):
                log.warning("file_permissions", **warning)
            case ConfigRenamed(old, new, where):
                log.warning(
                    "config_renamed",
                    old=old,
                    new=new,
                    where=where,
                    message=f"{where}: {old} is now {new}; {old} is read for this release",
                )
            case TuneInterrupted(signum):
                log.warning("tune_interrupted", signal=signum)
            case _:
                self._fleet(event)

    def _fleet(self, event: DaemonEvent) -> None:
        """The shared profile store's lines (r1sup.state.fleet)."""
        log = self.log
        match event:
            case FleetHit(key, store, waited_s):
                log.info("profile_store_hit", key=key, store=store, waited_s=waited_s)
            case FleetMiss(key, store):
                log.info("profile_store_miss", key=key, store=store, read_only=True)
            case FleetUnavailable(store, error):
                log.warning("profile_store_unavailable", store=store, error=error)
            case FleetLeaseAcquired(key, store, lease_s):
                log.info("profile_lease_acquired", key=key, store=store, lease_s=lease_s)
            case FleetWaiting():
                log.info("profile_store_waiting", **vars(event))
            case FleetWaitTimeout(key, waited_s):
                log.warning("profile_store_wait_timeout", key=key, waited_s=waited_s)
            case FleetPublished(key, store, written):
                log.info("profile_published" if written else "profile_store_unchanged", key=key, store=store)
            case FleetReadOnly(key, store):
                log.info("profile_store_read_only", key=key, store=store)
            case FleetPublishFailed(key, store, error):
                log.error("profile_publish_failed", key=key, store=store, error=error)
            case FleetFileInvalid(path, reason):
                log.warning("profile_store_file_invalid", path=path, reason=reason)
            case FleetLeaseTakenOver():
                log.warning("profile_lease_taken_over", **vars(event))
            case FleetLeaseBreakFailed(path, error):
                log.warning("profile_lease_break_failed", path=path, error=error)
            case FleetLeaseLost(key, store):
                log.warning("profile_lease_lost", key=key, store=store)
            case FleetLeaseReleaseFailed(key, error):
                log.warning("profile_lease_release_failed", key=key, error=error)


def logging_bus(log: Any) -> Bus:
    """A bus whose one subscriber is the log: where nothing else follows the events (``r1sup tune``
    has no status.json, metrics or systemd), their log lines are still written by the log's sink."""
    bus = Bus(log)
    bus.subscribe(LogSink(log))
    return bus


class StatusSource(Protocol):
    """What status.json is made of: the daemon's state, read at each write."""

    @property
    def state_dir(self) -> str: ...

    def status_fields(self, recent: list[dict[str, Any]]) -> dict[str, Any]: ...


class StatusFile:
    """``status.json``, rewritten atomically at each change of state or status (while vLLM loads: at
    each phase and at most every ``PROGRESS_WRITE_S``), and the last document for ``/status``. The
    recent events it lists (the last ``RECENT_EVENTS``) are kept here."""

    def __init__(self, source: StatusSource, log: Any) -> None:
        self.source = source
        self.log = log
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_EVENTS)
        self.doc: dict[str, Any] | None = None  # what status.json holds (read from the endpoint's thread)
        self._progress: tuple[str, float] = ("", 0.0)  # the phase last written, when
        self._unwritten = False  # the last write failed: tried again at the heartbeats
        self._last_retry = float("-inf")

    def __call__(self, event: DaemonEvent) -> None:
        match event:
            case Heartbeat(now, _):
                self._retry(now)
            case StateChanged(old, new, _):
                if old != new:  # the same state with a new status line is no change of state
                    self.note("state_changed", old=old, new=new)
                self.write()
            case StatusText():
                self.write()
            case LoadingProgress(now, phase, _):
                last_phase, written = self._progress
                if phase != last_phase or now - written >= PROGRESS_WRITE_S:
                    self.write()
                    self._progress = (phase, now)
            case Launching(attempt, flags):
                self.note("launch_started", attempt=attempt, flags=flags.to_dict())
            case AttemptFailed(_, failure):
                self.note(
                    "failure_classified",
                    failure_class=failure.cls,
                    phase=failure.phase,
                    evidence=failure.evidence[:200],
                )
                self.write()
            case (SearchStepped() as step) | StepAfterServing(step=step):
                self.note("search_step", status=step.status)
            case ServingFailed(failure, _):
                self.note("serving_failed", failure_class=failure.cls, evidence=failure.evidence[:200])
            case LivenessJudged(_, verdict, changed):
                if changed and verdict.evidence in (liveness.EVIDENCE_WAITING, liveness.EVIDENCE_STALL):
                    self.note(
                        "liveness",
                        verdict=verdict.state,
                        evidence=verdict.evidence,
                        reason=verdict.reason[:200],
                    )
            case DaemonFailed(exit_code, reason):
                self.note("daemon_failed", exit_code=exit_code, reason=reason)
            case ProfileFound(key, _, _, degraded):
                if not degraded:
                    self.note("profile_found", key=key)
            case ProfileDoesNotFit(key, _, conditions):
                others = conditions.others_gib if conditions is not None else None
                self.note("profile_does_not_fit_now", key=key, others_gib=others)
            case ProfileDegraded(_, reason):
                self.note("profile_degraded", reason=reason)
            case RetunePlanned(best_key):
                self.note("retune_planned", best_key=best_key)
                self.write()
            case ProfileStoreWaiting(text):
                self.note("profile_store_waiting", status=text)
                self.write()
            case ProfileStoreHit(key):
                self.note("profile_store_hit", key=key)

    def note(self, event: str, **fields: Any) -> None:
        self.recent.append({"ts": utc_now_iso(zulu=False), "event": event, **fields})

    def write(self) -> None:
        """Write status.json. An entry in its place that is not a regular file (a symlink, a directory)
        is moved aside first; a write that fails (a full disk) is logged once and tried again at the
        daemon's heartbeats every ``STATUS_RETRY_S`` until it succeeds, so the file comes back when
        the disk does, not at the next change of state."""
        from r1sup.adapters import statefiles

        payload = self.source.status_fields(list(self.recent))
        self.doc = payload
        path = Path(self.source.state_dir) / STATUS_FILE
        try:
            statefiles.ensure_state_dir(self.source.state_dir)
            _set_aside_if_not_a_file(path)
            statefiles.atomic_write_json(path, payload, mode=0o600)
        except R1supError as exc:
            if not self._unwritten:
                self.log.warning("status_write_failed", error=str(exc))
            self._unwritten = True
            return
        if self._unwritten:
            self.log.info("status_write_recovered", path=str(path))
            self._unwritten = False

    def _retry(self, now: float) -> None:
        if self._unwritten and now - self._last_retry >= STATUS_RETRY_S:
            self._last_retry = now
            self.write()


def _set_aside_if_not_a_file(path: Path) -> None:
    import os
    import stat

    from r1sup.adapters import statefiles

    try:
        st = os.lstat(path)
    except OSError:
        return
    if stat.S_ISLNK(st.st_mode):
        statefiles.set_file_aside(path, "a symlink (r1sup does not write through it)", kind="status")
    elif not stat.S_ISREG(st.st_mode):
        statefiles.set_file_aside(path, "not a regular file", kind="status")


class MetricsSink:
    """The Prometheus metrics (:class:`r1sup.adapters.metrics.Metrics`), and the listener that serves them."""

    def __init__(self, metrics: Any, figures: Callable[[], Figures] = Figures) -> None:
        self.metrics = metrics
        self.figures = figures  # vLLM's start-up figures of the launch that serves

    def __call__(self, event: DaemonEvent) -> None:
        m = self.metrics
        match event:
            case StateChanged(_, new, _):
                m.set_state(new)
            case Launching(_, flags):
                m.launches.inc()
                m.launched(flags)
            case AttemptFailed(_, failure):
                m.failures.labels(failure_class=failure.cls).inc()
            case (SearchStepped() as step) | StepAfterServing(step=step):
                m.search_step(step.failure_class)
            case Serving(_, _, probe, _, capacity, slo):
                m.probe(probe)
                m.verified(capacity)
                m.slo(slo)
                m.memory(self.figures())
                m.child_up.set(1)
            case HealthPassed():
                m.success()
            case ServingFailed(failure, _):
                m.failures.labels(failure_class=failure.cls).inc()
                m.child_up.set(0)
            case RestartScheduled():
                m.restarts.inc()
            case Stopping():
                m.child_up.set(0)

    def serve(self, host: str, port: int, view: Any, mask: Any) -> None:
        """Listen on ``host:port`` (OSError when the address cannot be bound)."""
        self.metrics.serve(host, port, view=view, mask=mask)

    def close(self) -> None:
        self.metrics.close()


class SystemdSink:
    """sd_notify, one STATUS= line per fact. READY=1 goes once (again only if it could not be sent);
    WATCHDOG=1 at half systemd's interval while the loop turns healthy; the start timeout is extended
    every ``EXTEND_EVERY_S`` while starting; the loading progress at most every ``PROGRESS_STATUS_S``
    (and at each new phase)."""

    def __init__(self, notifier: Notifier) -> None:
        self.notifier = notifier
        self.ready_sent = False
        self._next_watchdog = 0.0
        self._last_extend: float | None = None
        self._progress: tuple[str, float] = ("", 0.0)  # the phase last shown, when

    def __call__(self, event: DaemonEvent) -> None:
        n = self.notifier
        match event:
            case StateChanged(_, _, status):
                if status:
                    n.status(status)
            case StatusText(text) | ProfileStoreWaiting(text):
                n.status(text)
            case LoadingProgress(now, phase, text):
                last_phase, sent = self._progress
                if phase != last_phase or now - sent >= PROGRESS_STATUS_S:
                    n.status(text)
                    self._progress = (phase, now)
            case (SearchStepped() as step) | StepAfterServing(step=step):
                n.status(step.status)
            case Heartbeat(now, starting):
                self._heartbeat(now, starting)
            case Serving(_, _, _, text):
                if not self.ready_sent:
                    self.ready_sent = n.ready(text) or not n.enabled
            case Reloading():
                n.reloading()
            case ReloadFailed(error):
                n.status(f"serving; reload failed: {error}")
            case ConfigReloaded(_, applied):
                if applied:
                    n.status("serving; config reloaded, flags unchanged")
            case Stopping():
                n.stopping()

    def _heartbeat(self, now: float, starting: bool) -> None:
        interval = self.notifier.watchdog_interval_s
        if interval and now >= self._next_watchdog:
            self.notifier.watchdog()
            self._next_watchdog = now + interval
        if starting and (self._last_extend is None or now - self._last_extend >= EXTEND_EVERY_S):
            self._last_extend = now
            self.notifier.extend_timeout(3 * EXTEND_EVERY_S)
