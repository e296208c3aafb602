"""r1sup's own footprint while it supervises an idle server: resident memory and CPU of the daemon process.

Target (issue 7): at most 80 MB RSS and at most 1% of one core while serving, with the default
health and liveness intervals (5 s / 60 s). Starts ``r1sup run`` on the fake GPU engine
(tests/fakevllm, no GPU needed), waits until status.json says ``serving``, then samples r1sup's own
process (not its children) once a second for ``--seconds`` and prints the peak RSS and the CPU time
used over the wall time beside the targets. SIGTERM at the end; exit 1 if a target is missed.
RSS is judged in MiB, the unit of systemd's ``MemoryMax=80M``; the figure in 10^6-byte MB is shown too.

    python benchmarks/bench_daemon_idle.py [--seconds 30]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import psutil

ROOT = Path(__file__).resolve().parent.parent
TARGET_RSS_MIB = 80.0  # "80 MB" read as systemd reads MemoryMax=80M: 80 x 2^20 bytes
MIB = 1024**2
TARGET_CPU_PCT = 1.0  # of one core
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(work: Path, port: int) -> Path:
    """A fake-engine config with the daemon's default intervals; only the probe is made small."""
    text = f"""
[model]
name = "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
served_name = "r1"

[server]
launch = ["-m", "fakevllm"]
port = {port}
stop_timeout_s = 10
memory_release_timeout_s = 10

[start]
max_model_len = 8192

[search]
first_launch = "as_configured"

[probe]
requests = 4
output_tokens = 8

[state]
dir = "{work / "state"}"
"""
    path = work / "r1sup.toml"
    path.write_text(text, encoding="utf-8")
    return path


def read_status(work: Path) -> dict[str, object]:
    try:
        return dict(json.loads((work / "state" / "status.json").read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return {}


def wait_serving(proc: subprocess.Popen[bytes], work: Path) -> bool:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if read_status(work).get("state") == "serving":
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.2)
    return False


def sample(pid: int, seconds: float) -> tuple[float, float, float, int]:
    """(peak RSS in bytes, mean RSS in bytes, CPU % of one core, samples) of ``pid`` alone."""
    me = psutil.Process(pid)
    t0 = time.monotonic()
    c0 = me.cpu_times()
    rss: list[int] = []
    while time.monotonic() - t0 < seconds:
        rss.append(me.memory_info().rss)
        time.sleep(1.0)
    c1 = me.cpu_times()
    wall = time.monotonic() - t0
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    return float(max(rss)), float(sum(rss) / len(rss)), 100.0 * cpu / wall, len(rss)


def spawn_run(config: Path, env: dict[str, str], log: IO[bytes]) -> subprocess.Popen[bytes]:
    """``r1sup run --config config`` (JSON log lines into ``log``), started from the repository's root."""
    return subprocess.Popen(
        [sys.executable, "-m", "r1sup.cli.app", "--log-format", "json", "run", "--config", str(config)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=ROOT,
    )


def cleanup(config: Path) -> list[int]:
    """Kill any fake engine of this config still alive; returns their pids."""
    from r1sup.adapters.launcher import instance_id, leftovers
    from r1sup.core import config as cfg

    left = leftovers(instance_id(cfg.load(config, environ={})))
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(left, timeout=10)
    return [p.pid for p in left]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="how long to sample the idle daemon")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (config, log, state)")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="r1sup-idle-"))
    config = write_config(work, free_port())
    scenario = {"gpu": "RTX 4090", "time_scale": 0.002}
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "fakenvml"), str(ROOT / "tests")]),
        "FAKE_VLLM_SCENARIO": json.dumps(scenario),
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("NOTIFY_SOCKET", None)
    log_path = work / "r1sup.log"
    code = 1
    with log_path.open("wb") as log:
        proc = spawn_run(config, env, log)
        try:
            if not wait_serving(proc, work):
                print(f"r1sup did not reach 'serving' (exit {proc.poll()}); log: {log_path}", file=sys.stderr)
                args.keep = True
                return 2
            status = read_status(work)
            print(
                f"serving: r1sup pid {proc.pid}, vLLM (fake) pid {status.get('child_pid')}, "
                f"sampling {args.seconds:g} s with health every 5 s and liveness every 60 s"
            )
            peak, mean, cpu, n = sample(proc.pid, args.seconds)
            rss_mib = peak / MIB
            print(f"{'measure':<22} {'value':>10} {'target':>10}")
            print(f"{'RSS peak (MiB)':<22} {rss_mib:>10.1f} {'<= ' + format(TARGET_RSS_MIB, 'g'):>10}")
            print(f"{'RSS peak (10^6 B MB)':<22} {peak / 1e6:>10.1f} {'':>10}")
            print(f"{'RSS mean (MiB)':<22} {mean / MIB:>10.1f} {'':>10}")
            print(f"{'CPU (% of a core)':<22} {cpu:>10.2f} {'<= ' + format(TARGET_CPU_PCT, 'g'):>10}")
            print(f"samples: {n}")
            ok = rss_mib <= TARGET_RSS_MIB and cpu <= TARGET_CPU_PCT
            print("result:", "PASS" if ok else "FAIL")
            code = 0 if ok else 1
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    stopped = proc.wait(timeout=STOP_TIMEOUT_S)
                    print(f"r1sup stopped (exit {stopped})")
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
                    print("r1sup did not stop on SIGTERM; killed", file=sys.stderr)
                    code = 1
            left = cleanup(config)
            if left:
                print(f"killed leftover engine processes: {left}", file=sys.stderr)
                code = 1
    if args.keep:
        print(f"work directory: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
