"""Launches to a working config per GPU scenario: ``r1sup tune`` (smart, naive), vLLM's auto-fit, the optimum.

For every scenario of :mod:`scenarios` (GPU x DeepSeek-R1 distill x target) this runs, against the fake
GPU engine (``tests/fakevllm``) and the fake NVML (``tests/fakenvml``):

- ``smart`` and ``naive``: the real CLI, ``python -m r1sup.cli.app --log-format json tune --config F --json
  --strategy S``. ``smart`` runs with ``search.first_launch = "planned"`` (the planner predicts the first
  launch; ``--first-launch as_configured`` starts it from the user's ``[start]`` to measure the search
  alone). ``naive`` is the seed's walk done by hand (``r1sup.core.naive``, the baseline kept for this
  benchmark): it always starts from the user's ``[start]``;
- ``auto-fit``: the engine alone with vLLM's ``--max-model-len -1`` and the user's other flags;
- ``optimum``: ``fakevllm.optimum.optimum``, the best feasible configuration by exhaustive search over the
  fake engine's own accounting, within the same [search] bounds.

Every figure comes from the runs: launches and simulated seconds from the engine's state file (one line
per launch), the final flags from ``tune --json``, the KV capacity from the engine's line of the final
launch. Definitions:

- ``ctx``: the final ``max_model_len``; ``conc``: requests of the target's size that the KV cache holds at
  once, ``usable KV tokens // context`` with ``usable KV tokens = (num_gpu_blocks - 1) x block`` (vLLM holds
  one null block back);
- target ``met`` (project issue 6): the run ended serving (so one request of ``ctx`` fits: vLLM's own
  start-up check), ``ctx >= context``, ``max_num_seqs >= concurrency`` and the KV cache holds
  ``concurrency x context`` tokens (``conc >= concurrency``); the context is not multiplied by the
  concurrency; ``MISS``: not met; ``infeas``: ``r1sup tune`` gave up (exit 3 or 4); ``fail``: auto-fit did
  not start;
- the optimum's ``ctx`` is the longest context (up to the user's ``max_model_len``) one request fits
  while the target is met; with a target context and no ``max_model_len``, the target context is the
  context asked (issue 36: ``tune`` launches at it), so the optimum is the longest feasible context not
  above the target;
- ``sim s``: the simulated seconds of all launches (start-up, or start-up until the failure plus teardown);
  the probe's serving time is not counted (its simulated clock runs with real time).

The ``serving`` family (issue 29) has no ``[target]``: per scenario the report adds the context asked,
the sequences vLLM runs at once with the user's flags (its default, or ``start.max_num_seqs``; read from
the auto-fit launch), the context and sequences r1sup serves, whether ``tune`` gave its one-line
``reduced`` warning, whether ``r1sup plan --config`` (run first, on the same fake box) recommended the
first launch, and the optimum that keeps at least 32 sequences (or the user's value); "fits w/ vLLM
seqs": the optimum's search finds the asked context while serving vLLM's default (or the user's).

Targets (issues 15 and 29), smart with ``search.first_launch = "planned"``: at least 97% of the
scenarios that have a feasible configuration end within 95% of the optimum's context with the target
met; none of them is declared infeasible (exit 3 or 4); median launches 1, at most 2; ``plan --config``
recommends the first launch in every scenario (its exit 3: ``tune`` launches nothing); ``max_num_seqs``
never below 16 (nor a lower ``start.max_num_seqs``); without a target, vLLM's default (or the user's)
wherever the asked context fits with it, and the one-line warning wherever less than half the context
or fewer sequences are served. With ``--first-launch as_configured``
(from the user's flags): median launches at most 2, at most 4, and every feasible scenario at least 90%
of the optimum's context. Exit status 1 when a target is missed.

    python benchmarks/bench_scenarios.py [--quick] [--only ID,ID] [--family NAME] [--json OUT] [--workdir DIR]
                                         [--first-launch planned|as_configured] [--time-scale S]

Scenarios run one after another (about 11 minutes for all 54 on 2 shared cores); each run gets its own
port, directory, state file and GPU-lock directory, and every process it started is gone afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
sys.path[:0] = [str(Path(__file__).resolve().parent), str(TESTS)]

import psutil  # noqa: E402

from fakevllm.optimum import Bounds as OptBounds  # noqa: E402
from fakevllm.optimum import optimum  # noqa: E402
from fakevllm.scenario import load_scenario  # noqa: E402
from r1sup.core.bounds import Bounds  # noqa: E402
from r1sup.core.flags import EngineFlags  # noqa: E402
from r1sup_proc import write_config  # noqa: E402
from scenarios import QUICK, QUICK_ADVERSARIAL, SCENARIOS, BenchScenario, by_id  # noqa: E402

TIME_SCALE = 0.001
TUNE_TIMEOUT_S = 240.0
AUTOFIT_TIMEOUT_S = 60.0
BLOCK = 16
TARGET_MEDIAN_LAUNCHES = 1
TARGET_MAX_LAUNCHES = 2  # from the plan (issue 29)
SERVING_MIN_SEQS = 32  # the serving scenarios' optimum keeps at least this many sequences (or the user's)
MIN_SEQS = 16  # search.min_max_num_seqs: r1sup never sets fewer
TARGET_CONTEXT_RATIO = 0.95
TARGET_WITHIN_SHARE = 0.97
TARGET_CONTEXT_RATIO_AS_CONFIGURED = 0.90
EXIT_INFEASIBLE = (3, 4)


@dataclass
class Run:
    """One way of getting a configuration (smart, naive, auto-fit) on one scenario."""

    method: str
    exit_code: int | None = None
    launches: int = 0
    sim_s: float = 0.0
    ok: bool = False  # ended with a serving engine (tune exit 0; auto-fit: started)
    ctx: int | None = None
    kv_tokens: int | None = None
    num_blocks: int | None = None
    usable_kv_tokens: int | None = None  # (num_gpu_blocks - 1) x block: what requests can hold
    conc: int | None = None  # requests of the target's size (target.context tokens) that fit at once
    met: bool = False  # ctx >= target context and the KV cache holds concurrency x context (issue 6)
    flags: dict[str, Any] | None = None
    seqs: int | None = None  # max_num_seqs the final launch ran with (vLLM's log: what it serves at once)
    first_flags: dict[str, Any] | None = None  # the first launch's flags (tune's report)
    plan: dict[str, Any] | None = None  # r1sup plan --config on the same box: verdict, exit, recommended
    plan_is_first: bool | None = None  # plan's recommendation is the first launch (exit 3: none launched)
    reduced: dict[str, Any] | None = None  # tune's one-line warning (issue 29), when it gave one
    # what tune's load probe proved (r1sup.core.capacity): requests that ran at once, output tokens/s (on the
    # fake engine's simulated speed, scaled by the run's time scale: a relative figure only)
    probe_requests: int | None = None
    probe_tokens_per_s: float | None = None
    outcomes: list[str] = field(default_factory=list)
    reason: str = ""
    wall_s: float = 0.0
    files: dict[str, str] = field(default_factory=dict)

    @property
    def infeasible(self) -> bool:
        return self.exit_code in EXIT_INFEASIBLE

    @property
    def first_right(self) -> bool:
        return self.ok and self.launches == 1


@dataclass
class Result:
    scenario: BenchScenario
    smart: Run
    naive: Run
    autofit: Run
    optimum: dict[str, Any] | None
    wanted_seqs: int | None = None  # vLLM's default max_num_seqs for the user's flags, or the user's
    fits_with_wanted: bool = False  # the asked context fits while serving that many (the optimum's search)

    @property
    def feasible(self) -> bool:
        return self.optimum is not None

    def context_ratio(self, run: Run) -> float | None:
        if self.optimum is None:
            return None
        return (run.ctx or 0) / self.optimum["max_model_len"] if run.ok else 0.0

    def to_dict(self) -> dict[str, Any]:
        s = self.scenario
        return {
            "id": s.id,
            "box": s.box,
            "gpu": s.gpu,
            "gpu_count": s.count,
            "others_gib": s.others_gib,
            "model": s.model_id,
            "target": {"concurrency": s.concurrency, "context": s.context},
            "start": dict(s.start),
            "search": dict(s.search),
            "why": s.why,
            "smart": {**asdict(self.smart), "context_ratio": self.context_ratio(self.smart)},
            "naive": {**asdict(self.naive), "context_ratio": self.context_ratio(self.naive)},
            "autofit": {**asdict(self.autofit), "context_ratio": self.context_ratio(self.autofit)},
            "optimum": self.optimum,
            "wanted_seqs": self.wanted_seqs,
            "fits_with_wanted": self.fits_with_wanted,
            "asked_context": asked_context(self.scenario),
        }


# --- helpers ----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_env(scenario: Mapping[str, Any]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_VLLM_", "R1SUP_", "VLLM_"))}
    paths = [str(TESTS / "fakenvml"), str(TESTS)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env["FAKE_VLLM_SCENARIO"] = json.dumps(dict(scenario))
    return env


def read_state(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def stop_group(proc: subprocess.Popen[Any], grace_s: float = 10.0) -> None:
    """SIGTERM the process group of ``proc`` (its own session), then SIGKILL it if it lingers."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # children that outlived the leader in the same group


def kill_strays(marker: str) -> list[int]:
    """Kill processes of this user whose FAKE_VLLM_SCENARIO names ``marker`` (this run's state file)."""
    killed = []
    me = os.getuid()
    for proc in psutil.process_iter(["pid", "uids"]):
        try:
            if proc.info["uids"] is None or proc.info["uids"].real != me or proc.pid == os.getpid():
                continue
            if marker in proc.environ().get("FAKE_VLLM_SCENARIO", ""):
                proc.kill()
                killed.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return killed


def fill_capacity(run: Run, line: Mapping[str, Any], bs: BenchScenario) -> None:
    """Context, capacity and the target verdict from the engine's record of a launch that started."""
    run.ctx = int(line["max_model_len"])
    run.kv_tokens = int(line["kv_cache_tokens"])
    run.num_blocks = int(line["num_gpu_blocks"])
    usable = line.get("usable_kv_tokens")
    run.usable_kv_tokens = int(usable) if usable is not None else max(0, run.num_blocks - 1) * BLOCK
    seqs = (line.get("flags") or {}).get("max_num_seqs")
    served = (line.get("numbers") or {}).get("max_num_seqs")
    run.seqs = int(served) if served is not None else seqs
    seqs_ok = seqs is None or seqs >= bs.concurrency
    each = bs.context or run.ctx
    run.conc = run.usable_kv_tokens // each if each else 0
    run.met = run.ok and run.ctx >= bs.context and run.conc >= bs.concurrency and seqs_ok


def scenario_for_run(bs: BenchScenario, state: Path, time_scale: float) -> dict[str, Any]:
    return {**bs.scenario(), "time_scale": time_scale, "state_file": str(state)}


def user_flags(bs: BenchScenario) -> EngineFlags:
    return EngineFlags(**dict(bs.start))


def search_bounds(bs: BenchScenario) -> Bounds:
    return dataclasses.replace(Bounds(), **dict(bs.search))


# --- the three ways ---------------------------------------------------------------------------------


def run_tune(
    bs: BenchScenario, strategy: str, work: Path, time_scale: float, first_launch: str = "planned"
) -> Run:
    """``r1sup tune`` through the real CLI, the fake engine as vLLM and the fake NVML as the GPUs."""
    d = work / f"{bs.id}-{strategy}"
    d.mkdir(parents=True, exist_ok=True)
    state = d / "engine-state.jsonl"
    state.unlink(missing_ok=True)
    locks = d / "gpu-locks"  # live engines record the memory they hold here (the fake NVML reads it)
    locks.mkdir(exist_ok=True)
    sc = {**scenario_for_run(bs, state, time_scale), "gpu_lock_dir": str(locks)}
    config = d / "r1sup.toml"
    write_config(
        config,
        {
            "model": {"name": bs.model_id},
            "server": {
                "launch": ["-m", "fakevllm"],
                "port": free_port(),
                "startup_timeout_s": 120.0,
                "stall_timeout_s": 60.0,
                "stop_timeout_s": 10.0,
                "memory_release_timeout_s": 10.0,
            },
            "start": dict(bs.start),
            "search": {"first_launch": first_launch, **dict(bs.search)},
            "target": {"concurrency": bs.concurrency, "context": bs.context} if bs.has_target else {},
            "probe": {"requests": 2, "output_tokens": 4, "request_timeout_s": 60.0, "timeout_s": 120.0},
            "state": {"dir": str(d / "state")},
        },
    )
    # r1sup plan --config first: after the tune, the profile it saves would calibrate the plan
    plan = run_plan(config, sc) if strategy == "smart" and first_launch == "planned" else None
    stdout_path, stderr_path = d / "tune.json", d / "tune.log"
    argv = [
        sys.executable,
        "-m",
        "r1sup.cli.app",
        "--log-format",
        "json",
        "tune",
        "--config",
        str(config),
        "--json",
        "--strategy",
        strategy,
    ]
    run = Run(
        method=strategy, files={"state": str(state), "stdout": str(stdout_path), "log": str(stderr_path)}
    )
    t0 = time.monotonic()
    with open(stdout_path, "w", encoding="utf-8") as out, open(stderr_path, "w", encoding="utf-8") as err:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env=engine_env(sc),
            cwd=ROOT,
            start_new_session=True,
        )
        try:
            run.exit_code = proc.wait(timeout=TUNE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            run.reason = f"timed out after {TUNE_TIMEOUT_S:.0f}s"
            stop_group(proc, grace_s=20.0)
            run.exit_code = proc.returncode
        finally:
            stop_group(proc)
            kill_strays(str(state))
    run.wall_s = round(time.monotonic() - t0, 2)
    try:
        report = json.loads(stdout_path.read_text(encoding="utf-8"))
    except ValueError:
        report = {}
    launches = [e for e in read_state(state) if e.get("event") == "launch"]
    run.launches = len(launches)
    run.sim_s = round(sum(float(e.get("simulated_seconds") or 0.0) for e in launches), 1)
    run.outcomes = [str(e.get("outcome")) for e in launches]
    run.reason = run.reason or str(report.get("reason") or "")
    counted = int(report.get("launches") or 0)
    if counted != run.launches:  # an engine that died before it could record its launch
        run.reason = f"engine recorded {run.launches} launch(es), r1sup counted {counted}; " + run.reason
        run.launches = max(counted, run.launches)
    run.ok = run.exit_code == 0 and bool(report.get("ok"))
    attempts = report.get("attempts") or []
    run.first_flags = attempts[0].get("flags") if attempts else None
    run.reduced = report.get("reduced")
    if plan is not None:
        run.plan = plan
        if run.plan.get("exit_code") == 3:
            run.plan_is_first = run.launches == 0 and run.exit_code == 3
        else:
            run.plan_is_first = run.plan.get("recommended") == run.first_flags
    if run.ok:
        run.flags = report.get("flags")
        proved = report.get("capacity") or {}
        run.probe_requests = proved.get("requests")
        run.probe_tokens_per_s = proved.get("output_tokens_per_second")
        final = launches[-1] if launches else {}
        if final.get("outcome") == "ready" and final.get("kv_cache_tokens") is not None:
            fill_capacity(run, final, bs)
            flagged = (run.flags or {}).get("max_model_len")
            if flagged is not None and int(flagged) != run.ctx:
                run.reason = f"tune reported max_model_len {flagged}, the engine ran {run.ctx}"
    return run


def run_plan(config: Path, scenario: Mapping[str, Any]) -> dict[str, Any]:
    """``r1sup plan --config F --json`` on the same fake box and the fake engine's vLLM version: its
    verdict, exit status and recommended flags."""
    import fakevllm

    argv = [sys.executable, "-m", "r1sup.cli.app", "plan", "--config", str(config), "--json"]
    argv += ["--vllm-version", fakevllm.__version__]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, env=engine_env(scenario), cwd=ROOT, timeout=120, check=False
        )
    except subprocess.TimeoutExpired:
        return {"exit_code": None, "error": "timed out"}
    try:
        out = json.loads(done.stdout)
    except ValueError:
        return {"exit_code": done.returncode, "error": done.stderr.strip()[-300:]}
    return {
        "exit_code": done.returncode,
        "verdict": out["verdict"]["status"],
        "recommended": out["recommended"],
    }


def run_autofit(bs: BenchScenario, work: Path, time_scale: float) -> Run:
    """vLLM's own way: ``--max-model-len -1`` with the user's other flags; one launch, no retry."""
    d = work / f"{bs.id}-autofit"
    d.mkdir(parents=True, exist_ok=True)
    state = d / "engine-state.jsonl"
    state.unlink(missing_ok=True)
    sc = scenario_for_run(bs, state, time_scale)
    flags = user_flags(bs).replace(max_model_len=-1)
    argv = [
        sys.executable,
        "-m",
        "fakevllm",
        "--model",
        bs.model_id,
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        *flags.to_argv(),
    ]
    run = Run(method="autofit", files={"state": str(state), "log": str(d / "engine.log")})
    t0 = time.monotonic()
    with open(d / "engine.log", "w", encoding="utf-8") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=engine_env(sc),
            cwd=ROOT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + AUTOFIT_TIMEOUT_S
            while time.monotonic() < deadline:
                if any(e.get("event") == "launch" for e in read_state(state)) or proc.poll() is not None:
                    break
                time.sleep(0.05)
        finally:
            stop_group(proc)
            kill_strays(str(state))
    run.wall_s = round(time.monotonic() - t0, 2)
    run.exit_code = proc.returncode
    launches = [e for e in read_state(state) if e.get("event") == "launch"]
    run.launches = len(launches)
    run.sim_s = round(sum(float(e.get("simulated_seconds") or 0.0) for e in launches), 1)
    run.outcomes = [str(e.get("outcome")) for e in launches]
    if launches:  # what vLLM serves at once with the user's flags (its default, or theirs)
        seqs = (launches[0].get("numbers") or {}).get("max_num_seqs")
        run.seqs = int(seqs) if seqs else None  # 0 or none: refused before vLLM resolved its batch
    if launches and launches[0].get("outcome") == "ready":
        run.ok = True
        run.flags = launches[0].get("flags")
        fill_capacity(run, launches[0], bs)
    elif launches:
        run.reason = str(launches[0].get("message") or launches[0].get("outcome"))[:200]
    else:
        run.reason = "no launch recorded"
    return run


def find_optimum(bs: BenchScenario, min_seqs: int = 0) -> dict[str, Any] | None:
    """The optimum; ``min_seqs``: the fewest sequences it may run at once (issue 29)."""
    scenario = load_scenario(bs.scenario())
    if bs.others_schedule:  # the box as it stays once the other tenant settled
        scenario = scenario.with_others(bs.others_schedule[-1])
    bounds = OptBounds.from_any(search_bounds(bs))
    if bs.context and bs.start.get("max_model_len") is None:
        # a target context without max_model_len is the context asked (issue 36): more is not what was asked
        cap = min(bounds.max_max_model_len or bs.context, bs.context)
        bounds = dataclasses.replace(bounds, max_max_model_len=cap)
    return optimum(
        scenario,
        bs.concurrency or None,
        bs.context or None,
        bounds,
        user_flags=user_flags(bs).to_dict(),
        cli_model=bs.model_id,
        min_seqs=min_seqs,
    )


def asked_context(bs: BenchScenario) -> int:
    """The context the user asked for: ``start.max_model_len``, else the model's."""
    asked = bs.start.get("max_model_len")
    if asked not in (None, -1):
        return int(asked)
    return int(load_scenario(bs.scenario()).effective_model(bs.model_id).max_position_embeddings)


def run_scenario(bs: BenchScenario, work: Path, time_scale: float, first_launch: str = "planned") -> Result:
    autofit = run_autofit(bs, work, time_scale)
    wanted = autofit.seqs  # vLLM's default for the user's flags (or the user's max_num_seqs)
    if wanted is None:
        wanted = bs.start.get("max_num_seqs") or None
    serving = None if bs.has_target else find_optimum(bs, min_seqs=min(SERVING_MIN_SEQS, wanted or 1))
    full = None if bs.has_target or not wanted else find_optimum(bs, min_seqs=wanted)
    return Result(
        scenario=bs,
        smart=run_tune(bs, "smart", work, time_scale, first_launch),
        naive=run_tune(bs, "naive", work, time_scale, "as_configured"),
        autofit=autofit,
        optimum=serving if not bs.has_target else find_optimum(bs),
        wanted_seqs=wanted,
        fits_with_wanted=bool(full and full["max_model_len"] >= asked_context(bs)),
    )


# --- the report -------------------------------------------------------------------------------------


def _verdict(run: Run) -> str:
    if run.ok:
        return "met" if run.met else "MISS"
    if run.method == "autofit":
        return "fail"
    return "infeas" if run.infeasible else f"exit{run.exit_code}"


def _k(tokens: int | None) -> str:
    if tokens is None:
        return "-"
    return f"{tokens / 1024:.1f}k" if tokens % 1024 else f"{tokens // 1024}k"


def _run_cells(run: Run, tune: bool) -> list[str]:
    cells = [str(run.launches), f"{run.sim_s:.0f}"] if tune else [f"{run.sim_s:.0f}"]
    cells += [_k(run.ctx) if run.ok else "-", str(run.conc) if run.ok else "-", _verdict(run)]
    return cells


_CHANGE_NAMES = {
    "gpu_memory_utilization": "util",
    "kv_cache_dtype": "kv",
    "enforce_eager": "eager",
    "max_num_seqs": "seqs",
    "quantization": "q",
    "tensor_parallel_size": "tp",
}


def _opt_cells(opt: dict[str, Any] | None) -> list[str]:
    if opt is None:
        return ["none", "-", "no config fits"]
    f = opt["flags"]
    parts = []
    for name in opt["changed"]:
        value = f[name]
        short = _CHANGE_NAMES.get(name, name)
        parts.append(short if isinstance(value, bool) else f"{short}={value}")
    return [_k(opt["max_model_len"]), str(opt["concurrency"]), " ".join(parts) or "as written"]


def table(results: Sequence[Result]) -> str:
    head1 = [
        "",
        "",
        "",
        "",
        "smart",
        "",
        "",
        "",
        "",
        "naive",
        "",
        "",
        "",
        "",
        "auto-fit",
        "",
        "",
        "",
        "optimum",
        "",
        "",
    ]
    head2 = [
        "scenario",
        "box",
        "model",
        "target",
        "L",
        "sim s",
        "ctx",
        "conc",
        "target",
        "L",
        "sim s",
        "ctx",
        "conc",
        "target",
        "sim s",
        "ctx",
        "conc",
        "target",
        "ctx",
        "conc",
        "changes",
    ]
    rows = [head1, head2]
    for r in results:
        s = r.scenario
        rows.append(
            [
                s.id,
                s.box,
                s.model,
                s.target,
                *_run_cells(r.smart, True),
                *_run_cells(r.naive, True),
                *_run_cells(r.autofit, False),
                *_opt_cells(r.optimum),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head2))]
    sep = {3, 8, 13, 17}  # a bar after these columns
    lines = []
    for n, row in enumerate(rows):
        cells = []
        for i, cell in enumerate(row):
            text = cell.ljust(widths[i]) if i < 4 or i == len(row) - 1 else cell.rjust(widths[i])
            cells.append(text + (" |" if i in sep else ""))
        lines.append(" ".join(cells).rstrip())
        if n == 1:
            lines.append("-" * len(lines[-1]))
    return "\n".join(lines)


@dataclass
class Target:
    name: str
    measured: str
    passed: bool


def summarize(results: Sequence[Result], first_launch: str = "planned") -> list[Target]:
    """The targets of the smart runs (issue 15): from the planned first launch, and from the user's flags."""
    planned = first_launch == "planned"
    launches = [r.smart.launches for r in results]
    median = statistics.median(launches) if launches else 0.0
    feasible = [r for r in results if r.feasible]
    ratios = [(r.context_ratio(r.smart) or 0.0, r.scenario.id) for r in feasible]
    worst = min(ratios) if ratios else (1.0, "-")
    wrong_infeasible = [r.scenario.id for r in feasible if r.smart.infeasible]
    med_ratio = statistics.median(x for x, _ in ratios) if ratios else 1.0
    naive = (
        f" (naive: median {statistics.median([r.naive.launches for r in results]) if results else 0:g}, "
        f"max {max((r.naive.launches for r in results), default=0)})"
    )
    max_median, max_launches = (TARGET_MEDIAN_LAUNCHES, TARGET_MAX_LAUNCHES) if planned else (2, 4)
    out = [
        Target(
            f"launches: median <= {max_median:g}, max <= {max_launches}",
            f"median {median:g}, max {max(launches, default=0)}" + naive,
            median <= max_median and max(launches, default=0) <= max_launches,
        ),
        Target(
            "no feasible scenario declared infeasible",
            f"{len(wrong_infeasible)} of {len(feasible)}"
            + (f": {', '.join(wrong_infeasible)}" if wrong_infeasible else ""),
            not wrong_infeasible,
        ),
    ]
    if planned:
        checked = [r for r in results if r.smart.plan_is_first is not None]
        differ = [r.scenario.id for r in checked if not r.smart.plan_is_first]
        out.append(
            Target(
                "r1sup plan --config recommends the first launch (its exit 3: tune launches nothing)",
                f"{len(checked) - len(differ)} of {len(checked)}"
                + (f"; not: {', '.join(differ)}" if differ else ""),
                not differ and len(checked) == len(results),
            )
        )
    served = [r for r in results if r.smart.ok and r.smart.seqs is not None]
    floor = [
        f"{r.scenario.id} {r.smart.seqs}"
        for r in served
        if (r.smart.seqs or 0) < min(MIN_SEQS, r.scenario.start.get("max_num_seqs") or MIN_SEQS)
    ]
    out.append(
        Target(
            f"max_num_seqs never below {MIN_SEQS} (nor a lower start.max_num_seqs)",
            f"{len(served) - len(floor)} of {len(served)}"
            + (f"; below: {', '.join(floor)}" if floor else ""),
            not floor,
        )
    )
    untargeted = [r for r in results if not r.scenario.has_target]
    if untargeted:
        fit = [r for r in untargeted if r.fits_with_wanted]
        kept = [r for r in fit if r.smart.ok and r.smart.seqs == r.wanted_seqs]
        lost = [f"{r.scenario.id} {r.smart.seqs} of {r.wanted_seqs}" for r in fit if r not in kept]
        out.append(
            Target(
                "no [target]: max_num_seqs is vLLM's default (or the user's) wherever the asked "
                "context fits with it",
                f"{len(kept)} of {len(fit)}" + (f"; not: {', '.join(lost)}" if lost else ""),
                not lost,
            )
        )
        unsaid = [
            r.scenario.id
            for r in untargeted
            if r.smart.ok
            and (
                2 * (r.smart.ctx or 0) < asked_context(r.scenario)
                or (r.smart.seqs or 0) < (r.wanted_seqs or 0)
            )
            and not r.smart.reduced
        ]
        reduced = [r for r in untargeted if r.smart.reduced]
        out.append(
            Target(
                "less than half the context asked, or fewer sequences, is said in one line with the ways out",
                f"{len(reduced)} said, {len(unsaid)} unsaid" + (f": {', '.join(unsaid)}" if unsaid else ""),
                not unsaid,
            )
        )
    if planned:
        good = [
            r for r in feasible if (r.context_ratio(r.smart) or 0) >= TARGET_CONTEXT_RATIO and r.smart.met
        ]
        bad = [
            f"{r.scenario.id} {r.context_ratio(r.smart) or 0:.0%}{'' if r.smart.met else ' MISS'}"
            for r in feasible
            if r not in good
        ]
        share = len(good) / len(feasible) if feasible else 1.0
        out.append(
            Target(
                f">= {TARGET_WITHIN_SHARE:.0%} of feasible scenarios within {TARGET_CONTEXT_RATIO:.0%} "
                "of the optimum's context and meeting the target",
                f"{len(good)} of {len(feasible)} = {share:.0%}; lowest {worst[0]:.1%} ({worst[1]}), median "
                f"{med_ratio:.1%}" + (f"; not: {', '.join(bad)}" if bad else ""),
                share >= TARGET_WITHIN_SHARE,
            )
        )
    else:
        below = [f"{sid} {ratio:.0%}" for ratio, sid in ratios if ratio < TARGET_CONTEXT_RATIO_AS_CONFIGURED]
        out.append(
            Target(
                f"context >= {TARGET_CONTEXT_RATIO_AS_CONFIGURED:.0%} of the optimum's "
                f"(each of {len(feasible)} feasible scenarios)",
                f"lowest {worst[0]:.1%} ({worst[1]}), median {med_ratio:.1%}"
                + (f"; below: {', '.join(below)}" if below else ""),
                not below,
            )
        )
    return out


def side_counts(results: Sequence[Result]) -> list[str]:
    def met(name: str) -> str:
        runs = [getattr(r, name) for r in results]
        return f"{sum(1 for run in runs if run.met)}/{len(runs)}"

    def total(name: str, attr: str) -> float:
        return sum(getattr(getattr(r, name), attr) for r in results)

    feasible = sum(1 for r in results if r.feasible)
    return [
        f"target met: smart {met('smart')}, naive {met('naive')}, auto-fit {met('autofit')}; "
        f"a feasible configuration exists (optimum) in {feasible}/{len(results)}",
        f"launches: smart {total('smart', 'launches'):.0f}, naive {total('naive', 'launches'):.0f}; "
        f"simulated seconds: smart {total('smart', 'sim_s'):.0f}, naive {total('naive', 'sim_s'):.0f}, "
        f"auto-fit {total('autofit', 'sim_s'):.0f}",
    ]


LEGEND = (
    "L: launches; sim s: simulated seconds of all launches (start-up, or until the failure plus teardown); "
    "ctx: final max_model_len;\n"
    "conc: requests of the target's context the KV cache holds at once (usable KV tokens // context); "
    "target: met = it serves,\n"
    "ctx >= context and conc >= concurrency (one request of ctx fits, concurrency x context tokens fit), "
    "MISS = not met,\n"
    "infeas = r1sup gave up (exit 3/4), fail = did not start; optimum: exhaustive search over the fake "
    "engine within the\n"
    "same bounds (longest ctx up to the user's that meets the target, then fewest changes), with its "
    "changes to the user's flags."
)


def serving_table(results: Sequence[Result]) -> str:
    """Per scenario: the context asked and what r1sup serves (context, sequences at once), vLLM's
    defaults, the optimum, and whether ``plan --config`` recommended the first launch."""
    rows = [
        [
            "scenario",
            "box",
            "model",
            "asked",
            "vLLM seqs",
            "L",
            "ctx",
            "seqs",
            "reduced",
            "plan=1st",
            "opt ctx",
            "opt seqs",
            "fits w/ vLLM seqs",
        ]
    ]
    for r in results:
        s, run, opt = r.scenario, r.smart, r.optimum
        opt_seqs = "-"
        if opt is not None:
            opt_seqs = str(opt["flags"].get("max_num_seqs") or r.wanted_seqs or "default")
        rows.append(
            [
                s.id,
                s.box,
                s.model,
                _k(asked_context(s)),
                str(r.wanted_seqs or "-"),
                str(run.launches),
                _k(run.ctx) if run.ok else ("infeas" if run.infeasible else "-"),
                str(run.seqs) if run.ok else "-",
                "yes" if run.reduced else "-",
                {True: "yes", False: "NO", None: "-"}[run.plan_is_first],
                _k(opt["max_model_len"]) if opt else "none",
                opt_seqs,
                "yes" if r.fits_with_wanted else "no",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        " ".join(c.ljust(widths[i]) if i < 3 else c.rjust(widths[i]) for i, c in enumerate(row))
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(line.rstrip() for line in lines)


def report(results: Sequence[Result], first_launch: str = "planned") -> tuple[str, bool]:
    targets = summarize(results, first_launch)
    lines = [table(results), "", LEGEND, "", *side_counts(results), ""]
    untargeted = [r for r in results if not r.scenario.has_target]
    if untargeted:
        lines += ["serving (no [target]): what r1sup serves", serving_table(untargeted), ""]
    lines += [f"targets (smart, {first_launch}):"]
    for t in targets:
        lines.append(f"  {'PASS' if t.passed else 'FAIL'}  {t.name}: {t.measured}")
    return "\n".join(lines), all(t.passed for t in targets)


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK + QUICK_ADVERSARIAL)}")
    parser.add_argument("--family", metavar="NAME", help="only the scenarios of one family (matrix, ...)")
    parser.add_argument("--only", metavar="IDS", help="comma-separated scenario ids")
    parser.add_argument("--json", metavar="OUT", help="write every figure as JSON here")
    parser.add_argument("--workdir", metavar="DIR", help="keep each run's config, logs and state files here")
    parser.add_argument("--time-scale", type=float, default=TIME_SCALE, help="real s per simulated s")
    parser.add_argument(
        "--first-launch",
        choices=("planned", "as_configured"),
        default="planned",
        help="search.first_launch of the smart runs: the planner's flags (default) or the user's [start]",
    )
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.only:
        chosen = by_id([i.strip() for i in args.only.split(",") if i.strip()])
    elif args.quick:
        chosen = by_id(QUICK + QUICK_ADVERSARIAL)
    elif args.family:
        chosen = [s for s in SCENARIOS if s.family == args.family]
    else:
        chosen = list(SCENARIOS)
    tmp = None
    if args.workdir:
        work = Path(args.workdir)
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="r1sup-bench-")
        work = Path(tmp.name)
    t0 = time.monotonic()
    results = []
    try:
        for n, bs in enumerate(chosen, 1):
            r = run_scenario(bs, work, args.time_scale, args.first_launch)
            results.append(r)
            wall = r.smart.wall_s + r.naive.wall_s + r.autofit.wall_s
            print(
                f"[{n}/{len(chosen)}] {bs.id}: smart {r.smart.launches} {_verdict(r.smart)}, "
                f"naive {r.naive.launches} {_verdict(r.naive)}, auto-fit {_verdict(r.autofit)} ({wall:.0f}s)",
                file=sys.stderr,
                flush=True,
            )
    finally:
        if tmp is not None:
            tmp.cleanup()
    text, ok = report(results, args.first_launch)
    print(text)
    print(
        f"\n{len(results)} scenarios in {time.monotonic() - t0:.0f}s (time_scale {args.time_scale:g}, "
        f"smart: search.first_launch {args.first_launch}; naive: as_configured)"
    )
    if args.json:
        payload = {
            "time_scale": args.time_scale,
            "first_launch": args.first_launch,
            "targets": [asdict(t) for t in summarize(results, args.first_launch)],
            "passed": ok,
            "scenarios": [r.to_dict() for r in results],
        }
        Path(args.json).write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
