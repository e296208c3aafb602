"""Time to serve on the real vLLM CPU engine: bare vLLM against ``r1sup run`` with a saved profile.

Target (issue 18): ``r1sup run`` with a saved profile reaches ``serving`` in at most 1.05x the time
bare vLLM takes to answer ``/v1/models`` with 200, both counted from the moment the process starts.

Three ways to start the tiny model of ``r1sup tiny-model`` with ``configs/demo-cpu.toml`` (its port
and state directory replaced), interleaved round by round so that the load of a shared machine falls
on each alike:

- ``bare``: ``python -m vllm.entrypoints.openai.api_server`` with the saved profile's command line (the
  same flags r1sup launches); time to the first 200 on ``/v1/models``.
- ``run``: ``r1sup run`` with that profile in its state directory (and the preflight's record of the
  tune's check of vLLM, as a ``tune`` then ``run`` on one box leaves it); time to the ``serving`` event, and
  to the first 200 on ``/v1/models``; and where the time went (vLLM's "Application startup complete",
  ``engine_ready``, the probe).
- ``tune``: ``r1sup tune`` from an empty state directory (the demo's two launches); time to
  ``tune_succeeded``. The first round's tune saves the profile the ``run`` rows use.

r1sup runs byte-compiled (its package is compiled first, as ``pip install`` leaves it). Medians side
by side, the ratio run/bare beside the target; exit 1 on a miss, 2 when a start failed.

    python benchmarks/bench_time_to_serve.py [--runs 3] [--no-tune] [--keep] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "demo-cpu.toml"
TARGET_RATIO = 1.05
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0
POLL_S = 0.05  # the /v1/models poll of the measurement itself
READY_LINE = "Application startup complete"


class StartFailed(Exception):
    pass


@dataclass
class Sample:
    """Seconds from the process start to each mark seen (by name)."""

    marks: dict[str, float] = field(default_factory=dict)

    def mark(self, name: str, t0: float) -> None:
        self.marks.setdefault(name, time.monotonic() - t0)


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


def wait_port_free(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not port_free(port):
        if time.monotonic() > deadline:
            raise StartFailed(f"port {port} still taken after {timeout:.0f}s")
        time.sleep(0.2)


def models_ok(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1.0) as resp:  # noqa: S310
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def poll_models(port: int, sample: Sample, t0: float, done: threading.Event) -> threading.Thread:
    """Mark ``models_200`` at the first 200 on /v1/models (a thread, until ``done``)."""

    def work() -> None:
        while not done.is_set():
            if models_ok(port):
                sample.mark("models_200", t0)
                return
            done.wait(POLL_S)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


def read_lines(stream: object, on_line: Callable[[str], None]) -> threading.Thread:
    def work() -> None:
        for raw in iter(stream.readline, b""):  # type: ignore[attr-defined]
            on_line(raw.decode("utf-8", "replace"))

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


def stop(proc: subprocess.Popen[bytes], *, group: bool) -> None:
    """SIGTERM (the group for bare vLLM, r1sup itself otherwise), then SIGKILL; bounded."""
    if proc.poll() is None:
        if group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    if group:
        with contextlib.suppress(ProcessLookupError):  # the engine core, if it outlived the API server
            os.killpg(proc.pid, signal.SIGKILL)


def env_for_vllm() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_bare(argv: list[str], port: int, log: Path) -> Sample:
    wait_port_free(port)
    sample, done = Sample(), threading.Event()
    t0 = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env_for_vllm(),
            start_new_session=True,
        )

        def on_line(line: str) -> None:
            out.write(line.encode())
            if READY_LINE in line:
                sample.mark("startup_complete", t0)

        reader = read_lines(proc.stdout, on_line)
        poller = poll_models(port, sample, t0, done)
        try:
            deadline = t0 + START_TIMEOUT_S
            while "models_200" not in sample.marks:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise StartFailed(f"bare vLLM did not answer (exit {proc.poll()}); log: {log}")
                time.sleep(POLL_S)
        finally:
            done.set()
            stop(proc, group=True)
            poller.join(5)
            reader.join(5)
    return sample


# r1sup's events -> the marks they set (the vLLM line relayed as a ``vllm`` event is matched by text)
R1SUP_MARKS = {
    "preflight_passed": "preflight_passed",
    "child_started": "child_started",
    "engine_ready": "engine_ready",
    "probe_started": "probe_started",
    "probe_passed": "probe_passed",
    "serving": "serving",
    "tune_succeeded": "tune_succeeded",
}


def run_r1sup(command: str, config_args: list[str], port: int, log: Path, until: str) -> Sample:
    """``r1sup run`` (stopped with SIGTERM once ``until`` is seen) or ``r1sup tune`` (to its end)."""
    wait_port_free(port)
    sample, done = Sample(), threading.Event()
    cmd = [sys.executable, "-m", "r1sup.cli.app", "--log-format", "json", command, *config_args]
    t0 = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env_for_vllm(),
        )

        def on_line(line: str) -> None:
            out.write(line.encode())
            try:
                event = json.loads(line)
            except ValueError:
                return
            name = event.get("event")
            if name == "vllm" and READY_LINE in str(event.get("text", "")):
                sample.mark("startup_complete", t0)
            elif name == "preflight_passed" and event.get("cached"):
                sample.mark("preflight_cached", t0)
                sample.mark(name, t0)
            elif name in R1SUP_MARKS:
                sample.mark(R1SUP_MARKS[name], t0)

        reader = read_lines(proc.stderr, on_line)
        poller = poll_models(port, sample, t0, done) if command == "run" else None
        try:
            deadline = t0 + START_TIMEOUT_S
            while until not in sample.marks:
                code = proc.poll()
                if code is not None:
                    reader.join(5)
                    if until in sample.marks:
                        break
                    raise StartFailed(f"r1sup {command} ended (exit {code}) before {until}; log: {log}")
                if time.monotonic() > deadline:
                    raise StartFailed(f"r1sup {command}: no {until} after {START_TIMEOUT_S:.0f}s; log: {log}")
                time.sleep(POLL_S)
        finally:
            done.set()
            stop(proc, group=False)
            if poller is not None:
                poller.join(5)
            reader.join(5)
    return sample


def byte_compile() -> None:
    """Byte-compile r1sup's package, as ``pip install`` leaves it (a source checkout under
    PYTHONDONTWRITEBYTECODE=1 would compile every module at each start); vLLM's are compiled already."""
    import compileall

    import r1sup

    compileall.compile_dir(str(Path(r1sup.__file__).parent), quiet=1)


def saved_profile(state: Path) -> dict[str, object]:
    files = sorted((state / "profiles").glob("*.json"))
    if not files:
        raise StartFailed(f"no profile saved under {state / 'profiles'}")
    return dict(json.loads(files[0].read_text(encoding="utf-8")))


def own_time(sample: Sample) -> float:
    """What r1sup adds to vLLM's own start-up: the time to ``serving`` less the engine's time from
    its start to "Application startup complete" (steadier than the ratio when the load varies)."""
    m = sample.marks
    return m["serving"] - (m["startup_complete"] - m["child_started"])


def median(samples: list[Sample], mark: str) -> float | None:
    values = [s.marks[mark] for s in samples if mark in s.marks]
    return statistics.median(values) if values else None


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="rounds (each: tune, bare, run)")
    parser.add_argument(
        "--no-tune",
        action="store_true",
        help="time no tune from scratch (one untimed tune saves the profile)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, state)")
    parser.add_argument("--json", metavar="FILE", help="also write every run's marks to FILE")
    args = parser.parse_args(argv)

    from r1sup.adapters.tinymodel import write_tiny_model

    byte_compile()
    work = Path(tempfile.mkdtemp(prefix="r1sup-tts-"))
    model = write_tiny_model(work / "tiny-model")
    port = free_port()
    run_state = work / "state-run"

    def config_args(state: Path) -> list[str]:
        sets = {"model.name": str(model), "server.port": str(port), "state.dir": str(state)}
        return ["--config", str(CONFIG), *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))]

    results: dict[str, list[Sample]] = {"bare": [], "run": [], "tune": []}
    bare_argv: list[str] = []
    code = 0
    try:
        for i in range(args.runs):
            if i == 0 or not args.no_tune:
                state = work / f"state-tune-{i}"
                tuned = run_r1sup("tune", config_args(state), port, work / f"tune-{i}.log", "tune_succeeded")
                if not args.no_tune:
                    results["tune"].append(tuned)
                if i == 0:
                    profile = saved_profile(state)
                    bare_argv = [str(a) for a in profile["command"]]  # type: ignore[union-attr]
                    shutil.copytree(state / "profiles", run_state / "profiles")
                    if (state / "preflight.json").exists():
                        shutil.copy2(state / "preflight.json", run_state / "preflight.json")
            results["bare"].append(run_bare(bare_argv, port, work / f"bare-{i}.log"))
            results["run"].append(
                run_r1sup("run", config_args(run_state), port, work / f"run-{i}.log", "serving")
            )
            print(
                f"round {i + 1}: bare {fmt(results['bare'][-1].marks.get('models_200'))} s, "
                f"run {fmt(results['run'][-1].marks.get('serving'))} s"
                + (
                    f", tune {fmt(results['tune'][-1].marks.get('tune_succeeded'))} s"
                    if results["tune"]
                    else ""
                ),
                flush=True,
            )
    except StartFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        args.keep = True
        code = 2

    if args.json:
        marks = {who: [s.marks for s in samples] for who, samples in results.items()}
        Path(args.json).write_text(json.dumps(marks, indent=1) + "\n", encoding="utf-8")
    if code == 0:
        code = report(results, bare_argv)
    if args.keep:
        print(f"work directory: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return code


def report(results: dict[str, list[Sample]], bare_argv: list[str]) -> int:
    bare, run, tune = results["bare"], results["run"], results["tune"]
    print(f"\nvLLM flags: {' '.join(bare_argv[3:])}")
    print(f"medians of {len(bare)} run(s), seconds from the process start")
    rows = [
        ("bare vLLM", "Application startup complete", median(bare, "startup_complete")),
        ("bare vLLM", "first 200 on /v1/models", median(bare, "models_200")),
        ("r1sup run", "preflight_passed", median(run, "preflight_passed")),
        ("r1sup run", "vLLM started (child_started)", median(run, "child_started")),
        ("r1sup run", "Application startup complete", median(run, "startup_complete")),
        ("r1sup run", "engine_ready", median(run, "engine_ready")),
        ("r1sup run", "first 200 on /v1/models", median(run, "models_200")),
        ("r1sup run", "probe_passed", median(run, "probe_passed")),
        ("r1sup run", "serving", median(run, "serving")),
    ]
    if tune:
        rows.append(("r1sup tune", "tune_succeeded (from scratch)", median(tune, "tune_succeeded")))
    for who, what, value in rows:
        print(f"  {who:<11} {what:<32} {fmt(value):>7}")
    gaps = [
        ("child_started -> startup complete", "child_started", "startup_complete"),
        ("startup complete -> engine_ready", "startup_complete", "engine_ready"),
        ("engine_ready -> probe_passed", "engine_ready", "probe_passed"),
        ("probe_passed -> serving", "probe_passed", "serving"),
    ]
    for label, a, b in gaps:
        values = [s.marks[b] - s.marks[a] for s in run if a in s.marks and b in s.marks]
        if values:
            print(f"  r1sup run   {label:<32} {statistics.median(values):>7.2f}")
    cached = sum("preflight_cached" in s.marks for s in run)
    print(f"  r1sup run   {'preflight: vLLM import skipped':<32} {cached} of {len(run)} run(s)")
    own = [own_time(s) for s in run]
    if own:
        print(f"  r1sup run   {'its own time (not vLLM loading)':<32} {statistics.median(own):>7.2f}")
    base, served = median(bare, "models_200"), median(run, "serving")
    if base is None or served is None:
        print("result: FAIL (no figures)")
        return 2
    ratio = served / base
    ok = ratio <= TARGET_RATIO
    print(f"\nrun with a profile / bare vLLM: {served:.2f} / {base:.2f} = {ratio:.3f}x", end=" ")
    print(f"(target <= {TARGET_RATIO}x)")
    print("result:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
