"""The strict test of vLLM output behind ``diagnose``'s exit 6 (issue 24): vLLM's formats count, keywords
in other text do not."""

from __future__ import annotations

from pathlib import Path

import pytest

from r1sup.cli import app as cli
from r1sup.core.logparse import LogReader

ROOT = Path(__file__).resolve().parent.parent

GPUSTACK = """\
2025-12-20 04:37:58.574746+08:00 - gpustack.worker.serve_manager - INFO - Provisioning model instance q-1
2025-12-20 04:37:58.574872+08:00 - gpustack.worker.backends.vllm - INFO - Starting vLLM model instance: q-1
2025-12-20 04:38:00.262558+08:00 - gpustack.worker.serve_manager - ERROR - Error provisioning model \
instance q-1 with backend vLLM: the process died unexpectedly
Traceback (most recent call last):
  File "/usr/local/lib/python3.11/dist-packages/gpustack/worker/serve_manager.py", line 422, in _serve
    server_ins.start()
  File "/usr/local/lib/python3.11/dist-packages/gpustack/worker/backends/vllm.py", line 51, in start
    self._handle_error(e)
"""
NOTE = "We tried to serve a 70B model with vLLM last night.\nIt crashed: the GPU ran out of memory.\n"
FASTAPI = """\
INFO:     Started server process [4242]
INFO:     Waiting for application startup.
INFO:     Application startup complete.
INFO:     Uvicorn running on http://0.0.0.0:8000 (Press CTRL+C to quit)
ERROR:    Exception in ASGI application
"""
TORCH_ONLY = "[rank0]:[E ProcessGroupNCCL.cpp:563] [Rank 0] Watchdog caught collective operation timeout\n"


def vllm_log(text: str) -> bool:
    reader = LogReader()
    reader.feed_lines(text.split("\n"))
    return reader.diagnose().vllm_log


@pytest.mark.parametrize(
    ("what", "text"),
    [
        ("a note that says out of memory", NOTE),
        ("another program's log naming vLLM", GPUSTACK),
        ("uvicorn alone", FASTAPI),
        ("torch's and NCCL's records alone", TORCH_ONLY),
        ("a Markdown table quoting vLLM", "| `fp8e4nv not supported` | fp8_unsupported |\n"),
        ("a quoted message in prose", 'The docs say "No available memory for the cache blocks" here.\n'),
        ("inline code in a list", "1. If KV is zero:\n   `No available memory for the cache blocks. ...`\n"),
    ],
)
def test_text_that_is_not_vllm_output(what: str, text: str) -> None:
    assert not vllm_log(text)


@pytest.mark.parametrize(
    ("what", "text"),
    [
        ("vLLM's stamp", "INFO 05-02 10:00:01 [gpu_model_runner.py:1329] Starting to load model /m"),
        ("an older stamp", "WARNING 10-17 09:57:35 config.py:341] Casting torch.bfloat16 to torch.float16."),
        ("a stamp with the pid", "2024-12-19 21:40:35 WARNING 56542 [model_runner_base.py:143] x"),
        ("a process tag", "(EngineCore_DP0 pid=83) hello"),
        ("a worker tag", "(VllmWorker rank=1 pid=291) RuntimeError: something"),
        ("a frame in vLLM", '  File "/usr/lib/python3/site-packages/vllm/v1/engine/core.py", line 9, in run'),
        ("vLLM's own message", "ValueError: No available memory for the cache blocks. Try increasing it."),
        ("vLLM's argument error", "api_server.py: error: argument --gpu-memory-utilization: invalid float"),
        (
            "an exception line naming a cause",
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB",
        ),
        (
            "a vllm exception class",
            "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
        ),
    ],
)
def test_vllm_output(what: str, text: str) -> None:
    assert vllm_log(text)


def test_a_death_notice_alone_in_prose_is_not_vllm_output() -> None:
    assert not vllm_log("the logs say the engine died unexpectedly\n")


@pytest.mark.parametrize("name", ["README.md", "CHANGELOG.md", "pyproject.toml"])
def test_the_projects_own_files_exit_6(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = ROOT / name
    if not path.is_file():
        pytest.skip(f"{name} is not in this checkout")
    code = cli.main(["diagnose", str(path)])
    out, err = capsys.readouterr()
    assert (code, out) == (6, "")
    assert "is not a vLLM log" in err


@pytest.mark.parametrize("text", [NOTE, GPUSTACK])
def test_not_vllm_text_exits_6(text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "paste.txt"
    path.write_text(text, encoding="utf-8")
    assert cli.main(["diagnose", str(path)]) == 6
    assert capsys.readouterr().out == ""
