"""A readable console: changes as ``old -> new`` only, integers as integers, no duplicate progress,
vLLM's tracebacks folded into the verdict (the full text at debug and in the JSON log), and on a
terminal one updating progress line. The JSON log keeps every field."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pty
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import structlog

from r1sup.adapters import logs
from r1sup_proc import ROOT, kill_engine_processes, write_config
from test_tune_fake import QWEN_7B, fake_body, fake_env, fake_scenario

OLD = {
    "max_model_len": 131072,
    "gpu_memory_utilization": 0.9,
    "kv_cache_dtype": "auto",
    "enforce_eager": False,
}
NEW = {**OLD, "kv_cache_dtype": "fp8"}


def render(fmt: str, event: str, **fields: Any) -> str:
    out = io.StringIO()
    logs.configure(level="debug", fmt=fmt, stream=out)
    try:
        logs.get_logger().info(event, **fields)
    finally:
        structlog.reset_defaults()
    return out.getvalue()


def test_console_shows_the_change_only_and_integers_as_integers() -> None:
    line = render(
        "console", "search_step", attempt=1, old=OLD, new=NEW, reason="fp8 KV fits", evidence="x" * 50
    )
    assert "kv_cache_dtype auto -> fp8" in line
    assert "131072" not in line and "old=" not in line and "new=" not in line and "xxxx" not in line
    line = render("console", "engine_progress", phase="weights", percent=45.0, elapsed_s=72.0, eta_s=30.4,
                  after="starting", after_s=12.0, max_model_len=32768.0, weights_gib=27.54)  # fmt: skip
    assert "phase='loading weights 45%'" in line and "after='starting vLLM (0:12)'" in line
    assert "elapsed=1:12" in line and "eta=0:30" in line
    assert "max_model_len=32768 " in line + " " and "32768.0" not in line and "weights_gib=27.54" in line
    line = render("console", "launch_started", attempt=2, flags=NEW, command=["python", "-m", "vllm"])
    assert "flags='ctx=131072 util=0.9 kv=fp8'" in line and "command" not in line


def test_json_keeps_every_field_as_logged() -> None:
    data = json.loads(
        render("json", "search_step", attempt=1, old=OLD, new=NEW, numbers={"max_model_len": 1.0})
    )
    assert data["old"] == OLD and data["new"] == NEW and data["numbers"] == {"max_model_len": 1.0}


def tune(tmp: Path, *cli: str, tty: bool = False) -> tuple[int, str, str]:
    """``r1sup tune`` on the fake engine: a context beyond the KV budget, then fp8 KV (two launches)."""
    tmp.mkdir(parents=True, exist_ok=True)
    body = fake_body(tmp, model=QWEN_7B, start={"max_model_len": 131072})
    config = write_config(tmp / "r1sup.toml", body)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **fake_env(fake_scenario(tmp))}
    argv = [sys.executable, "-m", "r1sup.cli.app", *cli, "tune", "--config", str(config)]
    try:
        if not tty:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=150, env=env, cwd=ROOT)
            return done.returncode, done.stdout, done.stderr
        master, slave = pty.openpty()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL, env=env,
                                cwd=ROOT)  # fmt: skip
        os.close(slave)
        chunks: list[bytes] = []

        def pump() -> None:
            while True:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the other end closed
                    return
                if not data:
                    return
                chunks.append(data)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            out, _ = proc.communicate(timeout=150)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        reader.join(timeout=10)
        os.close(master)
        return proc.returncode, out.decode(), b"".join(chunks).decode("utf-8", "replace")
    finally:
        kill_engine_processes(config)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_recovered_failure_reads_as_one_verdict(tmp_path: Path) -> None:
    code, _, err = tune(tmp_path / "console", "--log-format", "console")
    assert code == 0, err[-3000:]
    lines = err.splitlines()
    # vLLM's traceback is not on the console: the verdict names the root cause and where it was
    assert not any("Traceback" in line or 'File "' in line for line in lines), err[-3000:]
    verdict = next(line for line in lines if "failure_classified" in line)
    assert "failure_class=kv_insufficient" in verdict
    assert "estimated maximum model length is" in verdict  # the root-cause line
    assert re.search(r"detail='EngineCore\S* pid \d+, line \d+'", verdict), verdict  # where it was
    assert "vllm_error_lines=" in verdict
    assert sum("error" in line.split("]")[0] for line in lines) == 1  # the verdict, and nothing else
    step = next(line for line in lines if "search_step" in line)
    # the change as one readable text (which lever depends on the search), never the old/new dicts
    assert re.search(r"change='[a-z_]+ \S+ -> \S+", step) and "old=" not in step, step
    assert not re.search(r"=\d+\.0\b", err), re.search(r".{60}=\d+\.0\b.{20}", err)

    # the full traceback at debug
    code, _, err = tune(tmp_path / "debug", "--log-format", "console", "--log-level", "debug")
    assert code == 0 and "Traceback (most recent call last)" in err

    # the JSON log keeps vLLM's error lines at error, and each progress step once
    code, _, err = tune(tmp_path / "json", "--log-format", "json")
    assert code == 0
    events = [json.loads(line) for line in err.splitlines()]
    vllm_errors = [e for e in events if e["event"] == "vllm" and e["level"] == "error"]
    assert any("ValueError" in e["text"] for e in vllm_errors)
    for launch in (1, 2):
        steps = [
            (e["phase"], e.get("percent"))
            for e in events
            if e["event"] == "engine_progress" and e["launch"] == launch
        ]
        assert steps and len(steps) == len(set(steps)), steps


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_terminal_gets_one_updating_progress_line(tmp_path: Path) -> None:
    code, out, term = tune(tmp_path, "--log-format", "console", tty=True)
    assert code == 0, term[-3000:]
    assert "found a working configuration" in out  # the report on stdout, not on the terminal line
    assert "\r\x1b[2Kattempt 2: loading weights" in term  # rewritten in place
    assert re.search(r"\r\x1b\[2Kattempt 2: loading weights \d+%, 0:\d\d elapsed", term)
    # the percent moves on the line, not as log lines; a phase change is a log line
    logged = [line for line in term.replace("\r", "\n").splitlines() if "engine_progress" in line]
    assert logged and not any(re.search(r"phase=\S*'loading weights \d+%'", line) for line in logged)
    # the line is cleared once the launch is over: no progress text is left after the last clear
    assert not term.rsplit("\x1b[2K", 1)[1].startswith("attempt")


# --- --help: each command lists the exit codes it can return ---------------------------------------

HELP_EXIT_CODES = {
    "": {0, 1, 2, 3, 4, 5, 6, 7, 8, 129, 130, 143},
    "run": {0, 1, 2, 3, 4, 5},
    "tune": {0, 1, 2, 3, 4, 129, 130, 143},
    "plan": {0, 1, 2, 3, 7},
    "diagnose": {0, 1, 2, 6},
    "status": {0, 1, 2},
    "report": {0, 1, 2},
    "check": {0, 1, 2, 4},
    "profile": {0, 1, 2, 8},
    "profile export": {0, 1, 2},
    "profile import": {0, 1, 2},
    "profile gate": {0, 1, 2, 8},
    "tiny-model": {0, 1, 2},
    "worker": {0, 1, 2},
}


def help_exit_codes(argv: list[str]) -> list[int]:
    """The codes listed under ``exit codes`` in ``r1sup ARGV --help``, in order."""
    from r1sup.cli import app as cli

    out = io.StringIO()
    parser = cli.build_parser()
    code = None
    try:
        with contextlib.redirect_stdout(out):
            parser.parse_args([*argv, "--help"])
    except SystemExit as exc:
        code = exc.code
    assert code == 0
    text = out.getvalue()
    epilog = text[text.index("\nexit codes") :]
    return [int(m.group(1)) for m in re.finditer(r"^  (\d+) +\S", epilog, re.MULTILINE)]


@pytest.mark.parametrize("command", sorted(HELP_EXIT_CODES))
def test_help_lists_only_the_exit_codes_the_command_returns(command: str) -> None:
    codes = help_exit_codes(command.split())
    assert len(codes) == len(set(codes)), codes
    assert set(codes) == HELP_EXIT_CODES[command]


def test_top_level_exit_codes_are_errors_py_and_the_plan_verdicts_and_the_readme() -> None:
    from r1sup.core import errors, planner

    defined = {v for k, v in vars(errors).items() if k.startswith("EXIT_") and isinstance(v, int)}
    defined |= set(planner.VERDICTS.values())
    assert set(help_exit_codes([])) == defined
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Exit codes") :]
    table = table[: table.index("\n## ", 1)]
    documented = {
        int(c) for row in re.findall(r"^\| ([\d /]+) \|", table, re.MULTILINE) for c in row.split("/")
    }
    assert documented == defined
