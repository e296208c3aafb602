"""Loading progress: vLLM's lines -> phases, percent, elapsed time and ETA (pure, table-driven)."""

from __future__ import annotations

from pathlib import Path

import pytest

from r1sup.core import progress as P
from r1sup.core.logparse import LogReader, Progress

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "logs"


def kinds(lines: list[str]) -> list[tuple[str, dict[str, float]]]:
    reader = LogReader()
    out = []
    for line in lines:
        out += [(i.kind, dict(i.numbers)) for i in reader.feed(line) if isinstance(i, Progress)]
    return out


@pytest.mark.parametrize(
    ("line", "kind", "numbers"),
    [
        # vLLM's shard bar (weight_utils.py's tqdm, one update per line, process tag in front)
        (
            "(EngineCore_DP0 pid=212) Loading safetensors checkpoint shards:  45% Completed | 9/20 "
            "[00:31<00:38,  3.45s/it]",
            "weights_progress",
            {"weights_percent": 45, "shards_done": 9, "shards_total": 20},
        ),
        (
            "Loading safetensors checkpoint shards (eager): 100% Completed | 4/4 [00:02<00:00,  1.9it/s]",
            "weights_progress",
            {"weights_percent": 100, "shards_done": 4, "shards_total": 4},
        ),
        (
            "Loading pt checkpoint shards:   0% Completed | 0/2 [00:00<?, ?it/s]",
            "weights_progress",
            {"weights_percent": 0, "shards_done": 0, "shards_total": 2},
        ),
        (
            "(Worker_TP1 pid=7) Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  51%|█████     | "
            "34/67 [00:03<00:03, 10.9it/s]",
            "graph_capture",
            {"graphs_percent": 51, "graphs_done": 34, "graphs_total": 67},
        ),
        (
            "(EngineCore_DP0 pid=9) INFO 06-02 09:14:17 [gpu_model_runner.py:4020] Starting to load model "
            "/models/qwen-14b...",
            "weights_start",
            {},
        ),
        # the CPU build with dummy weights: no shards, a warm-up instead of a profile run
        (
            "(Worker pid=7525) INFO 11-29 18:54:01 [cpu_model_runner.py:87] Warming up model for the "
            "compilation...",
            "profiling_start",
            {},
        ),
        (
            "(APIServer pid=7317) INFO 11-29 18:54:19 [entry.py:140] Starting vLLM server on "
            "http://0.0.0.0:18932",
            "api_start",
            {},
        ),
    ],
)
def test_loading_lines_are_progress(line: str, kind: str, numbers: dict[str, float]) -> None:
    assert kinds([line]) == [(kind, numbers)]


def test_loading_percent_stays_out_of_the_observations() -> None:
    reader = LogReader()
    reader.feed("Loading safetensors checkpoint shards:  50% Completed | 4/8 [00:03<00:03,  1.10it/s]")
    assert not reader.figures


def test_a_real_cpu_start_up_walks_the_phases_in_order() -> None:
    lines = (FIXTURES / "cpu" / "clean-startup-one-request.log").read_text(encoding="utf-8").splitlines()
    tracker = P.LoadProgress(0.0)
    phases = []
    for t, (kind, numbers) in enumerate(kinds(lines), start=1):
        step = tracker.observe(kind, numbers, float(t))
        if step is not None and step.phase_changed:
            phases.append(step.snapshot.phase)
    assert phases == [P.WEIGHTS, P.PROFILING, P.KV_CACHE, P.API]


def test_a_gpu_start_up_with_shards_and_graphs() -> None:
    lines = (FIXTURES / "gpu" / "success-v1-full.log").read_text(encoding="utf-8").splitlines()
    tracker = P.LoadProgress(0.0)
    seen: list[tuple[str, float | None]] = []
    for t, (kind, numbers) in enumerate(kinds(lines), start=1):
        step = tracker.observe(kind, numbers, float(t))
        if step is not None:
            seen.append((step.snapshot.phase, step.snapshot.percent))
    assert [p for p, _ in seen if p == P.WEIGHTS] and (P.GRAPHS, 100.0) in seen
    order = [p for p, _ in seen]
    assert order == sorted(order, key=P.PHASES.index)  # forward only
    assert (P.WEIGHTS, 50.0) in seen and (P.GRAPHS, 50.0) in seen


def test_phase_changes_carry_the_numbers_of_the_phase_left_once() -> None:
    tracker = P.LoadProgress(100.0)
    assert tracker.observe("engine_config", {"max_model_len": 32768.0}, 101.0) is None
    step = tracker.observe("weights_start", {}, 105.0)
    assert step is not None and step.phase_changed
    assert (step.previous_phase, step.previous_phase_s, dict(step.numbers)) == (
        P.STARTING,
        5.0,
        {"max_model_len": 32768.0},
    )
    step = tracker.observe("weights_loaded", {"weights_gib": 27.54, "weights_load_s": 7.0}, 112.0)
    assert step is not None and step.snapshot.phase == P.PROFILING
    assert dict(step.numbers) == {"weights_gib": 27.54, "weights_load_s": 7.0}
    # the second rank's (or the second line's) same figure is not reported again; a new one is
    assert tracker.observe("weights_loaded", {"weights_gib": 27.54, "weights_load_s": 7.1}, 112.5) is None
    step = tracker.observe("kv_cache_available", {"kv_cache_gib": 42.17}, 120.0)
    assert step is not None and dict(step.numbers) == {"weights_load_s": 7.1, "kv_cache_gib": 42.17}


def test_percent_only_moves_forward_and_is_logged_every_ten_points() -> None:
    tracker = P.LoadProgress(0.0)
    tracker.observe("weights_start", {}, 1.0)
    logged = []
    for t, pct in enumerate([0, 5, 12, 12, 9, 30, 33, 100], start=2):
        step = tracker.observe("weights_progress", {"weights_percent": float(pct)}, float(t))
        if step is not None and tracker.should_log_percent(step):
            logged.append(pct)
    assert logged == [0, 12, 30, 100]


def test_eta_from_an_earlier_launch_and_vllms_own_percent() -> None:
    expected = {
        P.STARTING: 10.0,
        P.WEIGHTS: 60.0,
        P.PROFILING: 20.0,
        P.KV_CACHE: 1.0,
        P.API: 4.0,
        P.PROBE: 5.0,
    }
    tracker = P.LoadProgress(0.0, expected)
    assert tracker.eta(4.0) == pytest.approx(6.0 + 60 + 20 + 1 + 4 + 5)
    assert tracker.eta(30.0) == pytest.approx(90.0)  # starting overran: nothing left of it
    tracker.observe("weights_start", {}, 10.0)
    tracker.observe("weights_progress", {"weights_percent": 25.0}, 20.0)
    # 10 s for 25%: 30 s left by vLLM's own rate, then the later phases
    assert tracker.eta(20.0) == pytest.approx(30.0 + 20 + 1 + 4 + 5)
    assert "ETA" in tracker.snapshot(20.0).text() and "loading weights 25%" in tracker.snapshot(20.0).text()
    assert P.LoadProgress(0.0).eta(5.0) is None  # never timed: no ETA, and the line says nothing of one
    assert "ETA" not in P.LoadProgress(0.0).snapshot(5.0).text()


def test_durations_count_skipped_phases_as_zero_and_stop_at_the_end() -> None:
    tracker = P.LoadProgress(0.0)
    tracker.observe("weights_start", {}, 3.0)
    tracker.observe("profiling_start", {}, 4.0)
    tracker.observe("kv_cache_available", {}, 20.0)
    tracker.observe("engine_init", {}, 21.0)  # the CPU build: no graphs
    tracker.enter(P.PROBE, 25.0)
    assert tracker.enter(P.WEIGHTS, 26.0) is None  # never backwards
    tracker.finish(30.0)
    assert tracker.durations(99.0) == {
        P.STARTING: 3.0,
        P.WEIGHTS: 1.0,
        P.PROFILING: 16.0,
        P.KV_CACHE: 1.0,
        P.GRAPHS: 0.0,
        P.API: 4.0,
        P.PROBE: 5.0,
    }
    assert tracker.snapshot(99.0).elapsed_s == 30.0 and tracker.eta(99.0) is None


def test_expected_timings_come_from_the_newest_passed_attempt() -> None:
    failed = {"outcome": "failed", "phase_seconds": {"starting": 1.0}}
    old_ok = {"outcome": "ok", "phase_seconds": {"starting": 9.0, "weights": 50.0}}
    new_ok = {"outcome": "ok", "phase_seconds": {"starting": 8.0, "weights": 40.0, "bogus": 1.0}}
    assert P.expected_timings([[old_ok, failed, new_ok, failed]]) == {"starting": 8.0, "weights": 40.0}
    assert P.expected_timings([[failed], [old_ok]]) == {"starting": 9.0, "weights": 50.0}
    assert P.expected_timings([[failed], []]) == {}


@pytest.mark.parametrize(("seconds", "text"), [(0, "0:00"), (72.4, "1:12"), (3725, "1:02:05")])
def test_clock(seconds: float, text: str) -> None:
    assert P.clock(seconds) == text
