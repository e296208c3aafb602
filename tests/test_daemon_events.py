"""The daemon's side of the search's typed events, in process: each event becomes the daemon's state,
one STATUS= line, and an entry of status.json's recent events. No process is started."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from r1sup.core import config as cfg
from r1sup.core import failure as F
from r1sup.core.events import AttemptFailed, EventQueue, Launching, Probing, SearchStepped
from r1sup.core.flags import EngineFlags
from r1sup.core.profile_fit import Degraded
from r1sup.supervision.daemon import Daemon
from r1sup.supervision.runner import Runner
from r1sup.supervision.session import Session
from r1sup.supervision.states import Cause, IllegalTransition, State
from r1sup_proc import write_config
from replay import Recorded


class Quiet:
    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def daemon(tmp_path: Path) -> tuple[Daemon, Recorded]:
    body = {"model": {"name": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"}, "state": {"dir": str(tmp_path)}}
    config = cfg.load(write_config(tmp_path / "r1sup.toml", body), environ={})
    events = EventQueue()
    runner = Runner(config, events, log=Quiet())
    notifier = Recorded()
    return Daemon(Session(config, None, Quiet(), events, runner, {}), notifier=notifier), notifier


def statuses(notifier: Recorded) -> list[str]:
    return [line.removeprefix("STATUS=") for line in notifier.sent if line.startswith("STATUS=")]


def status_json(tmp_path: Path) -> dict[str, Any]:
    return dict(json.loads((tmp_path / "status.json").read_text(encoding="utf-8")))


def test_a_search_with_a_step_moves_the_daemon_through_its_states_with_one_status_per_fact(tmp_path: Path):
    d, notifier = daemon(tmp_path)
    first, second = EngineFlags(max_model_len=8192), EngineFlags(max_model_len=4096)
    oom = F.Failure(F.OOM_CUDAGRAPH, F.PHASE_CUDA_GRAPH, evidence="CUDA out of memory")
    d.on_search(Launching(1, first))
    assert d.state is State.LAUNCHING and d.flags == first
    d.on_search(AttemptFailed(1, oom))
    d.on_search(SearchStepped(2, first, second, oom.cls))
    d.on_search(Launching(2, second))
    d.on_search(Probing(2, second))
    assert d.state is State.PROBING and d.flags == second
    assert statuses(notifier) == [
        "attempt 1: launching vLLM",
        "attempt 2: context 8192 -> 4096 (oom_cudagraph)",
        "attempt 2: launching vLLM",
        "attempt 2: load probe",
    ]
    doc = status_json(tmp_path)
    assert doc["state"] == "probing" and doc["last_failure"]["class"] == "oom_cudagraph"
    recent = [e["event"] for e in doc["recent_events"] if e["event"] != "state_changed"]
    assert recent == ["launch_started", "failure_classified", "search_step", "launch_started"]


def test_an_event_the_state_table_forbids_is_refused(tmp_path: Path):
    d, _ = daemon(tmp_path)
    with pytest.raises(IllegalTransition, match="probe_started in state planning"):
        d.on_search(Probing(1, EngineFlags()))


def test_a_cause_the_table_has_no_row_for_raises_and_changes_nothing(tmp_path: Path):
    d, notifier = daemon(tmp_path)
    d.advance(Cause.PLANNED, "planning")
    d.advance(Cause.GAVE_UP, "failed: no way to serve")
    sent = list(notifier.sent)
    for cause in Cause:
        with pytest.raises(IllegalTransition, match=f"{cause.value} in state failed"):
            d.advance(cause, "again")
    assert d.state is State.FAILED and d.status_text == "failed: no way to serve"
    assert notifier.sent == sent


def test_status_json_shows_the_degraded_profile_served_and_the_planned_retune(tmp_path: Path):
    d, _ = daemon(tmp_path)
    assert d.status_fields([])["degraded"] is None
    d.degraded = Degraded("best-key", "other processes held 5.0 GiB", "2026-12-02T14:00:00+00:00")
    assert d.status_fields([])["degraded"] == {
        "best_key": "best-key",
        "reason": "other processes held 5.0 GiB",
        "since": "2026-12-02T14:00:00+00:00",
        "retune_planned": False,
    }
    d.degraded = replace(d.degraded, retune_planned=True)
    assert json.loads(json.dumps(d.status_fields([])))["degraded"]["retune_planned"] is True  # as written


class Logged:
    """A logger that keeps each call as (level, event, fields)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: self.calls.append((level, event, fields))


def test_the_first_plan_is_no_state_change_in_the_log_or_the_status_file(tmp_path: Path):
    """Issue 36: the text log showed ``state_changed old=planning new=planning`` (the first plan's status
    line, a transition of the table from a state to the same state, as a relaunch is); only changes are
    events."""
    body = {"model": {"name": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"}, "state": {"dir": str(tmp_path)}}
    config = cfg.load(write_config(tmp_path / "r1sup.toml", body), environ={})
    events, log, notifier = EventQueue(), Logged(), Recorded()
    d = Daemon(Session(config, None, log, events, Runner(config, events, log=Quiet()), {}), notifier=notifier)
    d.advance(Cause.PLANNED, "planning")
    d.on_search(Launching(1, EngineFlags(max_model_len=8192)))
    d.on_search(Launching(2, EngineFlags(max_model_len=4096)))  # a relaunch: launching again
    changes = [fields for _, event, fields in log.calls if event == "state_changed"]
    assert changes == [{"old": "planning", "new": "launching", "status": "attempt 1: launching vLLM"}]
    recent = status_json(tmp_path)["recent_events"]
    changed = [(e["old"], e["new"]) for e in recent if e["event"] == "state_changed"]
    assert changed == [("planning", "launching")]
    assert statuses(notifier) == ["planning", "attempt 1: launching vLLM", "attempt 2: launching vLLM"]
