"""``r1sup tune`` with an ``[slo]`` end to end on the fake engine given a latency model (each step takes
longer for every sequence running beside it): the highest concurrency that meets the targets is proven on
the running server and saved in the profile; a TTFT target below what one request gets is refused with
the measured floor (exit 3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_tune_fake import QWEN_1_5B, fake_body, fake_scenario, run_tune

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# 1 simulated second = 2 ms. A decode step of one request alone: 25 s simulated = 50 ms; each other
# sequence running beside it adds 12.5 s simulated = 25 ms to every step.
LATENCY = {"decode_tokens_per_s": 0.04, "step_s_per_batch_seq": 12.5}


def slo_body(tmp_path: Path, **slo: object) -> dict:
    body = fake_body(
        tmp_path,
        model=QWEN_1_5B,
        probe={"requests": 2, "output_tokens": 2, "max_concurrency": 1, "request_timeout_s": 30},
        slo={"prompt_tokens": 16, "output_tokens": 4, "requests_per_level": 8, "budget_s": 90, **slo},
    )
    return body


def test_tune_with_an_slo_proves_the_highest_concurrency_that_meets_it(tmp_path: Path):
    scenario = fake_scenario(tmp_path, runtime=LATENCY)
    t = run_tune(tmp_path, slo_body(tmp_path, itl_p95_s=0.16), scenario)
    assert t.code == 0, t.explain()
    slo = t.result["slo"]
    assert slo["verdict"] == "met", slo
    levels = {lv["concurrency"]: lv for lv in slo["levels"]}
    best = slo["concurrency"]
    assert levels[best]["meets"] and levels[best]["itl_p95_s"] <= 0.16
    # the level just above the proven one broke the ITL target: the search bracketed it
    above = [c for c, lv in levels.items() if c > best]
    assert above and not levels[min(above)]["meets"] and "itl" in levels[min(above)]["broken"]
    # the latency model is what bounds it: more at once, slower steps
    assert levels[max(levels)]["itl_p95_s"] > levels[1]["itl_p95_s"]
    assert 1 < best < max(levels)
    assert slo["launches"] == 0 and t.result["launches"] == 1  # load levels on the running server
    saved = json.loads(Path(t.result["profile_path"]).read_text(encoding="utf-8"))
    assert saved["slo"]["concurrency"] == best
    assert saved["slo"]["targets"]["itl_p95_s"] == 0.16


def test_tune_report_draws_the_levels_against_the_targets(tmp_path: Path):
    from r1sup_proc import R1sup
    from test_tune_fake import fake_env

    scenario = fake_scenario(tmp_path, runtime=LATENCY)
    t = run_tune(tmp_path, slo_body(tmp_path, itl_p95_s=0.16, max_concurrency=2), scenario)
    assert t.code == 0, t.explain()
    proc = R1sup("report", "--config", str(t.config), env=fake_env(scenario))
    assert proc.wait(60) == 0
    text = "".join(proc.lines)
    assert "service level: ITL p95 <= 160 ms" in text
    assert "proven: 2 requests at once" in text


def test_an_impossible_ttft_is_refused_with_the_measured_floor(tmp_path: Path):
    scenario = fake_scenario(tmp_path, runtime=LATENCY)
    t = run_tune(tmp_path, slo_body(tmp_path, ttft_p95_s=0.005), scenario)
    assert t.code == 3, t.explain()
    slo = t.result["slo"]
    assert slo["verdict"] == "impossible" and slo["concurrency"] == 0
    assert [lv["concurrency"] for lv in slo["levels"]] == [1]  # nothing more was tried
    floor_ms = slo["levels"][0]["ttft_p95_s"] * 1000
    assert f"below the measured floor {floor_ms:.0f} ms" in t.result["reason"]


def test_run_exports_the_saved_slo_capacity_labelled_with_its_targets(tmp_path: Path):
    from conftest import free_port
    from test_daemon_fake import FAST_DAEMON, START_S, metric, metrics_text, running

    scenario = fake_scenario(tmp_path, runtime=LATENCY)
    body = slo_body(tmp_path, itl_p95_s=0.16, max_concurrency=2)
    t = run_tune(tmp_path, body, scenario)
    assert t.code == 0 and t.result["slo"]["concurrency"] == 2, t.explain()
    port = free_port()
    body["daemon"] = {**FAST_DAEMON, **body.get("daemon", {}), "metrics_port": port}
    with running(tmp_path, body, scenario) as (proc, _config):
        proc.wait_event("serving", START_S)
        text = metrics_text(port)
        labels = 'e2e_p95_s="",itl_p95_s="0.16",ttft_p95_s=""'
        assert metric(text, "r1sup_capacity_slo_requests", labels) == 2.0, text


def test_a_relaunch_lifts_max_num_seqs_when_every_level_up_to_it_met(tmp_path: Path):
    # max_num_seqs 2 bounds the levels (more would wait behind it) and 2 at once still meet the ITL
    # target: one relaunch with 4, which proves more requests at once; the better point is kept
    scenario = fake_scenario(tmp_path, runtime=LATENCY)
    body = slo_body(tmp_path, itl_p95_s=0.16, max_concurrency=8)
    body["start"]["max_num_seqs"] = 2
    t = run_tune(tmp_path, body, scenario)
    assert t.code == 0, t.explain()
    slo = t.result["slo"]
    assert slo["verdict"] == "met" and slo["launches"] == 1, slo
    assert t.result["launches"] == 2
    assert slo["concurrency"] > 2 and slo["flags"]["max_num_seqs"] == 4
    assert slo["relaunch"].startswith("max_num_seqs 2 -> 4") and "kept" in slo["relaunch"]
    saved = json.loads(Path(t.result["profile_path"]).read_text(encoding="utf-8"))
    assert saved["flags"]["max_num_seqs"] == 4 and saved["slo"]["concurrency"] == slo["concurrency"]
    # the relaunch is an attempt of the run record (and of the result), as the search's launches are
    from r1sup.state import runrecord

    (path,) = runrecord.run_files(tmp_path / "state")
    record = json.loads(path.read_text(encoding="utf-8"))
    for attempts in (record["attempts"], t.result["attempts"]):
        assert [a["flags"]["max_num_seqs"] for a in attempts] == [2, 4], attempts
        relaunch = attempts[-1]
        assert relaunch["outcome"] == "ok" and relaunch["number"] == 2
        assert relaunch["why"].startswith("slo relaunch: every level up to max_num_seqs 2 met")
        assert relaunch["change"].startswith(f"proved {slo['concurrency']} requests at once (was 2)")
    assert record["attempts"][-1]["launch"] == 2
    from r1sup_proc import R1sup
    from test_tune_fake import fake_env

    proc = R1sup("report", "--config", str(t.config), env=fake_env(scenario))
    assert proc.wait(60) == 0
    assert "relaunched: max_num_seqs 2 -> 4" in "".join(proc.lines)


def test_no_relaunch_when_a_target_breaks_below_max_num_seqs(tmp_path: Path):
    scenario = fake_scenario(tmp_path, runtime=LATENCY)
    body = slo_body(tmp_path, itl_p95_s=0.16, max_concurrency=16)
    body["start"]["max_num_seqs"] = 16
    t = run_tune(tmp_path, body, scenario)
    assert t.code == 0, t.explain()
    slo = t.result["slo"]
    assert slo["verdict"] == "met" and 1 < slo["concurrency"] < 16
    assert slo["launches"] == 0 and slo["relaunch"] == "" and t.result["launches"] == 1


def test_a_ttft_break_that_waited_for_prefill_steps_relaunches_with_a_larger_budget(tmp_path: Path):
    # the latency model's prefill budget: a prefill step takes 200 ms, and a prompt waits for as many as
    # the prompt tokens in prefill with it (about 22 a request here) take at max_num_batched_tokens 64;
    # decode is fast. Up to 5 at once the first wave takes at most 2 steps (TTFT <= 0.4 s, within 0.5 s),
    # 6 take 3: the TTFT target breaks alone, 6 x 16 prompt tokens > 64, one relaunch with 128, where 8
    # at once take 2 steps
    runtime = {"decode_tokens_per_s": 5.0, "prefill_step_s": 100.0}
    scenario = fake_scenario(tmp_path, runtime=runtime)
    body = slo_body(tmp_path, ttft_p95_s=0.5, max_concurrency=8)
    body["start"].update(max_num_seqs=16, max_num_batched_tokens=64)
    body["probe"]["prompt_tokens"] = 32  # not near the context: its prefill would take 100 steps here
    t = run_tune(tmp_path, body, scenario)
    assert t.code == 0, t.explain()
    slo = t.result["slo"]
    assert slo["verdict"] == "met" and slo["launches"] == 1, slo
    assert slo["relaunch"].startswith("max_num_batched_tokens 64 -> 128"), slo["relaunch"]
    assert "broke the TTFT target alone" in slo["relaunch"] and "kept" in slo["relaunch"]
    assert slo["flags"]["max_num_batched_tokens"] == 128 and slo["concurrency"] == 8
    assert [a["flags"]["max_num_batched_tokens"] for a in t.result["attempts"]] == [64, 128]
    saved = json.loads(Path(t.result["profile_path"]).read_text(encoding="utf-8"))
    assert saved["flags"]["max_num_batched_tokens"] == 128
