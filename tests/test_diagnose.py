"""``r1sup diagnose``: output, exit codes, hostile input (in-process and as a process), the real engine."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from r1sup.cli import app as cli
from r1sup.cli.commands.diagnose import diagnose_path, render, report
from r1sup.core import failure as fl
from r1sup.core.advice import advise
from r1sup.core.logparse import LogReader, diagnose_text, lines_from_chunks

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
ROOT = Path(__file__).resolve().parent.parent
JSON_KEYS = {"vllm_log", "class", "phase", "memory", "line", "numbers", "evidence", "advice"}


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def run_process(
    args: list[str], stdin: bytes = b"", timeout: float = 60
) -> subprocess.CompletedProcess[bytes]:
    """``r1sup diagnose`` as a real child process (no shell), bounded by ``timeout``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "supervisor"))
    return subprocess.run(
        [sys.executable, "-m", "r1sup.cli.app", "diagnose", *args],
        input=stdin,
        capture_output=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def test_human_report(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["diagnose", str(FIXTURES / "cpu/kv-insufficient.log")], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "class     kv_insufficient (memory)"
    assert lines[1] == "phase     kv_cache"
    assert lines[2].startswith(
        "evidence  ValueError: To serve at least one request with the model's max seq len (32768)"
    )
    assert "  estimated_max_model_len  3712" in lines
    assert "  max_model_len            32768" in lines
    # the ladder's own decision: vLLM's estimate, the KV size pinned by the log's --kv-cache-memory-bytes
    assert lines[-1].startswith("next      r1sup would relaunch with max_model_len 32768 -> 3712")
    assert "--kv-cache-memory-bytes 4000000" in lines[-1]


def test_json_report(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["diagnose", "--json", str(FIXTURES / "gpu/oom-cudagraph-v1-tp2.log")], capsys)
    assert code == 0
    obj = json.loads(out)
    assert set(obj) == JSON_KEYS
    assert obj["class"] == fl.OOM_CUDAGRAPH
    assert obj["phase"] == fl.PHASE_CUDA_GRAPH
    assert obj["memory"] is True
    assert obj["evidence"] == "RuntimeError: CUDA error: out of memory"
    assert obj["numbers"]["kv_cache_tokens"] == 482112
    assert "--enforce-eager" in obj["advice"]


@pytest.mark.parametrize("path", sorted(str(p.relative_to(FIXTURES)) for p in FIXTURES.glob("*/*.log")))
def test_json_matches_the_reader_for_every_fixture(path: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["diagnose", "--json", str(FIXTURES / path)], capsys)
    # docker's own error before vLLM ever ran is read, but it is no line of vLLM output: exit 6
    vllm_output = path != "gpu/port-in-use-docker-allocated.log"
    assert code == (0 if vllm_output else 6)
    reader = LogReader()
    reader.feed_lines(lines_from_chunks([(FIXTURES / path).read_bytes()]))
    diagnosis = reader.diagnose()
    assert json.loads(out) == report(diagnosis, diagnose_path(str(FIXTURES / path))[1])
    assert diagnosis.vllm_log == vllm_output
    assert diagnosis.failure == diagnose_text(lines_from_chunks([(FIXTURES / path).read_bytes()]))[0]


# fixture -> what the ladder does with it, as the advice says it
LADDER_ADVICE = [
    ("gpu/oom-cudagraph-v1-tp2.log", "r1sup would relaunch with enforce_eager false -> true"),
    ("gpu/oom-profile-sampler-v1.log", "max_num_seqs default -> 512"),  # the sampler ran 1024 requests
    ("gpu/oom-weights-v1.log", "r1sup would stop (exit 3): the weights alone do not fit"),
    ("gpu/free-mem-below-util-gpu.log", "r1sup would stop (exit 3): only 7.34 of 139.72 GiB is free"),
    ("gpu/port-in-use-uvicorn-ci.log", "r1sup would stop (exit 4): the port is taken"),
    ("gpu/success-v1-full.log", "Nothing failed"),
]


@pytest.mark.parametrize(("path", "needle"), LADDER_ADVICE)
def test_advice_is_the_ladders_decision(path: str, needle: str) -> None:
    _, advice = diagnose_path(str(FIXTURES / path))
    assert needle in advice


@pytest.mark.parametrize("cls", sorted(fl.ALL_CLASSES))
def test_advice_for_every_class_without_figures(cls: str) -> None:
    text = advise(fl.Failure(cls))
    assert len(text) > 30 and "\n" not in text
    assert text.startswith(("r1sup would", "Nothing failed"))


def test_advice_never_promises_a_change_the_ladder_gives_up_on() -> None:
    # a context below [search] min_max_model_len: the ladder stops, so the advice says so (the old text
    # promised "set --max-model-len to 1024")
    failure = fl.Failure(
        fl.KV_INSUFFICIENT,
        fl.PHASE_KV_CACHE,
        "ValueError: To serve at least one request ...",
        fl.Numbers.from_dict(
            {"max_model_len": 32768.0, "estimated_max_model_len": 1024.0, "kv_available_gib": 0.1}
        ),
    )
    text = advise(failure, {"max_model_len": 32768, "kv_cache_memory_bytes": 100_000_000})
    assert text.startswith("r1sup would stop (exit 3)") and "1024" in text


@pytest.mark.parametrize(("target", "reason"), [("missing.log", "No such file"), (".", "Is a directory")])
def test_unreadable_input_exits_2(
    tmp_path: Path, target: str, reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(["diagnose", str(tmp_path / target)], capsys)
    assert code == 2
    assert out == ""
    assert err.startswith("r1sup: error: cannot read") and reason in err


def test_render_numbers_and_empty_verdict() -> None:
    text = render(fl.Failure(fl.NONE), "nothing")
    assert "class     none (not memory)" in text and "numbers   (none)" in text and "evidence  (none)" in text
    assert text.endswith("next      nothing\n")
    text = render(
        fl.Failure(
            fl.OOM_RUNTIME, phase=fl.PHASE_SERVING, evidence="bell\x07", numbers=fl.Numbers(host_used_gb=1.5)
        ),
        "-",
    )
    assert "evidence  bell?" in text and "  host_used_gb  1.5" in text


# --------------------------------------------------------------------------------------------
# Input that is not a vLLM log: said so, exit 6 (a vLLM log without a failure is "none", exit 0)

NOT_A_LOG = [
    ("empty", b"", "it is empty"),
    (
        # issue 36: a training script's OOM (torch's message, its traceback never in vLLM) is no vLLM failure
        "a training script's OOM",
        b"Traceback (most recent call last):\n"
        b'  File "train.py", line 228, in main\n    loss.backward()\n'
        b'  File "/usr/lib/python3/site-packages/torch/_tensor.py", line 118, in backward\n'
        b"    torch.autograd.backward(self, gradient, retain_graph, create_graph)\n"
        b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 86.00 MiB\n",
        "none of its 6 lines is vLLM output",
    ),
    ("random bytes", bytes(random.Random(6).randrange(256) for _ in range(4096)), "is vLLM output"),
    ("hello world", b"hello world\n", "none of its 1 line is vLLM output"),
    ("carriage returns only", b"\r\r\r\n\r\n", "none of its 2 lines is vLLM output"),
    (
        "another program's log",
        b"2024-05-01 10:00:00 INFO nginx started\n[notice] 1#1: start worker processes\nGET / 200\n",
        "none of its 3 lines is vLLM output",
    ),
]


@pytest.mark.parametrize(("what", "data", "reason"), NOT_A_LOG, ids=[n[0] for n in NOT_A_LOG])
def test_not_a_vllm_log_exits_6(
    what: str, data: bytes, reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "input.log"
    path.write_bytes(data)
    code, out, err = run_cli(["diagnose", str(path)], capsys)
    assert (code, out) == (6, "")
    assert err.startswith(f"r1sup: error: {path} is not a vLLM log: ") and reason in err
    assert err.count("\n") == 1
    code, out, err = run_cli(["diagnose", "--json", str(path)], capsys)
    obj = json.loads(out)
    assert code == 6 and set(obj) == JSON_KEYS
    assert (obj["vllm_log"], obj["class"], obj["line"]) == (False, fl.NONE, None)
    assert reason in obj["advice"] and reason in err


def test_dev_null_is_not_a_vllm_log(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["diagnose", os.devnull], capsys)
    assert (code, out) == (6, "")
    assert err == f"r1sup: error: {os.devnull} is not a vLLM log: it is empty\n"


def test_a_vllm_log_without_a_failure_says_none(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["diagnose", str(FIXTURES / "cpu/clean-startup-one-request.log")], capsys)
    assert (code, err) == (0, "")
    assert out.startswith("class     none (not memory)\n")
    code, out, _ = run_cli(
        ["diagnose", "--json", str(FIXTURES / "cpu/clean-startup-one-request.log")], capsys
    )
    obj = json.loads(out)
    assert (code, obj["vllm_log"], obj["class"]) == (0, True, fl.NONE)
    lines = (FIXTURES / "cpu/clean-startup-one-request.log").read_text(encoding="utf-8").split("\n")
    assert "Application startup complete" in lines[obj["line"] - 1]  # the evidence of a clean run


def test_one_quiet_vllm_line_is_a_vllm_log(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "one.log"
    path.write_bytes(
        b"(APIServer pid=1) INFO 01-01 00:00:00 [api_server.py:1] vLLM API server version 0.9.1\n"
    )
    code, out, _ = run_cli(["diagnose", "--json", str(path)], capsys)
    assert code == 0 and json.loads(out)["vllm_log"] is True


def test_help_lists_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["diagnose", "--help"], capsys)
    assert code == 0
    assert "exit codes:" in out and "  6    the input is not a vLLM log" in out


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("stdin", "reason"), [(b"", b"it is empty"), (b"hello world\n", b"none of its 1 line is vLLM output")]
)
def test_not_a_vllm_log_real_process(stdin: bytes, reason: bytes) -> None:
    done = run_process(["-"], stdin=stdin)
    assert done.returncode == 6
    assert done.stdout == b""
    assert done.stderr == b"r1sup: error: standard input is not a vLLM log: " + reason + b"\n"
    done = run_process([os.devnull])
    assert done.returncode == 6 and b"Traceback" not in done.stderr


# --------------------------------------------------------------------------------------------
# Hostile input (issue 9): a verdict or a clear error, never a traceback, bounded memory

HOSTILE = [
    (
        "invalid UTF-8",
        b"\xff\xfe\xfd\n\xc3\x28 (EngineCore pid=1) ERROR 01-01 00:00:00 [core.py:1] "
        b"ValueError: No available memory for the cache blocks.\n\x80\x81",
        fl.NO_KV_MEMORY,
    ),
    (
        "NUL bytes",
        b"\x00" * 1000
        + b"\nINFO 01-01 00:00:00 [gpu_model_runner.py:1] Starting to load model /m\nKilled\x00\n"
        + b"\x00" * 1000,
        fl.HOST_OOM,
    ),
    (
        "truncated traceback",
        b"(EngineCore pid=9) ERROR 01-01 00:00:00 [core.py:1] Traceback (most recent call last):\n"
        b"(EngineCore pid=9) ERROR 01-01 00:00:00 [core.py:1]   "
        b'File "/v/vllm/v1/worker/gpu_worker.py", line 9, in load_model\n'
        b"(EngineCore pid=9) ERROR 01-01 00:00:00 [core.py:1]     self.model_runner.load_mo",
        fl.ENGINE_DEAD,
    ),
]


@pytest.mark.parametrize(("what", "data", "cls"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_input_in_process(what: str, data: bytes, cls: str, tmp_path: Path) -> None:
    path = tmp_path / "input.log"
    path.write_bytes(data)
    assert diagnose_path(str(path))[0].failure.cls == cls


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("what", "data", "cls"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_input_on_stdin_of_a_real_process(what: str, data: bytes, cls: str) -> None:
    done = run_process(["--json", "-"], stdin=data)
    assert done.returncode == 0, done.stderr
    assert b"Traceback" not in done.stderr
    assert json.loads(done.stdout)["class"] == cls


def write_huge_line(path: Path, megabytes: int = 50) -> None:
    block = b"A" * (1 << 20)
    with path.open("wb") as f:
        f.write(b"(APIServer pid=1) INFO 01-01 00:00:00 [x.py:1] Starting\n")
        for _ in range(megabytes):
            f.write(block)  # one 50 MB line without a newline until the end
        f.write(
            b"\n(EngineCore pid=2) ERROR 01-01 00:00:01 [core.py:1] "
            b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. "
            b"GPU 0 has a total capacity of 23.56 GiB of which 1.75 MiB is free.\n"
        )


def test_fifty_megabyte_line_in_bounded_memory(tmp_path: Path) -> None:
    path = tmp_path / "huge.log"
    write_huge_line(path)
    tracemalloc.start()
    try:
        failure = diagnose_path(str(path))[0].failure
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert failure.cls == fl.OOM_WEIGHTS  # the line after the huge one is still read
    assert peak < 16 * 2**20, f"peak {peak / 2**20:.1f} MiB"


@pytest.mark.timeout(180)
def test_fifty_megabyte_line_real_process(tmp_path: Path) -> None:
    path = tmp_path / "huge.log"
    write_huge_line(path)
    done = run_process([str(path)], timeout=150)
    assert done.returncode == 0, done.stderr
    assert b"Traceback" not in done.stderr
    assert done.stdout.startswith(b"class     oom_weights (memory)")


@pytest.mark.timeout(60)
def test_unreadable_file_real_process(tmp_path: Path) -> None:
    done = run_process([str(tmp_path / "nope.log")])
    assert done.returncode == 2
    assert done.stderr.startswith(b"r1sup: error: cannot read") and b"Traceback" not in done.stderr


# --------------------------------------------------------------------------------------------
# Advice from the flags the log shows (issue 24)

V0_CONFIG = (
    "INFO 08-01 10:00:00 llm_engine.py:176] Initializing an LLM engine (v0.5.3.post1) with config: "
    "model='/models/llama-3-8b', speculative_config=None, tokenizer='/models/llama-3-8b', "
    "skip_tokenizer_init=False, tokenizer_mode=auto, revision=None, trust_remote_code=False, "
    "dtype=torch.bfloat16, max_seq_len=8192, download_dir=None, load_format=LoadFormat.AUTO, "
    "tensor_parallel_size=1, pipeline_parallel_size=1, disable_custom_all_reduce=False, quantization=None, "
    "enforce_eager=False, kv_cache_dtype={dtype}, quantization_param_path=None, device_config=cuda, "
    "decoding_config=DecodingConfig(guided_decoding_backend='outlines'), seed=0, served_model_name=llama"
)
FP8_ERROR = (
    "ERROR 08-01 10:01:10 async_llm_engine.py:56] triton.compiler.errors.CompilationError: at 1:0: "
    "fp8e4nv data type is not supported on CUDA arch < 89"
)


def test_fp8_advice_starts_from_the_config_lines_kv_dtype(tmp_path: Path) -> None:
    path = tmp_path / "ampere-fp8.log"
    path.write_text(V0_CONFIG.format(dtype="fp8") + "\n" + FP8_ERROR + "\n", encoding="utf-8")
    diagnosis, advice = diagnose_path(str(path))
    assert diagnosis.failure.cls == fl.FP8_UNSUPPORTED
    assert "kv_cache_dtype fp8 -> fp8_e5m2" in advice
    assert "set no fp8 flag" not in advice


def test_config_line_flags_are_the_engines_arguments() -> None:
    reader = LogReader()
    reader.feed_lines([V0_CONFIG.format(dtype="fp8_e5m2")])
    assert reader.engine_args == {
        "max_model_len": 8192,
        "tensor_parallel_size": 1,
        "enforce_eager": False,
        "kv_cache_dtype": "fp8_e5m2",
    }
    reader.feed_lines(["INFO 08-01 10:00:01 [arg_utils.py:1] non-default args: {'max_model_len': 4096}"])
    assert reader.engine_args["max_model_len"] == 4096  # vLLM's own list of what was given wins
