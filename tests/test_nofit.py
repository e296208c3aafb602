"""Permanent failures stop: the "does not fit" verdict is remembered per fingerprint in the state
directory (a restarted pod gives it again without a second search; a changed config clears it), and the
one-line verdict of a non-zero exit lands in the termination-message file Kubernetes reads. The daemon
runs as the real CLI on the fake GPU engine."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT
from r1sup.adapters import termination
from r1sup.state import nofit
from r1sup_proc import R1sup, engine_processes, kill_engine_processes, write_config
from test_tune_fake import engine_records, fake_body, fake_env, fake_scenario

FAST_DAEMON = {"health_interval_s": 0.3, "liveness_interval_s": 3600.0, "backoff_initial_s": 0.1}


# --- the pure decision and the file ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "free_then", "free_now", "holds"),
    [
        ("k", 20.0, 20.0, True),  # the same box, as free as before
        ("k", 20.0, 20.4, True),  # within the tolerance
        ("k", 20.0, 19.0, True),  # less free: still does not fit
        ("k", 20.0, 21.0, False),  # another tenant left: search again
        ("other", 20.0, 20.0, False),  # another config, image or GPU
        ("k", None, None, True),  # no NVML on either start
        ("k", None, 20.0, False),  # a GPU is seen now: search
        ("k", 20.0, None, False),
    ],
)
def test_a_remembered_verdict_holds_for_the_same_fingerprint_and_no_more_memory(
    key: str, free_then: float | None, free_now: float | None, holds: bool
):
    verdict = nofit.NoFit("k", "does not fit", free_then, "2026-01-01T00:00:00Z")
    assert nofit.still_holds(verdict, key, free_now) is holds


def test_the_verdict_file_round_trips_and_a_bad_one_is_set_aside(tmp_path: Path):
    state = tmp_path / "state"
    assert nofit.load(state) is None
    written = nofit.remember(state, "abc", "no working configuration: x", 21.5)
    assert nofit.load(state) == written
    assert oct((state / nofit.FILE_NAME).stat().st_mode & 0o777) == "0o600"
    (state / nofit.FILE_NAME).write_text(json.dumps({"schema_version": 1, "key": 3}), encoding="utf-8")
    assert nofit.load(state) is None
    assert not (state / nofit.FILE_NAME).exists() and list(state.glob(f"{nofit.FILE_NAME}.bad-*"))
    nofit.remember(state, "abc", "r", None)
    nofit.forget(state)
    nofit.forget(state)  # twice: nothing to remove is fine
    assert nofit.load(state) is None


def test_the_termination_message_is_written_only_where_the_file_exists(tmp_path: Path):
    missing = tmp_path / "termination-log"
    assert termination.write(str(missing), 3, "no working configuration") is False
    assert not missing.exists()  # never created: outside Kubernetes there is no such file
    missing.write_text("an older message that is longer than the new one\n", encoding="utf-8")
    assert termination.write(str(missing), 2, "start.max_model_len: must be\nat least 1") is True
    assert missing.read_text(encoding="utf-8") == "r1sup: exit 2: start.max_model_len: must be at least 1\n"
    assert termination.write(str(missing), 3, "x" * 10_000) is True
    assert len(missing.read_bytes()) <= termination.MAX_BYTES  # what the kubelet reads
    assert termination.write("", 3, "off") is False
    assert termination.path_from(None, {}) == "/dev/termination-log"
    assert termination.path_from(None, {termination.ENV: "/x"}) == "/x"
    assert termination.path_from("", {termination.ENV: "/x"}) == ""


# --- the daemon --------------------------------------------------------------------------------------


def env_for(scenario: dict[str, Any], termination_log: Path) -> dict[str, str]:
    env = fake_env(scenario)
    # this checkout's r1sup first, then the fake NVML and engine
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "supervisor"), env["PYTHONPATH"]])
    env[termination.ENV] = str(termination_log)
    return env


def run_to_exit(config: Path, env: dict[str, str], timeout: float = 150) -> tuple[int, R1sup]:
    proc = R1sup("run", "--config", str(config), env=env)
    try:
        code = proc.wait(timeout)
    finally:
        proc.kill()
        kill_engine_processes(config)
    return code, proc


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_restart_after_does_not_fit_gives_the_verdict_again_without_a_search(tmp_path: Path):
    """14B bf16 weights on a 24 GiB GPU with weight quantization not allowed: the first run launches,
    sees the weights not fit and exits 3; the restarted one exits 3 at once, no launch; with the
    config changed (quantization allowed) it searches again and serves, and the verdict is gone."""
    scenario = fake_scenario(tmp_path)
    log = tmp_path / "termination-log"
    log.write_text("", encoding="utf-8")  # the kubelet creates the file
    env = env_for(scenario, log)
    config = write_config(tmp_path / "r1sup.toml", fake_body(tmp_path, daemon=FAST_DAEMON))

    code, first = run_to_exit(config, env)
    assert code == 3, first.tail()
    assert [r["outcome"] for r in engine_records(tmp_path)] == ["oom_weights"]
    (recorded,) = first.named("no_fit_recorded")
    verdict = nofit.load(tmp_path / "state")
    assert verdict is not None and verdict.key == recorded["key"]
    assert "allow_weight_quantization" in verdict.reason
    message = log.read_text(encoding="utf-8")
    assert message.startswith("r1sup: exit 3: ") and message.count("\n") == 1
    assert "allow_weight_quantization" in message

    log.write_text("", encoding="utf-8")  # a new container: a new, empty file
    code, second = run_to_exit(config, env)
    assert code == 3, second.tail()
    assert len(engine_records(tmp_path)) == 1  # no second launch
    assert not second.named("launch_started") and second.named("no_fit_remembered")
    assert log.read_text(encoding="utf-8") == message

    assert not second.named("no_fit_recorded")  # the verdict is not written again

    changed = fake_body(tmp_path, daemon=FAST_DAEMON, search={"allow_weight_quantization": True})
    config = write_config(tmp_path / "r1sup.toml", changed)
    proc = R1sup("run", "--config", str(config), env=env)
    try:
        proc.wait_event("serving", 150)
        assert not proc.named("no_fit_remembered")
        assert nofit.load(tmp_path / "state") is None  # serving clears it
        proc.signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.tail()
        assert not engine_processes(config)
    finally:
        proc.kill()
        kill_engine_processes(config)
    assert [r["outcome"] for r in engine_records(tmp_path)] == ["oom_weights", "oom_weights", "ready"]


@pytest.mark.timeout(120)
def test_a_config_error_of_run_reaches_the_termination_message(tmp_path: Path):
    log = tmp_path / "termination-log"
    log.write_text("", encoding="utf-8")
    config = tmp_path / "r1sup.toml"
    config.write_text('[model]\nname = "org/m"\n[start]\nmax_model_length = 1\n', encoding="utf-8")
    proc = R1sup("run", "--config", str(config), env=env_for(fake_scenario(tmp_path), log))
    try:
        assert proc.wait(60) == 2, proc.tail()
    finally:
        proc.kill()  # nothing was launched: a config error stops before any engine
    text = log.read_text(encoding="utf-8")
    assert text.startswith("r1sup: exit 2: start.max_model_length: unknown setting"), text
