"""``r1sup run`` on the fake GPU engine: runtime OOM, SIGHUP, forced stop, metrics, status.json and
systemd's READY=1, each with the real CLI as a subprocess and bounded waits. The restart budget and a
SIGHUP that changes no flag are replayed in process (tests/test_replay.py)."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest

from conftest import free_port, wait_until
from r1sup_proc import NotifySocket, R1sup, engine_processes, kill_engine_processes, write_config
from test_tune_fake import QWEN_7B, TIME_SCALE, engine_records, fake_body, fake_env, fake_scenario

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# Fast daemon timers; liveness (a real completion, which counts as a request) is off unless a test
# sets it, so the requests the fake engine counts are the probe's and the test's own.
FAST_DAEMON = {
    "health_interval_s": 0.3,
    "health_timeout_s": 2.0,
    "health_failures": 3,
    "liveness_interval_s": 3600.0,
    "backoff_initial_s": 0.1,
    "backoff_max_s": 0.5,
    "restart_budget": 4,
}
START_S = 90  # bound on one bring-up (a few fake launches)


def daemon_body(tmp_path: Path, **sections: dict[str, Any]) -> dict[str, dict[str, Any]]:
    daemon = {**FAST_DAEMON, **sections.pop("daemon", {})}
    return fake_body(tmp_path, model=QWEN_7B, daemon=daemon, **sections)


@contextmanager
def running(
    tmp_path: Path,
    body: dict[str, dict[str, Any]],
    scenario: dict[str, Any],
    env: dict[str, str] | None = None,
) -> Iterator[tuple[R1sup, Path]]:
    """``r1sup run`` on ``body``; whatever happens, r1sup and every fake engine of it are killed."""
    config = write_config(tmp_path / "r1sup.toml", body)
    proc = R1sup("run", "--config", str(config), env={**fake_env(scenario), **(env or {})})
    try:
        yield proc, config
    finally:
        proc.kill()
        kill_engine_processes(config)


def status(tmp_path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((tmp_path / "state" / "status.json").read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return {}


def served_model(port: int, prompt: str = "Hello") -> int:
    """One completion against the engine; its HTTP status (0 when the server does not answer)."""
    body = json.dumps({"model": "r1", "prompt": prompt, "max_tokens": 4}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return 0


def stop_cleanly(proc: R1sup, config: Path, tmp_path: Path) -> None:
    proc.signal(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.tail()
    assert not engine_processes(config)
    assert status(tmp_path)["state"] == "stopped"


def order(proc: R1sup, *names: str) -> list[str]:
    """The events of these names, in the order r1sup logged them."""
    return [e["event"] for e in list(proc.events) if e.get("event") in names]


# --- (1) runtime OOM -------------------------------------------------------------------------------


def test_runtime_oom_steps_down_saves_the_profile_and_serves_again(tmp_path: Path):
    # the 7th completion of each engine runs out of memory: the probe sends 4, the test the rest
    scenario = fake_scenario(tmp_path, runtime={"fail_after_requests": 6, "failure": "oom"})
    body = daemon_body(tmp_path)
    body["probe"] = {**body.get("probe", {}), "max_concurrency": 1}  # no concurrency wave: 4 requests
    port = body["server"]["port"]
    with running(tmp_path, body, scenario) as (proc, config):
        proc.wait_event("serving", START_S)
        first = status(tmp_path)
        assert first["state"] == "serving" and first["launches"] == 1 and first["last_failure"] is None
        saved_before = proc.named("profile_saved")[-1]
        answers: list[int] = []
        while len(proc.named("serving_failed")) == 0 and len(answers) < 20:
            answers.append(served_model(port))
            if answers[-1] != 200:
                break
        assert answers[:2] == [200, 200] and answers[2] != 200, answers  # requests 5, 6 ok; the 7th fails
        failed = proc.wait_event("serving_failed", 30)
        assert failed["failure_class"] == "oom_runtime" and failed["phase"] == "serving"
        assert "CUDA out of memory" in failed["evidence"]
        step = proc.wait_event("search_step", 30)
        assert step["failure_class"] == "oom_runtime"
        # a 64 MiB allocation, within what the sampler takes for vLLM's 256 sequences: fewer sequences
        # (more than the KV cache holds at once, so free) are tried first
        assert step["old"]["max_num_seqs"] is None and 16 <= step["new"]["max_num_seqs"] < 256
        assert {k: v for k, v in step["new"].items() if k != "max_num_seqs"} == {
            k: v for k, v in step["old"].items() if k != "max_num_seqs"
        }
        seqs = step["new"]["max_num_seqs"]
        proc.wait_event("serving", START_S, count=2)
        st = status(tmp_path)
        assert st["state"] == "serving" and st["launches"] == 2 and st["profile_source"] == "tuned"
        assert st["flags"] == step["new"]
        assert st["last_failure"]["class"] == "oom_runtime"
        # the new profile replaced the old one: same key, new flags, on disk
        saved = proc.named("profile_saved")[-1]
        assert saved["path"] == saved_before["path"] and len(proc.named("profile_saved")) == 2
        profile = json.loads(Path(saved["path"]).read_text(encoding="utf-8"))
        assert profile["flags"] == step["new"]
        profiles = sorted(p.name for p in (tmp_path / "state" / "profiles").glob("*.json"))
        assert profiles == [Path(saved["path"]).name]
        # the engine saw it the same way: one runtime OOM, then a start with fewer sequences
        assert [r["outcome"] for r in engine_records(tmp_path, "runtime_failure")] == ["oom_runtime"]
        launches = engine_records(tmp_path)
        assert [r["flags"]["max_num_seqs"] for r in launches] == [None, seqs]
        assert served_model(port) == 200
        stop_cleanly(proc, config, tmp_path)
    # vLLM's lines: the runtime OOM's traceback is relayed at error; what vLLM prints while r1sup stops
    # it (the force-kill warnings and the EngineDeadError of every clean stop) stays at info, marked
    relayed = proc.named("vllm")
    errors = [e for e in relayed if e["level"] == "error"]
    assert any("CUDA out of memory" in e["text"] for e in errors)
    assert not any(e.get("during_stop") for e in errors)
    teardown = [e for e in relayed if e.get("during_stop")]
    assert any("force killing remaining process" in e["text"] for e in teardown)
    dead = [e for e in teardown if "EngineDeadError" in e["text"]]
    assert dead, teardown  # from the final SIGTERM's stop
    assert all(e["vllm_level"] == "ERROR" for e in dead)
    assert [e["level"] for e in teardown] == ["info"] * len(teardown)


# --- (3) SIGHUP ------------------------------------------------------------------------------------


def test_sighup_after_editing_start_replans_and_relaunches_with_the_new_flags(tmp_path: Path):
    body = daemon_body(tmp_path)
    with running(tmp_path, body, fake_scenario(tmp_path)) as (proc, config):
        proc.wait_event("serving", START_S)
        assert status(tmp_path)["flags"]["max_model_len"] == 8192
        body["start"]["max_model_len"] = 4096
        write_config(config, body)
        proc.signal(signal.SIGHUP)
        assert proc.wait_event("config_reloaded", 20)["changed"] is True
        stopped = proc.wait_event("engine_stopped", 30)
        assert stopped["reason"] == "config reloaded"
        proc.wait_event("serving", START_S, count=2)
        st = status(tmp_path)
        assert st["launches"] == 2 and st["state"] == "serving"
        assert [r["flags"]["max_model_len"] for r in engine_records(tmp_path)] == [8192, 4096]
        assert st["flags"]["max_model_len"] == 4096, "the edited [start] was launched, not the old profile"
        assert st["profile_source"] == "tuned"
        stop_cleanly(proc, config, tmp_path)


# --- (4) a second SIGTERM --------------------------------------------------------------------------


def engine_core_gone(child_pid: int) -> bool:
    """The fake's EngineCore child exited (it obeys SIGTERM; its API server ignores it here)."""
    try:
        kids = psutil.Process(child_pid).children()
    except psutil.Error:
        return True
    for kid in kids:
        try:
            if kid.status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.Error:
            continue
    return True


def test_second_sigterm_forces_the_stop(tmp_path: Path):
    stop_timeout = 120.0
    body = daemon_body(tmp_path, server={"stop_timeout_s": stop_timeout})
    scenario = fake_scenario(tmp_path, ignore_sigterm=True)
    with running(tmp_path, body, scenario) as (proc, config):
        proc.wait_event("serving", START_S)
        child = status(tmp_path)["child_pid"]
        assert not engine_core_gone(child)
        proc.signal(signal.SIGTERM)
        proc.wait_event("state_changed", 20, where=lambda e: e["new"] == "stopping")
        # the group got SIGTERM: the engine core obeyed, the API server ignores it and r1sup waits
        wait_until(lambda: engine_core_gone(child), 20, what="the engine core to take SIGTERM")
        assert proc.proc.poll() is None and psutil.pid_exists(child)
        t0 = time.monotonic()
        proc.signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.tail()
        assert time.monotonic() - t0 < stop_timeout / 4
        stopped = proc.named("engine_stopped")
        assert stopped and stopped[-1]["escalated"] is True
        assert not engine_processes(config)
        assert status(tmp_path)["state"] == "stopped"


def test_two_sigterms_in_quick_succession_force_the_stop(tmp_path: Path):
    # like an impatient double Ctrl-C: the second signal comes 20 ms after the first (long enough for
    # Python to run the handler of each), usually before r1sup's loop has begun to stop vLLM
    stop_timeout = 60.0
    body = daemon_body(tmp_path, server={"stop_timeout_s": stop_timeout})
    with running(tmp_path, body, fake_scenario(tmp_path, ignore_sigterm=True)) as (proc, config):
        proc.wait_event("serving", START_S)
        t0 = time.monotonic()
        proc.signal(signal.SIGTERM)
        time.sleep(0.02)  # the stimulus's timing, not a wait for a condition
        proc.signal(signal.SIGTERM)
        wait_until(
            lambda: proc.proc.poll() is not None,
            stop_timeout / 3,
            interval=0.2,
            what="r1sup to force the stop after the second SIGTERM",
        )
        assert proc.proc.returncode == 0, proc.tail()
        assert time.monotonic() - t0 < stop_timeout / 3
        assert not engine_processes(config)


@pytest.mark.parametrize(
    ("first", "signum"),
    [(signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGHUP)],
)
def test_a_signal_repeated_until_the_end_of_a_stop_still_ends_run_with_0(
    tmp_path: Path, first: int, signum: int
):
    # issue 34: a stop signal, then ``signum`` every 20 ms across the whole stop, the last ones after
    # r1sup's loop had ended: run ended by the signal (rc -15, -2, -1) instead of README's 0, as its
    # handlers were put back to the default action before the process ended. The fake ignores SIGTERM:
    # the stop lasts its whole grace period (6 s, the signals every 20 ms across it) before the SIGKILL,
    # unless the repeated signal forces it
    body = daemon_body(tmp_path, server={"stop_timeout_s": 6.0})
    with running(tmp_path, body, fake_scenario(tmp_path, ignore_sigterm=True)) as (proc, config):
        proc.wait_event("serving", START_S)
        proc.signal(first)
        deadline = time.monotonic() + 60
        while proc.proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(ProcessLookupError):
                proc.signal(signum)
            time.sleep(0.02)  # the stimulus's pace, not a wait for a condition
        assert proc.wait(60) == 0, proc.tail()
        assert proc.named("engine_stopped") and not engine_processes(config)
        assert status(tmp_path)["state"] == "stopped"


def test_a_probe_answered_5xx_while_health_answers_is_restarted_within_the_budget(tmp_path: Path):
    # issue 34: a proxy's 503 (not vLLM's EngineDeadError) for every probe request at the first two
    # launches while vLLM's /health answers was engine_dead, and run exited 4 for good; it is the probe's
    # transient fault: the same flags again after a backoff, within daemon.restart_budget
    runtime = {"reset_every": 1, "reset_status": 503, "reset_launches": 2}
    body = daemon_body(tmp_path, probe={"requests": 1})
    with running(tmp_path, body, fake_scenario(tmp_path, runtime=runtime)) as (proc, config):
        proc.wait_event("serving", START_S)
        failed = proc.named("probe_failed")
        assert [f["failure_class"] for f in failed] == ["probe_server_error", "probe_server_error"]
        assert all(f["server_errors"] == 1 and "(HTTP 503)" in f["evidence"] for f in failed)
        assert [e["restart"] for e in proc.named("restart_backoff")] == [1]
        assert not proc.named("daemon_failed") and not proc.named("fatal_failure")
        launched = proc.named("launch_started")
        assert len(launched) == 3 and launched[0]["flags"] == launched[2]["flags"]
        assert served_model(body["server"]["port"]) == 200
        stop_cleanly(proc, config, tmp_path)


def test_probe_requests_queued_past_their_timeout_while_vllm_generates_are_restarted_within_the_budget(
    tmp_path: Path,
):
    # issue 34: a probe request that got no answer within probe.request_timeout_s was engine_dead, and
    # run exited 4 for good. One slot, two requests at once, a token every ~0.25 s at the first two
    # launches: one request waits for the slot past its 1.5 s timeout while the other decodes (vLLM's
    # counters move, /health answers): probe_timeout, the same flags again after a backoff, within
    # daemon.restart_budget; the third launch decodes at full speed and serves
    runtime = {"decode_tokens_per_s": 1 / (0.25 / TIME_SCALE), "slow_launches": 2}
    probe = {"requests": 2, "concurrency": 2, "output_tokens": 12, "request_timeout_s": 1.5}
    body = daemon_body(tmp_path, start={"max_num_seqs": 1}, probe=probe)
    with running(tmp_path, body, fake_scenario(tmp_path, runtime=runtime)) as (proc, config):
        proc.wait_event("serving", START_S)
        failed = proc.named("probe_failed")
        assert [f["failure_class"] for f in failed] == ["probe_timeout", "probe_timeout"]
        assert all(f["request_timeouts"] >= 1 and f["timeout_progress_tokens"] >= 1 for f in failed)
        assert all("probe.request_timeout_s (1.5s)" in f["evidence"] for f in failed)
        assert [e["restart"] for e in proc.named("restart_backoff")] == [1]
        assert not proc.named("daemon_failed") and not proc.named("fatal_failure")
        launched = proc.named("launch_started")
        assert len(launched) == 3 and launched[0]["flags"] == launched[2]["flags"]
        assert served_model(body["server"]["port"]) == 200
        stop_cleanly(proc, config, tmp_path)


# --- (5) metrics, (6) status.json, (7) READY=1 ------------------------------------------------------


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def metric(text: str, name: str, labels: str = "") -> float | None:
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" ([0-9.e+-]+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else None


def test_metrics_endpoint_on_localhost(tmp_path: Path):
    metrics_port = free_port()
    body = daemon_body(tmp_path, daemon={"metrics_port": metrics_port})
    with running(tmp_path, body, fake_scenario(tmp_path)) as (proc, config):
        proc.wait_event("serving", START_S)
        listening = proc.named("metrics_listening")[0]
        assert listening["host"] == "127.0.0.1" and listening["port"] == metrics_port
        text = metrics_text(metrics_port)
        assert metric(text, "r1sup_state", 'state="serving"') == 1.0, text
        assert metric(text, "r1sup_state", 'state="launching"') == 0.0
        assert metric(text, "r1sup_launches_total") == 1.0
        assert metric(text, "r1sup_child_up") == 1.0
        assert metric(text, "r1sup_max_model_len") == 8192.0
        # bound to the loopback address only
        bound = [
            c.laddr
            for c in psutil.Process(proc.proc.pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == metrics_port
        ]
        assert [a.ip for a in bound] == ["127.0.0.1"]
        stop_cleanly(proc, config, tmp_path)


def test_a_metrics_port_another_process_holds_refuses_the_start(tmp_path: Path):
    # two configs with the same daemon.metrics_port: the second r1sup would serve while the first one's
    # endpoint answered its health checks. It refuses to start, naming the holder, as for server.port.
    metrics_port = free_port()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_PORT, str(metrics_port)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"listening\n"
        body = daemon_body(tmp_path, daemon={"metrics_port": metrics_port})
        with running(tmp_path, body, fake_scenario(tmp_path)) as (proc, config):
            assert proc.wait(60) == 4, proc.tail()
            said = f"daemon.metrics_port: port {metrics_port} on 127.0.0.1 is held by pid {holder.pid} ("
            assert said in proc.tail(), proc.tail()
            assert not proc.named("launch_started") and not engine_processes(config)
            assert status(tmp_path)["state"] == "failed"
    finally:
        holder.kill()
        holder.wait(timeout=10)


HOLD_PORT = """
import socket, sys, time
s = socket.socket()
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(8)
print("listening", flush=True)
time.sleep(120)
"""


def test_status_file_while_serving_and_after_the_stop(tmp_path: Path):
    body = daemon_body(tmp_path)
    with running(tmp_path, body, fake_scenario(tmp_path)) as (proc, config):
        proc.wait_event("serving", START_S)
        st = status(tmp_path)
        fields = ("state", "pid", "child_pid", "launches", "profile_source", "flags", "since", "last_failure")
        assert set(fields) <= set(st), sorted(st)
        assert st["state"] == "serving" and st["pid"] == proc.proc.pid
        assert st["child_pid"] in {p.pid for p in engine_processes(config)}
        assert st["launches"] == 1 and st["profile_source"] == "tuned" and st["last_failure"] is None
        assert st["flags"]["max_model_len"] == 8192 and st["flags"]["gpu_memory_utilization"] == 0.9
        (full,) = proc.named("probe_started")
        assert full["requests"] == 4 and "short" not in full  # no profile yet: the full probe
        tuned = st["capacity"]
        assert tuned["probe_tokens"] > 1000 and "context_from_profile" not in tuned, tuned
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", st["since"]), st["since"]
        assert st["port"] == body["server"]["port"] and st["served_model"] == "r1"
        stop_cleanly(proc, config, tmp_path)
        after = status(tmp_path)
        assert after["child_pid"] is None and after["pid"] == st["pid"]

    # a second run on the same state finds the saved profile: one launch, source "persisted"
    with running(tmp_path, body, fake_scenario(tmp_path)) as (proc, config):
        proc.wait_event("serving", START_S)
        st = status(tmp_path)
        assert st["launches"] == 1 and st["profile_source"] == "persisted"
        # its flags passed the full probe on this box: one wave at the target concurrency (1)
        (short,) = proc.named("probe_started")
        assert short["requests"] == 1 and short["short"]
        assert proc.named("probe_passed")[0]["succeeded"] == 1
        # short prompts (vLLM allocated the KV cache the full probe passed with): the capacity is still
        # the one the full probe measured, marked as the profile's (issue 36: one figure, not ~75 tokens)
        assert short["prompts"] and short["prompt_tokens"] < 100, short
        again = status(tmp_path)["capacity"]
        assert again["context_from_profile"] is True and again["wave_from_profile"] is True, again
        marks = ("context_from_profile", "wave_from_profile")
        assert {k: v for k, v in again.items() if k not in marks} == tuned
        text = subprocess.run(
            [sys.executable, "-m", "r1sup", "status", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        assert f"capacity: measured (the profile's full probe): {tuned['requests']} request(s)" in text, text
        assert f"1 at once of ~{tuned['probe_tokens']:,} tokens;" in text, text
        stop_cleanly(proc, config, tmp_path)


def test_ready_is_sent_only_after_the_probe_passed(tmp_path: Path):
    # fp8 (e4m3) KV on an RTX 3090 starts, then fails the probe's first request: the first launch is
    # ready but not good; READY=1 must wait for the second launch's probe.
    scenario = fake_scenario(tmp_path, gpu="RTX 3090", fp8_fails_at="first_request")
    body = daemon_body(tmp_path, start={"kv_cache_dtype": "fp8"})
    notify = NotifySocket(tmp_path / "notify.sock")
    try:
        with running(tmp_path, body, scenario, env={"NOTIFY_SOCKET": str(notify.path)}) as (proc, config):
            proc.wait_event("serving", START_S)
            wait_until(lambda: any("READY=1" in m for m in notify.messages), 10, what="READY=1")
            assert [e["launch"] for e in proc.named("engine_ready")] == [1, 2]
            assert [e["launch"] for e in proc.named("probe_failed")] == [1]
            assert [e["launch"] for e in proc.named("probe_passed")] == [2]
            messages = list(notify.messages)
            ready = [i for i, m in enumerate(messages) if "READY=1" in m]
            assert len(ready) == 1
            before = messages[: ready[0]]
            assert "STATUS=attempt 1: load probe" in before
            assert "STATUS=attempt 2: load probe" in before, before
            assert before.index("STATUS=attempt 2: load probe") > before.index("STATUS=attempt 1: load probe")
            assert f"MAINPID={proc.proc.pid}" in messages[ready[0]]
            assert status(tmp_path)["flags"]["kv_cache_dtype"] == "fp8_e5m2"
            stop_cleanly(proc, config, tmp_path)
            assert any("STOPPING=1" in m for m in notify.messages[ready[0] :])
    finally:
        notify.close()


# --- (7) transient conditions ----------------------------------------------------------------------


def test_a_profile_degraded_by_another_tenant_is_kept_beside_and_the_best_returns(tmp_path: Path):
    # another job holds 5 GiB at the first launch and is gone after it: the first profile is degraded
    # (kept beside the best, never over it); once the memory is back the daemon plans a re-tune
    locks = tmp_path / "gpu-locks"
    locks.mkdir()
    scenario = fake_scenario(tmp_path, other_process_schedule=[5.0, 0.0], gpu_lock_dir=str(locks))
    body = daemon_body(
        tmp_path,
        start={"max_model_len": 32768},
        search={"first_launch": "planned"},
        target={"concurrency": 2, "context": 8192},
        daemon={"memory_check_s": 0.5},
    )
    with running(tmp_path, body, scenario) as (proc, config):
        proc.wait_event("serving", START_S)
        degraded = proc.wait_event("profile_degraded", 10)
        assert "5.0 GiB" in degraded["reason"]
        planned = proc.wait_event("retune_planned", 30)
        proc.wait_event("serving", START_S, count=2)
        st = status(tmp_path)
        assert st["state"] == "serving" and st["launches"] == 2 and st["degraded"] is None
        launches = engine_records(tmp_path)
        assert [r["outcome"] for r in launches] == ["ready", "ready"]
        first, second = (r["flags"]["gpu_memory_utilization"] for r in launches)
        assert first < second  # sized for what was free, then for the whole card
        files = sorted((tmp_path / "state" / "profiles").glob("*.json"))
        saved = [json.loads(f.read_text(encoding="utf-8")) for f in files]
        assert len(saved) == 2  # the degraded one beside the best, under its own key
        marked = [p for p in saved if p["conditions"].get("degraded")]
        best = [p for p in saved if not p["conditions"].get("degraded")]
        assert len(marked) == 1 and len(best) == 1 and planned["best_key"] == best[0]["key"]
        assert marked[0]["conditions"]["others_gib"] == 5.0 and best[0]["conditions"]["others_gib"] == 0
        assert best[0]["flags"]["gpu_memory_utilization"] == second
        stop_cleanly(proc, config, tmp_path)


def test_a_tune_beside_another_tenant_keeps_its_profile_degraded_and_run_serves_it(tmp_path: Path):
    # issue 35, one bring-up: tune keeps the box's conditions in its profile as run does; found while
    # another job held 6 GiB, its profile is the degraded one, kept beside the best under its own key.
    # run on the box as it still is then serves that profile with one launch (no second search),
    # marked degraded, watching for the memory to come back.
    from test_tune_fake import run_plan, run_tune

    scenario = fake_scenario(tmp_path, gpu={"name": "RTX 4090", "other_process_gib": 6.0})
    body = daemon_body(tmp_path, daemon={"memory_check_s": 3600.0})
    t = run_tune(tmp_path, body, scenario)
    assert t.code == 0, t.explain()
    (degraded,) = t.proc.named("profile_degraded")
    assert "6.0 GiB" in degraded["reason"], degraded
    kept = json.loads(Path(t.result["profile_path"]).read_text(encoding="utf-8"))
    assert kept["conditions"]["others_gib"] == 6.0 and kept["conditions"]["degraded"] is True, kept
    assert kept["key"] != degraded["key"]  # beside the best (the key the daemon goes back to)
    assert kept["flags"] == t.result["flags"]
    # plan --config says what run launches now: that profile (nothing better fits what is free)
    code, out = run_plan(t.config, scenario, "--json")
    planned = json.loads(out)
    assert planned["recommended"] == kept["flags"], out
    assert planned["recommended_from"]["source"] == "saved_profile", out
    launched_by_tune = len(engine_records(tmp_path))
    with running(tmp_path, body, scenario) as (proc, config):
        proc.wait_event("serving", START_S)
        st = status(tmp_path)
        assert st["launches"] == 1 and st["flags"] == kept["flags"], st
        assert st["degraded"]["best_key"] == degraded["key"], st
        assert "no best profile" in st["degraded"]["reason"] and "6.0 GiB" in st["degraded"]["reason"]
        assert len(engine_records(tmp_path)) == launched_by_tune + 1
        assert not proc.named("search_step") and not proc.named("plan_made"), proc.tail()
        stop_cleanly(proc, config, tmp_path)


def test_a_probe_that_keeps_losing_its_connection_is_restarted_within_the_budget(tmp_path: Path):
    # issue 34: every probe request's connection reset at the first two launches while vLLM's /health
    # answers: not engine_dead and not run's end (it exited 4 for good); the same flags again after a
    # backoff, within daemon.restart_budget, and the third launch serves
    scenario = fake_scenario(tmp_path, runtime={"reset_every": 1, "reset_launches": 2})
    body = daemon_body(tmp_path, probe={"requests": 1})
    port = body["server"]["port"]
    with running(tmp_path, body, scenario) as (proc, config):
        proc.wait_event("serving", START_S)
        failed = proc.named("probe_failed")
        assert [f["failure_class"] for f in failed] == ["probe_connection", "probe_connection"]
        assert all(f["connection_errors"] == 1 and f["retried"] == 1 for f in failed)
        assert [e["restart"] for e in proc.named("restart_backoff")] == [1]
        assert not proc.named("daemon_failed") and not proc.named("fatal_failure")
        launched = proc.named("launch_started")
        assert len(launched) == 3 and launched[0]["flags"] == launched[2]["flags"]
        assert [r["outcome"] for r in engine_records(tmp_path)] == ["ready", "ready", "ready"]
        assert served_model(port) == 200
        stop_cleanly(proc, config, tmp_path)
