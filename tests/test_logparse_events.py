"""``diagnose`` on r1sup's own event log (issue 24): the relayed vLLM text is diagnosed, the launch's flags
are the engine's arguments, vLLM's line is the evidence."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import structlog

from r1sup.adapters import logs
from r1sup.cli import app as cli
from r1sup.cli.commands.diagnose import diagnose_stream
from r1sup.core import failure as fl
from r1sup.core.flags import EngineFlags
from r1sup.core.logparse import LogReader, parse_line
from r1sup.core.logparse.events import launched_flags, parse_event, relayed_line

FP8_FAIL = [
    "INFO 05-02 10:00:01 [gpu_model_runner.py:1329] Starting to load model /models/qwen...",
    "ERROR 05-02 10:00:30 [core.py:700] EngineCore failed to start.",
    "ERROR 05-02 10:00:30 [core.py:700] Traceback (most recent call last):",
    'ERROR 05-02 10:00:30 [core.py:700]   File "/v/vllm/v1/worker/gpu_model_runner.py", line 2012, in '
    "profile_run",
    "ERROR 05-02 10:00:30 [core.py:700] triton.compiler.errors.CompilationError: at 1:0: type fp8e4nv not "
    "supported in this architecture. The supported fp8 dtypes are ('fp8e4b15', 'fp8e5')",
]
OOM_FAIL = [
    "(EngineCore_DP0 pid=83) INFO 05-02 10:05:01 [gpu_model_runner.py:1329] Starting to load model /m...",
    "(EngineCore_DP0 pid=83) INFO 05-02 10:05:09 [gpu_model_runner.py:1347] Model loading took 14.25 GiB "
    "and 7.1 seconds",
    "(EngineCore_DP0 pid=83) ERROR 05-02 10:05:20 [core.py:700] torch.OutOfMemoryError: CUDA out of memory. "
    "Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 23.57 GiB of which 1.02 GiB is free. "
    "Including non-PyTorch memory, this process has 22.53 GiB memory in use.",
]


def journal(launches: list[tuple[EngineFlags, list[str]]]) -> str:
    """r1sup's JSON log of these launches, rendered by r1sup's own logging as ``journalctl -o cat`` shows
    it: each vLLM line relayed the way the runner relays it (its tag and stamp parsed off)."""
    out = io.StringIO()
    logs.configure(level="info", fmt="json", stream=out)
    try:
        log = structlog.get_logger("r1sup")
        for attempt, (flags, lines) in enumerate(launches, 1):
            log.info("launch_started", attempt=attempt, launch=attempt, flags=flags.to_dict(), command=[])
            log.info("child_started", attempt=attempt, pid=1000 + attempt)
            for raw in lines:
                item = parse_line(raw)
                log.info(
                    "vllm",
                    source="vllm",
                    proc=item.process,
                    rank=item.rank,
                    pid=item.pid,
                    vllm_level=item.level,
                    text=item.text,
                )
            log.error("failure_classified", attempt=attempt, failure_class="x", evidence="a JSON line")
    finally:
        logs.configure(level="info", fmt="json", stream=io.StringIO())
    return out.getvalue()


E5M2 = EngineFlags(kv_cache_dtype="fp8_e5m2", gpu_memory_utilization=0.84, max_model_len=32768)


def test_the_last_launch_is_diagnosed_with_its_flags() -> None:
    text = journal([(EngineFlags(kv_cache_dtype="fp8"), FP8_FAIL), (E5M2, OOM_FAIL)])
    reader = LogReader()
    reader.feed_lines(text.split("\n"))
    diagnosis = reader.diagnose()
    assert diagnosis.vllm_log
    assert diagnosis.failure.cls == fl.OOM_PROFILE  # after "Model loading took": the profile run
    assert diagnosis.failure.evidence.startswith("torch.OutOfMemoryError: CUDA out of memory.")
    assert diagnosis.failure.numbers.tried_to_allocate_mib == 1536
    assert reader.engine_args["kv_cache_dtype"] == "fp8_e5m2"
    assert reader.engine_args["gpu_memory_utilization"] == 0.84
    lines = text.split("\n")
    assert diagnosis.line is not None
    assert json.loads(lines[diagnosis.line - 1])["event"] == "vllm"  # the relayed line's place in the journal


def test_advice_starts_from_the_launched_flags() -> None:
    text = journal([(E5M2, OOM_FAIL)])
    diagnosis, advice = diagnose_stream(io.BytesIO(text.encode()))
    assert diagnosis.failure.cls == fl.OOM_PROFILE
    assert "0.84" in advice  # the utilization the launch ran, not vLLM's default 0.9
    assert "fp8 " not in advice.replace("fp8_e5m2", "")


def test_an_fp8_failure_of_the_journal_is_read_from_vllms_text() -> None:
    text = journal([(EngineFlags(kv_cache_dtype="fp8", gpu_memory_utilization=0.84), FP8_FAIL)])
    diagnosis, advice = diagnose_stream(io.BytesIO(text.encode()))
    assert diagnosis.failure.cls == fl.FP8_UNSUPPORTED
    assert "fp8e4nv" in diagnosis.failure.evidence and '"event"' not in diagnosis.failure.evidence
    assert "fp8_e5m2" in advice


def test_journal_on_stdin_of_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "journal.json"
    path.write_text(journal([(E5M2, OOM_FAIL)]), encoding="utf-8")
    assert cli.main(["diagnose", "--json", str(path)]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert (obj["vllm_log"], obj["class"]) == (True, fl.OOM_PROFILE)
    assert not obj["evidence"].startswith("{")


def test_journald_json_export_and_syslog_heads() -> None:
    inner = json.dumps(
        {"event": "vllm", "vllm_level": "ERROR", "proc": "EngineCore_DP0", "pid": 7, "text": "x"}
    )
    assert parse_event(json.dumps({"__CURSOR": "s=1", "MESSAGE": inner}))["text"] == "x"  # type: ignore[index]
    assert parse_event(f"May 02 10:00:01 gpu-box r1sup[411]: {inner}")["pid"] == 7  # type: ignore[index]
    assert (
        relayed_line(parse_event(inner) or {})
        == "(EngineCore_DP0 pid=7) ERROR 01-01 00:00:00 [r1sup_relay.py:0] x"
    )
    assert parse_event("not json {") is None
    assert parse_event('{"no": "event"}') is None
    assert launched_flags({"event": "launch_started", "flags": {"max_num_seqs": 8, "bad": [1]}}) == {
        "max_num_seqs": 8
    }


def test_r1sups_events_alone_are_not_vllm_output() -> None:
    text = journal([(E5M2, [])])
    reader = LogReader()
    reader.feed_lines(text.split("\n"))
    assert not reader.diagnose().vllm_log
