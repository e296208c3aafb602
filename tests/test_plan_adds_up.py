"""``r1sup plan`` adds up (issue 16, point 6): every way out is one change whose command, planned again
as given, fits with the figures it claims; one verdict, said alike in the text, the JSON and the exit
status; the memory chart. Real ``r1sup plan`` subprocesses for exit codes and streams."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from r1sup.core import catalog, modelarch, planner
from r1sup.core import memmodel as M
from r1sup.core.bounds import Bounds
from r1sup.core.flags import EngineFlags
from r1sup.core.hardware import GIB, DeviceFacts, GpuInfo
from r1sup.core.modelarch import arch_from_config

ROOT = Path(__file__).resolve().parent.parent
Q7 = "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
Q14 = "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B"
Q32 = "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"
L8 = "deepseek-ai/DeepSeek-R1-Distill-Llama-8B"
L70 = "deepseek-ai/DeepSeek-R1-Distill-Llama-70B"
R1 = "deepseek-ai/DeepSeek-R1"


def arch(model_id: str) -> modelarch.ModelArch:
    return arch_from_config(catalog.MODELS[model_id], name=model_id)


def gpu(name: str, count: int = 1, free_gib: float | None = None) -> DeviceFacts:
    found = catalog.find_gpu(name)
    assert found is not None, name
    spec = found[1]
    total = int(spec.total_gib * GIB)
    free = int(free_gib * GIB) if free_gib is not None else total
    source = "probe" if free_gib is not None else "catalog"
    return DeviceFacts(
        backend="cuda",
        gpus=tuple(GpuInfo(i, found[0], total, free, spec.compute_capability) for i in range(count)),
        source=source,
    )


# (model, GPU, GPUs, free GiB or None, flags, target concurrency, target context)
CASES: list[tuple[str, str, int, float | None, dict[str, Any], int | None, int | None]] = [
    (Q14, "RTX 4090", 1, None, {"max_model_len": 8192}, None, None),  # the issue's offload example
    (Q14, "RTX 4090", 1, None, {}, None, None),  # the full 131,072 context
    (Q32, "RTX 4090", 1, None, {"max_model_len": 8192}, None, None),
    (Q32, "L40S", 1, None, {"max_model_len": 32768}, 4, 8192),
    (Q7, "RTX 3090", 1, None, {}, None, None),
    (Q7, "L4", 1, None, {"max_model_len": 16384}, 8, 4096),
    (L8, "RTX 4090", 1, None, {"max_model_len": 200_000}, None, None),  # above the model's limit
    (L70, "A100 80GB", 1, None, {"max_model_len": 32768}, None, None),
    (L70, "RTX 4090", 2, None, {"max_model_len": 8192}, 2, None),
    (Q14, "H100 80GB", 1, 59.11, {"max_model_len": 32768}, 2, None),  # a busy GPU: 20 GiB held
    (Q32, "H100 80GB", 1, 30.0, {"max_model_len": 32768}, None, None),  # busy: the free part is not enough
    (R1, "H100 80GB", 8, None, {"max_model_len": 32768, "gpu_memory_utilization": 0.92}, None, None),
    (R1, "A100 40GB", 8, None, {"max_model_len": 16384}, None, None),
]
IDS = [f"{m.split('-')[-1]}-{g.replace(' ', '')}x{n}-{i}" for i, (m, g, n, *_rest) in enumerate(CASES)]

# the flags each kind of way out may change (beyond --max-model-len, which its title names when shorter)
CHANGES = {
    "utilization": {"gpu_memory_utilization"},
    "shorter_context": set(),
    "fp8_kv": {"kv_cache_dtype"},
    "fp8_weights": {"quantization"},
    "four_bit": {"quantization"},
    "tensor_parallel": {"tensor_parallel_size"},
    "pipeline_parallel": {"tensor_parallel_size"},
    "cpu_offload": {"cpu_offload_gb"},
    "enforce_eager": {"enforce_eager"},
    "fewer_seqs": {"max_num_seqs"},
}


def _changed(new: EngineFlags, old: EngineFlags) -> set[str]:
    return {
        f.name
        for f in dataclasses.fields(EngineFlags)
        if f.name != "max_model_len" and getattr(new, f.name) != getattr(old, f.name)
    }


def _plan(case: tuple[Any, ...]) -> tuple[modelarch.ModelArch, DeviceFacts, EngineFlags, planner.Plan]:
    model, name, count, free, flags, conc, ctx = case
    a = arch(model)
    device = gpu(name, count, free)
    f = EngineFlags(tensor_parallel_size=count, **flags)
    return a, device, f, planner.plan(a, device, f, target_concurrency=conc, target_context=ctx)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_way_out_fits_as_its_own_command_says(case: tuple[Any, ...]) -> None:
    a, device, flags, p = _plan(case)
    _, _, _, free, _, conc, ctx = case
    asked = min(p.max_model_len, a.max_position_embeddings)
    for way in p.suggestions:
        assert way.fits, way.title
        # its command is what its numbers say
        assert way.flags.max_model_len == way.context <= a.max_position_embeddings, way.title
        assert ("--max-model-len", str(way.context)) in zip(way.argv, way.argv[1:], strict=False)
        if way.context < asked:
            assert f"{way.context:,}" in way.title and f"{asked:,}" in way.title, way.title
        # one change, the one its title names (a busy GPU: at the utilization that can start, said so)
        changed = _changed(way.flags, flags)
        if free is not None and way.kind != "utilization" and "gpu_memory_utilization" in changed:
            assert "what is free" in way.title
            changed -= {"gpu_memory_utilization"}
        if way.kind == "pipeline_parallel":  # the layout: pipeline stages, a node's GPUs for tensor parallel
            assert way.pipeline_parallel_size > 1 and changed <= CHANGES[way.kind], (way.title, changed)
        elif way.kind == "four_bit" and changed != CHANGES[way.kind]:
            # a 4-bit checkpoint that alone does not hold the context: the search's first flags for it,
            # each other change named in its title as its vLLM argument
            assert CHANGES[way.kind] < changed and way.pipeline_parallel_size == 1, (way.title, changed)
            for name in changed - CHANGES[way.kind]:
                arg = "--" + name.replace("_", "-")
                assert arg in way.title.split(", with ", 1)[1], (way.title, name)
        else:
            assert changed == CHANGES[way.kind] and way.pipeline_parallel_size == 1, (way.title, changed)
        # planned again exactly as given, the same target and the model split the same way: it fits,
        # with the figures the way out claimed
        split = M.pipelined(a, way.pipeline_parallel_size) if way.pipeline_parallel_size > 1 else a
        # ways out ignore the ladder's bounds (a person decides): one below the utilization floor is
        # planned again with the floor at it
        floor = Bounds(min_gpu_memory_utilization=min(0.5, way.flags.gpu_memory_utilization))
        again = planner.plan(
            split, device, way.flags, target_concurrency=conc, target_context=ctx, bounds=floor
        )
        assert again.verdict == "fits" and again.fits and again.exit_code == 0, (
            way.title,
            again.verdict_reason,
        )
        assert again.kv_capacity_tokens == way.kv_capacity_tokens, way.title
        assert again.weights_gib == pytest.approx(way.weights_gib, abs=1e-9), way.title
        assert again.max_context == way.max_context, way.title
    # the fewest GPUs: one tensor-parallel size less than the way out's does not keep its context
    for way in p.suggestions:
        if way.kind != "tensor_parallel":
            continue
        smaller = [
            t
            for t in M.valid_tp_sizes(a, way.flags.tensor_parallel_size - 1)
            if t > flags.tensor_parallel_size
        ]
        for tp in smaller:
            fewer = way.flags.replace(tensor_parallel_size=tp)
            again = planner.plan(a, device, fewer, target_concurrency=conc, target_context=ctx)
            assert again.verdict != "fits", (way.title, tp)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_one_verdict_in_text_json_and_exit_status(case: tuple[Any, ...]) -> None:
    from r1sup.adapters.modelinfo import ModelSource
    from r1sup.cli.commands.plan import render

    _, device, _, p = _plan(case)
    d = json.loads(json.dumps(p.to_dict()))
    text = render(p, ModelSource({}, "catalog", p.model.name), device)
    verdict = next(line for line in text.splitlines() if line.startswith("verdict "))
    assert d["verdict"] == {"status": p.verdict, "reason": p.verdict_reason, "exit_code": p.exit_code}
    assert p.exit_code == {"fits": 0, "fits_with_changes": 7, "does_not_fit": 3}[p.verdict]
    assert p.verdict_reason in verdict and f"(exit {p.exit_code})" in verdict
    if d["fits"]:
        assert p.verdict == "fits" and verdict.startswith("verdict FITS as given")
    else:
        assert "FITS as given" not in text
    assert (p.verdict == "fits_with_changes") == (d["recommended"] is not None and not d["fits"]) or (
        p.verdict == "does_not_fit" and "target is not met" in p.verdict_reason
    )
    assert "FITS, but not as given" not in text  # the old wording that sat beside starts_as_given: true
    if d["starts_as_given"]:
        assert "would not start" not in verdict and "would stop" not in verdict
    else:
        # the real reason: vLLM refuses or stops at start-up, not "target NOT met"
        assert "NOT met" not in text
        assert any(w in p.verdict_reason for w in ("refuses", "would not start", "would stop", "exceed"))
    if d["startup_problem"] and "free memory" in d["startup_problem"]:
        assert "vLLM would not start: free memory on the device" in verdict
    # ways out are listed only where they fit
    assert all(s["fits"] for s in d["suggestions"]) and "not enough" not in text


def test_the_issues_offload_example_keeps_the_context_asked() -> None:
    _, _, flags, p = _plan(CASES[0])
    offload = next(s for s in p.suggestions if s.kind == "cpu_offload")
    assert offload.context == 8192 and offload.flags.kv_cache_dtype == "auto"
    assert offload.title == f"offload {offload.flags.cpu_offload_gb:g} GiB of weights to host memory"
    eager = [s for s in p.suggestions if s.kind == "enforce_eager"]
    assert all(s.flags.kv_cache_dtype == flags.kv_cache_dtype for s in eager)
    # not listed: the levers that cannot rescue weights larger than the budget
    assert not {"fp8_kv", "enforce_eager", "fewer_seqs"} & {s.kind for s in p.suggestions}


def test_the_issues_32b_on_a_4090_names_a_4_bit_checkpoint() -> None:
    # issue 36: 32B on an RTX 4090 at 8,192 tokens listed only tensor parallel and an offload; with a
    # 4-bit checkpoint the weights leave room for the context (with the search's first flags for it)
    _, _, _, p = _plan(CASES[2])
    kinds = [s.kind for s in p.suggestions]
    assert "four_bit" in kinds, kinds
    # the ways out stay mildest first: a checkpoint on this GPU before more GPUs and the offload
    assert kinds.index("four_bit") < kinds.index("tensor_parallel") < kinds.index("cpu_offload")
    four = p.suggestions[kinds.index("four_bit")]
    assert four.title.startswith("a 4-bit checkpoint (AWQ or GPTQ)")
    assert four.flags.quantization == "awq" and four.context == 8192
    assert four.kv_capacity_tokens >= 2 * 8192
    # 4-bit linear layers, 16-bit embeddings and LM head: about 30% of the bf16 weights
    assert 0.25 * p.weights_gib < four.weights_gib < 0.32 * p.weights_gib
    assert four.requires is not None and "--quantization awq or gptq" in four.requires


def test_above_the_models_limit_is_refused_and_never_proposed() -> None:
    a, _, _, p = _plan(CASES[6])
    assert p.verdict != "fits" and "above the model's limit of 131,072" in p.verdict_reason
    assert p.recommended is not None and (p.recommended.max_model_len or 0) <= a.max_position_embeddings
    assert all((s.flags.max_model_len or 0) <= a.max_position_embeddings for s in p.suggestions)


def test_the_assumed_version_and_batch_defaults_are_printed() -> None:
    from r1sup.adapters.modelinfo import ModelSource
    from r1sup.cli.commands.plan import render

    _, device, _, p = _plan(CASES[0])
    text = render(p, ModelSource({}, "catalog", Q14), device, "--vllm-version")
    assert f"vLLM    {p.vllm_version} (--vllm-version), V1 engine" in text
    assert "batch   max_num_seqs 256 (default), max_num_batched_tokens 2048 (default)" in text


def test_the_chart_draws_each_part_of_the_gpu() -> None:
    from r1sup.adapters.modelinfo import ModelSource
    from r1sup.cli.commands.plan import render

    _, device, _, p = _plan(CASES[9])  # busy H100: as given beside the recommended flags
    text = render(p, ModelSource({}, "catalog", Q14), device)
    chart = text[text.index("memory of each GPU\n") :]
    assert "as given: GPU (H100 80GB, 79.11 GiB)" in chart
    assert "with the recommended flags: GPU (H100 80GB, 79.11 GiB)" in chart
    bars = [line for line in chart.splitlines() if line.startswith("  predicted |")]
    assert len(bars) == 2
    # 20 of 79.11 GiB held by another process: a quarter of the 60-character bar
    assert 14 <= bars[1].count("O") <= 16
    for part in ("W", "N", "A", "G", "K"):
        assert part in bars[1]


# --- real r1sup plan processes --------------------------------------------------------------------


def r1sup(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("R1SUP_", "FAKE_VLLM"))}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "fakenvml"), str(ROOT / "tests")])
    base["FAKE_VLLM_SCENARIO"] = json.dumps({"gpu": {"name": "RTX 4090"}})
    return subprocess.run(
        [sys.executable, "-m", "r1sup.cli.app", "plan", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize(
    ("argv", "code", "words"),
    [
        (["--model", Q7, "--gpu", "RTX 4090", "--max-model-len", "32768"], 0, "FITS as given"),
        (["--model", Q7, "--gpu", "RTX 4090"], 7, "FITS only with the recommended flags"),
        (["--model", Q14, "--gpu", "RTX 4090"], 3, "DOES NOT FIT within the bounds"),
        (["--model", Q7, "--gpu", "RTX 4090", "--max-model-len", "0"], 2, None),
    ],
)
def test_exit_status_and_streams(argv: list[str], code: int, words: str | None) -> None:
    text = r1sup(*argv)
    assert text.returncode == code, text.stderr
    if words is None:  # bad input: one line on stderr, nothing on stdout
        assert text.stdout == "" and text.stderr.count("\n") == 1
        return
    assert text.stderr == ""
    assert text.stdout.startswith("model ") and words in text.stdout
    assert "memory of each GPU" in text.stdout
    js = r1sup(*argv, "--json")
    assert js.returncode == code and js.stderr == ""
    assert json.loads(js.stdout)["verdict"]["exit_code"] == code  # stdout is exactly one JSON object


def test_scripts_can_chain_on_the_verdict(tmp_path: Path) -> None:
    marker = tmp_path / "deployed"
    fits = f"{sys.executable} -m r1sup.cli.app plan --model {Q7} --gpu 'RTX 4090' --max-model-len 32768"
    nofit = f"{sys.executable} -m r1sup.cli.app plan --model {Q14} --gpu 'RTX 4090'"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests" / "fakenvml") + os.pathsep + str(ROOT / "tests")}
    env["FAKE_VLLM_SCENARIO"] = json.dumps({"gpu": {"name": "RTX 4090"}})
    for command, deployed in ((fits, True), (nofit, False)):
        marker.unlink(missing_ok=True)
        subprocess.run(
            ["sh", "-c", f"{command} >/dev/null && touch {marker}"], env=env, timeout=120, check=False
        )
        assert marker.exists() is deployed, command


def test_a_busy_gpu_says_vllm_would_not_start() -> None:
    env = {"FAKE_VLLM_SCENARIO": json.dumps({"gpu": {"name": "H100", "other_process_gib": 20}})}
    out = r1sup("--model", Q14, "--max-model-len", "32768", "--target-concurrency", "2", env=env)
    assert out.returncode == 7, out.stderr
    verdict = next(line for line in out.stdout.splitlines() if line.startswith("verdict "))
    assert "vLLM would not start: free memory on the device (59.11/79.11 GiB)" in verdict
    assert "target  2 concurrent request(s): not met as given (vLLM would not start)" in out.stdout
    assert "+ use the memory that is free" in out.stdout


def test_help_documents_the_exit_codes() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "r1sup.cli.app", "plan", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    for line in ("0    fits as given", "7    fits only with the recommended flags", "3    does not fit"):
        assert line in out.stdout
    readme = (ROOT / "README.md").read_text()
    assert "| 7 | `plan` only:" in readme
