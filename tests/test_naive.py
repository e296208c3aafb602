"""The naive strategy (r1sup.core.naive): the hand walk kept as the benchmarks' baseline, reached through the
search with ``search.strategy = "naive"``, with or without the model's architecture."""

from __future__ import annotations

from r1sup.core import catalog, modelarch, naive
from r1sup.core import failure as F
from r1sup.core import search as S
from r1sup.core.bounds import BlindFacts, Bounds
from r1sup.core.failure import Failure, Numbers
from r1sup.core.flags import EngineFlags

TINY_CPU = BlindFacts(
    backend="cpu", total_gib=7.71, free_gib=6.9, kv_bytes_per_token=1024, block_size=128, model_max_len=32768
)
Q14 = modelarch.arch_from_config(catalog.MODELS["deepseek-ai/DeepSeek-R1-Distill-Qwen-14B"])
R14_4090 = BlindFacts(
    backend="cuda",
    total_gib=23.99,
    free_gib=23.5,
    compute_capability=(8, 9),
    kv_bytes_per_token=196608,
    model_max_len=131072,
    gpu_name="NVIDIA GeForce RTX 4090",
    arch=Q14,
)


def kv_fail(length: int, estimate: int) -> Failure:
    return Failure(
        F.KV_INSUFFICIENT,
        F.PHASE_KV_CACHE,
        "ValueError: To serve at least one request ...",
        Numbers.from_dict({"max_model_len": length, "estimated_max_model_len": estimate}),
    )


def naive_search(
    facts: BlindFacts, flags: EngineFlags, arch: modelarch.ModelArch | None, **bounds: object
) -> S.Search:
    device = facts.device()
    limits = Bounds(strategy="naive", **bounds)  # type: ignore[arg-type]
    return S.Search(S.Facts(arch=arch, device=device, user=flags, bounds=limits, ladder_facts=facts))


def test_naive_halves_then_fp8_then_eager_then_util():
    flags = EngineFlags(max_model_len=4096)
    search = naive_search(TINY_CPU, flags, None, min_max_model_len=1024)
    seen = []
    for _ in range(5):
        d = search.after(S.Outcome(flags, kv_fail(4096, 3000)))
        assert isinstance(d, S.Next) and not d.retry
        seen.append(flags.describe_change(d.flags))
        flags = d.flags
    assert seen == [
        "max_model_len 4096 -> 2048",
        "max_model_len 2048 -> 1024",
        "kv_cache_dtype auto -> fp8",
        "enforce_eager false -> true",
        "gpu_memory_utilization 0.9 -> 0.85",
    ]


def test_naive_walks_by_hand_even_when_the_architecture_is_known():
    # the search would size the context from vLLM's estimate; the baseline only halves it
    flags = EngineFlags(max_model_len=131072)
    d = naive_search(R14_4090, flags, Q14).after(S.Outcome(flags, kv_fail(131072, 40000)))
    assert isinstance(d, S.Next) and d.flags == flags.replace(max_model_len=65536)
    assert d.reason == "halve the context: 131072 -> 65536"


def test_the_walk_stays_within_the_bounds():
    flags = EngineFlags(
        max_model_len=4096, kv_cache_dtype="fp8", enforce_eager=True, gpu_memory_utilization=0.5
    )
    bounds = Bounds(strategy="naive", min_max_model_len=4096, min_gpu_memory_utilization=0.5)
    assert naive.walk(flags, TINY_CPU, bounds) == []
    off = Bounds(strategy="naive", allow_fp8_kv=False, allow_eager=False, min_max_model_len=4096)
    assert naive.walk(EngineFlags(max_model_len=4096), TINY_CPU, off) == [
        (EngineFlags(max_model_len=4096, gpu_memory_utilization=0.85), "lower utilization -> 0.85")
    ]
