"""The normaliser on pasted logs (issue 24): what is not vLLM's is stripped (launchers, log collectors,
Markdown), what a terminal cut is joined; the verdict is the one of the clean log."""

from __future__ import annotations

import pytest

from r1sup.core import failure as fl
from r1sup.core.logparse import LogReader, diagnose_text, parse_line

OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
    "23.57 GiB of which 1.06 GiB is free."
)
CLEAN = [
    "(EngineCore_DP0 pid=83) INFO 05-02 10:00:01 [gpu_model_runner.py:1329] Starting to load model /m...",
    "(EngineCore_DP0 pid=83) ERROR 05-02 10:00:09 [core.py:700] Traceback (most recent call last):",
    '(EngineCore_DP0 pid=83) ERROR 05-02 10:00:09 [core.py:700]   File "/v/vllm/v1/worker/gpu_worker.py", '
    "line 212, in load_model",
    "(EngineCore_DP0 pid=83) ERROR 05-02 10:00:09 [core.py:700]     self.model_runner.load_model()",
    f"(EngineCore_DP0 pid=83) ERROR 05-02 10:00:09 [core.py:700] {OOM}",
]

WRAPPERS = {
    "docker compose": "vllm-1  | {}",
    "kubectl --timestamps": "2025-05-02T10:00:09.123456789Z {}",
    "CRI log file": "2025-05-02T10:00:09.123456789Z stderr F {}",
    "journald short-iso": "2025-05-02T10:00:09+0000 gpu-box vllm[411]: {}",
    "journald short-precise": "May 02 10:00:09.123456 gpu-box vllm[411]: {}",
    "DJL Serving": "WARN  PyProcess W-299-model1-stderr: [1,0]<stderr>:{}",
    "FastChat": "2025-05-02 10:00:09 | ERROR | stderr | {}",
    "a launcher in another language": "[\u65e5\u5fd7] {}",
    "a node relay": "2025-05-02 10:00:09.278801 master-0 >> {}",
    "Markdown quote and list": "> - {}",
}


@pytest.mark.parametrize("wrapper", list(WRAPPERS), ids=list(WRAPPERS))
def test_a_wrapped_log_reads_as_the_clean_one(wrapper: str) -> None:
    expected = diagnose_text(CLEAN)[0]
    assert (expected.cls, expected.phase) == (fl.OOM_WEIGHTS, fl.PHASE_LOAD_WEIGHTS)
    wrapped = [WRAPPERS[wrapper].format(line) for line in CLEAN]
    got = diagnose_text(wrapped)[0]
    assert (got.cls, got.phase, got.evidence) == (expected.cls, expected.phase, expected.evidence)
    assert got.numbers == expected.numbers
    reader = LogReader()
    reader.feed_lines(wrapped)
    assert reader.diagnose().vllm_log


@pytest.mark.parametrize("wrapper", list(WRAPPERS), ids=list(WRAPPERS))
def test_the_wrapper_is_stripped_from_the_message(wrapper: str) -> None:
    line = parse_line(WRAPPERS[wrapper].format(CLEAN[-1]))
    assert line.text == OOM
    assert (line.process, line.pid, line.level) == ("EngineCore_DP0", 83, "ERROR")


def test_the_wrappers_own_level_is_not_vllms() -> None:
    # DJL logs its worker's stdout at INFO: a vLLM ERROR behind it stays an error, a bare line has no level
    assert parse_line("INFO  PyProcess W-1-stdout: [1,0]<stdout>:" + OOM).level is None
    assert parse_line("INFO  PyProcess W-1-stdout: ERROR 05-02 10:00:09 [core.py:7] x").level == "ERROR"


def test_a_message_wrapped_in_the_middle_of_a_word_is_joined() -> None:
    cut = 96  # a terminal's width, inside "capacity"
    lines = [*CLEAN[:-1], CLEAN[-1][:cut], CLEAN[-1][cut:]]
    assert lines[-1][:1].isalpha() and not lines[-1].startswith(" ")
    failure = diagnose_text(lines)[0]
    assert failure.cls == fl.OOM_WEIGHTS
    assert failure.numbers.tried_to_allocate_mib == 2048
    assert failure.numbers.device_total_gib == 23.57
