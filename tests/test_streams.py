"""Every command writes its logs to stderr and its result to stdout (real subprocesses).

``r1sup tune --config F > t.out`` must leave the report alone in t.out, and ``r1sup plan --json | jq``
must see one JSON object, whatever the log level or format.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from r1sup_proc import ROOT, R1sup, engine_processes, kill_engine_processes, write_config
from test_tune_fake import QWEN_7B, fake_body, fake_env, fake_scenario

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CPU_LOG = ROOT / "tests" / "fixtures" / "logs" / "cpu" / "kv-insufficient.log"


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "r1sup.cli.app", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


def log_events(stderr: str) -> list[dict[str, Any]]:
    """Every stderr line is a JSON log event (with ``--log-format json``): parse them all."""
    events = []
    for line in stderr.splitlines():
        event = json.loads(line)
        assert "event" in event and "level" in event and "timestamp" in event, line
        events.append(event)
    return events


def no_log_lines(stdout: str) -> None:
    for line in stdout.splitlines():
        if line.startswith("{") and line.endswith("}"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            assert "event" not in obj or "timestamp" not in obj, f"a log event on stdout: {line}"


def test_plan_diagnose_check_and_status(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "r1sup.toml",
        {
            "model": {"name": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"},
            "state": {"dir": str(tmp_path / "st")},
        },
    )
    plan = cli("--log-format", "json", "--log-level", "debug", "plan", "--config", str(config),
               "--gpu", "RTX 4090", "--json")  # fmt: skip
    # stdout is exactly one JSON object; the exit status is the verdict's (7: only with the recommended flags)
    assert plan.returncode == json.loads(plan.stdout)["verdict"]["exit_code"] == 7, plan.stderr
    log_events(plan.stderr)

    text = cli("--log-format", "json", "--log-level", "debug", "plan", "--config", str(config), "--gpu", "L4")
    assert text.returncode in (0, 3, 7) and text.stdout.startswith("model ")
    no_log_lines(text.stdout)
    log_events(text.stderr)

    for extra in ([], ["--json"]):
        diag = cli("--log-format", "json", "--log-level", "debug", "diagnose", *extra, str(CPU_LOG))
        assert diag.returncode == 0, diag.stderr
        no_log_lines(diag.stdout)
        assert "kv_insufficient" in diag.stdout
        log_events(diag.stderr)

    check = cli("--log-format", "json", "--log-level", "debug", "check", "--config", str(config), "--json")
    assert check.returncode == 0 and json.loads(check.stdout)["model"]["name"].endswith("Qwen-7B")
    log_events(check.stderr)

    status = cli("--log-format", "json", "--log-level", "debug", "status", "--config", str(config), "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["exists"] is False
    log_events(status.stderr)

    # a usage error: one line on stderr, nothing on stdout
    bad = cli("plan", "--model", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "--gpu", "Voodoo 5")
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.count("\n") == 1


def test_tune_profile_export_import_and_run(tmp_path: Path) -> None:
    scenario = fake_scenario(tmp_path)
    body = fake_body(tmp_path, model=QWEN_7B)
    config = write_config(tmp_path / "r1sup.toml", body)
    env = fake_env(scenario)
    try:
        # tune, report on stdout: redirected to a file it holds the report and nothing else
        tune = cli("--log-format", "json", "tune", "--config", str(config), env=env, timeout=150)
        assert tune.returncode == 0, tune.stderr[-3000:]
        assert "found a working configuration" in tune.stdout
        no_log_lines(tune.stdout)
        events = log_events(tune.stderr)
        assert {"launch_started", "engine_ready", "probe_passed", "profile_saved"} <= {
            e["event"] for e in events
        }

        # the console format goes to stderr too
        console = cli(
            "--log-format", "console", "tune", "--config", str(config), "--json", env=env, timeout=150
        )
        assert console.returncode == 0, console.stderr[-3000:]
        assert json.loads(console.stdout)["ok"] is True
        assert "launch_started" in console.stderr and "{" not in console.stderr.splitlines()[0][:1]

        out = tmp_path / "exported.json"
        export = cli("--log-format", "json", "--log-level", "debug", "profile", "export", str(out),
                     "--config", str(config), env=env)  # fmt: skip
        assert export.returncode == 0, export.stderr
        assert export.stdout.startswith("exported profile ") and out.is_file()
        log_events(export.stderr)

        other = write_config(tmp_path / "other.toml", {**body, "state": {"dir": str(tmp_path / "other")}})
        imp = cli("--log-format", "json", "--log-level", "debug", "profile", "import", str(out),
                  "--config", str(other), env=env)  # fmt: skip
        assert imp.returncode == 0, imp.stderr
        assert "fingerprint matches this box" in imp.stdout
        no_log_lines(imp.stdout)
        log_events(imp.stderr)

        # run: nothing on stdout at all, every log event on stderr
        run = R1sup("run", "--config", str(config), env=env)
        try:
            run.wait_event("serving", 90)
            run.signal(signal.SIGTERM)
            assert run.wait(60) == 0, run.tail()
        finally:
            run.kill()
        assert run.lines == [], run.lines[:5]
        assert run.named("serving") and run.named("engine_stopped")
        assert all(line.startswith("{") for line in run.stderr), run.stderr[:3]
    finally:
        kill_engine_processes(config)
    assert not engine_processes(config)
