"""CLI start-up: median wall time of ``r1sup --help`` and ``r1sup status`` against ``python -c pass``.

Targets: ``r1sup --help`` at most 10x the bare interpreter (issue: foundation), ``r1sup status`` at
most 5x (issue 36: it was 10.1x). Runs each command N times, interleaved, in fresh processes, and
prints the medians side by side. Exit 1 if a target is missed. ``--before DIR``: also ``r1sup status``
of another source tree (a checkout's ``supervisor`` directory, e.g. of the previous commit), the row
``r1sup status (before)``, measured interleaved with the rest so that both see the same machine.

    python benchmarks/bench_cli_startup.py [--runs 21] [--before OTHER/supervisor]
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
TARGETS = {"r1sup --help": TARGET_RATIO, "r1sup status": 5.0}  # x the bare interpreter


def timed(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=False, timeout=60
    )
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--before", metavar="DIR", help="another source tree's supervisor directory")
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
    envs = dict.fromkeys(commands, env)
    if args.before:
        name = "r1sup status (before)"
        commands[name] = [sys.executable, "-m", "r1sup", "status", "--state-dir", state]
        envs[name] = {**env, "PYTHONPATH": str(Path(args.before).resolve())}
    for name, cmd in commands.items():  # warm the bytecode caches
        timed(cmd, envs[name])
    samples: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.runs):
        for name, cmd in commands.items():
            samples[name].append(timed(cmd, envs[name]))
    base = statistics.median(samples["python -c pass"])
    print(f"{'command':<22} {'median ms':>10} {'ratio':>7} {'target':>7}")
    ok = True
    for name, values in samples.items():
        median = statistics.median(values)
        ratio = median / base
        goal = TARGETS.get(name)
        target = "" if goal is None else f"<= {goal:g}x"
        print(f"{name:<22} {median * 1000:>10.1f} {ratio:>6.1f}x {target:>7}")
        if goal is not None and ratio > goal:
            ok = False
    shutil.rmtree(state, ignore_errors=True)
    print("result:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
