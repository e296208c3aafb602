"""vLLM's torch.compile cache, warm and cold: where r1sup looks for it, what a profile proven on a warm
cache means for a cold start (the memory model, and ``r1sup run`` on the fake engine), with the activation
peaks of a real pair of RTX 4090 / vLLM 0.27.1 starts of Qwen3-8B: 1.18 GiB cold, 0.19 GiB warm."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from r1sup.adapters import devices
from r1sup.core import memmodel as M
from r1sup.core import modelarch
from r1sup.core.figures import Figures
from r1sup.core.flags import EngineFlags
from r1sup.core.memmodel import Calibration
from r1sup.core.vllmversion import Version
from r1sup.state import profiles

DATA = Path(__file__).resolve().parent.parent / "benchmarks" / "data"
QWEN3_8B = json.loads((DATA / "models" / "qwen3-8b" / "config.json").read_text())
REAL_PEAKS = {"cold": 1.18, "warm": 0.19}


# --- where the cache is, and whether it holds anything ------------------------------------------


def test_the_cache_follows_vllms_own_variables(tmp_path: Path) -> None:
    assert (
        profiles.compile_cache_dir({"VLLM_CACHE_ROOT": str(tmp_path / "c")})
        == tmp_path / "c" / "torch_compile_cache"
    )
    xdg = profiles.compile_cache_dir({"XDG_CACHE_HOME": str(tmp_path / "x"), "HOME": str(tmp_path / "h")})
    assert xdg == tmp_path / "x" / "vllm" / "torch_compile_cache"
    home = profiles.compile_cache_dir({"HOME": str(tmp_path / "h")})
    assert home == tmp_path / "h" / ".cache" / "vllm" / "torch_compile_cache"


def test_an_empty_missing_or_disabled_cache_is_cold_and_a_filled_one_is_not_known_cold(
    tmp_path: Path,
) -> None:
    env = {"VLLM_CACHE_ROOT": str(tmp_path / "cache")}
    assert profiles.compile_cache_state(env) == "cold"  # missing
    (tmp_path / "cache" / "torch_compile_cache").mkdir(parents=True)
    assert profiles.compile_cache_state(env) == "cold"  # empty
    (tmp_path / "cache" / "torch_compile_cache" / "0f3c8d1e2a").mkdir()
    assert profiles.compile_cache_state(env) is None  # something cached: perhaps this model's
    assert profiles.compile_cache_state({**env, "VLLM_DISABLE_COMPILE_CACHE": "1"}) == "cold"


# --- the memory model: a warm measurement does not bound a cold start -----------------------------


def _warm_launch(version: Version) -> tuple[modelarch.ModelArch, object, EngineFlags, Calibration]:
    arch = modelarch.arch_from_config(QWEN3_8B)
    device = devices.from_catalog("RTX 4090")
    flags = EngineFlags(max_model_len=8192, gpu_memory_utilization=0.9)
    figures = {"peak_activation_gib": REAL_PEAKS["warm"], "compile_cache_cold": 0.0}
    return arch, device, flags, Calibration(flags=flags, figures=Figures(**figures), version=version)


def test_a_warm_peak_sizes_a_warm_start_and_the_cold_estimate_a_cold_one() -> None:
    v = Version.parse("0.27.1")
    arch, device, flags, warm = _warm_launch(v)
    on_warm = M.evaluate(arch, device, flags, v.started(compile_cache="warm"), warm)
    on_cold = M.evaluate(arch, device, flags, v.started(compile_cache="cold"), warm)
    unknown = M.evaluate(arch, device, flags, v, warm)
    assert on_warm.activation.gib == pytest.approx(REAL_PEAKS["warm"], abs=0.01)
    assert on_warm.activation.source == M.MEASURED
    assert on_cold.activation.source == M.COLD_OVER_WARM and on_cold.activation.gib > REAL_PEAKS["warm"]
    assert on_cold.kv.bytes < on_warm.kv.bytes
    assert unknown.kv.bytes == on_cold.kv.bytes  # not known to be warm: sized as cold
    assert any("warm torch.compile cache" in n for n in on_cold.notes)
    # a peak measured cold holds for any start
    cold = Calibration(
        flags=flags, figures=Figures(peak_activation_gib=REAL_PEAKS["cold"], compile_cache_cold=1.0)
    )
    assert M.evaluate(arch, device, flags, v, cold).activation.gib == pytest.approx(
        REAL_PEAKS["cold"], abs=0.01
    )


def test_the_plan_says_which_cache_it_assumed() -> None:
    assert "cold" in M.compile_note(Version.parse("0.27.1").started(compile_cache="cold"))
    assert "not known: sized as cold" in M.compile_note(Version.parse("0.27.1"))
    assert "warm" in M.compile_note(Version.parse("0.27.1").started(compile_cache="warm"))


# --- the fake engine: the real pair of peaks by the state of its cache ---------------------------


def test_the_fake_engine_takes_the_real_peaks_by_the_state_of_its_cache() -> None:
    from fakevllm.memory import simulate
    from fakevllm.scenario import load_scenario

    sc = load_scenario({"gpu": "RTX 4090", "vllm_version": "0.27.1", "compile_activation_gib": REAL_PEAKS})
    flags = {"max_model_len": 8192, "gpu_memory_utilization": 0.9}
    cold = simulate(sc, flags, cli_model=QWEN_7B, compile_cold=True)
    warm = simulate(sc, flags, cli_model=QWEN_7B, compile_cold=False)
    assert cold.numbers()["peak_activation_gib"] == REAL_PEAKS["cold"]
    assert warm.numbers()["peak_activation_gib"] == REAL_PEAKS["warm"]
    assert cold.usable_tokens < warm.usable_tokens


# --- r1sup run: a profile proven warm, started on a cold cache -----------------------------------

QWEN_7B = "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
ROOT = Path(__file__).resolve().parent.parent
# the r1sup of this checkout in the subprocess, next to the fake NVML and the fake engine
THIS_CHECKOUT = {
    "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("supervisor", "tests/fakenvml", "tests"))
}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_profile_proven_warm_relaunches_after_a_cold_start_without_a_ladder_step(tmp_path: Path) -> None:
    from fakevllm.memory import simulate
    from fakevllm.scenario import load_scenario
    from test_daemon_fake import START_S, daemon_body, running, stop_cleanly
    from test_tune_fake import engine_records, fake_scenario

    scenario = fake_scenario(tmp_path, vllm_version="0.27.1", compile_activation_gib=REAL_PEAKS)
    sim = load_scenario({k: v for k, v in scenario.items() if k != "state_file"})
    fits = {
        state: simulate(
            sim, {"max_model_len": 8192}, cli_model=QWEN_7B, compile_cold=state == "cold"
        ).usable_tokens
        for state in ("cold", "warm")
    }
    context = (fits["cold"] + fits["warm"]) // 2 // 16 * 16  # fits a warm start, not a cold one
    cache = tmp_path / "vllm-cache"
    (cache / "torch_compile_cache" / "earlier").mkdir(parents=True)  # warm: graphs of an earlier start
    body = daemon_body(
        tmp_path,
        start={"max_model_len": context},
        server={"env": {"VLLM_CACHE_ROOT": str(cache)}},
    )
    with running(tmp_path, body, scenario, env=THIS_CHECKOUT) as (proc, config):
        proc.wait_event("serving", START_S)
        stop_cleanly(proc, config, tmp_path)
    saved = [json.loads(f.read_text()) for f in (tmp_path / "state" / "profiles").glob("*.json")]
    assert len(saved) == 1, saved
    assert saved[0]["observations"].get("compile_cache_cold") == 0.0, (
        saved[0]["observations"],
        proc.named("launch_started"),
    )
    assert saved[0]["flags"]["max_model_len"] == context
    first = len(engine_records(tmp_path))

    shutil.rmtree(cache)  # a wiped cache (a new image, a new box): the next start compiles from nothing
    with running(tmp_path, body, scenario, env=THIS_CHECKOUT) as (proc, config):
        proc.wait_event("serving", START_S)
        check = proc.named("compile_cache_cold")
        assert len(check) == 1 and check[0]["context_fits"] is not None
        relaunch = proc.named("compile_cache_cold_relaunch")
        assert len(relaunch) == 1, proc.tail(40)
        assert not proc.named("search_step"), proc.tail(40)
        stop_cleanly(proc, config, tmp_path)
    launches = engine_records(tmp_path)[first:]
    assert [r["outcome"] for r in launches][-1] == "ready" and len(launches) == 2
    assert launches[0]["outcome"] != "ready"
    assert launches[0]["flags"]["max_model_len"] == launches[1]["flags"]["max_model_len"] == context
