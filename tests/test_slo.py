"""The service-level judgement (r1sup.core.slo): percentiles, levels, the next level, knee, verdicts."""

from __future__ import annotations

import pytest

from r1sup.core import slo as S

T = S.Targets(ttft_p95_s=0.5, itl_p95_s=0.05)
W = S.Workload((128, 128), (16, 16))


def sample(ttft: float, itl: float = 0.01, ok: bool = True) -> S.Sample:
    return S.Sample(ok=ok, ttft_s=ttft, itl_s=(itl, itl, itl), e2e_s=ttft + 3 * itl, output_tokens=4)


def level(concurrency: int, meets: bool, rate: float = 1.0) -> S.Level:
    broken = () if meets else ("ttft",)
    return S.Level(concurrency, 8, 8, 0, 1.0, 0.1, 0.01, 0.2, rate, rate if meets else 0.0, 10.0, broken)


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [([], 0.95, None), ([3.0], 0.95, 3.0), ([1.0, 2.0], 0.5, 1.5), ([4.0, 1.0, 3.0, 2.0], 1.0, 4.0)],
)
def test_percentile(values, q, expected):
    assert S.percentile(values, q) == expected


@pytest.mark.parametrize(
    ("samples", "broken"),
    [
        ([sample(0.1)] * 10, ()),
        ([sample(0.1)] * 9 + [sample(2.0)], ("ttft",)),  # the slowest of ten is the p95's neighbour
        ([sample(0.1, itl=0.2)] * 4, ("itl",)),
        ([sample(0.1)] * 3 + [S.Sample(ok=False, error="500")], ("errors",)),
        ([S.Sample(ok=False, error="timeout")], ("errors",)),
    ],
)
def test_a_level_breaks_the_targets_its_p95_misses(samples, broken):
    assert S.judge(4, samples, 2.0, T).broken == broken


def test_goodput_counts_only_requests_that_met_every_target():
    lv = S.judge(4, [sample(0.1)] * 6 + [sample(0.9)] * 2, 2.0, T)
    assert (lv.completed, lv.request_rate, lv.goodput) == (8, 4.0, 3.0)


@pytest.mark.parametrize(
    ("gaps", "tokens", "good"),
    [
        # four chunks of 16 tokens each, 30 ms apart: 90 ms over 63 tokens after the first, 1.4 ms a token
        ((0.03, 0.03, 0.03), 64, True),
        # one token a chunk, 30 ms apart: 30 ms a token, over the 20 ms target
        ((0.03,) * 63, 64, False),
        ((), 1, True),  # one token: no time per token (vLLM counts it 0)
    ],
)
def test_goodput_judges_a_request_by_its_time_per_token_not_its_mean_chunk_gap(gaps, tokens, good):
    targets = S.Targets(itl_p95_s=0.02)
    request = S.Sample(ok=True, ttft_s=0.1, itl_s=gaps, e2e_s=0.1 + sum(gaps), output_tokens=tokens)
    assert request.meets(targets) is good
    assert S.judge(1, [request], 1.0, targets).goodput == (1.0 if good else 0.0)


def test_end_to_end_target_is_judged_when_asked():
    targets = S.Targets(e2e_p95_s=0.2)
    assert S.judge(1, [sample(0.3)] * 4, 1.0, targets).broken == ("e2e",)
    assert S.judge(1, [sample(0.3)] * 4, 1.0, S.Targets(ttft_p95_s=1.0)).broken == ()


@pytest.mark.parametrize(
    ("history", "cap", "expected"),
    [
        ([], 64, 1),
        ([(1, True)], 64, 2),
        ([(1, True), (2, True), (4, True)], 64, 8),
        ([(1, True), (2, True), (4, True), (8, False)], 64, 6),  # bisect between 4 and 8
        ([(1, True), (4, True), (8, False), (6, True)], 64, 7),
        ([(1, True), (4, True), (8, False), (6, True), (7, False)], 64, None),  # bracketed: 6
        ([(1, True), (2, True)], 3, 3),  # doubling stops at the cap
        ([(1, True), (2, True), (3, True)], 3, None),
        ([(1, False)], 64, None),  # one at a time breaks: nothing meets
    ],
)
def test_next_concurrency_doubles_until_broken_then_bisects(history, cap, expected):
    assert S.next_concurrency([level(c, ok) for c, ok in history], cap) == expected


def test_knee_is_the_lowest_level_near_the_best_rate():
    levels = [level(1, True, 2.0), level(2, True, 3.8), level(4, True, 6.0), level(8, False, 6.3)]
    assert S.knee(levels) == 4
    assert S.knee([]) is None


def test_conclude_names_the_best_level_that_met():
    levels = [level(1, True), level(2, True), level(4, False)]
    result = S.conclude(T, W, levels)
    assert (result.verdict, result.requests) == (S.MET, 2)


def test_conclude_refuses_an_impossible_ttft_with_the_measured_floor():
    floor = S.judge(1, [sample(0.8)] * 4, 4.0, T)
    result = S.conclude(T, W, [floor])
    assert result.verdict == S.IMPOSSIBLE and result.requests == 0
    assert "TTFT p95 target 500 ms is below the measured floor 800 ms" in result.reason


def test_conclude_without_a_level_is_unmeasured():
    assert S.conclude(T, W, [], budget_ended=True).verdict == S.UNMEASURED


def test_result_round_trips_and_refuses_damage():
    result = S.conclude(T, W, [level(1, True), level(2, False)], seconds=3.2, flags={"max_num_seqs": 8})
    again = S.SloResult.from_dict(result.to_dict())
    assert again == result
    bad = result.to_dict() | {"verdict": "great"}
    with pytest.raises(ValueError, match="verdict"):
        S.SloResult.from_dict(bad)
    bad = result.to_dict()
    bad["levels"][0]["goodput"] = float("nan")
    with pytest.raises(ValueError, match="goodput"):
        S.SloResult.from_dict(bad)


def test_a_relaunch_doubles_max_num_seqs_only_when_the_flag_bounded_every_met_level():
    capped = S.conclude(T, W, [level(1, True), level(2, True), level(4, True)])
    step = S.relaunch_step(capped, max_num_seqs=4, max_concurrency=64)
    assert step is not None and (step.flag, step.old, step.new) == ("max_num_seqs", 4, 8)
    assert "max_num_seqs 4" in step.why
    # never past the highest level asked for
    step = S.relaunch_step(capped, max_num_seqs=4, max_concurrency=6)
    assert step is not None and step.new == 6


@pytest.mark.parametrize(
    ("levels", "seqs", "top", "budget_ended"),
    [
        ([level(1, True), level(2, True), level(4, False), level(3, False)], 8, 64, False),  # a target broke
        ([level(1, True), level(2, True), level(4, True)], 4, 4, False),  # max_num_seqs is the top asked
        ([level(1, True), level(2, True), level(4, True)], None, 64, False),  # vLLM's default: unknown
        ([level(1, True), level(2, True)], 4, 64, True),  # the budget, not the flag, ended it
        ([level(1, False)], 4, 64, False),  # nothing met
    ],
)
def test_no_relaunch_where_the_evidence_does_not_name_a_flag(levels, seqs, top, budget_ended):
    found = S.conclude(T, W, levels, budget_ended=budget_ended)
    assert S.relaunch_step(found, max_num_seqs=seqs, max_concurrency=top) is None


def test_the_relaunch_line_round_trips():
    found = S.conclude(T, W, [level(1, True)])
    data = {**found.to_dict(), "relaunch": "max_num_seqs 4 -> 8"}
    assert S.SloResult.from_dict(data).relaunch == "max_num_seqs 4 -> 8"
    assert S.SloResult.from_dict(found.to_dict()).relaunch == ""


def broke(concurrency: int, *kinds: str, itl: float = 0.01) -> S.Level:
    return S.Level(concurrency, 8, 8, 0, 1.0, 0.9, itl, 1.0, 8.0, 0.0, 10.0, kinds)


MET_TO_4 = [level(1, True), level(2, True), level(4, True)]


@pytest.mark.parametrize(("budget", "steps"), [(512, 2), (256, 4), (1000, 2)])
def test_a_ttft_break_whose_prompts_outgrow_one_prefill_step_relaunches_with_a_larger_budget(budget, steps):
    # 8 at once broke the TTFT target alone; their 8 x 128 prompt tokens need more than one step of the
    # budget: the budget doubled
    found = S.conclude(T, W, [*MET_TO_4, broke(8, "ttft")])
    step = S.relaunch_step(found, None, 64, batched_tokens=budget)
    assert step is not None and (step.flag, step.old, step.new) == (
        "max_num_batched_tokens",
        budget,
        2 * budget,
    )
    assert "8 x 128 = 1024 tokens at least" in step.why
    assert f"take {steps} or more prefill steps of max_num_batched_tokens {budget}" in step.why


@pytest.mark.parametrize(
    ("last", "workload", "budget"),
    [
        (broke(8, "ttft"), W, 1024),  # one step held every prompt of the level: the budget did not wait
        (broke(8, "ttft"), W, None),  # the budget is not known
        (broke(8, "ttft", "itl"), W, 512),  # the steps were slow too: the engine, not the budget
        (broke(8, "errors"), W, 512),
        (broke(8, "ttft", itl=0.04), W, 512),  # no room in the ITL target for longer steps
        (broke(8, "ttft"), S.Workload((128, 128), (16, 16), "prompts.jsonl"), 512),  # lengths not known
        (level(8, True), W, 512),  # nothing broke
    ],
)
def test_no_prefill_budget_relaunch_where_the_evidence_does_not_point_at_it(last, workload, budget):
    found = S.conclude(T, workload, [*MET_TO_4, last])
    assert S.relaunch_step(found, None, 64, batched_tokens=budget) is None


def test_a_flag_that_bounded_every_met_level_is_lifted_before_the_prefill_budget():
    found = S.conclude(T, W, [*MET_TO_4, broke(8, "ttft")])
    step = S.relaunch_step(found, 4, 64, batched_tokens=512)
    assert step is not None and step.flag == "max_num_seqs"
