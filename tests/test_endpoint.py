"""r1sup's HTTP endpoint: the verdicts as pure functions, then the listener over real HTTP."""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from typing import Any

import pytest

from conftest import free_port
from r1sup.daemon import State
from r1sup.endpoint import Endpoint, View, live, loop_limit_s, ready, route
from r1sup.metrics import Metrics


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
    r = Replay(tmp_path, monkeypatch, [crash, Script()], daemon={"metrics_port": port})
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
