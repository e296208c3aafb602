"""``r1sup status`` and ``r1sup report`` against a real ``r1sup run`` on the fake GPU engine: the
loading progress in status.json, ``status`` and systemd's STATUS=; the served-model line with the
KV cache usage from vLLM's /metrics and the GPU memory NVML reports; a clean stop; the run's page."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import wait_until
from r1sup_proc import ROOT, NotifySocket, R1sup, engine_processes, kill_engine_processes, write_config
from test_tune_fake import QWEN_7B, fake_body, fake_env, fake_scenario

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def status(state: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``r1sup status``; with the fake NVML on its path (``env``) it sees the fake engine's GPU memory."""
    return subprocess.run(
        [sys.executable, "-m", "r1sup.cli.app", "status", "--state-dir", str(state), *extra],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def status_json(state: Path) -> dict[str, Any]:
    done = status(state, "--json")
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def test_progress_served_line_stop_and_report(tmp_path: Path) -> None:
    locks = tmp_path / "locks"
    locks.mkdir()
    # slow enough (time scale 0.05: a 7B start-up takes a few seconds) to be seen while it loads
    scenario = fake_scenario(tmp_path, time_scale=0.05, gpu_lock_dir=str(locks))
    body = fake_body(
        tmp_path, model=QWEN_7B, daemon={"health_interval_s": 0.5, "liveness_interval_s": 3600.0}
    )
    config = write_config(tmp_path / "r1sup.toml", body)
    state = tmp_path / "state"
    notify = NotifySocket(tmp_path / "notify.sock")
    env = {**fake_env(scenario), "NOTIFY_SOCKET": str(notify.path)}
    try:
        for run_number in (1, 2):
            proc = R1sup("run", "--config", str(config), env=env)
            try:
                seen = wait_until(
                    lambda: (d := status_json(state).get("served")) and d[0].get("progress") and d[0],
                    60,
                    interval=0.2,
                    what="the loading progress in status",
                )
                assert seen["state"] in ("launching", "probing")  # type: ignore[index]
                assert seen["progress"]["phase"] in (
                    "starting",
                    "weights",
                    "profiling",
                    "kv_cache",
                    "graphs",
                    "api",
                    "probe",
                )  # type: ignore[index]
                proc.wait_event("serving", 90)
                text = status(state, "--verbose", env=fake_env(scenario)).stdout
                row = text.splitlines()[1]
                cells = re.split(r"\s{2,}", row)
                assert cells[0] == "r1" and cells[1].startswith("http://127.0.0.1:"), row
                # what the probe proved: the most requests seen at once (its concurrency wave's, or
                # the one context request at a time), its tokens/s
                capacity = status_json(state)["daemon"]["capacity"]
                assert cells[3] == str(capacity["requests"]) and re.fullmatch(r"\d+\.\d", cells[4]), cells
                assert re.fullmatch(r"\d+\.\d GiB", cells[5]), cells  # NVML: the engine's GPU memory
                assert re.fullmatch(r"\d[\d,]*", cells[6]), cells  # KV tokens, as vLLM reported them
                assert re.fullmatch(r"\d+%", cells[7]), cells  # usage from vLLM's /metrics
                assert cells[-1] == "serving" and cells[-3] == ("tuned" if run_number == 1 else "persisted")
                assert capacity["context_requests"] == 1 and capacity["context_tokens"] == 8192, capacity
                assert capacity["kv_cache_tokens"] > 8192 and not capacity["reduced"], capacity
                proc.signal(signal.SIGTERM)
                assert proc.wait(60) == 0, proc.tail()
            finally:
                proc.kill()
            after = status(state).stdout
            assert after.splitlines()[1].split()[-1] == "stopped" and "stale" not in after

            messages = list(notify.messages)
            loading = [m for m in messages if re.match(r"STATUS=attempt 1: \w", m) and "elapsed" in m]
            assert loading, messages
            if run_number == 1:
                assert not any("ETA" in m for m in loading)  # nothing timed this model here yet
            else:
                assert any("ETA" in m for m in loading), loading  # the first run's profile timed it
            notify.messages.clear()

        page = tmp_path / "run.html"
        done = subprocess.run(
            [sys.executable, "-m", "r1sup.cli.app", "report", "--state-dir", str(state), "--html", str(page)],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        html = page.read_text(encoding="utf-8")
        assert "r1sup run:" in html and 'id="events"' in html and "state_changed" in html
        assert 'class="memchart"' in html
    finally:
        notify.close()
        kill_engine_processes(config)
    assert not engine_processes(config)
