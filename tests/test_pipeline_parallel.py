"""Pipeline-parallel layouts (issue 17, point 6): vLLM's layer split, what each stage's GPU holds, and
``plan`` answering "how many nodes of what", in agreement with the Helm chart's multi-node example."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from r1sup.core import catalog, modelarch, planner, vllmversion
from r1sup.core import memmodel as M
from r1sup.core.flags import EngineFlags
from r1sup.core.hardware import GIB, DeviceFacts, GpuInfo
from r1sup.core.modelarch import arch_from_config

ROOT = Path(__file__).resolve().parent.parent
R1 = "deepseek-ai/DeepSeek-R1"
L70 = "deepseek-ai/DeepSeek-R1-Distill-Llama-70B"
Q32 = "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"
Q15 = "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"  # tied embeddings


def arch(model_id: str) -> modelarch.ModelArch:
    return arch_from_config(catalog.MODELS[model_id], name=model_id)


def gpus(name: str, count: int) -> DeviceFacts:
    found = catalog.find_gpu(name)
    assert found is not None
    spec = found[1]
    total = int(spec.total_gib * GIB)
    return DeviceFacts(
        backend="cuda",
        gpus=tuple(GpuInfo(i, found[0], total, total, spec.compute_capability) for i in range(count)),
        source="catalog",
    )


SPLITS = [(61, 2), (61, 3), (61, 4), (80, 3), (64, 8), (28, 3), (48, 5), (10, 4), (5, 5), (7, 1)]


def vllms_get_pp_indices() -> Any:
    """``get_pp_indices`` of the installed vLLM (vllm/distributed/utils.py), its own source compiled alone
    with ``VLLM_PP_LAYER_PARTITION`` unset: importing its module imports torch, a minute of a loaded core
    in each test process."""
    import ast
    import importlib.util
    import logging
    import types

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    path = Path(spec.submodule_search_locations[0]) / "distributed" / "utils.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    [func] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_pp_indices"]
    scope: dict[str, Any] = {
        "envs": types.SimpleNamespace(VLLM_PP_LAYER_PARTITION=None),
        "logger": logging.getLogger("vllm.distributed.utils"),
    }
    exec(compile(ast.Module([func], type_ignores=[]), str(path), "exec"), scope)  # noqa: S102 - vLLM's code
    return scope["get_pp_indices"]


@pytest.mark.parametrize(("layers", "pp"), SPLITS)
def test_the_layer_split_is_vllms(layers: int, pp: int) -> None:
    get_pp_indices = vllms_get_pp_indices()
    ranges = [get_pp_indices(layers, rank, pp) for rank in range(pp)]
    assert M.pp_partition(layers, pp) == tuple(end - start for start, end in ranges)
    assert [r[0] for r in ranges] == [sum(M.pp_partition(layers, pp)[:i]) for i in range(pp)]


def test_a_split_needs_a_layer_per_stage() -> None:
    assert M.pp_refusal(arch(Q15), 29) is not None and M.pp_refusal(arch(Q15), 28) is None
    with pytest.raises(ValueError, match="cannot be split"):
        M.pipelined(arch(Q15), 29)


@pytest.mark.parametrize(
    ("model_id", "pp", "tp", "kv_dtype"),
    [(R1, 2, 8, "auto"), (R1, 4, 4, "fp8"), (L70, 3, 2, "auto"), (Q32, 2, 1, "fp8"), (Q15, 4, 1, "auto")],
)
def test_the_stages_hold_the_model_once(model_id: str, pp: int, tp: int, kv_dtype: str) -> None:
    """Every layer's weights and KV on exactly one stage: the stages add up to the unsplit model, plus
    what each stage keeps of its own (the rotary cache, and a tied LM head's copy on the last stage)."""
    whole = arch(model_id)
    flags = EngineFlags(tensor_parallel_size=tp, kv_cache_dtype=kv_dtype)
    stages = M.pipeline_stages(M.pipelined(whole, pp))
    assert [s.layers for s in stages] == list(M.pp_partition(whole.layers, pp))
    assert [s.first_stage for s in stages] == [True] + [False] * (pp - 1)
    assert [s.last_stage for s in stages] == [False] * (pp - 1) + [True]
    assert sum(s.dense_layers for s in stages) == whole.dense_layers
    assert sum(M.kv_bytes_per_token(s, kv_dtype, tp) for s in stages) == M.kv_bytes_per_token(
        whole, kv_dtype, tp
    )
    rope = 0 if whole.is_mla else whole.max_position_embeddings * whole.head_dim * whole.dtype_bytes
    tied_head = whole.vocab * whole.hidden * whole.dtype_bytes // tp if whole.tied else 0
    split = sum(M.weights_bytes(s, flags) for s in stages)
    assert split == pytest.approx(M.weights_bytes(whole, flags) + (pp - 1) * rope + tied_head, abs=pp)
    # only the last stage samples: the sampler's vocabulary-wide warm-up is not on the others
    device = gpus("H100 80GB", tp)
    v = vllmversion.as_version("0.32.0")
    first, last = M.evaluate_stages(M.pipelined(whole, pp), device, flags, v)[:: pp - 1]
    assert first.activation.bytes <= last.activation.bytes


@pytest.mark.parametrize(
    ("model_id", "pp", "gpu"), [(R1, 2, "H100 80GB"), (L70, 4, "RTX 4090"), (Q32, 2, "L4")]
)
def test_every_stage_gets_the_fullest_stages_blocks(model_id: str, pp: int, gpu: str) -> None:
    """vLLM gives every rank the smallest rank's KV block count (get_kv_cache_configs): the plan's
    capacity is the stage with the fewest blocks."""
    a = M.pipelined(arch(model_id), pp)
    device = gpus(gpu, 8)
    flags = EngineFlags(max_model_len=4096, tensor_parallel_size=8 if model_id == R1 else 4)
    p = planner.plan(a, device, flags, version="0.32.0")
    per_stage = [e.num_blocks * e.block_size for e in M.evaluate_stages(a, device, flags, "0.32.0")]
    assert len(per_stage) == pp and p.kv_capacity_tokens == min(per_stage)
    assert len(p.stage_breakdowns) == pp and p.layout.stage_layers == tuple(M.pp_partition(a.layers, pp))
    layout = p.to_dict()["layout"]  # plan --json: 16 GPUs are two nodes of 8, 8 GPUs one
    assert layout["gpus"] == pp * flags.tensor_parallel_size
    assert (layout["gpus"], layout["nodes"]) in ((16, 2), (8, 1))
    assert layout["stage_layers"] == list(M.pp_partition(a.layers, pp))
    assert len(layout["stage_breakdowns"]) == pp


@pytest.mark.parametrize(
    ("model_id", "gpu", "flags", "per_node"),
    [
        (
            R1,
            "H100 80GB",
            {"max_model_len": 32768, "gpu_memory_utilization": 0.92, "tensor_parallel_size": 8},
            8,
        ),
        (R1, "A100 40GB", {"max_model_len": 16384, "tensor_parallel_size": 8}, 8),
        (L70, "RTX 4090", {"max_model_len": 32768, "tensor_parallel_size": 4}, 4),
        (L70, "L4", {"max_model_len": 65536, "tensor_parallel_size": 2}, 2),
    ],
)
def test_how_many_nodes_of_what(
    model_id: str, gpu: str, flags: dict[str, int | float], per_node: int
) -> None:
    """The multi-node way out is the fewest nodes: planned again as given it fits, one stage less not."""
    a = arch(model_id)
    device = gpus(gpu, int(flags["tensor_parallel_size"]))
    p = planner.plan(a, device, EngineFlags(**flags), version="0.32.0", gpus_per_node=per_node)
    assert p.verdict != "fits"
    way = next(s for s in p.suggestions if s.kind == "pipeline_parallel")
    pp, tp = way.pipeline_parallel_size, way.flags.tensor_parallel_size
    assert way.nodes == -(-tp * pp // per_node) and way.gpus_per_node == per_node
    assert way.argv[-2:] == ["--pipeline-parallel-size", str(pp)]
    assert f"{tp} x pipeline parallel {pp}" in way.title and f"of {per_node} x {gpu}" in way.title
    again = planner.plan(M.pipelined(a, pp), device, way.flags, version="0.32.0", gpus_per_node=per_node)
    assert again.verdict == "fits" and again.kv_capacity_tokens == way.kv_capacity_tokens
    fewer = M.pipelined(a, pp - 1) if pp > 2 else a
    assert planner.plan(fewer, device, way.flags, version="0.32.0").verdict != "fits"


def test_one_node_of_h200_holds_the_full_r1() -> None:
    p = planner.plan(
        arch(R1), gpus("H200 141GB", 8), EngineFlags(max_model_len=32768, tensor_parallel_size=8)
    )
    assert p.verdict == "fits" and not [s for s in p.suggestions if s.kind == "pipeline_parallel"]


# --- plan against the multi-node deployment --------------------------------------------------------


def multinode_config(tmp_path: Path) -> Path:
    """r1sup.toml of the chart's multi-node example, as the chart renders it (deploy/helm/r1sup)."""
    yaml = pytest.importorskip("yaml")
    helm = pytest.importorskip("helm_python")
    chart = ROOT / "deploy" / "helm" / "r1sup"
    values = yaml.safe_load((chart / "examples" / "multinode-deepseek-r1.yaml").read_text())
    with helm.Chart.load(str(chart)) as loaded:
        doc = yaml.safe_load(
            loaded.render(values, name="r1", namespace="serving")["r1sup/templates/configmap.yaml"]
        )
    path = tmp_path / "r1sup.toml"
    path.write_text(doc["data"]["r1sup.toml"] + f'\n[state]\ndir = "{tmp_path / "state"}"\n')
    return path


def r1sup_plan(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("R1SUP_", "FAKE_VLLM"))}
    return subprocess.run(
        [sys.executable, "-m", "r1sup.cli.app", "plan", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def test_plan_agrees_with_the_multinode_deployment(tmp_path: Path) -> None:
    """The chart's multi-node example serves the full R1 with tensor parallel 8 (``[start]``) and pipeline
    parallel 2 (``server.extra_args``) on 2 nodes of 8 x 80 GB: plan reads both and says it fits."""
    config = multinode_config(tmp_path)
    out = r1sup_plan("--config", str(config), "--gpu", "H100 80GB", "--vllm-version", "0.32.0")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "verdict FITS as given (exit 0)" in out.stdout
    assert (
        "tensor parallel 8 x pipeline parallel 2 = 16 GPUs on 2 nodes of 8; layers per stage 31, 30"
        in out.stdout
    )
    assert "pipeline stage 1 of 2 (31 layers with the embeddings)" in out.stdout
    d = json.loads(r1sup_plan("--config", str(config), "--gpu", "H100 80GB", "--json").stdout)
    assert (
        d["layout"]["nodes"] == 2 and d["layout"]["gpus"] == 16 and d["model"]["pipeline_parallel_size"] == 2
    )

    # one node of the same GPUs: plan says how many nodes it takes, the deployment's layout
    one = r1sup_plan("--config", str(config), "--gpu", "H100 80GB", "--pipeline-parallel-size", "1")
    assert one.returncode == 3
    assert "+ 2 nodes of 8 x H100 80GB: tensor parallel 8 x pipeline parallel 2" in one.stdout
    assert "--tensor-parallel-size 8 --pipeline-parallel-size 2" in one.stdout


def test_a_bad_pipeline_size_is_a_usage_error(tmp_path: Path) -> None:
    out = r1sup_plan("--model", Q15, "--gpu", "L4", "--pipeline-parallel-size", "29")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("r1sup: error: --pipeline-parallel-size: 28 layers cannot be split")
