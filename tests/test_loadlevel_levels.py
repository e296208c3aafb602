"""How a load level is measured (r1sup.adapters.loadlevel): as vLLM's sweep measures one, a warm-up request
first that is neither judged nor timed, and the same request count at every level (at least the level's
concurrency). Driven with a fake sender and a fake clock: no server, no sleeps."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from types import SimpleNamespace

import pytest

from r1sup.adapters import loadlevel as L
from r1sup.core import slo as S
from r1sup.core.errors import InternalError


def spec(concurrency: int, requests: int, warmup: int) -> L.LevelSpec:
    return L.LevelSpec(
        base_url="http://127.0.0.1:1",
        model="m",
        concurrency=concurrency,
        requests=tuple(L.Request(f"r{i}", 4) for i in range(requests)),
        request_timeout_s=30,
        timeout_s=1000,
        warmup=tuple(L.Request("warm", 4) for _ in range(warmup)),
    )


def test_the_warm_up_request_goes_first_and_is_neither_judged_nor_timed():
    now = [0.0]
    sent: list[str] = []

    async def send(request: L.Request) -> S.Sample:
        sent.append(request.text)
        now[0] += 100.0 if request.text == "warm" else 1.0  # a cold first request: slow
        return S.Sample(ok=request.text != "warm", ttft_s=0.1, itl_s=(0.01,) * 3, e2e_s=0.2, output_tokens=4)

    samples, duration = asyncio.run(L.drive(spec(1, 4, 1), send, clock=lambda: now[0]))
    assert sent == ["warm", "r0", "r1", "r2", "r3"]
    assert len(samples) == 4 and all(s.ok for s in samples)  # the warm-up's (failed) sample is dropped
    assert duration == 4.0  # the four measured requests, one at a time; not the warm-up's 100 s


def test_a_warm_up_that_outlives_the_level_fails_every_request_of_it():
    async def send(request: L.Request) -> S.Sample:
        await asyncio.sleep(10)
        raise AssertionError("not reached")

    slow = L.LevelSpec(
        "http://127.0.0.1:1", "m", 2, (L.Request("r", 4),) * 3, 30, 0.01, warmup=(L.Request("w", 4),)
    )
    samples, _ = asyncio.run(L.drive(slow, send))
    assert [s.ok for s in samples] == [False] * 3
    assert samples[0].error == "level timed out after 0.01 s"


def test_every_level_measures_the_same_requests_and_at_least_its_concurrency():
    slo = SimpleNamespace(
        ttft_p95_s=1.0,
        itl_p95_s=None,
        e2e_p95_s=None,
        prompt_tokens=16,
        prompt_tokens_max=None,
        output_tokens=4,
        output_tokens_max=None,
        prompts_file="sample",  # the shipped prompts: no server to size generated ones with
        requests_per_level=8,
        max_concurrency=16,
        level_timeout_s=60,
        budget_s=600,
    )
    seen: dict[int, tuple[int, int]] = {}

    def measure(level: L.LevelSpec) -> tuple[list[S.Sample], float]:
        assert level.warmup == level.requests[:1]  # the workload's first request, as vLLM's test run
        seen[level.concurrency] = (len(level.requests), len(level.warmup))
        fast = S.Sample(ok=True, ttft_s=0.1, itl_s=(0.01,), e2e_s=0.2, output_tokens=2)
        return [fast] * len(level.requests), 1.0

    server = L.Server("http://127.0.0.1:1", "m", None, 30)
    found = L.search(slo, server, measure=measure)
    assert found.requests == 16
    assert seen == {1: (8, 1), 2: (8, 1), 4: (8, 1), 8: (8, 1), 16: (16, 1)}


# --- the level's own process -----------------------------------------------------------------------


def test_a_level_runs_in_a_child_of_its_own_and_its_samples_come_back_whole():
    # nothing listens on the port: every request fails on the connection, in the child, and each sample
    # comes back with its error and time; the warm-up is in neither
    from conftest import free_port

    level = L.LevelSpec(
        base_url=f"http://127.0.0.1:{free_port()}",
        model="m",
        concurrency=2,
        requests=(L.Request("a b", 4), L.Request("c d", 8), L.Request("e", 2)),
        request_timeout_s=5,
        timeout_s=20,
        warmup=(L.Request("a b", 4),),
    )
    assert L.spec_of(json.loads(json.dumps(dataclasses.asdict(level)))) == level
    samples, duration = L.run_level_apart(level)
    assert len(samples) == 3 and 0 <= duration < 20
    assert all(not s.ok and "Connect" in s.error and s.e2e_s is not None for s in samples), samples


def test_a_level_child_that_fails_is_r1sups_internal_error_not_a_failed_level():
    level = spec(1, 1, 0)
    with pytest.raises(InternalError) as raised:
        L.run_level_apart(level, python="/bin/false")
    assert raised.value.where == "r1sup.adapters.loadlevel (the level child)"
    assert raised.value.error == "exit code 1"
