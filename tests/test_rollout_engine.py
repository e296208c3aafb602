"""A rolling restart of two ``r1sup run`` replicas of the real vLLM CPU engine under a bounded flood from
the openai client loses no request that was accepted (issue 27, "Rollouts without loss").

The Service is played by :class:`Service`, a client-side round robin (kube-proxy's part: it runs beside
the client) over the replicas whose r1sup ``/readyz`` answered 200 at its last look (every 0.1 s). Each
request opens a new connection to the vLLM port of the replica it picks; a connection refused there
(the replica stopped listening) is tried again on another replica, which is what a client or a load
balancer does with a failed connect. Anything else that goes wrong once a replica accepted the
connection (a status other than 200, a reset, an answer short of its tokens) is a lost request.

The roll: replicas A and B start together (one after the other would double the wait on 2 cores); the
flood starts, paced, once one of them is in the Service (a replica still loading or probing gets
nothing), and goes full speed once both are. A gets SIGTERM with requests in flight, answers
``/readyz`` 503 at once, keeps vLLM taking requests for ``daemon.drain_unready_s`` (the Service's poll
sees the 503 in that time), waits until vLLM's ``/metrics`` shows nothing running or waiting, stops
vLLM and exits 0; the flood goes on to B. Each engine's OpenMP threads are bound to a core of its own
(``VLLM_CPU_OMP_THREADS_BIND``): an earlier attempt with vLLM's default binding saw a starting engine
get under 1 % of a CPU beside one serving a flood.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from conftest import free_port, wait_until
from r1sup_proc import R1sup, engine_processes, kill_engine_processes, tiny_engine_config, write_config

pytestmark = [pytest.mark.engine, pytest.mark.serial, pytest.mark.timeout(600)]

MAX_TOKENS = 32
WORKERS = 4
MOST_REQUESTS = 1500  # the flood's bound in count (it ends by itself well before); the timeout bounds time
PACE_S = 1.0  # until both replicas serve, one worker sends, pausing this long between requests
AFTER_ROLL = 12  # requests the flood still sends once A has exited (all to B)
UNREADY_S = 1.5  # A's /readyz is 503 this long before vLLM stops taking requests (> the Service's poll)
POLL_S = 0.1


@dataclass
class Replica:
    name: str
    api_port: int
    ready_port: int
    ready: bool = False


@dataclass
class Tally:
    """What the Service saw: connects refused (tried again elsewhere) and accepted, per replica."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    refused: Counter[str] = field(default_factory=Counter)
    accepted: list[tuple[float, str]] = field(default_factory=list)  # (monotonic time, replica)
    in_flight: Counter[str] = field(default_factory=Counter)


class Service(httpx.BaseTransport):
    """Round robin over the ready replicas, one new connection per request, failed connects retried."""

    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas = replicas
        self.tally = Tally()
        self.inner = httpx.HTTPTransport(limits=httpx.Limits(max_keepalive_connections=0))
        self._turn = itertools.count()
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, daemon=True)
        self._poller.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            for r in self.replicas:
                try:
                    url = f"http://127.0.0.1:{r.ready_port}/readyz"
                    with urllib.request.urlopen(url, timeout=1.0) as resp:
                        r.ready = resp.status == 200
                except OSError:  # 503 (HTTPError), refused, timed out
                    r.ready = False
            self._stop.wait(POLL_S)

    def _pick(self, deadline: float) -> Replica:
        while time.monotonic() < deadline:
            ready = [r for r in self.replicas if r.ready]
            if ready:
                return ready[next(self._turn) % len(ready)]
            time.sleep(0.05)
        raise httpx.ConnectError("no replica ready")

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        deadline = time.monotonic() + 60
        request.read()
        while True:
            replica = self._pick(deadline)
            request.url = request.url.copy_with(port=replica.api_port)
            with self.tally.lock:
                self.tally.in_flight[replica.name] += 1
            try:
                response = self.inner.handle_request(request)
                response.read()  # the whole answer while it counts as in flight
            except httpx.ConnectError:
                with self.tally.lock:
                    self.tally.refused[replica.name] += 1
                if time.monotonic() >= deadline:
                    raise
                continue
            finally:
                with self.tally.lock:
                    self.tally.in_flight[replica.name] -= 1
            with self.tally.lock:
                self.tally.accepted.append((time.monotonic(), replica.name))
            response.headers["x-replica"] = replica.name
            return response

    def close(self) -> None:
        self._stop.set()
        self._poller.join(timeout=5)
        self.inner.close()


def replica_config(tmp_path: Path, model: Path, name: str, core: str) -> tuple[Path, Replica]:
    api_port, ready_port = free_port(), free_port()
    body = tiny_engine_config(
        tmp_path / name,
        model,
        api_port,
        daemon={
            "metrics_port": ready_port,
            "drain_unready_s": UNREADY_S,
            "drain_timeout_s": 60.0,
            "health_interval_s": 1.0,
        },
        probe={"max_concurrency": 2},
    )
    body["server"]["env"] = {"VLLM_CPU_OMP_THREADS_BIND": core}
    # the drain's budget (the lower of drain_timeout_s and this): vLLM 0.32 on these 2 cores took 14-28 s
    # from its SIGTERM to its exit in the runs seen, so 30 s left the drain incomplete once in four
    body["server"]["stop_timeout_s"] = 60
    (tmp_path / name).mkdir()
    return write_config(tmp_path / name / "r1sup.toml", body), Replica(name, api_port, ready_port)


def test_a_rolling_restart_under_a_flood_loses_no_accepted_request(tmp_path: Path, tiny_model: Path):
    import openai

    cores = sorted(os.sched_getaffinity(0))
    config_a, a = replica_config(tmp_path, tiny_model, "a", str(cores[0]))
    config_b, b = replica_config(tmp_path, tiny_model, "b", str(cores[-1]))
    service = Service([a, b])
    client = openai.OpenAI(
        base_url="http://127.0.0.1:1/v1",  # the Service puts each request on a replica's port
        api_key="none",
        timeout=120,
        max_retries=0,  # nothing is retried but a refused connect (by the Service)
        http_client=httpx.Client(transport=service),
    )
    stop = threading.Event()
    full = threading.Event()  # both replicas serve: the flood goes at full speed
    sent = itertools.count(1)
    done_after_roll = itertools.count(1)
    a_exited = threading.Event()
    answers: list[tuple[str, str]] = []  # (replica or "", "ok" or what went wrong)

    def flood(worker: int) -> None:
        if worker > 0:
            while not full.wait(1.0) and not stop.is_set():
                pass
        while not stop.is_set() and next(sent) <= MOST_REQUESTS:
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model="tiny",
                    messages=[{"role": "user", "content": "Count the sheep."}],
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                reply = raw.parse()
                usage = reply.usage.completion_tokens if reply.usage else 0
                whole = reply.choices[0].finish_reason == "length" and usage == MAX_TOKENS
                answers.append((raw.headers.get("x-replica", ""), "ok" if whole else f"short: {reply}"))
            except openai.OpenAIError as exc:
                answers.append(("", f"{type(exc).__name__}: {exc}"))
            if a_exited.is_set() and next(done_after_roll) >= AFTER_ROLL:
                stop.set()
            if not full.is_set():
                stop.wait(PACE_S)

    # both start together (the machine has 2 cores; one after the other would double the wait); the
    # flood starts, paced, with the first in the Service, goes full speed once both are, then A rolls
    t0 = time.monotonic()
    proc_a = R1sup("run", "--config", str(config_a))
    proc_b = R1sup("run", "--config", str(config_b))
    try:
        wait_until(lambda: a.ready or b.ready, 400, interval=0.5, what="a replica in the Service")
        with ThreadPoolExecutor(WORKERS) as pool:
            workers = [pool.submit(flood, i) for i in range(WORKERS)]
            wait_until(lambda: a.ready and b.ready, 400, interval=0.5, what="both in the Service")
            full.set()
            assert proc_a.named("serving") and proc_b.named("serving")
            wait_until(lambda: any(r == "a" for r, _ in answers), 60, what="A answering")
            wait_until(lambda: any(r == "b" for r, _ in answers), 60, what="B answering")
            # A's turn: SIGTERM while it holds requests, with no pause before it (Kubernetes takes a
            # terminating pod out of the endpoints, then pauses in preStop; here A's own /readyz 503
            # and drain_unready_s do that against a Service that polls)
            wait_until(lambda: service.tally.in_flight["a"] > 0, 30, interval=0.01, what="A busy")
            held = service.tally.in_flight["a"]
            sigterm_at = time.monotonic()
            proc_a.signal(signal.SIGTERM)
            code_a = proc_a.wait(120)
            exited_at = time.monotonic()
            a_exited.set()
            for w in workers:
                w.result(timeout=300)
        wall = time.monotonic() - t0

        failed = [(r, what) for r, what in answers if what != "ok"]
        accepted = service.tally.accepted
        to_a_after = sum(1 for t, r in accepted if r == "a" and t > sigterm_at)
        by = Counter(r for _, r in accepted)
        drain = proc_a.named("drain_started")[0] if proc_a.named("drain_started") else {}
        drained_s = proc_a.named("drain_finished")[0]["seconds"] if proc_a.named("drain_finished") else None
        print(
            f"A's drain: {drain.get('running')} running, {drain.get('waiting')} waiting at its start, "
            f"finished after {drained_s} s; "
            f"sent {len(answers)}, accepted {len(accepted)}, completed {len(answers) - len(failed)}, "
            f"by A {by['a']}, by B {by['b']}, "
            f"in flight on A at SIGTERM {held}, answered by A after it {to_a_after}, "
            f"refused connects {dict(service.tally.refused)}, A exited {exited_at - sigterm_at:.1f} s after "
            f"SIGTERM, wall {wall:.0f} s"
        )
        assert code_a == 0, proc_a.tail()
        assert not failed, failed[:5]
        assert len(answers) < MOST_REQUESTS  # the flood ended by its own rule, after the roll
        assert len(accepted) == len(answers) and all(r for r, _ in answers)
        # the drain did the work: A held requests at the SIGTERM, answered them, and went out whole
        drained = proc_a.named("drain_finished")
        assert proc_a.named("drain_started") and drained and drained[0]["complete"] is True, proc_a.tail()
        states = [e["new"] for e in proc_a.named("state_changed")]
        assert states[-3:] == ["draining", "stopping", "stopped"]
        assert not engine_processes(config_a)
        with pytest.raises(httpx.ConnectError):  # gone: a late connection fails at connect, not half-way
            httpx.get(f"http://127.0.0.1:{a.api_port}/v1/models", timeout=5)
        # B carried the flood after A left, alone
        assert [r for _, r in accepted[-AFTER_ROLL:]] == ["b"] * AFTER_ROLL
        assert len(proc_b.named("launch_started")) == 1 and not proc_b.named("serving_failed")
    finally:
        stop.set()
        service.close()
        print("answers:", Counter((r, what[:80]) for r, what in answers).most_common(8))
        wanted = ("stop_requested", "state_changed", "drain_started", "drain_finished", "engine_stopped")
        for e in proc_a.events:
            if e.get("event") in wanted:
                print("A:", e.get("timestamp"), e.get("event"), {k: e.get(k) for k in ("new", "seconds")})
            elif e.get("event") == "vllm" and "[shutdown]" in str(e.get("text")):
                print("A:", e.get("timestamp"), "vllm", e.get("text"))
        for proc, config in ((proc_a, config_a), (proc_b, config_b)):
            if proc.proc.poll() is None:
                proc.signal(signal.SIGTERM)
                try:
                    proc.wait(90)
                except Exception:
                    proc.kill()
            kill_engine_processes(config)
