"""A service level on the fake engine: ``r1sup tune`` with an ``[slo]`` against a sweep in the style of
vLLM's ``benchmarks/auto_tune`` on the same engine (issue 37).

The fake engine (tests/fakevllm) is given a latency model: a decode step takes 50 ms for one sequence
and 25 ms more for each other sequence running beside it, and at most ``max_num_seqs`` run at once (the
rest wait). One workload (16-token prompts, 4 output tokens), one service level (ITL p95, ``--itl-ms``),
everything on 127.0.0.1:

- ``r1sup tune [slo]``: ``r1sup tune --json`` with ``max_num_seqs`` 2 as given; its levels, and its one
  relaunch with ``max_num_seqs`` doubled when every level up to the flag met the target.
- ``sweep (auto_tune style)``: one launch of the fake engine per ``max_num_seqs`` of ``--grid``, each
  measured with one level at that many requests at once (r1sup's own level measurement, so both sides
  are timed alike); the best point meeting the service level wins. A launch that fails is not
  recovered (auto_tune's way).

Printed side by side: launches, failed launches left unrecovered, the highest concurrency meeting the
service level, its goodput (requests/s that met every target each) and wall time.

    python benchmarks/bench_slo_fake.py [--itl-ms 160] [--grid 2,4,8,16] [--json FILE]

Exit 0 when every step ran (whatever the figures show), 2 when a step could not run at all.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "supervisor"), str(ROOT / "tests")]

MODEL = "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
LATENCY = {"decode_tokens_per_s": 0.04, "step_s_per_batch_seq": 12.5}  # in simulated seconds
TIME_SCALE = 0.002  # 1 simulated second = 2 ms
PROMPT_TOKENS, OUTPUT_TOKENS, REQUESTS = 16, 4, 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scenario(work: Path) -> dict[str, Any]:
    return {
        "gpu": "RTX 4090",
        "time_scale": TIME_SCALE,
        "state_file": str(work / "engine.jsonl"),
        "runtime": LATENCY,
    }


def env_of(scene: dict[str, Any]) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT / "tests" / "fakenvml"), str(ROOT / "tests"), str(ROOT / "supervisor")])
    return {**os.environ, "PYTHONPATH": path, "FAKE_VLLM_SCENARIO": json.dumps(scene)}


def run_r1sup(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from r1sup_proc import write_config

    body: dict[str, dict[str, Any]] = {
        "model": {"name": MODEL, "served_name": "r1"},
        "server": {"launch": ["-m", "fakevllm"], "port": free_port(), "startup_timeout_s": 90},
        "start": {"max_model_len": 8192, "max_num_seqs": 2},
        "search": {"first_launch": "as_configured"},
        "probe": {"requests": 2, "output_tokens": 2, "max_concurrency": 1, "request_timeout_s": 30},
        "slo": {
            "itl_p95_s": args.itl_ms / 1000,
            "prompt_tokens": PROMPT_TOKENS,
            "output_tokens": OUTPUT_TOKENS,
            "requests_per_level": REQUESTS,
            "max_concurrency": max(args.grid),
            "budget_s": 120,
        },
        "state": {"dir": str(work / "state")},
    }
    config = write_config(work / "r1sup.toml", body)
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "r1sup", "tune", "--config", str(config), "--json"],
        env=env_of(scenario(work)),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    wall = time.monotonic() - t0
    result = json.loads(proc.stdout)
    found = result.get("slo") or {}
    best = next((lv for lv in found.get("levels", []) if lv["concurrency"] == found.get("concurrency")), None)
    failed = sum(1 for a in result.get("attempts", []) if a.get("outcome") != "ok")
    return {
        "name": "r1sup tune [slo]",
        "exit": proc.returncode,
        "launches": result.get("launches"),
        "failed_unrecovered": 0 if proc.returncode in (0, 3) else failed,
        "concurrency": found.get("concurrency"),
        "goodput": best["goodput"] if best else None,
        "wall_s": round(wall, 1),
        "note": (found.get("relaunch") or "no relaunch").split(" (")[0],
    }


def sweep_point(args: argparse.Namespace, work: Path, seqs: int) -> tuple[bool, Any]:
    """One auto_tune-style launch with ``max_num_seqs`` = ``seqs``, one level at ``seqs`` at once."""
    import httpx

    from r1sup.adapters import loadlevel
    from r1sup.core import slo as S

    port = free_port()
    argv = [sys.executable, "-m", "fakevllm", "--model", MODEL, "--served-model-name", "r1"]
    argv += ["--port", str(port), "--max-model-len", "8192", "--max-num-seqs", str(seqs)]
    log = open(work / f"sweep-{seqs}.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(argv, env=env_of(scenario(work)), stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False, f"exit {proc.returncode}"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            return False, "not ready in 90 s"
        slo = SimpleNamespace(
            prompt_tokens=PROMPT_TOKENS,
            prompt_tokens_max=None,
            output_tokens=OUTPUT_TOKENS,
            output_tokens_max=None,
        )
        ratio = loadlevel.words_per_token(base, "r1", None, 30)
        # measured as r1sup's levels are: the same request count a level, one warm-up request first
        requests = loadlevel.build_requests(slo, S.level_requests(seqs, REQUESTS), ratio, None)
        warmup = requests[: loadlevel.WARMUP_REQUESTS]
        spec = loadlevel.LevelSpec(base, "r1", seqs, requests, 30, 120, warmup=warmup)
        samples, duration = loadlevel.run_level(spec)
        return True, S.judge(seqs, samples, duration, S.Targets(itl_p95_s=args.itl_ms / 1000))
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def run_sweep(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    launches, failed, best = 0, 0, None
    for seqs in args.grid:
        launches += 1
        ok, level = sweep_point(args, work, seqs)
        if not ok:
            failed += 1
            continue
        if level.meets and (best is None or level.concurrency > best.concurrency):
            best = level
    return {
        "name": "sweep (auto_tune style)",
        "exit": 0,
        "launches": launches,
        "failed_unrecovered": failed,
        "concurrency": best.concurrency if best else 0,
        "goodput": best.goodput if best else None,
        "wall_s": round(time.monotonic() - t0, 1),
        "note": f"max_num_seqs {','.join(map(str, args.grid))}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--itl-ms", type=float, default=160.0)
    parser.add_argument("--grid", default="2,4,8,16", help="max_num_seqs values of the sweep")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    try:
        args.grid = [int(v) for v in args.grid.split(",")]
    except ValueError:
        parser.error("--grid: integers separated by commas")
    with tempfile.TemporaryDirectory(prefix="bench-slo-fake-") as tmp:
        work = Path(tmp)
        try:
            rows = [run_r1sup(args, work), run_sweep(args, work)]
        except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
            print(f"bench_slo_fake: a step could not run: {exc}", file=sys.stderr)
            return 2
    print(
        f"fake engine, ITL p95 <= {args.itl_ms:g} ms, "
        f"{PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} output tokens"
    )
    print(f"{'':26}{'launches':>9}{'unrecov':>8}{'at once':>8}{'goodput':>9}{'wall s':>8}  note")
    for r in rows:
        good = "-" if r["goodput"] is None else f"{r['goodput']:.2f}"
        print(
            f"{r['name']:26}{r['launches']!s:>9}{r['failed_unrecovered']!s:>8}{r['concurrency']!s:>8}"
            f"{good:>9}{r['wall_s']:>8}  {r['note']}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
