"""``r1sup diagnose [--json] FILE|-``: explain a vLLM log.

Prints the failure class, the phase, the evidence line and its line number, the numbers and what
r1sup would change next. The input is read as bytes in bounded chunks and decoded with replacement,
and the reader caps the length of a line, so a huge, binary or truncated file gives a verdict in
bounded memory. Exit status 0 when the input is a vLLM log (whatever the class), 6 when no line of it
is vLLM output (empty, binary, another program's text), 2 when it cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import IO, Any

from r1sup.core.advice import advise
from r1sup.core.errors import InputError, NotAVllmLog
from r1sup.core.failure import NONE, Failure
from r1sup.core.logparse import Diagnosis, LogReader

# Small enough that a chunk and the lines split from it stay in the CPU cache (a 1 MiB chunk of text
# with any non-ASCII character decodes to 2-4 MiB, and reading a large log took half as long again).
CHUNK_BYTES = 1 << 16

# failure numbers first, then the success path, then anything else in sorted order
_KEY_ORDER = (
    "max_model_len",
    "estimated_max_model_len",
    "kv_capacity_tokens",
    "kv_needed_gib",
    "kv_available_gib",
    "free_gib",
    "total_gib",
    "requested_gib",
    "gpu_memory_utilization",
    "tried_to_allocate_mib",
    "device_free_mib",
    "device_total_gib",
    "weights_gib",
    "kv_cache_gib",
    "kv_cache_tokens",
    "max_concurrency",
    "cudagraph_gib",
    "peak_activation_gib",
)


def read_chunks(stream: IO[bytes], chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The stream's bytes in chunks of at most ``chunk_bytes``."""
    while True:
        chunk = stream.read(chunk_bytes)
        if not chunk:
            return
        yield chunk


def diagnose_stream(stream: IO[bytes], exit_code: int | None = None) -> tuple[Diagnosis, str]:
    """Read a whole log from a binary stream; return the diagnosis and what r1sup's search would do."""
    reader = LogReader()
    reader.feed_chunks(read_chunks(stream))
    diagnosis = reader.diagnose(exit_code)
    advice = advise(
        diagnosis.failure,
        reader.engine_args,
        reader.engine_version,
        reader.engine_device,
        reader.figures,
    )
    return diagnosis, advice


def diagnose_path(path: str, exit_code: int | None = None) -> tuple[Diagnosis, str]:
    """Like :func:`diagnose_stream` for a file name, ``-`` meaning standard input."""
    try:
        if path == "-":
            return diagnose_stream(sys.stdin.buffer, exit_code)
        with open(path, "rb") as stream:
            return diagnose_stream(stream, exit_code)
    except OSError as exc:
        reason = exc.strerror or exc.__class__.__name__
        raise InputError(f"cannot read {path}: {reason}") from exc


def not_a_log_reason(diagnosis: Diagnosis) -> str:
    """Why the input is not a vLLM log, in one line."""
    if diagnosis.lines == 0:
        return "it is empty"
    plural = "" if diagnosis.lines == 1 else "s"
    return f"none of its {diagnosis.lines} line{plural} is vLLM output"


def report(diagnosis: Diagnosis, advice: str) -> dict[str, Any]:
    """The ``--json`` object (``advice``: what r1sup's search would do next, see advice.advise)."""
    # another program's output (a training script's OOM, SGLang, TGI): no vLLM failure class either
    failure = diagnosis.failure if diagnosis.vllm_log else Failure(NONE)
    return {
        "vllm_log": diagnosis.vllm_log,
        "class": failure.cls,
        "phase": failure.phase,
        "memory": failure.memory,
        "line": diagnosis.line if diagnosis.vllm_log else None,
        "evidence": failure.evidence,
        "numbers": failure.numbers.to_dict(),
        "advice": advice if diagnosis.vllm_log else f"Not a vLLM log: {not_a_log_reason(diagnosis)}.",
    }


def _printable(text: str) -> str:
    return "".join(ch if ch.isprintable() or ch == "\t" else "?" for ch in text)


def _number(value: float) -> str:
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:g}"


def render(failure: Failure, advice: str, line: int | None = None) -> str:
    """The human report."""
    kind = "memory" if failure.memory else "not memory"
    lines = [
        f"class     {failure.cls} ({kind})",
        f"phase     {failure.phase}",
        f"evidence  {_printable(failure.evidence) or '(none)'}",
    ]
    if line is not None:
        lines.append(f"line      {line}")
    if failure.detail:
        lines.append(f"where     {_printable(failure.detail)}")
    numbers = failure.numbers.to_dict()
    keys = [k for k in _KEY_ORDER if k in numbers] + sorted(k for k in numbers if k not in _KEY_ORDER)
    if keys:
        width = max(len(k) for k in keys)
        lines.append("numbers")
        lines.extend(f"  {k:<{width}}  {_number(numbers[k])}" for k in keys)
    else:
        lines.append("numbers   (none)")
    lines.append(f"next      {advice}")
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    diagnosis, advice = diagnose_path(args.file)
    if args.json:
        sys.stdout.write(json.dumps(report(diagnosis, advice), indent=2) + "\n")
    elif diagnosis.vllm_log:
        sys.stdout.write(render(diagnosis.failure, advice, diagnosis.line))
    if not diagnosis.vllm_log:
        name = "standard input" if args.file == "-" else args.file
        raise NotAVllmLog(f"{name} is not a vLLM log: {not_a_log_reason(diagnosis)}")
    return 0
