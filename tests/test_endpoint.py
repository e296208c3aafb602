"""r1sup's HTTP endpoint: the verdicts as pure functions, then the listener over real HTTP."""

from __future__ import annotations

import contextlib
import json
import signal
import urllib.error
import urllib.request
from typing import Any

import pytest

from conftest import free_port
from r1sup.adapters.endpoint import METRICS_REUSE_S, Endpoint, View, live, loop_limit_s, ready, route
from r1sup.adapters.metrics import Metrics
from r1sup.supervision.states import State


def view(state: str = "serving", age: float = 0.5, limit: float = 150.0, status: Any = None) -> View:
    return View(state=state, loop_age_s=age, loop_limit_s=limit, status=status)


@pytest.mark.parametrize("state", [s.value for s in State])
def test_ready_only_while_serving(state: str):
    assert ready(view(state)) is (state == "serving")
    code, _, body = route("/readyz", view(state), None)
    assert code == (200 if state == "serving" else 503)
    assert json.loads(body) == {"ready": state == "serving", "state": state}


def test_a_draining_daemon_is_not_ready_and_its_status_says_why():
    # a drain waits for the requests in flight: the load balancer sends no new ones meanwhile
    assert route("/readyz", view("draining"), None)[0] == 503
    assert route("/readyz", view("a-state-added-later"), None)[0] == 503
    doc = {"state": "draining", "status": "draining: 3 running, 0 waiting"}
    code, _, body = route("/status", view("draining", status=doc), None)
    assert code == 200 and json.loads(body)["status"] == "draining: 3 running, 0 waiting"


@pytest.mark.parametrize(
    ("age", "limit", "alive"),
    [(0.0, 150.0, True), (149.9, 150.0, True), (150.0, 150.0, True), (150.1, 150.0, False)],
)
def test_live_while_the_loop_turned_within_the_limit(age: float, limit: float, alive: bool):
    assert live(view(age=age, limit=limit)) is alive
    code, _, body = route("/livez", view("launching", age, limit), None)
    assert code == (200 if alive else 503)
    assert json.loads(body)["live"] is alive and json.loads(body)["loop_age_s"] == round(age, 3)


def test_loop_limit_covers_a_whole_stop_of_vllm():
    # SIGTERM grace, then the wait for memory and port, both from the config; the margin on top
    assert loop_limit_s(30.0, 60.0) > 30.0 + 60.0
    assert loop_limit_s(300.0, 60.0) - loop_limit_s(30.0, 60.0) == 270.0


def test_status_and_unknown_paths():
    doc = {"state": "serving", "launches": 2}
    assert route("/status", view(status=doc), None)[0:2] == (200, "application/json")
    assert json.loads(route("/status", view(status=doc), None)[2]) == doc
    assert route("/status", view(status=None), None)[0] == 503  # before the first status write
    assert route("/nope", view(), None)[0] == 404
    assert route("/livez", None, None)[0] == 404  # a bare metrics listener has no probes


def get(port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_the_listener_answers_each_request_from_a_fresh_view():
    current = {"v": view("launching", status={"state": "launching", "note": "key sk-secret-1 here"})}
    metrics = Metrics()
    metrics.set_state("launching")
    endpoint = Endpoint(
        view=lambda: current["v"], metrics=metrics.exposition, mask=lambda t: t.replace("sk-secret-1", "***")
    )
    port = free_port()
    endpoint.serve("127.0.0.1", port)
    try:
        assert endpoint.port == port
        assert get(port, "/readyz")[0] == 503
        assert get(port, "/livez")[0] == 200
        code, headers, body = get(port, "/status")
        assert code == 200 and headers["Cache-Control"] == "no-store"
        assert json.loads(body)["note"] == "key *** here"  # the key is masked in what /status returns
        code, headers, body = get(port, "/metrics")
        assert code == 200 and headers["Content-Type"].startswith("text/plain")
        assert 'r1sup_state{state="launching"} 1.0' in body.decode()
        current["v"] = view("serving", age=0.1)
        assert get(port, "/readyz/")[0] == 200  # a trailing slash is the same path
        current["v"] = view("serving", age=500.0, limit=150.0)  # the loop is wedged; the thread answers
        code, _, body = get(port, "/livez")
        assert code == 503 and json.loads(body)["loop_age_s"] == 500.0
        request = urllib.request.Request(f"http://127.0.0.1:{port}/readyz", method="HEAD")
        with urllib.request.urlopen(request, timeout=5) as r:
            assert r.status == 200 and r.read() == b""
    finally:
        endpoint.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=2)


def test_a_flood_of_metrics_requests_shares_one_render_per_interval():
    renders: list[float] = []
    now = [100.0]

    def render() -> tuple[str, bytes]:
        renders.append(now[0])
        return "text/plain", f"r1sup_renders {len(renders)}\n".encode()

    endpoint = Endpoint(view=lambda: view("serving"), metrics=render, clock=lambda: now[0])
    bodies = {endpoint.answer("/metrics")[2] for _ in range(1000)}
    assert bodies == {b"r1sup_renders 1\n"} and renders == [100.0]
    for path in ("/readyz", "/livez", "/status"):  # the probes never render it
        endpoint.answer(path)
    now[0] += METRICS_REUSE_S * 0.99
    assert endpoint.answer("/metrics")[2] == b"r1sup_renders 1\n"
    now[0] = 100.0 + METRICS_REUSE_S  # as old as the interval: rendered again
    assert endpoint.answer("/metrics")[2] == b"r1sup_renders 2\n"
    now[0] -= 10.0  # a clock that went back never keeps a text for longer
    assert endpoint.answer("/metrics")[2] == b"r1sup_renders 3\n"
    assert len(renders) == 3


def test_a_view_that_raises_is_a_500_not_a_dropped_connection():
    def broken() -> View:
        raise RuntimeError("boom")

    endpoint = Endpoint(view=broken)
    port = free_port()
    endpoint.serve("127.0.0.1", port)
    try:
        code, _, body = get(port, "/readyz")
    finally:
        endpoint.close()
    assert code == 500 and "RuntimeError: boom" in json.loads(body)["error"]


# --- through every state of the daemon, replayed ------------------------------------------------------


def test_readyz_follows_the_daemon_through_every_state(tmp_path, monkeypatch):
    from replay import STARTUP, Replay, Script

    # the daemon replayed in process (tests/replay.py) with its real endpoint on a real port: an engine
    # that crashes while serving, a backoff, a relaunch, a stop. /readyz and /livez are read over HTTP
    # right after each transition and every second while serving; the endpoint's thread answers from
    # the daemon's view of that moment.
    port = free_port()
    crash = Script(exit_at=len(STARTUP) * 0.5 + 20)
    r = Replay(tmp_path, [crash, Script()], daemon={"metrics_port": port})
    seen: list[dict[str, Any]] = []

    def read() -> None:
        ready_code, _, ready_body = get(port, "/readyz")
        live_code, _, live_body = get(port, "/livez")
        said, alive = json.loads(ready_body), json.loads(live_body)
        seen.append(
            {
                "daemon": r.daemon.state.value,
                "state": said["state"],
                "ready": ready_code,
                "live": live_code,
                "loop_age_s": alive["loop_age_s"],
                "live_state": alive["state"],
            }
        )

    r.on_transition(lambda old, new: read())
    r.at_serving(1, lambda: [r.after(float(i), read) for i in range(1, 16)])
    r.at_serving(2, lambda: r.signal(5.0, signal.SIGTERM))
    assert r.run() == 0
    states = [s["state"] for s in seen]
    for expected in ("planning", "launching", "probing", "serving", "backoff", "stopping"):
        assert expected in states, states
    assert all(s["state"] == s["daemon"] == s["live_state"] for s in seen), seen
    # the order the daemon went through, as the endpoint saw it
    first = {s: states.index(s) for s in ("planning", "launching", "probing", "serving", "backoff")}
    assert first["planning"] < first["launching"] < first["probing"] < first["serving"] < first["backoff"]
    assert set(states[states.index("stopping") :]) <= {"stopping", "stopped"}, states
    # ready exactly while serving; live all along
    for s in seen:
        assert s["ready"] == (200 if s["state"] == "serving" else 503), s
        assert s["live"] == 200, s
    serving = [s for s in seen if s["state"] == "serving"]
    assert len(serving) > 15 and max(s["loop_age_s"] for s in serving) < 1.0
    # after the exit nothing listens any more
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=2)


# --- bounded: a flood of connections cannot stop the daemon (issue 26) ---------------------------------


def _timed_get(port: int, path: str) -> tuple[int, float]:
    import time

    start = time.monotonic()
    code = get(port, path)[0]
    return code, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.serial  # its bound is one second: run alone, not beside other process tests
@pytest.mark.timeout(240)
def test_ten_thousand_idle_and_slowloris_connections_under_ulimit_1024(tmp_path):
    """The daemon runs with RLIMIT_NOFILE 1024; 10,000 connections to its endpoint (127.0.0.1 only),
    half idle, half sending a byte now and then, all held open: /livez and /readyz answer within a
    second all along, vLLM keeps serving, and SIGTERM stops the daemon at once."""
    import os
    import resource
    import socket
    import time

    import psutil

    from conftest import ROOT
    from r1sup_proc import R1sup, engine_processes, kill_engine_processes, write_config

    total = 10_000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < total + 500:
        pytest.skip(f"this test holds {total} sockets; the hard limit on open files is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, total + 500), hard))
    port, endpoint_port = free_port(), free_port()
    config = write_config(
        tmp_path / "c.toml",
        {
            "model": {"name": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "served_name": "r1-7b"},
            "server": {"port": port, "launch": ["-m", "fakevllm"], "startup_timeout_s": 60},
            "start": {"max_model_len": 16384},
            "probe": {"requests": 3, "output_tokens": 4},
            "daemon": {"metrics_port": endpoint_port, "health_interval_s": 0.5, "liveness_interval_s": 1.0},
            "state": {"dir": str(tmp_path / "state")},
        },
    )
    env = {
        "PYTHONPATH": f"{ROOT / 'tests' / 'fakenvml'}:{ROOT / 'tests'}",
        "FAKE_VLLM_SCENARIO": json.dumps({"gpu": "RTX 4090", "time_scale": 0.002}),
    }

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    daemon = R1sup("run", "--config", str(config), env=env, preexec=limit_files)
    held: list[socket.socket] = []
    try:
        daemon.wait_event("serving", 90)
        assert psutil.Process(daemon.proc.pid).rlimit(psutil.RLIMIT_NOFILE) == (1024, 1024)
        child = json.loads((tmp_path / "state" / "status.json").read_text())["child_pid"]
        slow: list[socket.socket] = []
        worst = 0.0
        for i in range(total):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", endpoint_port))
            held.append(s)
            if i % 2:
                slow.append(s)
            if i % 1000 == 999:
                for s in slow[-500:]:  # the slowloris half: one byte of a request that never ends
                    with contextlib.suppress(OSError):
                        s.send(b"G")
                for path in ("/livez", "/readyz"):
                    code, took = _timed_get(endpoint_port, path)
                    assert code == 200, (i, path, code)
                    worst = max(worst, took)
        print(f"worst probe latency during the flood: {worst:.3f} s")
        assert worst < 1.0, worst
        for path in ("/livez", "/readyz", "/status"):
            code, took = _timed_get(endpoint_port, path)
            assert code == 200 and took < 1.0, (path, code, took)
        assert len(os.listdir(f"/proc/{daemon.proc.pid}/fd")) < 1024
        assert psutil.Process(child).is_running()
        for event in ("internal_error", "serving_failed", "daemon_failed"):
            assert not daemon.named(event), daemon.tail()
        assert len(daemon.named("launch_started")) == 1
        asked = time.monotonic()
        daemon.signal(signal.SIGTERM)
        daemon.wait_event("state_changed", 5, where=lambda e: e.get("new") == "stopping")
        assert time.monotonic() - asked < 1.5  # (the event's own trip through the pipe included)
        assert daemon.wait(60) == 0, daemon.tail()
    finally:
        for s in held:
            s.close()
        daemon.kill()
        kill_engine_processes(config)
    assert not engine_processes(config)


@pytest.mark.slow
@pytest.mark.serial  # its bound is one second: run alone, not beside other process tests
@pytest.mark.timeout(180)
def test_bursts_of_three_thousand_churning_connections_leave_readyz_under_a_probes_second(tmp_path):
    """Issue 34: 3,000 connections to the daemon's endpoint (127.0.0.1) opened at once and closed, once a
    second: a burst beyond the listen backlog (1024) had the kernel drop the SYN of a kubelet's
    /readyz, answered only after TCP's 1 s retransmit (1.1-2.1 s measured). The backlog holds a burst;
    every /readyz during the churn is answered within the probe's default second."""
    import socket
    import threading
    import time

    from r1sup_proc import R1sup, kill_engine_processes, write_config
    from test_daemon_fake import daemon_body
    from test_tune_fake import fake_env, fake_scenario

    endpoint_port = free_port()
    body = daemon_body(tmp_path, daemon={"metrics_port": endpoint_port})
    config = write_config(tmp_path / "r1sup.toml", body)
    daemon = R1sup("run", "--config", str(config), env=fake_env(fake_scenario(tmp_path)))
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            burst = []
            for _ in range(3000):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", endpoint_port))
                burst.append(s)
            for s in burst:
                s.close()
            stop.wait(1.0)

    churner = threading.Thread(target=churn, daemon=True)
    try:
        daemon.wait_event("serving", 90)
        churner.start()
        took: list[float] = []
        end = time.monotonic() + 10.0
        while time.monotonic() < end:
            code, seconds = _timed_get(endpoint_port, "/readyz")
            assert code == 200
            took.append(seconds)
            time.sleep(0.05)  # a probe's pace, not a wait for a condition
        took.sort()
        print(
            f"/readyz under churn: {len(took)} asked, p50 {took[len(took) // 2]:.4f} s, max {took[-1]:.3f} s"
        )
        assert took[-1] < 1.0, took[-5:]
        assert not daemon.named("internal_error") and len(daemon.named("launch_started")) == 1
    finally:
        stop.set()
        churner.join(10)
        daemon.kill()
        kill_engine_processes(config)


def _raw(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def test_the_listener_bounds_time_size_methods_and_connections(monkeypatch):
    import socket
    import time

    from r1sup.adapters import endpoint as ep

    monkeypatch.setattr(ep, "REQUEST_TIMEOUT_S", 0.3)
    monkeypatch.setattr(ep, "MAX_CONNECTIONS", 4)
    server = Endpoint(view=lambda: view("serving"))
    port = free_port()
    server.serve("127.0.0.1", port)
    try:
        assert _raw(port, b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 200 OK\r\n")
        assert _raw(port, b"POST /readyz HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405 ")
        assert _raw(port, b"garbage\r\n\r\n").startswith(b"HTTP/1.1 400 ")
        assert _raw(port, b"GET /" + b"x" * 20000).startswith(b"HTTP/1.1 431 ")
        start = time.monotonic()
        assert _raw(port, b"GET /readyz HTTP/1.1\r\n").startswith(b"HTTP/1.1 408 ")  # never finished
        assert time.monotonic() - start < 2.0
        # more half-sent heads than the cap: the oldest are closed, a probe still gets in
        slow = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(10)]
        try:
            for s in slow:
                s.sendall(b"G")
            assert get(port, "/readyz")[0] == 200
            assert slow[0].recv(10) == b""  # closed to make room
        finally:
            for s in slow:
                s.close()
    finally:
        server.close()


def test_connections_that_send_nothing_never_take_a_slot():
    """Issue 34: the kernel hands the listener a connection only once its first bytes are there
    (deferred accept), so a crowd of silent connections costs the endpoint's thread nothing and keeps
    no slot; a probe among them is answered."""
    import socket
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("deferred accept is Linux's")
    server = Endpoint(view=lambda: view("serving"))
    port = free_port()
    server.serve("127.0.0.1", port)
    silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(200)]
    try:
        assert get(port, "/readyz")[0] == 200
        assert server._listener is not None
        assert len(server._listener.conns) == 0 and server._listener.evicted == 0
    finally:
        for s in silent:
            s.close()
        server.close()


def test_half_sent_heads_past_the_cap_do_not_pause_accepting(monkeypatch):
    """Issue 34: past the cap, a young connection that sent part of a head is closed to make room; it
    no longer pauses accepting for its grace, which made a probe behind a churn of them in the accept
    queue wait (a grace of 30 s here: the probe would wait that long)."""
    import socket

    from r1sup.adapters import endpoint as ep

    monkeypatch.setattr(ep, "MAX_CONNECTIONS", 4)
    monkeypatch.setattr(ep, "EVICT_GRACE_S", 30.0)
    server = Endpoint(view=lambda: view("serving"))
    port = free_port()
    server.serve("127.0.0.1", port)
    slow = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(10)]
    try:
        for s in slow:
            s.sendall(b"GET /readyz HTTP/1.1\r\nHost: 1")
        assert get(port, "/readyz")[0] == 200
    finally:
        for s in slow:
            s.close()
        server.close()


def test_a_burst_of_concurrent_clients_is_answered_past_the_connection_cap():
    """300 clients at once, over the cap of 64 open connections: each gets its answer (the issue saw 27
    of 500 concurrent /status time out against a backlog of 5)."""
    import threading

    server = Endpoint(view=lambda: view("serving", status={"state": "serving", "pad": "x" * 2000}))
    port = free_port()
    server.serve("127.0.0.1", port)
    clients = 300
    start = threading.Barrier(clients)
    codes: list[int] = []

    def client() -> None:
        start.wait(30)
        try:
            codes.append(get(port, "/status")[0])
        except OSError as exc:
            codes.append(-1)
            raise AssertionError(exc) from None

    threads = [threading.Thread(target=client) for _ in range(clients)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        server.close()
    assert codes == [200] * clients, sorted(set(codes))


def test_accept_out_of_file_descriptors_is_survived(monkeypatch):
    import errno

    from r1sup.adapters import endpoint as ep

    server = Endpoint(view=lambda: view("serving"))
    port = free_port()
    server.serve("127.0.0.1", port)
    listener = server._listener
    assert listener is not None
    real = listener.sock
    failures = {"left": 3}

    class Exhausted:
        """The listening socket as a process out of file descriptors sees it: accept fails (EMFILE)."""

        def __getattr__(self, name):
            return getattr(real, name)

        def fileno(self):
            return real.fileno()

        def accept(self):
            if failures["left"]:
                failures["left"] -= 1
                raise OSError(errno.EMFILE, "Too many open files")
            return real.accept()

    try:
        listener.selector.unregister(real)
        listener.sock = Exhausted()  # type: ignore[assignment]
        listener.selector.register(listener.sock, ep.selectors.EVENT_READ, None)
        assert get(port, "/livez")[0] == 200  # waited in the backlog while accept failed, then answered
        assert failures["left"] == 0 and server._thread is not None and server._thread.is_alive()
    finally:
        listener.sock = real
        server.close()


@pytest.mark.slow
@pytest.mark.serial  # its bounds are hang guards, but the churn takes a core: run alone
@pytest.mark.timeout(120)
def test_probes_are_answered_under_three_thousand_churning_connections():
    """Issue 34: 3,000 connections churning (closed at once, half a request, a whole one, idle holders;
    127.0.0.1, 4 s, the churn of benchmarks/bench_endpoint_churn.py) filled a listen backlog of 1024, so
    the kernel dropped probes' SYNs and /readyz took 1-3.5 s (a SYN is sent again after 1 s, then 3 s).
    Every probe now connects at once and gets its answer, right, well within 2 s, and half of them
    within 100 ms (they waited 0.15-0.3 s in the accept queue behind the churn before issue 34's fix)."""
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    from conftest import ROOT

    somaxconn = Path("/proc/sys/net/core/somaxconn")
    if not somaxconn.is_file() or int(somaxconn.read_text()) < 4096:
        pytest.skip("the kernel caps the listen backlog below 4096 (net.core.somaxconn)")
    # the daemon's endpoint: the churn's whole requests ask /metrics, which a daemon renders (each
    # render took the one thread a few milliseconds: the probes waited 0.3 s at the median behind them)
    metrics = Metrics()
    metrics.set_state("serving")
    server = Endpoint(view=lambda: view("serving"), metrics=metrics.exposition)
    port = free_port()
    server.serve("127.0.0.1", port)
    bench = ROOT / "benchmarks" / "bench_endpoint_churn.py"
    args = ["--role", "churn", "--port", str(port), "--connections", "3000", "--seconds", "4"]
    churn = subprocess.Popen([sys.executable, str(bench), *args], stdout=subprocess.PIPE, text=True)
    probes: list[tuple[str, float, float, bytes]] = []
    try:
        time.sleep(0.5)  # the churn under way
        n = 0
        while churn.poll() is None and n < 400:
            path = ("/readyz", "/livez")[n % 2]
            n += 1
            start = time.monotonic()
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                connected = time.monotonic() - start
                s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                data = b""
                while chunk := s.recv(4096):
                    data += chunk
            probes.append((path, connected, time.monotonic() - start, data))
            time.sleep(0.02)
        out, _ = churn.communicate(timeout=30)
    finally:
        if churn.poll() is None:
            churn.kill()
            churn.wait(10)
        server.close()
    counts = json.loads(out)
    assert counts["opened"] >= 3000, counts  # the churn ran
    assert len(probes) >= 3, probes
    for path, connected, took, data in probes:
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n"), (path, head)
        assert json.loads(body)["ready" if path == "/readyz" else "live"] is True
        assert connected < 0.5, (path, connected)  # no SYN dropped: a dropped one is sent again after 1 s
        assert took < 2.0, (path, took)
    # The half of the probes that waited least: behind a first-come queue of the churn's connections
    # that was 0.15-0.3 s; with silent connections kept out and the rest answered at once, well under a
    # millisecond on an idle machine, a few on a loaded one.
    median = sorted(p[2] for p in probes)[len(probes) // 2]
    print(f"{len(probes)} probes, median {median:.4f} s, slowest {max(p[2] for p in probes):.3f} s, {counts}")
    assert median < 0.1, median
