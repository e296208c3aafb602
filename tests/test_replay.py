"""The daemon's state table, replayed: every transition it allows is driven in process by a scripted
history on a fake clock (tests/replay.py: vLLM's output from the log fixtures, scripted checks,
scheduled signals). Each test names the transitions it drives (``covers``) and fails unless the daemon
took them; the last test fails when a transition of the table has no replay."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from r1sup.core import errors
from r1sup.core import failure as F
from r1sup.core.errors import InternalError, PreflightError
from r1sup.core.liveness import Figures
from r1sup.supervision.daemon import backoff_delay
from r1sup.supervision.states import LEGAL, Cause, State
from replay import CHECK_LATENCY_S, IDLE, RUNTIME_OOM, STARTUP, Replay, Script, log_lines, stats_line

S = State
Pair = tuple[State, State]
COVERS: dict[Pair, list[str]] = {}
_made: list[Replay] = []


def covers(*pairs: Pair) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The transitions a test drives; it fails unless each of them happened in its replays."""

    def mark(test: Callable[..., Any]) -> Callable[..., Any]:
        for pair in pairs:
            COVERS.setdefault(pair, []).append(test.__name__)
        return pytest.mark.covers(*pairs)(test)

    return mark


@pytest.fixture(autouse=True)
def _check_covers(request: pytest.FixtureRequest) -> Any:
    _made.clear()
    yield
    marker = request.node.get_closest_marker("covers")
    if marker is None:
        return
    seen = {pair for r in _made for pair in r.transitions}
    missing = [f"{a.value} -> {b.value}" for a, b in marker.args if (a, b) not in seen]
    assert not missing, f"declared but not taken: {missing}; taken: {sorted(seen, key=str)}"


def _json(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text(encoding="utf-8")))


def replay(tmp_path: Path, *scripts: Script, **sections: dict[str, Any]) -> Replay:
    r = Replay(tmp_path, list(scripts) or [Script()], **sections)
    _made.append(r)
    return r


def stop_after_serving(r: Replay, seconds: float = 30.0, count: int = 1) -> None:
    r.at_serving(count, lambda: r.signal(seconds, signal.SIGTERM))


BUSY = Figures(running=2, waiting=1, prompt_tokens=100, generation_tokens=50, finished=3)


def busy_then_done(done_after_s: float) -> Callable[[float], Figures]:
    """Requests in flight, progressing, until ``done_after_s`` seconds after the engine's start."""

    def figures(s: float) -> Figures:
        if s >= done_after_s:
            return IDLE
        return Figures(running=2, waiting=1, prompt_tokens=100 + s, generation_tokens=50 + 10 * s, finished=3)

    return figures


def crashing(after_s: float, code: int = 1) -> Script:
    """Starts, then exits while serving ``after_s`` seconds after its start, saying nothing."""
    return Script(exit_at=len(STARTUP) * 0.5 + after_s, exit_code=code)


# --- bring-up ----------------------------------------------------------------------------------------


@covers(
    (S.PLANNING, S.PLANNING),
    (S.PLANNING, S.LAUNCHING),
    (S.LAUNCHING, S.PROBING),
    (S.PROBING, S.SERVING),
    (S.SERVING, S.DRAINING),
    (S.DRAINING, S.STOPPING),
    (S.STOPPING, S.STOPPED),
)
def test_a_search_brings_the_engine_up_and_sigterm_stops_it(tmp_path: Path) -> None:
    r = replay(tmp_path)
    stop_after_serving(r)
    assert r.run() == errors.EXIT_OK
    # draining (/readyz 503) first, even with nothing in flight, then the stop at once
    assert r.states() == ["planning", "launching", "probing", "serving", "draining", "stopping", "stopped"]
    # READY=1 once, after the probe; STOPPING=1 at the stop; the engine stopped by r1sup
    ready = [i for i, line in enumerate(r.notifier.sent) if line == "READY=1"]
    assert len(ready) == 1 and "STOPPING=1" in r.notifier.sent[ready[0] :]
    assert r.engine(1).stopped_by == "stop"
    doc = r.status_json()
    assert doc["state"] == "stopped" and doc["launches"] == 1 and doc["profile_source"] == "tuned"
    assert r.log.names("probe_passed", "tune_succeeded", "serving", "drain_skipped", "engine_stopped") == [
        "probe_passed",
        "tune_succeeded",
        "serving",
        "drain_skipped",
        "engine_stopped",
    ]


def test_the_stop_escalates_to_sigkill_on_its_timer_while_the_loop_turns(tmp_path: Path) -> None:
    # supervisord's STOPPING: SIGTERM, then SIGKILL when server.stop_timeout_s has passed; meanwhile the
    # loop turns: what vLLM prints during its teardown is relayed as it comes, marked as such
    teardown = [
        "(APIServer pid=1) WARNING 06-02 09:20:00 [launcher.py:101] Shutting down FastAPI HTTP server."
    ]
    r = replay(tmp_path, Script(term_ignored=True, teardown=teardown), server={"stop_timeout_s": 10.0})
    stop_after_serving(r)
    assert r.run() == errors.EXIT_OK
    stopped = r.log.named("engine_stopped")[-1]
    assert stopped["escalated"] is True and r.engine(1).stopped_by == "sigkill"
    assert 10.0 <= stopped["seconds"] < 10.5
    relayed = [f for f in r.log.named("vllm") if "Shutting down FastAPI" in f["text"]]
    assert relayed and relayed[0]["during_stop"] is True and relayed[0]["t"] < stopped["t"] - 9.0


def test_a_second_sigterm_forces_the_sigkill_at_once(tmp_path: Path) -> None:
    r = replay(tmp_path, Script(term_ignored=True), server={"stop_timeout_s": 30.0})
    r.at_serving(1, lambda: [r.signal(30.0, signal.SIGTERM), r.signal(32.0, signal.SIGTERM)])
    assert r.run() == errors.EXIT_OK
    stopped = r.log.named("engine_stopped")[-1]
    assert stopped["escalated"] is True and 2.0 <= stopped["seconds"] < 2.5


def test_an_engine_that_exits_on_sigterm_is_not_killed(tmp_path: Path) -> None:
    r = replay(tmp_path, Script(teardown=["(APIServer pid=1) INFO 06-02 09:20:00 [x.py:1] bye"] * 3))
    stop_after_serving(r)
    assert r.run() == errors.EXIT_OK
    stopped = r.log.named("engine_stopped")[-1]
    assert stopped["escalated"] is False and r.engine(1).stopped_by == "stop"
    assert 1.5 <= stopped["seconds"] < 2.0  # its three teardown lines, 0.5 s apart, then the exit


@covers((S.LAUNCHING, S.LAUNCHING))
def test_an_oom_at_start_up_steps_to_new_flags_and_launches_again(tmp_path: Path) -> None:
    oom = log_lines("gpu/oom-cudagraph-capture-frames-v1.log")
    r = replay(tmp_path, Script(lines=oom, exit_at=len(oom) * 0.5 + 1), Script())
    stop_after_serving(r)
    assert r.run() == errors.EXIT_OK
    failed = r.log.named("failure_classified")[0]
    assert failed["failure_class"] == F.OOM_CUDAGRAPH
    first, second = r.engine(1).spec, r.engine(2).spec
    assert first.argv != second.argv  # the search changed a flag
    assert any(line.startswith("STATUS=attempt 2: ") and "oom_cudagraph" in line for line in r.notifier.sent)
    assert r.status_json()["last_failure"]["class"] == F.OOM_CUDAGRAPH


@covers((S.LAUNCHING, S.SERVING))
def test_without_a_probe_a_ready_engine_is_serving(tmp_path: Path) -> None:
    r = replay(tmp_path, probe={"enabled": False})
    stop_after_serving(r)
    assert r.run() == errors.EXIT_OK
    assert "probing" not in r.states() and not r.log.named("probe_started")


@covers((S.LAUNCHING, S.BACKOFF), (S.BACKOFF, S.LAUNCHING))
def test_an_engine_that_dies_at_start_up_without_a_cause_is_retried_after_a_backoff(tmp_path: Path) -> None:
    r = replay(tmp_path, Script(lines=STARTUP[:6], exit_at=4.0), Script())
    stop_after_serving(r)
    assert r.run() == errors.EXIT_OK
    assert r.states()[:4] == ["planning", "launching", "backoff", "launching"]
    retry = r.log.named("retry_backoff")[0]
    assert retry["failure_class"] == F.ENGINE_DEAD
    assert f"STATUS=attempt 2: retry in {retry['seconds']:.1f}s (engine_dead)" in r.notifier.sent
    # the same flags again: a transient failure says nothing about them
    assert r.engine(1).spec.argv == r.engine(2).spec.argv


@covers((S.LAUNCHING, S.STOPPING))
def test_sigterm_while_vllm_loads_stops_it_and_exits_0(tmp_path: Path) -> None:
    r = replay(tmp_path)
    r.on_entering(S.LAUNCHING, lambda: r.signal(3.0, signal.SIGTERM))
    assert r.run() == errors.EXIT_OK
    assert r.states()[-2:] == ["stopping", "stopped"] and r.engine(1).stopped_by == "stop"
    assert not r.log.named("engine_ready")


@covers((S.LAUNCHING, S.FAILED))
def test_a_model_that_is_nowhere_fails_at_once(tmp_path: Path) -> None:
    missing = log_lines("gpu/model-not-found-gated-k8s.log")
    r = replay(tmp_path, Script(lines=missing, exit_at=len(missing) * 0.5 + 1))
    assert r.run() == errors.EXIT_FATAL_FAILURE
    assert len(r.engines) == 1 and r.states()[-1] == "failed"
    assert r.status_json()["last_failure"]["class"] == F.MODEL_NOT_FOUND


# --- the probe ---------------------------------------------------------------------------------------


def _probe_oom() -> Script:
    """Ready, then out of memory under the probe's requests: the traceback, then the exit."""
    out = (len(STARTUP) + 1) * 0.5
    later = [(out + 1.0 + i * 0.01, line) for i, line in enumerate(RUNTIME_OOM)]
    return Script(probe_ok=False, probe_s=4.0, later=later, exit_at=out + 2.0)


@covers((S.PROBING, S.LAUNCHING))
def test_an_oom_under_the_probe_steps_down_and_launches_again(tmp_path: Path) -> None:
    r = replay(tmp_path, _probe_oom(), Script())
    stop_after_serving(r)
    assert r.run() == errors.EXIT_OK
    failed = r.log.named("probe_failed")[0]
    assert failed["failure_class"] == F.OOM_RUNTIME and failed["phase"] == F.PHASE_SERVING
    assert r.states()[:5] == ["planning", "launching", "probing", "launching", "probing"]


@covers((S.PROBING, S.BACKOFF))
def test_probe_requests_that_fail_on_a_live_engine_are_retried(tmp_path: Path) -> None:
    r = replay(tmp_path, Script(probe_ok=False), Script())
    stop_after_serving(r)
    assert r.run() == errors.EXIT_OK
    assert r.log.named("probe_failed")[0]["failure_class"] == F.ENGINE_DEAD
    assert r.states()[:5] == ["planning", "launching", "probing", "backoff", "launching"]


@covers((S.PROBING, S.STOPPING))
def test_sigterm_during_the_probe_stops_the_engine(tmp_path: Path) -> None:
    r = replay(tmp_path, Script(probe_s=20.0))
    r.on_entering(S.PROBING, lambda: r.signal(2.0, signal.SIGTERM))
    assert r.run() == errors.EXIT_OK
    assert r.states()[-3:] == ["probing", "stopping", "stopped"]
    assert not r.log.named("probe_passed") and r.engine(1).stopped_by == "stop"


@covers((S.PROBING, S.FAILED))
def test_a_probe_child_that_cannot_run_is_r1sups_failure_not_the_engines(tmp_path: Path) -> None:
    r = replay(tmp_path, Script(probe_internal=True))
    with pytest.raises(InternalError):
        r.run()
    assert r.states()[-1] == "failed" and len(r.engines) == 1 and r.engine(1).stopped_by == "stop"
    assert r.status_json()["last_failure"]["class"] == F.INTERNAL_ERROR


# --- serving -----------------------------------------------------------------------------------------


@covers((S.SERVING, S.LAUNCHING))
def test_an_oom_while_serving_steps_down_saves_the_profile_and_serves_again(tmp_path: Path) -> None:
    out = (len(STARTUP) + 1) * 0.5
    oom = Script(later=[(out + 40 + i * 0.01, line) for i, line in enumerate(RUNTIME_OOM)], exit_at=out + 41)
    r = replay(tmp_path, oom, Script())
    stop_after_serving(r, count=2)
    assert r.run() == errors.EXIT_OK
    failed = r.log.named("serving_failed")[0]
    assert failed["failure_class"] == F.OOM_RUNTIME
    step = r.log.named("search_step")[0]
    assert step["old"] != step["new"]
    doc = r.status_json()
    assert (
        doc["launches"] == 2 and doc["flags"] == step["new"] and doc["last_failure"]["class"] == F.OOM_RUNTIME
    )
    assert r.states().count("serving") == 2 and not r.log.named("restart_backoff")
    # the new flags are the saved profile now
    profiles = sorted((tmp_path / "state" / "profiles").glob("*.json"))
    assert len(profiles) == 1 and step["new"] == _json(profiles[0])["flags"]


@covers((S.SERVING, S.BACKOFF), (S.BACKOFF, S.LAUNCHING))
def test_an_engine_that_crashes_while_serving_is_restarted_after_a_backoff(tmp_path: Path) -> None:
    r = replay(tmp_path, crashing(after_s=20), Script())
    stop_after_serving(r, count=2)
    assert r.run() == errors.EXIT_OK
    failed = r.log.named("serving_failed")[0]
    assert failed["failure_class"] == F.ENGINE_DEAD
    backoff = r.log.named("restart_backoff")[0]
    assert backoff["restart"] == 1 and 1.0 <= backoff["seconds"] <= 2.0  # initial x 2^0 + U(0, initial)
    assert r.engine(1).spec.argv == r.engine(2).spec.argv


def test_after_a_crash_the_state_the_table_gives_chooses_the_next_step(tmp_path: Path) -> None:
    # serving ends in a crash: the daemon names it, the table says backoff, and backoff's step (the
    # restart's wait) launches the same flags again; the launch's causes take it back to serving
    r = replay(tmp_path, crashing(after_s=20), Script())
    stop_after_serving(r, count=2)
    assert r.run() == errors.EXIT_OK
    crash = r.causes.index((S.SERVING, Cause.CRASHED, S.BACKOFF))
    assert r.causes[crash + 1 :] == [
        (S.BACKOFF, Cause.LAUNCH_STARTED, S.LAUNCHING),
        (S.LAUNCHING, Cause.PROBE_STARTED, S.PROBING),
        (S.PROBING, Cause.READY, S.SERVING),
        (S.SERVING, Cause.DRAIN_REQUESTED, S.DRAINING),
        (S.DRAINING, Cause.STOP_REQUESTED, S.STOPPING),
        (S.STOPPING, Cause.ENGINE_STOPPED, S.STOPPED),
    ]
    assert r.log.names("restart_backoff", "launch_started")[-2:] == ["restart_backoff", "launch_started"]


def test_status_json_shows_the_capacity_of_the_flags_serving_and_none_while_nothing_serves(
    tmp_path: Path,
) -> None:
    r = replay(tmp_path, crashing(after_s=20), Script())
    seen: list[tuple[str, Any]] = []
    r.on_transition(lambda old, new: seen.append((new.value, r.status_json()["capacity"])))
    stop_after_serving(r, count=2)
    assert r.run() == errors.EXIT_OK
    capacities = {state: capacity for state, capacity in seen if state in ("serving", "launching")}
    assert capacities["launching"] is None  # the last launch: nothing proven for its flags yet
    serving = capacities["serving"]
    assert serving["requests"] == 1 and serving["output_tokens_per_second"] == 40.0 and not serving["reduced"]
    assert serving["context_tokens"] == r.status_json()["flags"]["max_model_len"]
    # nothing serves while it backs off after the crash, nor once it stopped
    assert [capacity for state, capacity in seen if state in ("backoff", "stopped")] == [None, None]


@covers((S.SERVING, S.FAILED))
def test_crashes_beyond_the_restart_budget_exit_5(tmp_path: Path) -> None:
    r = replay(tmp_path, crashing(after_s=5), daemon={"restart_budget": 2})
    assert r.run() == errors.EXIT_RESTART_BUDGET
    assert len(r.engines) == 3 and [e["restart"] for e in r.log.named("restart_backoff")] == [1, 2]
    seconds = [e["seconds"] for e in r.log.named("restart_backoff")]
    assert 1.0 <= seconds[0] <= 2.0 and 2.0 <= seconds[1] <= 3.0  # exponential, with jitter
    assert (
        r.states()[-1] == "failed"
        and r.log.named("daemon_failed")[0]["exit_code"] == errors.EXIT_RESTART_BUDGET
    )
    failures = r.log.named("serving_failed")
    assert len(failures) == 3 and {f["failure_class"] for f in failures} == {F.ENGINE_DEAD}
    # a crash is not a memory problem: the same flags each time
    assert not r.log.named("search_step") and len({tuple(e.spec.argv) for e in r.engines}) == 1
    doc = r.status_json()
    assert doc["state"] == "failed" and doc["launches"] == 3 and doc["child_pid"] is None


def test_a_stable_period_resets_the_restart_budget(tmp_path: Path) -> None:
    # each engine serves 400 s (> stable_after_s 300) before crashing: the budget of 1 never runs out
    scripts = [crashing(after_s=400)] * 3 + [Script()]
    r = replay(tmp_path, *scripts, daemon={"restart_budget": 1})
    stop_after_serving(r, count=4)
    assert r.run() == errors.EXIT_OK
    assert [e["restart"] for e in r.log.named("restart_backoff")] == [1, 1, 1]


@covers((S.SERVING, S.BACKOFF))
def test_an_engine_dead_behind_a_healthy_health_check_is_restarted_within_one_liveness_interval(
    tmp_path: Path,
) -> None:
    # from 30 s after its start: /health still answers 200, the processes live, requests get vLLM's
    # engine-dead reply (the trap the liveness completion exists for)
    dead_from = (len(STARTUP) + 1) * 0.5 + 30

    def completion(s: float) -> tuple[int, str]:
        return (
            (500, '{"error": "EngineDeadError: EngineCore encountered an issue"}')
            if s >= dead_from
            else (200, "")
        )

    r = replay(tmp_path, Script(completion=completion), Script())
    stop_after_serving(r, count=2)
    assert r.run() == errors.EXIT_OK
    failed = r.log.named("serving_failed")[0]
    assert failed["failure_class"] == F.ENGINE_DEAD and "engine-dead reply" in failed["evidence"]
    verdicts = [e["verdict"] for e in r.log.named("liveness") if e["t"] <= failed["t"]]
    assert verdicts[-1] == "hung" and "hung" not in verdicts[:-1]  # alive (or idle) until then
    died_at = r.engine(1).started_at + dead_from
    interval = r.daemon.config.daemon.liveness_interval_s
    assert failed["t"] - died_at <= interval, (failed["t"], died_at)
    assert r.log.named("restart_backoff") and len(r.engines) == 2


# --- liveness: a long queue, a stopped engine core -----------------------------------------------------

OUT_S = (len(STARTUP) + 1) * 0.5  # the start-up lines are out this long after a launch


def one_slot_queue(count: int, each_s: float, from_s: float) -> Callable[[float], Figures]:
    """``count`` requests through one sequence slot from ``from_s`` seconds after the start, each
    ``each_s`` seconds long, tokens flowing all along (the counters move at every sample)."""

    def figures(s: float) -> Figures:
        if s < from_s:
            return IDLE
        done = min(count, int((s - from_s) // each_s))
        tokens = 4.0 * min(s - from_s, count * each_s)
        running = 0 if done == count else 1
        return Figures(running, count - done - running, 100.0 * count, tokens, done)

    return figures


def liveness_with_work(r: Replay) -> list[dict[str, Any]]:
    return [e for e in r.log.named("liveness") if (e.get("running") or 0) + (e.get("waiting") or 0) > 0]


def test_a_queue_longer_than_every_timeout_is_served_without_a_restart(tmp_path: Path) -> None:
    # 24 requests of 25 s each through one slot: the last waits 575 s in the queue, ten times the
    # progress timeout (60 s); the counters move at every sample
    queue = one_slot_queue(24, 25.0, from_s=OUT_S + 20)
    r = replay(tmp_path, Script(figures=queue))
    stop_after_serving(r, seconds=20 + 24 * 25 + 60)
    assert r.run() == errors.EXIT_OK
    assert not r.log.named("serving_failed") and len(r.engines) == 1
    verdicts = liveness_with_work(r)
    assert {e["verdict"] for e in verdicts} == {"alive"}
    assert any(e["waiting"] >= 10 for e in verdicts)
    # no one-token completion queued behind work that made progress
    assert not [e for e in verdicts if e["probe"]]
    interval = r.daemon.config.daemon.liveness_interval_s
    assert len(verdicts) >= 24 * 25 / interval - 2  # a verdict per sample
    before_stop = [e for e in r.log.named("liveness") if e["t"] < r.log.named("drain_skipped")[0]["t"]]
    assert before_stop[-1]["verdict"] == "idle"  # once the queue is served


def test_a_stopped_engine_core_under_load_is_restarted_within_the_progress_timeout(tmp_path: Path) -> None:
    # 40 s into serving the engine core is stopped (SIGSTOP): /health and /metrics go on answering,
    # the figures freeze with work pending, a completion sent from then on is never answered
    stopped = OUT_S + 40
    moving = busy_then_done(10_000.0)
    script = Script(
        figures=lambda s: moving(min(s, stopped)),
        completion_s=lambda s: None if s >= stopped else 0.05,
    )
    r = replay(tmp_path, script, Script())
    stop_after_serving(r, count=2)
    assert r.run() == errors.EXIT_OK
    failed = r.log.named("serving_failed")[0]
    assert failed["failure_class"] == F.HANG and "no progress" in failed["evidence"]
    d = r.daemon.config.daemon
    detected = failed["t"] - (r.engine(1).started_at + stopped)
    # the target: the progress timeout + one interval (the progress made until the stop shows at the
    # next sample)
    assert d.progress_timeout_s <= detected <= d.progress_timeout_s + d.liveness_interval_s, detected
    hung = [e for e in r.log.named("liveness") if e["verdict"] == "hung"]
    assert hung and hung[-1]["evidence"] == "stall" and hung[-1]["running"] == 2
    assert not [e for e in r.log.named("liveness") if e.get("health_failures")]  # /health kept answering
    assert r.states().count("serving") == 2 and len(r.engines) == 2


def test_an_idle_engine_that_stops_answering_is_restarted(tmp_path: Path) -> None:
    # idle, then the engine core is stopped: the figures say nothing is pending, /health answers; only
    # r1sup's own one-token completion, sent while idle, goes unanswered
    stopped = OUT_S + 40
    script = Script(completion_s=lambda s: None if s >= stopped else 0.05)
    r = replay(tmp_path, script, Script())
    stop_after_serving(r, count=2)
    assert r.run() == errors.EXIT_OK
    failed = r.log.named("serving_failed")[0]
    assert failed["failure_class"] == F.HANG
    d = r.daemon.config.daemon
    detected = failed["t"] - (r.engine(1).started_at + stopped)
    # the completion is due within an interval, unanswered for the progress timeout, seen at a sample
    interval = d.liveness_interval_s
    assert d.progress_timeout_s <= detected <= interval + d.progress_timeout_s + interval, detected
    before = {e["verdict"] for e in r.log.named("liveness") if e["t"] < r.engine(1).started_at + stopped}
    assert "idle" in before and "hung" not in before  # its completions were answered until then
    hung = [e for e in r.log.named("liveness") if e["verdict"] == "hung"][-1]
    assert hung["own_completion_unanswered_s"] >= d.progress_timeout_s
    assert r.states().count("serving") == 2 and len(r.engines) == 2


def _hanging_metrics(start_s: float, end_s: float, late_s: float = 90.0) -> Callable[[float], float | None]:
    """A /metrics read asked between ``start_s`` and ``end_s`` comes back ``late_s`` later (the issue's
    read under a flood on a loaded machine: not back 67 s after it was due); the others at once."""
    return lambda s: late_s if start_s <= s < end_s else CHECK_LATENCY_S


def _stats_lines(from_s: float, until_s: float, tps: Callable[[float], float]) -> list[tuple[float, str]]:
    """vLLM's stats line every 10 s: one running, 20 waiting, ``tps(s)`` generation tokens/s."""
    count = int((until_s - from_s) // 10)
    return [(from_s + 10 * i, stats_line(tps(from_s + 10 * i), 1, 20)) for i in range(count)]


def test_a_busy_server_whose_metrics_read_hangs_is_judged_on_its_stats_lines(tmp_path: Path) -> None:
    # issue 34: the one-slot flood; from 30 s in, each /metrics read comes back 90 s late, until 400 s,
    # while vLLM's stats lines (every 10 s) say 700 tokens/s. A read not back is unknown, never a stall.
    queue = one_slot_queue(24, 25.0, from_s=OUT_S + 20)
    hang = (OUT_S + 30, OUT_S + 400)
    script = Script(
        figures=queue,
        metrics_s=_hanging_metrics(*hang),
        later=_stats_lines(OUT_S + 25, OUT_S + 20 + 24 * 25, lambda s: 700.0),
    )
    r = replay(tmp_path, script)
    stop_after_serving(r, seconds=20 + 24 * 25 + 60)
    assert r.run() == errors.EXIT_OK
    assert not r.log.named("serving_failed") and len(r.engines) == 1
    start = r.engine(1).started_at
    d = r.daemon.config.daemon
    during = [
        e
        for e in liveness_with_work(r)
        if start + hang[0] + 2 * d.liveness_interval_s < e["t"] < start + hang[1]
    ]
    assert during and {e["verdict"] for e in during} == {"alive"}
    assert {e["source"] for e in during} == {"stats_line"}
    # the read that did not come back was recorded as such, once per read, by the serving phase
    overdue = [e for e in during if "unanswered after" in e.get("metrics_error", "")]
    assert overdue and overdue[0]["metrics_state"] == "failing"
    after = [e for e in liveness_with_work(r) if e["t"] > start + hang[1] + 90 + d.liveness_interval_s]
    assert after and {e["source"] for e in after} == {"metrics"}  # /metrics decides again once it answers


def test_a_stopped_engine_core_whose_metrics_read_hangs_is_restarted_on_its_stats_lines(
    tmp_path: Path,
) -> None:
    # the same hang of /metrics, and 100 s in the engine core stops: its stats lines show no throughput
    stopped = OUT_S + 100
    moving = busy_then_done(10_000.0)
    script = Script(
        figures=lambda s: moving(min(s, stopped)),
        metrics_s=_hanging_metrics(OUT_S + 30, 10_000.0),
        completion_s=lambda s: None if s >= stopped else 0.05,
        later=_stats_lines(OUT_S + 25, OUT_S + 600, lambda s: 700.0 if s < stopped else 0.0),
    )
    r = replay(tmp_path, script, Script())
    stop_after_serving(r, count=2)
    assert r.run() == errors.EXIT_OK
    failed = r.log.named("serving_failed")[0]
    assert failed["failure_class"] == F.HANG and "judged on vLLM's stats lines" in failed["evidence"]
    d = r.daemon.config.daemon
    detected = failed["t"] - (r.engine(1).started_at + stopped)
    # the progress timeout from the last line that moved (at most a line's 10 s before the stop)
    assert d.progress_timeout_s - 10 <= detected <= d.progress_timeout_s + d.liveness_interval_s, detected
    hung = [e for e in r.log.named("liveness") if e["verdict"] == "hung"][-1]
    assert hung["evidence"] == "stall" and hung["source"] == "stats_line"
    assert r.states().count("serving") == 2 and len(r.engines) == 2


# --- reload and drain --------------------------------------------------------------------------------


def _reload_with_new_context(r: Replay, after_s: float = 10.0) -> Callable[[], None]:
    def edit_and_hup() -> None:
        r.edit_config(start={"max_model_len": 4096})
        r.signal(after_s, signal.SIGHUP)

    return edit_and_hup


@covers((S.SERVING, S.PLANNING))
def test_sighup_after_editing_the_context_replans_and_relaunches(tmp_path: Path) -> None:
    r = replay(tmp_path, daemon={"drain_timeout_s": 0.0})  # no drain: straight to planning
    r.at_serving(1, _reload_with_new_context(r))
    stop_after_serving(r, count=2)
    assert r.run() == errors.EXIT_OK
    assert r.states()[:6] == ["planning", "launching", "probing", "serving", "planning", "launching"]
    assert "--max-model-len" in r.engine(2).spec.argv
    assert r.engine(2).spec.argv[r.engine(2).spec.argv.index("--max-model-len") + 1] == "4096"
    assert "RELOADING=1" in r.notifier.sent


def test_sighup_without_a_flag_change_does_not_relaunch(tmp_path: Path) -> None:
    r = replay(tmp_path)
    seen: list[dict[str, Any]] = []

    def hups() -> None:
        served = r.status_json()
        r.signal(5.0, signal.SIGHUP)  # the file as it was
        r.after(8.0, lambda: r.edit_config(daemon={"health_interval_s": 7.0}))  # implies no vLLM flag
        r.signal(10.0, signal.SIGHUP)
        r.after(15.0, lambda: seen.extend([served, r.status_json()]))

    r.at_serving(1, hups)
    stop_after_serving(r, seconds=20)
    assert r.run() == errors.EXIT_OK
    assert [e["changed"] for e in r.log.named("config_reloaded")] == [False, False]
    assert len(r.engines) == 1 and "STATUS=serving; config reloaded, flags unchanged" in r.notifier.sent
    # between the reloads and the stop nothing was stopped or launched
    names = r.log.names("config_reloaded", "engine_stopped", "launch_started")
    assert names == ["launch_started", "config_reloaded", "config_reloaded", "engine_stopped"]
    assert r.daemon.config.daemon.health_interval_s == 7.0  # the reloaded config is the one in use
    before, after = seen
    assert (
        after["state"] == "serving" and after["launches"] == 1 and after["child_pid"] == before["child_pid"]
    )


def _sigterm_after_serving(
    r: Replay, figures_after: Callable[[float], Figures], seconds: float = 30.0
) -> None:
    """SIGTERM ``seconds`` after serving; the engine's figures from then on are ``figures_after(s)``, s
    seconds after the SIGTERM (BUSY before it)."""
    at: list[float] = []

    def arm() -> None:
        at.append(r.clock() - r.engine(1).started_at + seconds)
        r.signal(seconds, signal.SIGTERM)

    r.scripts[0].figures = lambda s: BUSY if not at or s < at[0] else figures_after(s - at[0])
    r.at_serving(1, arm)


@covers((S.SERVING, S.DRAINING), (S.DRAINING, S.STOPPING))
def test_sigterm_lets_the_requests_in_flight_finish(tmp_path: Path) -> None:
    # busy for 8 s after the SIGTERM; vLLM takes requests until then, then drains itself (2 s) and exits
    r = replay(tmp_path, Script(drain_s=2.0))
    _sigterm_after_serving(r, lambda s: BUSY if s < 8.0 else IDLE)
    assert r.run() == errors.EXIT_OK
    started, finished = r.log.named("drain_started")[0], r.log.named("drain_finished")[0]
    assert started["budget_s"] == 30.0 and started["unready_s"] == 0.0 and started["vllm_drains"] is True
    assert finished["complete"] is True and 10.0 <= finished["seconds"] <= 11.0
    assert r.engine(1).code == 0  # it exited by itself, from its own drain, before r1sup's stop
    assert r.states()[-3:] == ["draining", "stopping", "stopped"]


def test_sigterm_with_an_unready_pause_keeps_vllm_open_that_long(tmp_path: Path) -> None:
    # nothing in flight, but /readyz says 503 for 5 s before vLLM is told to stop taking requests
    r = replay(tmp_path, Script(), daemon={"drain_unready_s": 5.0})
    _sigterm_after_serving(r, lambda s: IDLE)
    assert r.run() == errors.EXIT_OK
    changed = [e for e in r.log.named("state_changed") if e["new"] == "draining"][0]
    signalled = r.log.named("stop_requested")[0]
    finished = r.log.named("drain_finished")[0]
    assert r.log.named("drain_started")[0]["unready_s"] == 5.0 and not r.log.named("drain_skipped")
    assert finished["complete"] is True and 5.0 <= finished["seconds"] <= 6.5
    assert changed["t"] == signalled["t"]  # out of the load balancer at once
    assert r.engine(1).code == 0


def test_requests_that_keep_coming_close_vllm_at_half_the_budget(tmp_path: Path) -> None:
    # busy all along (no load balancer sends elsewhere): at 15 s of 30 vLLM is told to stop taking
    # requests and finishes what it holds (4 s)
    r = replay(tmp_path, Script(drain_s=4.0))
    _sigterm_after_serving(r, lambda s: BUSY)
    assert r.run() == errors.EXIT_OK
    finished = r.log.named("drain_finished")[0]
    assert finished["complete"] is True and 19.0 <= finished["seconds"] <= 19.6


def test_vllm_saying_its_drain_is_done_ends_the_wait_for_its_slow_teardown(tmp_path: Path) -> None:
    # nothing in flight: vLLM is closed after two quiet reads, says at once that its requests are done,
    # then takes 40 s to exit (vLLM 0.32's CPU worker ignores its executor's SIGTERM): r1sup's stop ends it
    r = replay(tmp_path, Script(drain_s=40.0, drained_line_s=0.3), daemon={"drain_unready_s": 1.0})
    _sigterm_after_serving(r, lambda s: IDLE)
    assert r.run() == errors.EXIT_OK
    finished = r.log.named("drain_finished")[0]
    assert finished["complete"] is True and finished["seconds"] <= 4.0
    assert r.engine(1).stopped_by == "stop"  # r1sup's stop, not its own exit 40 s later


def test_without_the_drained_line_the_drain_waits_for_vllm_to_exit(tmp_path: Path) -> None:
    r = replay(tmp_path, Script(drain_s=20.0), daemon={"drain_unready_s": 1.0})
    _sigterm_after_serving(r, lambda s: IDLE)
    assert r.run() == errors.EXIT_OK
    finished = r.log.named("drain_finished")[0]
    assert finished["complete"] is True and 21.0 <= finished["seconds"] <= 24.0
    assert r.engine(1).code == 0


@covers((S.SERVING, S.STOPPING))
def test_without_a_drain_sigterm_stops_the_engine_at_once(tmp_path: Path) -> None:
    # drain_timeout_s 0: vLLM is not asked to drain itself, and requests in flight do not hold the stop
    r = replay(tmp_path, Script(figures=lambda s: BUSY), daemon={"drain_timeout_s": 0.0})
    stop_after_serving(r)
    assert r.run() == errors.EXIT_OK
    assert "--shutdown-timeout" not in r.engine(1).spec.argv
    assert not r.log.named("drain_started") and "draining" not in r.states()
    assert r.states()[-3:] == ["serving", "stopping", "stopped"] and r.engine(1).stopped_by == "stop"


def test_a_second_sigterm_ends_the_drain(tmp_path: Path) -> None:
    r = replay(tmp_path, Script(figures=lambda s: BUSY, drain_s=100.0))

    def twice() -> None:
        r.signal(10, signal.SIGTERM)
        r.signal(13, signal.SIGTERM)

    r.at_serving(1, twice)
    assert r.run() == errors.EXIT_OK
    finished = r.log.named("drain_finished")[0]
    assert finished["complete"] is False and finished["seconds"] <= 3.5
    assert r.states()[-2:] == ["stopping", "stopped"]


@covers((S.DRAINING, S.PLANNING))
def test_a_reload_that_changes_flags_drains_before_the_relaunch(tmp_path: Path) -> None:
    r = replay(tmp_path, Script(figures=busy_then_done(60.0)), Script())
    r.at_serving(1, _reload_with_new_context(r))
    stop_after_serving(r, count=2)
    assert r.run() == errors.EXIT_OK
    assert r.states()[:7] == [
        "planning",
        "launching",
        "probing",
        "serving",
        "draining",
        "planning",
        "launching",
    ]
    started = r.log.named("drain_started")[0]
    assert started["reason"] == "config reloaded"
    # the drain waited for the work in flight (done 60 s after the first start), then the relaunch
    finished = r.log.named("drain_finished")[0]
    assert finished["complete"] is True and finished["t"] >= r.engine(1).started_at + 60.0
    order = r.log.names("drain_started", "drain_finished", "engine_stopped", "launch_started")
    assert order[1:5] == ["drain_started", "drain_finished", "engine_stopped", "launch_started"]
    argv = r.engine(2).spec.argv
    assert argv[argv.index("--max-model-len") + 1] == "4096"


def test_a_sigterm_during_a_reloads_drain_drains_for_the_shutdown_and_never_replans(tmp_path: Path) -> None:
    # the daemon is draining for a reload when SIGTERM comes: it stays draining, and draining's step is
    # now the shutdown's drain; the re-plan the reload wanted never comes
    r = replay(tmp_path, Script(figures=lambda s: BUSY))
    r.at_serving(1, _reload_with_new_context(r))
    r.on_entering(S.DRAINING, lambda: r.signal(5.0, signal.SIGTERM))
    assert r.run() == errors.EXIT_OK
    assert [e["reason"] for e in r.log.named("drain_started")] == ["config reloaded", "shutdown"]
    assert r.states()[-4:] == ["serving", "draining", "stopping", "stopped"]
    assert len(r.engines) == 1 and "planning" not in r.states()[1:]


# --- stops and failures in any state -----------------------------------------------------------------


@covers((S.PLANNING, S.STOPPING))
def test_a_sigterm_that_came_while_planning_stops_before_any_launch(tmp_path: Path) -> None:
    r = replay(tmp_path)
    r.queue.signals.append(signal.SIGTERM)
    assert r.run() == errors.EXIT_OK
    assert r.engines == [] and r.states() == ["planning", "stopping", "stopped"]


@covers((S.BACKOFF, S.STOPPING))
def test_sigterm_during_a_backoff_stops_without_relaunching(tmp_path: Path) -> None:
    r = replay(tmp_path, crashing(after_s=5), daemon={"backoff_initial_s": 30.0, "backoff_max_s": 60.0})
    r.on_entering(S.BACKOFF, lambda: r.signal(1.0, signal.SIGTERM))
    assert r.run() == errors.EXIT_OK
    assert len(r.engines) == 1 and r.states()[-3:] == ["backoff", "stopping", "stopped"]


@covers((S.PLANNING, S.FAILED))
def test_a_preflight_that_fails_says_failed_and_launches_nothing(tmp_path: Path) -> None:
    r = replay(tmp_path)

    def refuse() -> Any:
        raise PreflightError("server.python", "No module named 'vllm'", exit_code=errors.EXIT_FATAL_FAILURE)

    r.preflight = refuse
    with pytest.raises(PreflightError):
        r.run()
    assert r.engines == [] and r.states() == ["planning", "failed"]
    assert r.status_json()["status"] == "failed: server.python: No module named 'vllm'"


def _failing_in(state: State, *scripts: Script) -> Any:
    COVERS.setdefault((state, S.FAILED), []).append("test_r1sups_own_failure_in_any_state_...")
    return pytest.param(state, list(scripts), marks=pytest.mark.covers((state, S.FAILED)), id=state.value)


@pytest.mark.parametrize(
    "state, scripts",
    [
        _failing_in(S.LAUNCHING, Script()),
        _failing_in(S.PROBING, Script()),
        _failing_in(S.SERVING, Script()),
        _failing_in(S.DRAINING, Script(figures=lambda s: BUSY, drain_s=60.0)),
        _failing_in(S.BACKOFF, crashing(after_s=5), Script()),
        _failing_in(S.STOPPING, Script()),
    ],
)
def test_r1sups_own_failure_in_any_state_stops_vllm_and_says_failed(
    tmp_path: Path, state: State, scripts: list[Script]
) -> None:
    r = replay(tmp_path, *scripts)
    stop_after_serving(r, seconds=5)

    def bug() -> None:
        raise KeyError("a bug of r1sup's own")

    r.on_entering(state, bug)
    with pytest.raises(InternalError) as raised:
        r.run()
    assert "KeyError" in str(raised.value)
    assert r.transitions[-1] == (state, S.FAILED)
    assert all(not e.alive() for e in r.engines)
    assert r.status_json()["last_failure"]["class"] == F.INTERNAL_ERROR


def test_backoff_grows_exponentially_with_jitter_and_is_capped() -> None:
    delays = [backoff_delay(n, 1.0, 8.0) for n in range(1, 7)]
    assert 1.0 <= delays[0] <= 2.0 and 2.0 <= delays[1] <= 3.0 and 4.0 <= delays[2] <= 5.0
    assert all(d <= 8.0 for d in delays[3:])


# --- the table ---------------------------------------------------------------------------------------


def test_every_transition_of_the_state_table_has_a_replay() -> None:
    table = {(a, b) for a, targets in LEGAL.items() for b in targets if a is not b}
    table |= {(a, a) for a, targets in LEGAL.items() if a in targets}
    missing = sorted(f"{a.value} -> {b.value}" for a, b in table - set(COVERS))
    assert not missing, f"transitions of states.LEGAL without a replay test: {missing}"
    unknown = sorted(f"{a.value} -> {b.value}" for a, b in set(COVERS) - table)
    assert not unknown, f"replays of transitions the table forbids: {unknown}"


def test_a_reload_of_a_file_that_names_search_by_its_old_name_warns_and_changes_nothing(
    tmp_path: Path,
) -> None:
    r = replay(tmp_path, search={"max_attempts": 5})

    def rename_and_hup() -> None:
        import tomllib

        from r1sup_proc import write_config

        body = tomllib.loads(r.config_path.read_text(encoding="utf-8"))
        body["ladder"] = body.pop("search")
        write_config(r.config_path, body)
        r.signal(5.0, signal.SIGHUP)

    r.at_serving(1, rename_and_hup)
    stop_after_serving(r, seconds=20)
    assert r.run() == errors.EXIT_OK
    (warned,) = r.log.named("config_renamed")
    assert (warned["old"], warned["new"], warned["where"]) == ("[ladder]", "[search]", str(r.config_path))
    assert [e["changed"] for e in r.log.named("config_reloaded")] == [False] and len(r.engines) == 1
    assert r.daemon.config.search.max_attempts == 5
