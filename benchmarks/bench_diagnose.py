"""Time ``r1sup diagnose`` on a realistic 400k-line vLLM log against a bare one-regex loop.

The log (written to a temporary directory) is what a long-running server leaves behind: a start-up
with its progress lines, then hours of serving (metrics every few seconds, access-log lines, some
warnings, per-request error tracebacks) and an out-of-memory crash at the end. Both sides read the
same file from disk:

* baseline: ``for line in open(path): if rx.search(line)`` with one compiled regex;
* diagnose: the function ``r1sup diagnose`` runs (bounded chunks, decoding, the streaming reader and
  the verdict), checked to find the crash.

Each side runs ``--repeat`` times (alternating) and the best time counts. Exit status 1 when
diagnose takes more than ``--max-ratio`` (3) times the baseline.

    python benchmarks/bench_diagnose.py [--lines 400000] [--repeat 5] [--max-ratio 3]
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import tempfile
import time
from pathlib import Path

from r1sup.commands.diagnose import diagnose_path

BASELINE_RE = re.compile(r"Error|Traceback|out of memory")

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "logs" / "gpu"


def _fixture_lines(name: str, first: str, last: str | None = None) -> list[str]:
    """The lines of a test fixture from the one containing ``first`` to the one containing ``last``."""
    lines = (FIXTURES / name).read_text(encoding="utf-8").split("\n")
    start = next(i for i, line in enumerate(lines) if first in line)
    end = next(i for i, line in enumerate(lines) if last in line) if last else len(lines) - 1
    return lines[start : end + 1]


def write_log(path: Path, n_lines: int, seed: int = 7) -> int:
    """Write a realistic serving log of about ``n_lines`` lines; return the number written."""
    rng = random.Random(seed)
    startup = _fixture_lines("success-v1-full.log", "version", "Application startup complete")
    request_error = _fixture_lines(
        "request-too-long-serving.log", "Error in preprocessing", "400 Bad Request"
    )
    crash = _fixture_lines("oom-runtime-v1.log", "EngineDeadError", "Finished server process")
    out: list[str] = list(startup)
    second = 0
    while len(out) < n_lines - len(crash):
        second += 1
        ts = f"06-02 {9 + second // 3600 % 14:02d}:{second // 60 % 60:02d}:{second % 60:02d}"
        roll = rng.random()
        if roll < 0.40:
            ip = f"10.0.{rng.randrange(256)}.{rng.randrange(256)}:{rng.randrange(30000, 60000)}"
            out.append(f'INFO:     {ip} - "POST /v1/chat/completions HTTP/1.1" 200 OK')
        elif roll < 0.70:
            out.append(
                f"(APIServer pid=1) INFO {ts} [loggers.py:236] Engine 000: "
                f"Avg prompt throughput: {rng.uniform(0, 5000):.1f} tokens/s, "
                f"Avg generation throughput: {rng.uniform(0, 900):.1f} tokens/s, "
                f"Running: {rng.randrange(64)} reqs, Waiting: {rng.randrange(8)} reqs, "
                f"GPU KV cache usage: {rng.uniform(0, 100):.1f}%, Prefix cache hit "
                f"rate: {rng.uniform(0, 60):.1f}%"
            )
        elif roll < 0.85:
            out.append(
                f"(APIServer pid=1) INFO {ts} [logger.py:43] Received request "
                f"chatcmpl-{rng.getrandbits(64):016x}: "
                f"params: SamplingParams(n=1, temperature=0.7, top_p=0.95, "
                f"max_tokens={rng.randrange(16, 4096)}), "
                "prompt_token_ids: None, lora_request: None."
            )
        elif roll < 0.95:
            request = f"chatcmpl-{rng.getrandbits(64):016x}"
            out.append(f"(APIServer pid=1) INFO {ts} [async_llm.py:420] Added request {request}.")
        elif roll < 0.997:
            out.append(
                f"(EngineCore_DP0 pid=212) WARNING {ts} [scheduler.py:1620] Request "
                f"chatcmpl-{rng.getrandbits(48):012x} was preempted: not enough free KV cache blocks."
            )
        else:
            out.extend(request_error)
    out.extend(crash)
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return len(out)


def baseline(path: Path) -> int:
    hits = 0
    search = BASELINE_RE.search
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if search(line):
                hits += 1
    return hits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lines", type=int, default=400_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--max-ratio", type=float, default=3.0)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="r1sup-bench-") as tmp:
        path = Path(tmp) / "vllm.log"
        written = write_log(path, args.lines)
        size_mib = path.stat().st_size / 2**20
        best_base = best_diag = float("inf")
        failure = None
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            baseline(path)
            t1 = time.perf_counter()
            failure, _ = diagnose_path(str(path))
            t2 = time.perf_counter()
            best_base = min(best_base, t1 - t0)
            best_diag = min(best_diag, t2 - t1)
    assert failure is not None
    ratio = best_diag / best_base
    print(f"log: {written} lines, {size_mib:.1f} MiB (best of {args.repeat})")
    print(
        f"{'baseline (one regex per line)':<32} {best_base * 1000:8.1f} ms  {best_base / written * 1e6:6.2f} "
        f"us/line"
    )
    print(f"{'r1sup diagnose':<32} {best_diag * 1000:8.1f} ms  {best_diag / written * 1e6:6.2f} us/line")
    print(f"ratio {ratio:.2f}x (limit {args.max_ratio:.1f}x); verdict: {failure.cls} ({failure.phase})")
    if failure.cls != "oom_runtime":
        print("FAIL: diagnose did not find the crash at the end of the log", file=sys.stderr)
        return 1
    if ratio > args.max_ratio:
        print("FAIL: diagnose is too slow", file=sys.stderr)
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
