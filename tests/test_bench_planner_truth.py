"""The real-GPU truth benchmark (benchmarks/bench_planner_truth.py) on the repository's own records: the
records are what the logs printed, and the memory model meets its targets on them (as in CI, where
../shared does not exist)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench_planner_truth.py"
RECORDS = ROOT / "benchmarks" / "data" / "gpu-truth.jsonl"


def records() -> list[dict[str, Any]]:
    return [json.loads(line) for line in RECORDS.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.mark.parametrize("record", records(), ids=lambda r: r["id"])
def test_a_record_holds_only_figures_its_log_printed(record: dict[str, Any]) -> None:
    assert record["source"].startswith("https://") and record["excerpt"].strip()
    if record["scope"] == "in":
        assert (ROOT / "benchmarks" / "data" / "models" / record["model_dir"] / "config.json").is_file()
    excerpt = record["excerpt"]
    environment = record.get("environment") or {}
    sampler = environment.get("top_k_top_p_sampler")
    if sampler == "flashinfer":
        assert "Using FlashInfer for top-p & top-k sampling" in excerpt
    elif sampler == "native":
        assert "Falling back to the PyTorch-native implementation of top-p & top-k sampling" in excerpt
    cache = environment.get("compile_cache")
    if cache == "cold":
        assert "Compiling a graph for dynamic shape takes" in excerpt
    elif cache == "warm":
        assert "Directly load the compiled graph(s)" in excerpt
    for key, value in record["observed"].items():
        if key == "kv_tokens":
            assert f"GPU KV cache size: {int(value):,} tokens" in excerpt, key
        elif key.endswith("_gib"):
            assert f"{value:.2f}" in excerpt or f"{value:g}" in excerpt, (key, value)


def test_the_repositorys_records_meet_the_targets(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--records", str(RECORDS), "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "PASS  every record within 0.5 GiB of the KV memory" in proc.stdout
    rows = json.loads(out.read_text())
    assert {r["id"] for r in rows} == {r["id"] for r in records() if r["scope"] == "in"}
    for row in rows:
        predicted, logged = row["predicted"], row["logged"]
        assert not row["error"], row
        assert abs(predicted["kv_tokens"] / logged["kv_tokens"] - 1) <= 0.10, row["id"]
        assert abs(predicted["kv_gib"] - logged["kv_gib"]) <= 0.5, row["id"]


def test_a_record_of_the_same_log_from_elsewhere_gets_what_this_repository_read_from_it() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_planner_truth", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up
    try:
        spec.loader.exec_module(bench)
    finally:
        del sys.modules[spec.name]
    mine = next(
        r for r in records() if (r.get("environment") or {}).get("top_k_top_p_sampler") == "flashinfer"
    )
    # the same log file read at another commit, its excerpt without the sampler line
    other = re.sub(r"/blob/[0-9a-f]{40}/", "/blob/" + "0" * 40 + "/", mine["log_url"])
    assert other != mine["log_url"]
    elsewhere = {"id": "x", "log_url": other, "excerpt": "Available KV cache memory: 5.01 GiB"}
    assert bench.engine_env(elsewhere) == {"VLLM_USE_FLASHINFER_SAMPLER": "1"}
    assert bench.engine_env({"id": "y", "excerpt": "Available KV cache memory: 5.01 GiB"}) == {}
