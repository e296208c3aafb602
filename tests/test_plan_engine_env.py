"""``r1sup plan`` sizes the engine as its environment will start it: FlashInfer's sampler
(VLLM_USE_FLASHINFER_SAMPLER) and the state of vLLM's torch.compile cache, and says what it assumed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
QWEN2_7B = ROOT / "benchmarks" / "data" / "models" / "qwen2-7b"
# the A100 80GB / vLLM 0.10.1 start of dennislee22/vLLM-benchmarking that printed 5.01 GiB of KV
ARGS = ["--gpu", "A100 80GB", "--vllm-version", "0.10.1", "--max-model-len", "16384"]
ARGS += ["--gpu-memory-utilization", "0.25"]


def plan(tmp_path: Path, **env: str) -> tuple[int, dict[str, Any], str]:
    full = {k: v for k, v in os.environ.items() if k != "VLLM_USE_FLASHINFER_SAMPLER"}
    full["PYTHONPATH"] = str(ROOT / "supervisor")
    full["VLLM_CACHE_ROOT"] = str(tmp_path / "cache")
    full.update(env)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "r1sup.cli.app",
            "--log-level",
            "error",
            "plan",
            "--json",
            "--model",
            str(QWEN2_7B),
            *ARGS,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=full,
        stdin=subprocess.DEVNULL,
    )
    data = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
    return proc.returncode, data, proc.stderr


def test_the_sampler_switch_in_the_environment_sizes_the_warm_up(tmp_path: Path) -> None:
    _, unset, _ = plan(tmp_path)
    _, on, _ = plan(tmp_path, VLLM_USE_FLASHINFER_SAMPLER="1")
    _, off, _ = plan(tmp_path, VLLM_USE_FLASHINFER_SAMPLER="0")
    assert abs(on["breakdown"]["kv_gib"] - 5.01) <= 0.15  # what that log printed
    assert off["breakdown"]["kv_gib"] == unset["breakdown"]["kv_gib"] < on["breakdown"]["kv_gib"] - 0.8
    assert any("VLLM_USE_FLASHINFER_SAMPLER" in n for n in unset["notes"])
    assert not any("VLLM_USE_FLASHINFER_SAMPLER" in n for n in on["notes"] + off["notes"])


def test_a_bad_sampler_switch_is_a_config_error(tmp_path: Path) -> None:
    code, _, err = plan(tmp_path, VLLM_USE_FLASHINFER_SAMPLER="yes")
    assert code == 2 and "VLLM_USE_FLASHINFER_SAMPLER must be an integer" in err


def test_the_plan_says_which_compile_cache_it_assumed(tmp_path: Path) -> None:
    _, empty, _ = plan(tmp_path)
    assert empty["compile_cache"]["assumed"] == "cold" and "nothing cached" in empty["compile_cache"]["note"]
    (tmp_path / "cache" / "torch_compile_cache" / "0f3c8d1e2a").mkdir(parents=True)
    _, filled, _ = plan(tmp_path)
    assert filled["compile_cache"]["assumed"] == "cold"
    assert "not known: sized as cold" in filled["compile_cache"]["note"]


def _plan_installed(
    capsys: Any, monkeypatch: Any, tmp_path: Path, flashinfer: bool, **env: str
) -> dict[str, Any]:
    """``plan`` in-process with vLLM 0.10.1.1 installed next to r1sup (no --vllm-version), FlashInfer
    installed there or not."""
    from r1sup.cli.app import main
    from r1sup.cli.commands import plan as plan_cmd

    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(plan_cmd, "installed_vllm_version", lambda: "0.10.1.1")
    monkeypatch.setattr(plan_cmd, "installed_flashinfer", lambda: flashinfer)
    args = [a for a in ARGS if a not in ("--vllm-version", "0.10.1")]
    main(["--log-level", "error", "plan", "--json", "--model", str(QWEN2_7B), *args])
    data: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert data["vllm_version"] == "0.10.1" and data["vllm_version_from"] == "installed"
    return data


def test_vllm_0_10_installed_with_flashinfer_is_sized_as_its_sampler_runs_without_a_variable(
    capsys: Any, monkeypatch: Any, tmp_path: Path
) -> None:
    with_fi = _plan_installed(capsys, monkeypatch, tmp_path, flashinfer=True)
    without = _plan_installed(capsys, monkeypatch, tmp_path, flashinfer=False)
    # the A100 80GB / vLLM 0.10.1.1 log (FlashInfer installed, no variable set) printed 5.01 GiB
    assert abs(with_fi["breakdown"]["kv_gib"] - 5.01) <= 0.15
    assert without["breakdown"]["kv_gib"] < with_fi["breakdown"]["kv_gib"] - 0.8
    # what is installed is known: no note asking for the variable either way
    assert not any("VLLM_USE_FLASHINFER_SAMPLER" in n for n in with_fi["notes"] + without["notes"])
    # the variable still wins over what is installed (vLLM: =0 turns FlashInfer's sampler off)
    off = _plan_installed(capsys, monkeypatch, tmp_path, flashinfer=True, VLLM_USE_FLASHINFER_SAMPLER="0")
    assert off["breakdown"]["kv_gib"] == without["breakdown"]["kv_gib"]


def test_flashinfer_is_found_the_way_vllm_looks_for_it(monkeypatch: Any, tmp_path: Path) -> None:
    from r1sup.cli.commands import plan as plan_cmd

    monkeypatch.syspath_prepend(str(tmp_path))
    if plan_cmd.installed_flashinfer():
        pytest.skip("a real FlashInfer is installed here: the check can only say yes")
    (tmp_path / "flashinfer").mkdir()
    (tmp_path / "flashinfer" / "__init__.py").write_text("raise ImportError('never imported')\n")
    assert plan_cmd.installed_flashinfer() is True
