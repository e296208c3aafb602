"""The bus and its subscribers, in process: delivery, a failing subscriber, each sink's form of the
daemon's events, and daemon.py writing to no sink itself. No process is started."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import structlog
from structlog.testing import capture_logs

from r1sup.adapters.metrics import Metrics
from r1sup.adapters.notify import Notifier
from r1sup.core import config as cfg
from r1sup.core import events as E
from r1sup.core import failure as F
from r1sup.core import liveness
from r1sup.core.capacity import Reduction
from r1sup.core.events import AttemptFailed, EventQueue, Launching, Probing, SearchStepped
from r1sup.core.flags import EngineFlags
from r1sup.core.hardware import Conditions
from r1sup.core.probing import ProbeResult
from r1sup.supervision import daemon as daemon_module
from r1sup.supervision.bus import Bus
from r1sup.supervision.daemon import Daemon
from r1sup.supervision.runner import Runner
from r1sup.supervision.session import Session
from r1sup.supervision.subscribers import LogSink, MetricsSink, StatusFile, SystemdSink
from r1sup.supervision.tuner import TuneResult
from r1sup_proc import write_config
from test_daemon_events import Recorded

OOM = F.Failure(F.OOM_RUNTIME, F.PHASE_SERVING, evidence="CUDA out of memory. Tried to allocate 2.00 GiB")
FIRST, SECOND = EngineFlags(max_model_len=8192), EngineFlags(max_model_len=4096)


class Calls:
    """A logger that keeps its calls: (level, event, fields)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: self.calls.append((level, event, fields))


# --- the bus -----------------------------------------------------------------------------------


def test_each_subscriber_gets_each_event_once_in_the_order_they_subscribed():
    bus = Bus(Calls())
    seen: list[tuple[str, object]] = []
    for name in ("first", "second", "third"):
        bus.subscribe(lambda event, name=name: seen.append((name, event)))
    one, two = E.StatusText("one"), E.ProfileMissing("k")
    bus.publish(one)
    bus.publish(two)
    assert seen == [
        ("first", one),
        ("second", one),
        ("third", one),
        ("first", two),
        ("second", two),
        ("third", two),
    ]


def test_a_subscriber_that_raises_is_logged_and_the_others_still_get_the_event():
    log = Calls()
    bus = Bus(log)
    seen: list[str] = []

    class Broken:
        def __call__(self, event: object) -> None:
            raise OSError("disk full")

    bus.subscribe(lambda event: seen.append("before"))
    bus.subscribe(Broken())
    bus.subscribe(lambda event: seen.append("after"))
    bus.publish(E.Stopping())
    bus.publish(E.Stopping())
    assert seen == ["before", "after", "before", "after"]
    failed = [fields for level, event, fields in log.calls if event == "subscriber_failed"]
    assert len(failed) == 2 and {level for level, _, _ in log.calls} == {"error"}
    assert failed[0]["subscriber"] == "Broken" and failed[0]["published"] == "Stopping"
    assert failed[0]["error"] == "OSError: disk full" and "raise OSError" in failed[0]["traceback"]


# --- daemon.py writes to no sink itself -----------------------------------------------------------

SINKS = frozenset({"log", "notifier", "metrics"})
SINK_CALLS = frozenset({"write_status", "note", "atomic_write_json"})


def _chain(node: ast.expr) -> list[str]:
    """``self.log.info`` -> ["self", "log", "info"]; [] for anything but names and attributes."""
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return []
    return [node.id, *reversed(names)]


def _makes_logger(node: ast.expr) -> bool:
    """``get_logger()``, ``logs.get_logger(...)``, ``(log or get_logger())``: a logger made on the spot."""
    if isinstance(node, ast.BoolOp):
        return any(_makes_logger(value) for value in node.values)
    return isinstance(node, ast.Call) and _chain(node.func)[-1:] == ["get_logger"]


def sink_writes(source: str) -> list[str]:
    """Calls that write to a sink directly: a method of a logger, notifier or metrics object (also
    through getattr, or of a logger made on the spot), writing status.json or its recent events, or
    structlog itself."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [(node.lineno, f"import {m}") for m in modules if m.split(".")[0] == "structlog"]
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Attribute) and _makes_logger(node.func.value):
            found.append((node.lineno, f"get_logger().{node.func.attr}"))
            continue
        chain = _chain(node.func)
        if isinstance(node.func, ast.Name) and node.func.id == "getattr" and node.args:
            chain = [*_chain(node.args[0]), "?"]
        if SINKS & set(chain[:-1]) or (chain and chain[-1] in SINK_CALLS):
            found.append((node.lineno, ".".join(chain)))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def test_the_check_finds_each_kind_of_direct_write():
    source = """
import structlog
def f(self, level):
    self.log.info("serving")
    getattr(self.log, level)("liveness")
    self.s.notifier.status("x")
    self.metrics.child_up.set(1)
    self.write_status()
    self.note("search_step")
    statefiles.atomic_write_json(path, {})
    Tuner(self.config, self.runner, self.log)   # handing the logger on is no write
    self.publish(E.Stopping())
    get_logger().warning("state_dir_created")
    (log or logs.get_logger(command="tune")).info("x")
    log = get_logger()   # making one is no write
"""
    assert sink_writes(source) == [
        "line 2: import structlog",
        "line 4: self.log.info",
        "line 5: self.log.?",
        "line 6: self.s.notifier.status",
        "line 7: self.metrics.child_up.set",
        "line 8: self.write_status",
        "line 9: self.note",
        "line 10: statefiles.atomic_write_json",
        "line 13: get_logger().warning",
        "line 14: get_logger().info",
    ]


def test_daemon_py_writes_to_no_sink_outside_the_subscribers():
    source = Path(daemon_module.__file__).read_text(encoding="utf-8")
    assert sink_writes(source) == []


# --- the whole package: status.json, the metrics and sd_notify are the subscribers' alone -----------

PACKAGE = Path(daemon_module.__file__).parents[1]  # supervisor/r1sup
# where each sink is defined; the subscribers are its only writers
SINK_MODULES = frozenset({"supervision/subscribers.py", "adapters/notify.py", "adapters/metrics.py"})
NOTIFY_CALLS = frozenset(n for n in vars(Notifier) if not n.startswith("_")) - {"enabled"}
METRIC_CALLS = frozenset(n for n in vars(Metrics) if not n.startswith("_"))
METRIC_CALLS |= {"inc", "dec", "set", "labels", "observe"}
STATUS_NAMES = frozenset({"STATUS_FILE", "status.json"})
WRITERS = frozenset({"atomic_write_json", "write_text", "write_bytes", "dump"})


def _names_status(node: ast.AST) -> bool:
    return any(
        (isinstance(n, ast.Name) and n.id in STATUS_NAMES)
        or (isinstance(n, ast.Constant) and n.value in STATUS_NAMES)
        for n in ast.walk(node)
    )


def systemd_metrics_status_writes(source: str) -> list[str]:
    """A call of a notifier's or a metrics object's method (sd_notify, Prometheus), and a file write in
    a function that names status.json (``STATUS_FILE`` or the name itself) in its code."""
    found: set[tuple[int, str]] = set()
    tree = ast.parse(source)
    notifiers, metrics = {"notifier"}, {"metrics"}
    for node in ast.walk(tree):  # local names for them: ``n = self.notifier``
        if isinstance(node, ast.Assign) and (value := _chain(node.value)):
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
            notifiers |= names if value[-1] == "notifier" else set()
            metrics |= names if value[-1] == "metrics" else set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not (chain := _chain(node.func)):
            continue
        receivers, method = set(chain[:-1]), chain[-1]
        if receivers & notifiers and method in NOTIFY_CALLS:
            found.add((node.lineno, ".".join(chain)))
        if receivers & metrics and method in METRIC_CALLS:
            found.add((node.lineno, ".".join(chain)))
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for scope in scopes or [tree]:  # each function on its own
        if not _names_status(scope):
            continue
        for node in ast.walk(scope):
            if isinstance(node, ast.Call) and (chain := _chain(node.func)) and chain[-1] in WRITERS:
                found.add((node.lineno, ".".join(chain)))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def test_the_package_check_finds_sd_notify_metrics_and_status_json_writes():
    source = """
STATUS_FILE = "status.json"
def f(self, m):
    self.notifier.ready("serving")
    self.notifier.enabled  # a property: no write
    self.metrics.launches.inc()
    self.metrics.set_state("serving")
    metrics.get("kv_usage")  # a dict of figures: no write
    n = self.s.notifier
    n.stopping()
    statefiles.atomic_write_json(Path(d) / STATUS_FILE, {})
def g(path):
    path.write_text("a report")  # no status.json named here
"""
    assert systemd_metrics_status_writes(source) == [
        "line 4: self.notifier.ready",
        "line 6: self.metrics.launches.inc",
        "line 7: self.metrics.set_state",
        "line 10: n.stopping",
        "line 11: statefiles.atomic_write_json",
    ]
    assert systemd_metrics_status_writes("statefiles.atomic_write_json(path, doc)") == []  # not status.json


def test_only_the_subscribers_write_status_json_the_metrics_and_sd_notify():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name not in SINK_MODULES:
            writes = systemd_metrics_status_writes(path.read_text(encoding="utf-8"))
            if writes:
                found[name] = writes
    assert found == {}
    # and the check does see the subscribers' own writes: systemd's, the metrics' and status.json's
    theirs = " ".join(
        systemd_metrics_status_writes(
            (PACKAGE / "supervision" / "subscribers.py").read_text(encoding="utf-8")
        )
    )
    assert "n.ready" in theirs and "m.probe" in theirs  # the sinks' local names for them
    assert "self.metrics.serve" in theirs and "statefiles.atomic_write_json" in theirs


# The modules that still write log lines themselves, besides the bus (``subscriber_failed``) and the
# subscribers: what is not (yet) an event. Exact, so that a new direct writer fails here and one moved
# behind the bus takes its module off this list. The preflight, the fleet's store, what is known before a
# search (supervision/footing.py), the session's start and ``r1sup tune`` publish events instead (a
# ``publish`` handed in, or a bus with the log's sink alone where there is no daemon's bus).
DIRECT_LOGGERS = {
    "supervision/runner.py": "vLLM's relayed lines, the loading progress, a launch's start, verdict and stop",
    "supervision/prober.py": "the probe's start and verdict (probe_started, probe_passed, probe_queued, "
    "probe_failed), the runner's before the probe had a module of its own",
    "adapters/statefiles.py": "files set aside, the state directory's lock: beneath the sinks (status.json "
    "is written through it) and called from every layer",
    "state/profiles.py": "the profile store's saves, imports and exports, and what the fingerprint lacks",
    "state/runrecord.py": "a run record that could not be saved, and saved again",
    "adapters/endpoint.py": "r1sup's /status and /metrics listener's warnings, from its own thread",
    "supervision/worker.py": "r1sup worker, a headless vLLM of a multi-node group (its own process, no bus)",
    "adapters/logs.py": "the logging set-up itself (structlog)",
}


def test_the_modules_that_still_log_directly_are_the_known_ones():
    direct = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        writes = [w for w in sink_writes(path.read_text(encoding="utf-8")) if "log" in w]
        if writes and name not in ("supervision/bus.py", "supervision/subscribers.py"):
            direct[name] = writes
    assert sorted(direct) == sorted(DIRECT_LOGGERS), {
        n: w for n, w in direct.items() if n not in DIRECT_LOGGERS
    }


# --- each subscriber's form ---------------------------------------------------------------------


def test_log_lines_keep_their_documented_names_and_fields():
    verdict = liveness.Verdict(
        liveness.HUNG, liveness.EVIDENCE_STALL, "no progress for 300 s", figures={"running": 2}
    )
    step = SearchStepped(3, FIRST, SECOND, OOM.cls)
    with capture_logs() as logs:
        sink = LogSink(structlog.get_logger())
        sink(E.StateChanged("probing", "serving", "serving tiny"))
        sink(E.ServingFailed(OOM, 12.345))
        sink(E.StepAfterServing(step, OOM.evidence, "context halved"))
        sink(E.LivenessJudged(1, verdict, changed=True))
        sink(
            E.LivenessJudged(1, liveness.Verdict(liveness.ALIVE, liveness.EVIDENCE_PROGRESS, "moved"), False)
        )
        sink(E.RestartScheduled(2, 5, 4.4567))
        sink(E.ProfileFound("abc", {"max_model_len": 4096}, degraded=True))
        sink(E.HealthPassed())  # no line: a metric only
        # the search's step and retry, written by the log's sink too (in the daemon and in `tune`)
        sink(SearchStepped(3, FIRST, SECOND, OOM.cls, OOM.evidence, "a shorter context fits"))
        sink(E.Retrying(4, 2.5, F.ENGINE_DEAD))
        sink(Launching(4, SECOND))  # no line: the runner's launch_started says it
    assert [(e["log_level"], e["event"]) for e in logs] == [
        ("info", "state_changed"),
        ("error", "serving_failed"),
        ("info", "search_step"),
        ("error", "liveness"),
        ("debug", "liveness"),
        ("info", "restart_backoff"),
        ("info", "profile_found"),
        ("info", "search_step"),
        ("info", "retry_backoff"),
    ]
    assert logs[0] == {
        "event": "state_changed",
        "log_level": "info",
        "old": "probing",
        "new": "serving",
        "status": "serving tiny",
    }
    assert (
        logs[1]["served_s"] == 12.3
        and logs[1]["failure_class"] == "oom_runtime"
        and logs[1]["phase"] == "serving"
    )
    assert logs[2]["old"] == FIRST.to_dict() and logs[2]["new"] == SECOND.to_dict()
    assert logs[2]["reason"] == "context halved" and "attempt" not in logs[2]
    assert logs[3]["running"] == 2 and logs[3]["launch"] == 1 and logs[3]["verdict"] == "hung"
    assert logs[5]["seconds"] == 4.46 and logs[5]["restart"] == 2 and logs[5]["budget"] == 5
    assert logs[6]["degraded"] is True and "updated_at" not in logs[6]
    assert logs[7] == {
        "event": "search_step",
        "log_level": "info",
        "attempt": 2,  # the launch that failed; the new flags go to launch 3
        "failure_class": "oom_runtime",
        "evidence": OOM.evidence,
        "old": FIRST.to_dict(),
        "new": SECOND.to_dict(),
        "change": FIRST.describe_change(SECOND),
        "reason": "a shorter context fits",
    }
    retry = {"event": "retry_backoff", "log_level": "info", "seconds": 2.5, "failure_class": "engine_dead"}
    assert logs[8] == retry


def test_the_searchs_own_lines_keep_their_names_levels_and_fields():
    short = F.Failure(F.KV_INSUFFICIENT, F.PHASE_KV_CACHE, evidence="4 sequences fit, 8 asked")
    with capture_logs() as logs:
        sink = LogSink(structlog.get_logger())
        sink(E.FirstFlags(FIRST, "as configured"))
        sink(E.CapacityShort(1, short))
        sink(E.SearchRefined(SECOND, FIRST))
        sink(E.ColdCacheRelaunch(2, OOM.cls, FIRST, 3.5))
        sink(E.ConfigReduced(Reduction("context halved", 4096, 8192, 16, 256, ("fp8 weights",))))
        sink(E.SearchSucceeded(3, FIRST))
        sink(E.SearchGaveUp(F.NONE, "does not fit", ("a smaller model",), 3, launches=0))
        sink(E.SearchGaveUp(OOM.cls, "no flags left", (), 3))
        sink(E.SearchGaveUp(F.CONFIG_ERROR, "bad flag", (), 4, fatal=True))
        sink(E.ColdCacheAhead(FIRST, 12000.0, 1.234, 4096, True))
        sink(E.EstimateUnavailable("memory_chart", "ValueError: no GPU"))
        sink(E.DeviceProbeFailed("NVMLError: gone", search=True))
        sink(E.DeviceProbeFailed("NVMLError: gone"))  # while serving: at debug
    flags = FIRST.to_dict()
    assert logs == [
        {"event": "first_flags", "log_level": "info", "flags": flags, "reason": "as configured"},
        {
            "event": "failure_classified",
            "log_level": "error",
            "attempt": 1,
            "failure_class": F.KV_INSUFFICIENT,
            "evidence": "4 sequences fit, 8 asked",
        },
        {"event": "search_refined", "log_level": "info", "old": SECOND.to_dict(), "new": flags},
        {
            "event": "compile_cache_cold_relaunch",
            "log_level": "warning",
            "attempt": 2,
            "failure_class": OOM.cls,
            "flags": flags,
            "kv_cache_gib": 3.5,
        },
        {
            "event": "config_reduced",
            "log_level": "warning",
            "reason": "context halved",
            "context": 4096,
            "asked_context": 8192,
            "max_num_seqs": 16,
            "wanted_max_num_seqs": 256,
            "ways_out": ["fp8 weights"],
        },
        {"event": "tune_succeeded", "log_level": "info", "launches": 3, "flags": flags},
        {
            "event": "search_exhausted",
            "log_level": "error",
            "failure_class": F.NONE,
            "reason": "does not fit",
            "suggestions": ["a smaller model"],
            "exit_code": 3,
            "launches": 0,
        },
        {
            "event": "search_exhausted",
            "log_level": "error",
            "failure_class": OOM.cls,
            "reason": "no flags left",
            "suggestions": [],
            "exit_code": 3,
        },
        {
            "event": "fatal_failure",
            "log_level": "error",
            "failure_class": F.CONFIG_ERROR,
            "reason": "bad flag",
            "suggestions": [],
            "exit_code": 4,
        },
        {
            "event": "compile_cache_cold",
            "log_level": "warning",
            "flags": flags,
            "proven_kv_cache_tokens": 12000.0,
            "predicted_kv_gib": 1.23,
            "predicted_context": 4096,
            "context_fits": True,
            "note": "proven on a warm torch.compile cache; this start compiles from nothing",
        },
        {"event": "memory_chart_unavailable", "log_level": "debug", "error": "ValueError: no GPU"},
        {"event": "device_probe_failed", "log_level": "warning", "error": "NVMLError: gone"},
        {"event": "device_probe_failed", "log_level": "debug", "error": "NVMLError: gone"},
    ]


def test_lines_of_the_parts_without_a_bus_of_their_own_keep_their_names_levels_and_fields():
    """The preflight, the fleet's store, the session's start and ``r1sup tune`` publish events; the log's
    sink writes the lines they wrote themselves before (the README's and operators' names)."""
    store = "/srv/store"
    with capture_logs() as logs:
        sink = LogSink(structlog.get_logger())
        sink(E.PreflightPassed("/usr/bin/python3", "vllm", "0.32.0", "2.9.0", "hf-cache", "/hf", 1.5, True))
        sink(E.PreflightFailed("server.python", "cannot import vllm", 4))
        sink(E.PreflightCacheUnusable("/s/preflight.json", "not JSON"))
        sink(E.PreflightCacheNotSaved("/s/preflight.json", "disk full"))
        sink(E.FilePermissions({"file": "/k", "mode": "0o644", "why": "key file readable by others"}))
        sink(E.TuneInterrupted(15))
        sink(E.FleetHit("k", store, 2.5))
        sink(E.FleetMiss("k", store))
        sink(E.FleetUnavailable(store, "refused"))
        sink(E.FleetLeaseAcquired("k", store, 600.0))
        sink(E.FleetWaiting("k", "node-b", 7, 42.0))
        sink(E.FleetWaitTimeout("k", 300.0))
        sink(E.FleetPublished("k", store, written=True))
        sink(E.FleetPublished("k", store, written=False))
        sink(E.FleetReadOnly("k", store))
        sink(E.FleetPublishFailed("k", store, "read-only file system"))
        sink(E.FleetFileInvalid(f"{store}/profiles/k.json", "not JSON"))
        sink(E.FleetLeaseTakenOver("k", None, None, "unreadable lease (not JSON)"))
        sink(E.FleetLeaseBreakFailed(f"{store}/leases/k.lease", "Permission denied"))
        sink(E.FleetLeaseLost("k", store))
        sink(E.FleetLeaseReleaseFailed("k", "gone"))
        sink(E.PlannerNote("model architecture unknown"))
        sink(E.PlanMade(SECOND, "fits_with_changes", FIRST.describe_change(SECOND)))
        sink(E.PlannerCalibrated(FIRST, {"weights_gib": 14.2, "kv_cache_gib": 3.5}))
    assert logs[-3:] == [
        {"event": "planner_note", "log_level": "info", "note": "model architecture unknown"},
        {
            "event": "plan_made",
            "log_level": "info",
            "flags": SECOND.to_dict(),
            "verdict": "fits_with_changes",
            "changed": FIRST.describe_change(SECOND),
        },
        {
            "event": "planner_calibrated",
            "log_level": "info",
            "flags": FIRST.to_dict(),
            "weights_gib": 14.2,
            "kv_cache_gib": 3.5,
        },
    ]
    assert logs[:-3] == [
        {
            "event": "preflight_passed",
            "log_level": "info",
            "python": "/usr/bin/python3",
            "engine_package": "vllm",
            "vllm_version": "0.32.0",
            "torch_version": "2.9.0",
            "model": "hf-cache",
            "model_where": "/hf",
            "seconds": 1.5,
            "cached": True,
        },
        {
            "event": "preflight_failed",
            "log_level": "error",
            "field": "server.python",
            "error": "cannot import vllm",
            "exit_code": 4,
        },
        {
            "event": "preflight_cache_unusable",
            "log_level": "debug",
            "path": "/s/preflight.json",
            "reason": "not JSON",
        },
        {
            "event": "preflight_cache_not_saved",
            "log_level": "debug",
            "path": "/s/preflight.json",
            "error": "disk full",
        },
        {
            "event": "file_permissions",
            "log_level": "warning",
            "file": "/k",
            "mode": "0o644",
            "why": "key file readable by others",
        },
        {"event": "tune_interrupted", "log_level": "warning", "signal": 15},
        {"event": "profile_store_hit", "log_level": "info", "key": "k", "store": store, "waited_s": 2.5},
        {"event": "profile_store_miss", "log_level": "info", "key": "k", "store": store, "read_only": True},
        {"event": "profile_store_unavailable", "log_level": "warning", "store": store, "error": "refused"},
        {
            "event": "profile_lease_acquired",
            "log_level": "info",
            "key": "k",
            "store": store,
            "lease_s": 600.0,
        },
        {
            "event": "profile_store_waiting",
            "log_level": "info",
            "key": "k",
            "holder_host": "node-b",
            "holder_pid": 7,
            "lease_expires_in_s": 42.0,
        },
        {"event": "profile_store_wait_timeout", "log_level": "warning", "key": "k", "waited_s": 300.0},
        {"event": "profile_published", "log_level": "info", "key": "k", "store": store},
        {"event": "profile_store_unchanged", "log_level": "info", "key": "k", "store": store},
        {"event": "profile_store_read_only", "log_level": "info", "key": "k", "store": store},
        {
            "event": "profile_publish_failed",
            "log_level": "error",
            "key": "k",
            "store": store,
            "error": "read-only file system",
        },
        {
            "event": "profile_store_file_invalid",
            "log_level": "warning",
            "path": f"{store}/profiles/k.json",
            "reason": "not JSON",
        },
        {
            "event": "profile_lease_taken_over",
            "log_level": "warning",
            "key": "k",
            "holder_host": None,
            "holder_pid": None,
            "why": "unreadable lease (not JSON)",
        },
        {
            "event": "profile_lease_break_failed",
            "log_level": "warning",
            "path": f"{store}/leases/k.lease",
            "error": "Permission denied",
        },
        {"event": "profile_lease_lost", "log_level": "warning", "key": "k", "store": store},
        {"event": "profile_lease_release_failed", "log_level": "warning", "key": "k", "error": "gone"},
    ]


def test_a_tuner_without_a_bus_logs_the_searchs_events_through_the_log_sink(tmp_path: Path):
    from r1sup.supervision.tuner import ModelKnowledge, Tuner

    body = {"model": {"name": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"}, "state": {"dir": str(tmp_path)}}
    config = cfg.load(write_config(tmp_path / "r1sup.toml", body), environ={})
    with capture_logs() as logs:
        log = structlog.get_logger()
        tuner = Tuner(config, Runner(config, EventQueue(), log=log), log, know=ModelKnowledge())
        tuner.publish(SearchStepped(2, FIRST, SECOND, OOM.cls, OOM.evidence, "halved"))
    assert [(e["event"], e["attempt"], e["reason"]) for e in logs] == [("search_step", 1, "halved")]


class Source:
    """status.json's fields as a daemon would give them."""

    def __init__(self, directory: Path) -> None:
        self.state_dir = str(directory)
        self.state = "planning"

    def status_fields(self, recent: list[dict[str, Any]]) -> dict[str, Any]:
        return {"state": self.state, "recent_events": recent}


def on_disk(directory: Path) -> dict[str, Any]:
    return dict(json.loads((directory / "status.json").read_text(encoding="utf-8")))


def test_status_file_notes_recent_events_and_writes_at_the_changes(tmp_path: Path):
    source = Source(tmp_path)
    sink = StatusFile(source, Calls())
    sink(Launching(1, FIRST))  # noted, not written yet
    assert not (tmp_path / "status.json").exists() and sink.doc is None
    source.state = "launching"
    sink(E.StateChanged("planning", "launching", "attempt 1: launching vLLM"))
    sink(AttemptFailed(1, OOM))
    sink(SearchStepped(2, FIRST, SECOND, OOM.cls))
    sink(E.ProfileFound("k", {}, degraded=True))  # the degraded variant is not a recent event
    doc = on_disk(tmp_path)
    assert doc == sink.doc and doc["state"] == "launching"
    events = [
        (e["event"], {k: v for k, v in e.items() if k not in ("ts", "event")}) for e in doc["recent_events"]
    ]
    assert events == [
        ("launch_started", {"attempt": 1, "flags": FIRST.to_dict()}),
        ("state_changed", {"old": "planning", "new": "launching"}),
        (
            "failure_classified",
            {"failure_class": "oom_runtime", "phase": "serving", "evidence": OOM.evidence},
        ),
    ]  # the ladder step is noted and shown at the next write
    sink(E.StatusText("x"))
    assert on_disk(tmp_path)["recent_events"][-1] == {
        **sink.recent[-1],
        "event": "search_step",
        "status": "attempt 2: context 8192 -> 4096 (oom_runtime)",
    }


def test_status_file_notes_no_change_of_state_where_the_state_stays(tmp_path: Path):
    """Issue 36: a new status line within planning read ``planning -> planning`` in ``status``."""
    source = Source(tmp_path)
    sink = StatusFile(source, Calls())
    sink(E.StateChanged("starting", "planning", "planning"))
    sink(E.StateChanged("planning", "planning", "re-planning after reload"))
    changes = [
        (e["old"], e["new"]) for e in on_disk(tmp_path)["recent_events"] if e["event"] == "state_changed"
    ]
    assert changes == [("starting", "planning")]
    assert sink.doc == on_disk(tmp_path)  # the new status line is still written


def test_a_profile_that_does_not_fit_now_says_what_is_free_in_the_log_and_in_status_json(tmp_path: Path):
    busy = Conditions(free_gib=7.5, total_gib=23.99, others_gib=16.0, holders=("pid 7 trainer (16.0 GiB)",))
    with capture_logs() as logs:
        log = LogSink(structlog.get_logger())
        log(E.ProfileDoesNotFit("k", {"max_model_len": 4096}, busy))
        log(E.ProfileDoesNotFit("k", {"max_model_len": 4096}, None))  # no GPU: nothing to say of it
    assert logs == [
        {
            "event": "profile_does_not_fit_now",
            "log_level": "warning",
            "key": "k",
            "flags": {"max_model_len": 4096},
            "free_gib": 7.5,
            "total_gib": 23.99,
            "others_gib": 16.0,
            "holders": ["pid 7 trainer (16.0 GiB)"],
        },
        {
            "event": "profile_does_not_fit_now",
            "log_level": "warning",
            "key": "k",
            "flags": {"max_model_len": 4096},
        },
    ]
    sink = StatusFile(Source(tmp_path), Calls())
    sink(E.ProfileDoesNotFit("k", {}, busy))
    sink(E.ProfileDoesNotFit("k", {}, None))
    noted = [{k: v for k, v in e.items() if k != "ts"} for e in sink.recent]
    assert noted == [
        {"event": "profile_does_not_fit_now", "key": "k", "others_gib": 16.0},
        {"event": "profile_does_not_fit_now", "key": "k", "others_gib": None},
    ]


def test_status_file_keeps_the_last_twenty_events(tmp_path: Path):
    sink = StatusFile(Source(tmp_path), Calls())
    for n in range(25):
        sink(E.ProfileStoreHit(f"k{n}"))
    sink(E.StatusText("x"))
    assert [e["key"] for e in on_disk(tmp_path)["recent_events"]] == [f"k{n}" for n in range(5, 25)]


def test_loading_progress_paces_status_json_and_status_lines_each_its_own_way(tmp_path: Path):
    class Counted(Source):
        """Keeps the moment of each write (the loop's clock, set below)."""

        now = 0.0
        writes: list[float] = []

        def status_fields(self, recent: list[dict[str, Any]]) -> dict[str, Any]:
            self.writes.append(self.now)
            return super().status_fields(recent)

    source = Counted(tmp_path)
    notifier = Recorded()
    files, systemd = StatusFile(source, Calls()), SystemdSink(notifier)
    shown: list[float] = []
    for tick in range(0, 70):  # 0.1 s per turn of the loop: weights from 0 s, a new phase at 5.5 s
        now = 100.0 + tick / 10
        phase = "weights" if now < 105.5 else "kv_cache"
        source.now = now
        event = E.LoadingProgress(now, phase, f"{phase} at {now:.1f}")
        files(event)
        sent = len(notifier.sent)
        systemd(event)
        if len(notifier.sent) > sent:
            shown.append(now)
    assert source.writes == [100.0, 105.0, 105.5]  # each phase at once, else every 5 s
    assert shown == [100.0, 102.0, 104.0, 105.5]  # each phase at once, else every 2 s
    assert notifier.sent[-1] == "STATUS=kv_cache at 105.5"


def test_status_write_failure_is_a_log_line_not_an_error(tmp_path: Path):
    (tmp_path / "file").write_text("", encoding="utf-8")
    log = Calls()
    sink = StatusFile(Source(tmp_path / "file" / "state"), log)
    sink(E.StatusText("x"))
    assert [(level, event) for level, event, _ in log.calls] == [("warning", "status_write_failed")]
    assert sink.doc is not None  # /status still answers with what the file would hold


def test_metrics_follow_the_events():
    sink = MetricsSink(Metrics())
    value = sink.metrics.registry.get_sample_value
    sink(E.StateChanged("planning", "launching"))
    sink(Launching(1, FIRST))
    sink(AttemptFailed(1, OOM))
    sink(SearchStepped(2, FIRST, SECOND, OOM.cls))
    sink(Launching(2, SECOND))
    sink(E.StateChanged("probing", "serving", "serving"))
    sink(
        E.Serving(SECOND, "tuned", ProbeResult(ok=True, ttft_p50_s=0.2, ttft_p95_s=0.4, duration_s=3.0), "s")
    )
    assert (
        value("r1sup_state", {"state": "serving"}) == 1.0
        and value("r1sup_state", {"state": "launching"}) == 0.0
    )
    assert value("r1sup_launches_total") == 2.0 and value("r1sup_max_model_len") == 4096.0
    assert value("r1sup_failures_total", {"failure_class": "oom_runtime"}) == 1.0
    # the search's steps, and the same count under the old name (an alias for one release)
    assert value("r1sup_search_steps_total", {"failure_class": "oom_runtime"}) == 1.0
    assert value("r1sup_ladder_steps_total", {"failure_class": "oom_runtime"}) == 1.0
    assert value("r1sup_child_up") == 1.0 and value("r1sup_probe_ttft_seconds", {"quantile": "0.95"}) == 0.4
    sink(E.ServingFailed(F.Failure(F.ENGINE_DEAD, F.PHASE_SERVING), 30.0))
    sink(E.RestartScheduled(1, 5, 2.0))
    assert value("r1sup_child_up") == 0.0 and value("r1sup_restarts_total") == 1.0
    assert value("r1sup_failures_total", {"failure_class": "engine_dead"}) == 1.0
    sink(E.StepAfterServing(SearchStepped(3, SECOND, FIRST, OOM.cls), "", ""))
    assert value("r1sup_search_steps_total", {"failure_class": "oom_runtime"}) == 2.0
    assert value("r1sup_ladder_steps_total", {"failure_class": "oom_runtime"}) == 2.0


def test_systemd_lines_one_status_per_fact_ready_once():
    notifier = Recorded()
    sink = SystemdSink(notifier)
    sink(E.StateChanged("planning", "planning", "planning"))
    sink(E.StateChanged("probing", "serving", None))  # no status: no line
    sink(E.Serving(FIRST, "persisted", None, "serving tiny on port 8000"))
    sink(E.ConfigReloaded(changed=False, applied=True))
    sink(E.ConfigReloaded(changed=True, applied=False))
    sink(E.ReloadFailed("r1sup.toml: bad"))
    sink(E.Serving(FIRST, "tuned", None, "serving again"))  # READY=1 only the first time
    sink(E.Stopping())
    assert notifier.sent == [
        "STATUS=planning",
        "READY=1",
        "STATUS=serving tiny on port 8000",
        notifier.sent[3],  # MAINPID=
        "STATUS=serving; config reloaded, flags unchanged",
        "STATUS=serving; reload failed: r1sup.toml: bad",
        "STOPPING=1",
        "STATUS=stopping",
    ]
    assert notifier.sent[3].startswith("MAINPID=")


def test_systemd_watchdog_at_half_the_interval_and_the_start_timeout_extended_while_starting():
    class Timed(Recorded):
        def __init__(self) -> None:
            Notifier.__init__(self, {"WATCHDOG_USEC": "4000000"})  # pings every 2 s
            self.sent = []

    notifier = Timed()
    sink = SystemdSink(notifier)
    pings: list[tuple[float, str]] = []
    for tick in range(0, 250):  # 25 s, a turn every 0.1 s; starting for the first 15 s
        now = 1000.0 + tick / 10
        sent = len(notifier.sent)
        sink(E.Heartbeat(now, starting=now < 1015.0))
        pings += [(round(now - 1000.0, 1), line) for line in notifier.sent[sent:]]
    assert [t for t, line in pings if line == "WATCHDOG=1"] == [float(t) for t in range(0, 25, 2)]
    assert [(t, line) for t, line in pings if line != "WATCHDOG=1"] == [
        (0.0, "EXTEND_TIMEOUT_USEC=30000000"),
        (10.0, "EXTEND_TIMEOUT_USEC=30000000"),
    ]


# --- the daemon on the bus ----------------------------------------------------------------------


def test_serving_reaches_every_sink_before_its_log_line(tmp_path: Path):
    """The daemon's own wiring: when ``serving`` is logged, status.json, /metrics and systemd say so."""
    seen_at_log: dict[str, Any] = {}

    class Peek(Calls):
        def __getattr__(self, level: str) -> Any:
            def log(event: str, **fields: Any) -> None:
                if event == "serving":
                    seen_at_log["state"] = on_disk(tmp_path)["state"]
                    seen_at_log["up"] = metrics.registry.get_sample_value("r1sup_child_up")
                    seen_at_log["ready"] = "READY=1" in notifier.sent
                self.calls.append((level, event, fields))

            return log

    body = {
        "model": {"name": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"},
        "state": {"dir": str(tmp_path)},
        "daemon": {"metrics_port": 9},  # never served: run() is not called
    }
    config = cfg.load(write_config(tmp_path / "r1sup.toml", body), environ={})
    events, notifier, log = EventQueue(), Recorded(), Peek()
    d = Daemon(Session(config, None, log, events, Runner(config, events, log=Calls()), {}), notifier=notifier)
    assert d.metrics_sink is not None
    metrics = d.metrics_sink.metrics
    d.on_search(Launching(1, FIRST))
    d.on_search(Probing(1, FIRST))
    d._served(TuneResult(ok=True, exit_code=0, flags=FIRST, probe=ProbeResult(ok=True)))
    assert seen_at_log == {"state": "serving", "up": 1.0, "ready": True}
    assert [event for _, event, _ in log.calls] == ["state_changed"] * 3 + ["serving"]
    assert d.endpoint_view().status == d.status_file.doc == on_disk(tmp_path)
