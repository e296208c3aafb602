"""CLI start-up: median wall time of ``r1sup --help`` and ``r1sup status`` against ``python -c pass``.

Target (issue: foundation): each at most 10x the bare interpreter. Runs each command N times,
interleaved, in fresh processes, and prints the medians side by side. Exit 1 if a target is missed.

    python benchmarks/bench_cli_startup.py [--runs 21]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_RATIO = 10.0


def timed(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=False, timeout=60
    )
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args(argv)
    r1sup = shutil.which("r1sup", path=str(Path(sys.executable).parent)) or shutil.which("r1sup")
    if r1sup is None:
        print("r1sup is not installed next to this interpreter", file=sys.stderr)
        return 2
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    state = tempfile.mkdtemp(prefix="r1sup-bench-")
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "r1sup --help": [r1sup, "--help"],
        "r1sup status": [r1sup, "status", "--state-dir", state],
    }
    for cmd in commands.values():  # warm the bytecode caches
        timed(cmd, env)
    samples: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.runs):
        for name, cmd in commands.items():
            samples[name].append(timed(cmd, env))
    base = statistics.median(samples["python -c pass"])
    print(f"{'command':<16} {'median ms':>10} {'ratio':>7} {'target':>7}")
    ok = True
    for name, values in samples.items():
        median = statistics.median(values)
        ratio = median / base
        target = "" if name == "python -c pass" else f"<= {TARGET_RATIO:g}x"
        print(f"{name:<16} {median * 1000:>10.1f} {ratio:>6.1f}x {target:>7}")
        if name != "python -c pass" and ratio > TARGET_RATIO:
            ok = False
    shutil.rmtree(state, ignore_errors=True)
    print("result:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
