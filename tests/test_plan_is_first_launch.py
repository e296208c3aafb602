"""``r1sup plan --config`` recommends what ``tune`` launches first (issue 29): one recommender.

A property over the catalog (models x GPUs x vLLM versions x with and without a target x an idle and a
busy GPU): the plan's recommended flags and verdict are the first launch of ``tune`` as the tuner
decides it (:func:`r1sup.supervision.footing.plan_first_decision` on :func:`r1sup.core.knowledge.new_search`,
the code path ``tune`` and ``run`` take), and the plan's exit 3 means ``tune`` gives up without a launch. A
few real ``tune`` runs on the fake engine (tests/fakevllm) check the same against
``r1sup plan --config --json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r1sup.adapters.logs import get_logger
from r1sup.core import catalog, config, memmodel, planner
from r1sup.core.bounds import Bounds
from r1sup.core.flags import EngineFlags
from r1sup.core.hardware import GIB, DeviceFacts, GpuInfo, ProcessUse
from r1sup.supervision import footing, tuner

Q7 = "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
Q32 = "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"
L70 = "deepseek-ai/DeepSeek-R1-Distill-Llama-70B"
MODELS = sorted(m for m in catalog.MODELS if m != "deepseek-ai/DeepSeek-R1")
GPUS = sorted(name for name in catalog.GPUS if catalog.GPUS[name].platform == "cuda")
VERSIONS = ("0.10.0", "0.21.0", "0.33.0")
STARTS: tuple[dict[str, Any], ...] = (
    {},
    {"max_model_len": 32768},
    {"max_model_len": 131072, "max_num_seqs": 256},
    {"max_model_len": 16384, "gpu_memory_utilization": 0.85, "max_num_seqs": 4096},
)
TARGETS: tuple[dict[str, Any], ...] = ({}, {"concurrency": 4, "context": 8192})


def box(gpu: str, count: int, busy_gib: float) -> DeviceFacts:
    spec = catalog.GPUS[gpu]
    total = int(spec.total_gib * GIB)
    free = total - int(busy_gib * GIB)
    gpus = tuple(GpuInfo(i, gpu, total, free, spec.compute_capability) for i in range(count))
    held = (
        tuple(ProcessUse(4242, "other-job", int(busy_gib * GIB), i) for i in range(count)) if busy_gib else ()
    )
    return DeviceFacts(backend="cuda", gpus=gpus, processes=held, source="probe")


def both(model: str, device: DeviceFacts, version: str, start: dict[str, Any], target: dict[str, Any]):
    cfg = config.build({"model": {"name": model}, "start": start, "target": target}, env={})
    arch = memmodel.arch_from_config(catalog.MODELS[model])
    v = memmodel.as_version(version)
    # r1sup plan --config: the config's [start], [target] and [ladder], the box, the version
    plan = planner.plan(
        arch,
        device,
        EngineFlags.from_start(cfg.start),
        target_concurrency=cfg.target.concurrency,
        target_context=cfg.target.context,
        bounds=Bounds.from_config(cfg),
        version=v,
    )
    # r1sup tune: the tuner's first decision
    know = tuner.ModelKnowledge(device=device, arch=arch, vllm_version=version)
    search = tuner.new_search(cfg, know)
    first, why, give_up = footing.plan_first_decision(cfg, know, search, get_logger())
    return plan, first, give_up, EngineFlags.from_start(cfg.start)


def check(plan: Any, first: EngineFlags, give_up: Any, user: EngineFlags) -> None:
    if plan.verdict == "does_not_fit":
        assert plan.exit_code == 3 and give_up is not None  # tune gives up without a launch
        assert plan.recommended is None
        return
    assert give_up is None
    assert plan.recommended == first
    if plan.verdict == "fits":
        assert plan.exit_code == 0 and first.replace(max_model_len=user.max_model_len) == user
    else:
        assert plan.exit_code == 7 and first.replace(max_model_len=user.max_model_len) != user


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model=st.sampled_from(MODELS),
    gpu=st.sampled_from(GPUS),
    count=st.sampled_from([1, 1, 2]),
    version=st.sampled_from(VERSIONS),
    start=st.sampled_from(STARTS),
    target=st.sampled_from(TARGETS),
    busy=st.sampled_from([0.0, 0.0, 0.3]),
)
def test_plan_recommends_the_first_launch_of_tune(
    model: str, gpu: str, count: int, version: str, start: dict[str, Any], target: dict[str, Any], busy: float
) -> None:
    total = catalog.GPUS[gpu].total_gib
    start = {**start, "tensor_parallel_size": count} if count > 1 else start
    plan, first, give_up, user = both(model, box(gpu, count, busy * total), version, start, target)
    check(plan, first, give_up, user)


@pytest.mark.parametrize(
    ("model", "gpu", "busy", "start", "verdict"),
    [
        # the issue's cases: 7B on an RTX 4090 at 131072 (fp8 KV, vLLM's 256 sequences kept) and 70B on
        # an H200 beside 0.6 GiB of another process (bf16 weights leave about a GiB: a short context)
        (
            "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
            "RTX 4090",
            0.0,
            {"max_model_len": 131072},
            "fits_with_changes",
        ),
        ("deepseek-ai/DeepSeek-R1-Distill-Llama-70B", "H200 141GB", 0.6, {"max_model_len": 32768}, None),
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", "A100 80GB", 0.0, {"max_model_len": 32768}, None),
    ],
)
def test_the_issues_boxes(
    model: str, gpu: str, busy: float, start: dict[str, Any], verdict: str | None
) -> None:
    plan, first, give_up, user = both(model, box(gpu, 1, busy), "0.33.0", start, {})
    check(plan, first, give_up, user)
    if verdict:
        assert plan.verdict == verdict
    if model.endswith("Qwen-7B"):
        assert first.fp8_kv and first.max_num_seqs is None and first.max_model_len == 131072


FAKE_CASES = [
    ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", {"name": "RTX 4090"}, {"max_model_len": 131072}),
    (
        "deepseek-ai/DeepSeek-R1-Distill-Llama-70B",
        {"name": "H200", "total_gib": 141, "compute_capability": [9, 0], "other_process_gib": 0.6},
        {"max_model_len": 32768},
    ),
    ("deepseek-ai/DeepSeek-R1-Distill-Qwen-14B", {"name": "RTX 4090"}, {"max_model_len": 32768}),
    ("deepseek-ai/DeepSeek-R1-Distill-Llama-70B", {"name": "RTX 4090"}, {"max_model_len": 8192}),
]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("model", "gpu", "start"), FAKE_CASES)
def test_plan_config_is_the_first_launch_on_the_fake_engine(
    tmp_path: Path, model: str, gpu: dict[str, Any], start: dict[str, Any]
) -> None:
    from r1sup_proc import R1sup, write_config
    from test_tune_fake import fake_body, fake_env, fake_scenario, run_tune

    body = fake_body(tmp_path, model=model, start=start, ladder={"first_launch": "planned"})
    scenario = fake_scenario(tmp_path, gpu=gpu)
    path = write_config(tmp_path / "plan.toml", body)
    planned = R1sup(
        "plan", "--config", str(path), "--json", "--vllm-version", "0.32.0", env=fake_env(scenario)
    )
    try:
        code = planned.wait(60)
    finally:
        planned.kill()
    plan = json.loads("".join(planned.lines))
    t = run_tune(tmp_path, body, scenario)
    if code == 3:
        assert plan["verdict"]["status"] == "does_not_fit"
        assert t.code == 3 and t.result["launches"] == 0 and not t.engine, t.explain()
        return
    assert t.attempts, t.explain()
    assert plan["recommended"] == t.attempts[0]["flags"], t.explain()
    assert code == plan["verdict"]["exit_code"] and code in (0, 7)
