"""Tuner helpers: calibration from earlier profiles, the status line, first flags."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from r1sup.core import catalog, planner, vllmversion
from r1sup.core import config as cfg
from r1sup.core import events as E
from r1sup.core import memmodel as M
from r1sup.core.events import status_line
from r1sup.core.figures import Figures
from r1sup.core.flags import EngineFlags
from r1sup.core.hardware import GIB, DeviceFacts, GpuInfo
from r1sup.core.knowledge import adopt_versions
from r1sup.state import profiles
from r1sup.state.calibration import calibration
from r1sup.supervision.tuner import ModelKnowledge, planner_suggestions
from r1sup_proc import write_config

Q7 = "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
BOX = DeviceFacts(backend="cuda", gpus=(GpuInfo(0, "NVIDIA GeForce RTX 4090", 24 * GIB, 23 * GIB, (8, 9)),))


def fp(**changes: object) -> dict:
    base = dict(
        model="deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
        model_config_hash="abc",
        device=BOX,
        versions={"vllm": "0.33.0", "torch": "2.9.0"},
        target={"concurrency": 4, "context": 8192},
        tensor_parallel_size=1,
        r1sup_version="0.1.0",
    )
    base.update(changes)
    return profiles.fingerprint(**base)  # type: ignore[arg-type]


def save(store: profiles.ProfileStore, fingerprint: dict, flags: EngineFlags, observations: dict) -> None:
    profile = profiles.Profile.create(
        fingerprint=fingerprint,
        model="deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
        served_name="r1",
        flags=flags,
        command=["vllm"],
        probe={"ok": True},
        observations=Figures(**observations),
    )
    assert store.save(profile) is not None


def test_calibration_carries_a_launch_to_another_target_on_the_same_box(tmp_path: Path):
    store = profiles.ProfileStore(tmp_path)
    figures = {"weights_gib": 14.2, "non_torch_gib": 0.4, "cudagraph_gib": 1.1, "kv_cache_gib": 5.0}
    save(store, fp(), EngineFlags(max_model_len=32768), figures)
    found = calibration(store, fp(target={"concurrency": 8, "context": 4096}))
    assert found is not None
    assert found.flags == EngineFlags(max_model_len=32768)  # the flags the figures were measured with
    assert found.figures.to_dict() == figures and str(found.version) == "0.33.0"
    # the memory model moves them to other flags: fp8 weights shrink the measured 14.2 GiB
    know = ModelKnowledge(device=BOX, arch=planner.arch_from_config(catalog.MODELS[Q7]))
    fp8 = M.evaluate(know.arch, BOX, EngineFlags(quantization="fp8"), "0.33.0", found)
    assert fp8.weights.source == M.SCALED and 7.5 < fp8.weights.gib < 9.0


def test_calibration_ignores_other_boxes_and_other_engines(tmp_path: Path):
    store = profiles.ProfileStore(tmp_path)
    other_gpu = DeviceFacts(
        backend="cuda", gpus=(GpuInfo(0, "NVIDIA GeForce RTX 3090", 24 * GIB, 23 * GIB, (8, 6)),)
    )
    save(store, fp(device=other_gpu), EngineFlags(), {"weights_gib": 14.2})
    save(store, fp(versions={"vllm": "0.20.0", "torch": "2.6.0"}), EngineFlags(), {"weights_gib": 14.3})
    assert calibration(store, fp(target={"concurrency": 1, "context": 2048})) is None


def test_the_version_comes_from_the_fingerprint_when_nothing_else_knows_it():
    know = ModelKnowledge(device=BOX)
    assert know.version() == vllmversion.NEWEST_KNOWN
    adopt_versions(know, profiles.fingerprint_vllm(fp(versions={"vllm": "0.19.0", "torch": "2.6.0"})))
    assert str(know.version()) == "0.19.0"
    adopt_versions(know, profiles.fingerprint_vllm(fp()))  # a version already known is kept
    assert str(know.version()) == "0.19.0"


def test_status_line_reads_like_an_operator_would_write_it():
    old = EngineFlags(max_model_len=8192)
    new = EngineFlags(max_model_len=3712)
    assert status_line(2, old, new, "kv_insufficient") == "attempt 2: context 8192 -> 3712 (kv_insufficient)"


def test_ways_out_after_an_exhausted_ladder_respect_the_configured_shortest_context(tmp_path: Path):
    # 14B in bf16 does not fit a 24 GiB card; the user will not serve less than 40000 tokens
    model = "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B"
    body = {"model": {"name": model}, "search": {"min_max_model_len": 40000}}
    config = cfg.load(write_config(tmp_path / "c.toml", body), environ={})
    found = catalog.find_model(model)
    assert found is not None
    know = ModelKnowledge(device=BOX, arch=planner.arch_from_config(found[1]))
    ways = planner_suggestions(config, know, EngineFlags(max_model_len=65536))
    offload = [w for w in ways if w.startswith("offload")]
    assert len(offload) == 1, ways
    # a way out that fits only a shorter context than the config allows is not offered as one
    (length,) = [int(a.split()[1]) for a in offload[0].split(" --")[1:] if a.startswith("max-model-len")]
    assert length >= 40000, offload


# --- the search's events, in process -----------------------------------------------------------------


class ScriptedRunner:
    """A runner whose launches end as scripted (a failure class, or "ok"), with no process behind."""

    def __init__(self, outcomes: list[str]) -> None:
        self.outcomes = list(outcomes)
        self.launched: list[EngineFlags] = []
        self.stopped: list[str] = []

    def check_signals(self) -> None:
        pass

    def sleep(self, seconds: float) -> Iterator[Any]:
        yield from ()

    def launch(self, flags: EngineFlags, *, attempt: int) -> Iterator[Any]:
        from r1sup.core import failure as F

        yield from ()

        self.launched.append(flags)
        outcome = self.outcomes.pop(0)
        failure = (
            F.NO_FAILURE
            if outcome == "ok"
            else F.Failure(outcome, F.PHASE_CUDA_GRAPH, evidence=f"scripted {outcome}")
        )
        return SimpleNamespace(
            started_engine=True,
            spec=SimpleNamespace(display=("vllm", "serve")),
            failure=failure,
            ready=outcome == "ok",
            figures=Figures(),
            progress=None,
            probe={"ok": True} if outcome == "ok" else None,
            stands_on=None,
        )

    def capacity_failure(self, launch: Any) -> None:
        return None

    def probe(self, launch: Any) -> Iterator[Any]:
        raise AssertionError("the probe is off in this config")

    def stop(self, launch: Any, *, reason: str) -> Iterator[Any]:
        yield from ()
        self.stopped.append(reason)


def test_the_search_publishes_typed_events_in_the_order_they_happen(tmp_path: Path, monkeypatch: Any):
    from r1sup.supervision import tuner as T

    body = {"model": {"name": Q7}, "probe": {"enabled": False}, "search": {"first_launch": "as_configured"}}
    config = cfg.load(write_config(tmp_path / "c.toml", body), environ={})
    know = ModelKnowledge(device=BOX, arch=planner.arch_from_config(catalog.MODELS[Q7]))
    runner = ScriptedRunner(["oom_cudagraph", "ok"])
    seen: list[E.SearchEvent] = []
    monkeypatch.setattr(T.Tuner, "refresh_device", lambda self: iter(()))
    start = EngineFlags(max_model_len=8192)
    search = T.Tuner(config, runner, log=structlog_null(), know=know, publish=seen.append).run(start)  # type: ignore[arg-type]
    with pytest.raises(StopIteration) as ended:  # the scripted runner has no waits: it never yields
        next(search)
    result = ended.value.value
    assert result.ok and result.launches == 2, result.reason
    kinds = [type(e).__name__ for e in seen]
    # the flags found give up part of what was asked (ConfigReduced says what), then the success
    assert kinds == [
        *("Launching", "AttemptFailed", "SearchStepped"),
        *("Launching", "ConfigReduced", "SearchSucceeded"),
    ], result.reduced
    launching, failed, step, again, reduced, succeeded = seen
    assert isinstance(reduced, E.ConfigReduced) and reduced.reduction == result.reduced
    assert isinstance(launching, E.Launching) and launching.attempt == 1 and launching.flags == start
    assert isinstance(failed, E.AttemptFailed) and failed.failure.cls == "oom_cudagraph"
    assert isinstance(step, E.SearchStepped) and step.old == start and step.new == runner.launched[1]
    assert step.evidence == failed.failure.evidence and step.reason  # what the search_step line says
    # the STATUS= line of the step, computed where the step is
    assert step.status.startswith("attempt 2: context 8192 -> ") and step.status.endswith(" (oom_cudagraph)")
    assert "gpu_memory_utilization 0.9 -> " in step.status, step.status
    assert isinstance(again, E.Launching) and again.attempt == 2 and again.flags == step.new
    assert isinstance(succeeded, E.SearchSucceeded) and succeeded == E.SearchSucceeded(2, step.new)


def structlog_null() -> Any:
    class Null:
        def __getattr__(self, name: str) -> Any:
            return lambda *args, **kwargs: None

    return Null()
