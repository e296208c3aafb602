"""The search's decisions: candidates over all levers, the objective, and the evidence rules.

Each case plays a failure as vLLM reports it (class, phase, the figures of its message) and checks what
the search launches next, or why it stops.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from r1sup.core import catalog, memmodel, modelarch, profile_fit
from r1sup.core import failure as F
from r1sup.core import search as S
from r1sup.core.bounds import Bounds
from r1sup.core.capacity import Reduction
from r1sup.core.errors import EXIT_FATAL_FAILURE, EXIT_NO_WORKING_CONFIG
from r1sup.core.failure import Failure, Numbers
from r1sup.core.figures import Figures
from r1sup.core.flags import EngineFlags
from r1sup.core.hardware import GIB, DeviceFacts, GpuInfo
from r1sup.supervision.bringup import stored_conditions

Q7 = modelarch.arch_from_config(catalog.MODELS["deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"])
Q14 = modelarch.arch_from_config(catalog.MODELS["deepseek-ai/DeepSeek-R1-Distill-Qwen-14B"])
L8 = modelarch.arch_from_config(catalog.MODELS["deepseek-ai/DeepSeek-R1-Distill-Llama-8B"])


def gpu(total_gib: float, free_gib: float | None = None, cc: tuple[int, int] = (8, 9), count: int = 1):
    free = free_gib if free_gib is not None else total_gib - 0.4
    one = GpuInfo(0, "NVIDIA GeForce RTX 4090", int(total_gib * GIB), int(free * GIB), cc)
    return DeviceFacts(backend="cuda", gpus=(one,) * count)


def search(arch, device, user: EngineFlags, **bounds) -> S.Search:
    return S.Search(S.Facts(arch=arch, device=device, user=user, bounds=Bounds(**bounds)))


def oom(cls: str, tried_gib: float, free_gib: float, phase: str = F.PHASE_SERVING) -> Failure:
    return Failure(
        cls,
        phase,
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {tried_gib:.2f} GiB",
        Numbers.from_dict({"tried_to_allocate_mib": tried_gib * 1024, "device_free_mib": free_gib * 1024}),
    )


def test_first_keeps_the_users_flags_when_they_fit() -> None:
    # only a free change: max_num_seqs from vLLM's 256 to 16, more than the 4 requests the target runs
    # and than the KV cache holds at once (fewer CUDA graphs, more KV)
    user = EngineFlags(max_model_len=32768)
    s = search(Q7, gpu(23.99), user, target_concurrency=4, target_context=16384)
    first = s.recommend().flags
    assert first.replace(max_num_seqs=None) == user
    assert first.max_num_seqs is None or first.max_num_seqs >= 16
    set_seqs = EngineFlags(max_model_len=32768, max_num_seqs=16)
    assert (
        search(Q7, gpu(23.99), set_seqs, target_concurrency=4, target_context=16384).recommend().flags
        == set_seqs
    )


def test_first_combines_levers_when_weights_nearly_fill_the_card() -> None:
    # 14.2 GiB of weights on a 16.5 GiB card: no single lever gives a context; all of them together do
    user = EngineFlags(max_model_len=16384)
    device = gpu(16.5)
    s = search(Q7, device, user, target_concurrency=1, target_context=4096)
    first = s.recommend().flags
    assert first != user
    assert first.gpu_memory_utilization == s.utilization_cap(1) > user.gpu_memory_utilization
    assert first.fp8_kv and first.enforce_eager
    assert 4096 <= (first.max_model_len or 0) <= 16384
    assert first.max_num_seqs is not None and first.max_num_seqs >= 16  # search.min_max_num_seqs


def test_first_lowers_a_users_max_num_seqs_far_beyond_what_the_kv_cache_holds() -> None:
    user = EngineFlags(max_num_seqs=4096)
    s = search(Q7, gpu(23.99), user, target_concurrency=4, target_context=16384)
    first = s.recommend().flags
    assert first.max_num_seqs is not None and 4 <= first.max_num_seqs < 4096
    # the context is not the price of the sampler: it stays at the longest the KV cache holds
    plain = (
        search(Q7, gpu(23.99), EngineFlags(), target_concurrency=4, target_context=16384).recommend().flags
    )
    assert (first.max_model_len or 0) >= 0.9 * (plain.max_model_len or 0)


def test_runtime_oom_whose_figures_do_not_move_marks_the_lever_ineffective() -> None:
    user = EngineFlags(max_model_len=16384, max_num_seqs=256)
    device = gpu(23.99)
    s = search(Q7, device, user, target_concurrency=2, target_context=8192)
    first = s.recommend().flags
    d1 = s.after(S.Outcome(first, oom(F.OOM_RUNTIME, 2.0, 1.6), Figures(), device))
    assert isinstance(d1, S.Next)
    seen = [first, d1.flags]
    if d1.flags.max_num_seqs != first.max_num_seqs:
        # the same allocation fails with the same memory free: fewer sequences changed nothing
        d2 = s.after(S.Outcome(d1.flags, oom(F.OOM_RUNTIME, 2.0, 1.6), Figures(), device))
        assert isinstance(d2, S.Next)
        assert (F.OOM_RUNTIME, "max_num_seqs") in s.evidence.ineffective
        seen.append(d2.flags)
    last = seen[-1]
    # the fix that works: 0.4 GiB (and a margin) more outside vLLM's budget
    assert last.gpu_memory_utilization <= first.gpu_memory_utilization - 0.4 / 23.99
    assert len(set(seen)) == len(seen)  # never the same configuration twice
    assert len(seen) <= 3


def test_a_failed_configuration_is_never_relaunched() -> None:
    user = EngineFlags(max_model_len=32768)
    device = gpu(23.99)
    s = search(Q14, device, user, target_concurrency=1, target_context=8192)
    flags = s.recommend().flags
    tried = {flags}
    for _ in range(4):
        d = s.after(S.Outcome(flags, oom(F.OOM_RUNTIME, 0.5, 0.1), Figures(), device))
        if isinstance(d, S.GiveUp):
            break
        assert d.flags not in tried
        tried.add(d.flags)
        flags = d.flags


def test_kv_insufficient_calibrates_the_model_with_vllms_figure() -> None:
    user = EngineFlags(max_model_len=131072)
    device = gpu(23.99)
    s = search(Q7, device, user, target_concurrency=1, target_context=8192, allow_fp8_kv=False)
    est = memmodel.evaluate(Q7, device, user)
    # vLLM measured 1 GiB less for the KV cache than the model predicts
    measured = est.kv.gib - 1.0
    failure = Failure(
        F.KV_INSUFFICIENT,
        F.PHASE_KV_CACHE,
        "ValueError: To serve at least one request ...",
        Numbers.from_dict({"max_model_len": 131072, "kv_available_gib": measured}),
    )
    figures = {"kv_cache_gib": measured, "requested_gib": 0.9 * 23.99, "weights_gib": est.weights.gib}
    d = s.after(S.Outcome(user, failure, Figures(**figures), device))
    assert isinstance(d, S.Next)
    assert s.evidence.calibrated == 1
    again = memmodel.evaluate(Q7, device, user, calibration=s.evidence.calibration)
    assert again.kv.gib == pytest.approx(measured, abs=0.01)


def test_free_memory_is_read_again_after_each_launch() -> None:
    # a tenant held 8 GiB at the first launch and is gone now: utilization goes back up
    user = EngineFlags(max_model_len=32768)
    busy, idle = gpu(23.99, free_gib=20.0), gpu(23.99)
    s = search(Q7, busy, user, target_concurrency=2, target_context=8192)
    failure = Failure(
        F.FREE_MEM_BELOW_UTIL,
        F.PHASE_STARTUP,
        "ValueError: Free memory on device (20.0/23.99 GiB) on startup is less than desired GPU memory "
        "utilization (0.9, 21.59 GiB).",
        Numbers.from_dict(
            {"free_gib": 20.0, "total_gib": 23.99, "gpu_memory_utilization": 0.9, "requested_gib": 21.59}
        ),
    )
    d = s.after(S.Outcome(user, failure, Figures(), idle))
    assert isinstance(d, S.Next)
    assert d.flags.gpu_memory_utilization >= 0.9
    assert s.evidence.util_cap is None
    still = search(Q7, busy, user, target_concurrency=2, target_context=8192)
    d2 = still.after(S.Outcome(user, failure, Figures(), busy))
    assert isinstance(d2, S.Next)
    assert d2.flags.gpu_memory_utilization <= (20.0 - 0.25) / 23.99


def test_fp8_unsupported_excludes_e4m3_on_this_box() -> None:
    user = EngineFlags(max_model_len=32768, kv_cache_dtype="fp8")
    device = gpu(23.69, cc=(8, 6))
    s = search(L8, device, user, target_concurrency=2, target_context=16384)
    assert s.recommend().flags.kv_cache_dtype != "fp8"  # vLLM refuses e4m3 below 8.9: never launched
    failure = Failure(
        F.FP8_UNSUPPORTED, F.PHASE_KV_CACHE, "fp8e4nv data type is not supported on CUDA arch < 89"
    )
    d = s.after(S.Outcome(user.replace(kv_cache_dtype="fp8_e5m2"), failure, Figures(), device))
    assert isinstance(d, S.Next)
    assert not d.flags.fp8_kv


def test_gives_up_only_when_nothing_fits_and_names_the_bound() -> None:
    user = EngineFlags(max_model_len=8192)
    device = gpu(23.99)
    s = search(Q14, device, user, target_concurrency=1, target_context=8192)
    failure = oom(F.OOM_WEIGHTS, 0.5, 0.2, F.PHASE_LOAD_WEIGHTS)
    d = s.after(S.Outcome(user, failure, Figures(), device))
    assert isinstance(d, S.GiveUp)
    assert d.exit_code == EXIT_NO_WORKING_CONFIG
    assert d.bound == "search.allow_weight_quantization"
    assert any("allow_weight_quantization" in w for w in d.ways_out)
    allowed = search(
        Q14, device, user, target_concurrency=1, target_context=8192, allow_weight_quantization=True
    )
    d2 = allowed.after(S.Outcome(user, failure, Figures(), device))
    assert isinstance(d2, S.Next) and d2.flags.quantization == "fp8"


def test_a_context_above_the_models_limit_is_capped_not_fatal() -> None:
    user = EngineFlags(max_model_len=262144)
    device = gpu(79.11, cc=(9, 0))
    s = search(L8, device, user, target_concurrency=4, target_context=32768)
    failure = Failure(
        F.CONFIG_ERROR,
        F.PHASE_STARTUP,
        "ValueError: User-specified max_model_len (262144) is greater than the derived max_model_len "
        "(max_position_embeddings=131072 or model_max_length=None in model's config.json).",
        Numbers.from_dict({"derived_max_model_len": 131072}),
    )
    d = s.after(S.Outcome(user, failure, Figures(), device))
    assert isinstance(d, S.Next)
    assert d.flags.max_model_len is not None and d.flags.max_model_len <= 131072


@pytest.mark.parametrize("cls", [F.PORT_IN_USE, F.MODEL_NOT_FOUND])
def test_fatal_classes_stop_at_once(cls: str) -> None:
    user = EngineFlags(max_model_len=8192)
    s = search(Q7, gpu(23.99), user)
    d = s.after(S.Outcome(user, Failure(cls, F.PHASE_STARTUP, "boom"), Figures(), None))
    assert isinstance(d, S.GiveUp) and d.exit_code == EXIT_FATAL_FAILURE


def test_margin_shrinks_as_this_box_calibrates_the_model() -> None:
    user = EngineFlags(max_model_len=32768)
    device = gpu(23.99)
    s = search(Q7, device, user)
    est = memmodel.evaluate(Q7, device, user)
    fresh = s.margin(est)
    later = S.Search(s.facts, replace(s.evidence, calibrated=3)).margin(est)
    assert 0 < later < fresh
    assert later >= min(fresh, S.MEASURED_KV_ERROR_GIB * GIB)


def test_objective_prefers_free_changes_over_costly_ones() -> None:
    # the same context either way: lowering max_num_seqs (free) beats eager mode (costs decode speed)
    user = EngineFlags(max_model_len=16384)
    s = search(Q7, gpu(23.99), user, target_concurrency=2, target_context=8192)
    ranked = s.ranked(margin=True)
    assert ranked[0].key() <= ranked[-1].key()
    same_context = [c for c in ranked if c.context == ranked[0].context and c.meets_target]
    assert same_context[0].cost == min(c.cost for c in same_context)


# --- transient conditions --------------------------------------------------------------------------


def busy_gpu(total_gib: float, others_gib: float) -> DeviceFacts:
    from r1sup.core.hardware import ProcessUse

    one = GpuInfo(
        0, "NVIDIA GeForce RTX 4090", int(total_gib * GIB), int((total_gib - others_gib - 0.4) * GIB), (8, 9)
    )
    holder = ProcessUse(pid=4242, name="other-job", used_bytes=int(others_gib * GIB), gpu_index=0)
    return DeviceFacts(backend="cuda", gpus=(one,), processes=(holder,))


def test_conditions_name_the_memory_other_processes_hold() -> None:
    found = S.conditions(busy_gpu(23.99, 5.0))
    assert found is not None and found.others_gib == 5.0 and found.total_gib == 23.99
    assert found.holders == ("pid 4242 other-job (5.0 GiB)",) and not found.degraded
    mine = S.conditions(busy_gpu(23.99, 5.0), own_pids=frozenset({4242}))
    assert mine is not None and mine.others_gib == 0 and mine.holders == ()
    assert S.conditions(DeviceFacts(backend="cpu", host_total_bytes=64 * GIB)) is None
    assert S.conditions(None) is None


def test_a_profile_keeps_its_conditions_as_the_json_it_always_held() -> None:
    # the object written before the conditions were a type, key for key and in this order
    found = S.conditions(busy_gpu(23.99, 5.0))
    assert found is not None
    held = (
        '"free_gib": 18.59, "total_gib": 23.99, "others_gib": 5.0, '
        '"holders": ["pid 4242 other-job (5.0 GiB)"]'
    )
    assert json.dumps(stored_conditions(found, None)) == "{" + held + "}"
    degraded = replace(found, degraded="other processes held 5.0 GiB")
    cut = Reduction("reduced: context 4096 of the 32768 asked; ways out: fp8", 4096, 32768, 16, 16, ("fp8",))
    assert json.dumps(stored_conditions(degraded, cut)) == (
        "{" + held + ', "degraded": true, "reason": "other processes held 5.0 GiB", '
        '"reduced": {"reason": "reduced: context 4096 of the 32768 asked; ways out: fp8", "context": 4096, '
        '"asked_context": 32768, "max_num_seqs": 16, "wanted_max_num_seqs": 16, "ways_out": ["fp8"]}}'
    )
    assert stored_conditions(None, cut) == {"reduced": cut.to_dict()}
    assert stored_conditions(None, None) == {}


def test_a_profile_found_beside_another_tenant_is_degraded_and_the_idle_box_is_not() -> None:
    user = EngineFlags(max_model_len=32768)
    busy = busy_gpu(23.99, 5.0)
    s = search(Q7, busy, user, target_concurrency=2, target_context=8192)
    found_busy = s.recommend().flags
    assert found_busy != user and found_busy.gpu_memory_utilization < 0.9
    why = profile_fit.degraded_by_others(s, found_busy, S.conditions(busy))
    assert why is not None and "5.0 GiB" in why
    idle = search(Q7, gpu(23.99), user, target_concurrency=2, target_context=8192)
    assert profile_fit.degraded_by_others(idle, idle.recommend().flags, S.conditions(gpu(23.99))) is None


def test_a_saved_profile_is_checked_against_what_is_free_now() -> None:
    user = EngineFlags(max_model_len=32768)
    best = search(Q7, gpu(23.99), user, target_concurrency=2, target_context=8192).recommend().flags
    assert profile_fit.fits_now(search(Q7, gpu(23.99), user), best)
    assert not profile_fit.fits_now(search(Q7, busy_gpu(23.99, 5.0), user), best)


# --- the objective serves traffic: max_num_seqs is concurrency, never free (issue 29) -----------------

Q32 = modelarch.arch_from_config(catalog.MODELS["deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"])
L70 = modelarch.arch_from_config(catalog.MODELS["deepseek-ai/DeepSeek-R1-Distill-Llama-70B"])


def card(name: str, others_gib: float = 0.0) -> DeviceFacts:
    spec = catalog.GPUS[name]
    total = spec.total_gib
    free = int((total - 0.4 - others_gib) * GIB)
    one = GpuInfo(0, f"NVIDIA {name}", int(total * GIB), free, spec.compute_capability)
    return DeviceFacts(backend="cuda", gpus=(one,))


def seqs_of(s: S.Search, flags: EngineFlags) -> int:
    assert s.facts.arch is not None
    return memmodel.resolve_batch(s.facts.arch, s.facts.device, flags, s.facts.version).max_num_seqs


def test_7b_on_a_4090_at_131072_keeps_vllms_256_sequences_with_fp8_kv() -> None:
    user = EngineFlags(max_model_len=131072)
    s = search(Q7, card("RTX 4090"), user)
    first = s.recommend().flags
    assert first.max_num_seqs is None and seqs_of(s, first) == 256  # vLLM's default on a 24 GiB card
    assert first.fp8_kv and first.max_model_len == 131072
    assert s.reduction(first) is None
    assert s.costs(first) == ["kv_cache_dtype fp8: KV cache in 8 bits, a small accuracy cost"]


def test_32b_on_an_a100_at_32768_keeps_the_context_and_the_sequences() -> None:
    # the KV cache just holds 32768 tokens at utilization 0.9 (8.1 GiB predicted for 8.0 needed): within
    # the margin kept for the model's error, so the first launch takes 0.95, and nothing else changes
    user = EngineFlags(max_model_len=32768)
    s = search(Q32, card("A100 80GB"), user)
    first = s.recommend().flags
    assert first.replace(gpu_memory_utilization=0.9) == user
    assert seqs_of(s, first) == 256  # an A100 gets vLLM's small defaults
    assert s.reduction(first) is None
    raised = f"gpu_memory_utilization 0.9 -> {first.gpu_memory_utilization:g}"
    assert [c.split(":")[0] for c in s.costs(first)] == [raised]


@pytest.mark.parametrize("context", [32768, 131072])
def test_a_users_256_sequences_are_kept_where_the_context_fits_with_them(context: int) -> None:
    user = EngineFlags(max_model_len=context, max_num_seqs=256)
    s = search(Q7, card("RTX 4090"), user)
    first = s.recommend().flags
    assert first.max_num_seqs == 256
    assert first.max_model_len == context


def test_a_users_4096_sequences_are_lowered_only_to_the_most_that_fit() -> None:
    user = EngineFlags(max_model_len=32768, max_num_seqs=4096)
    s = search(Q7, card("RTX 4090"), user)
    first = s.recommend().flags
    seqs = first.max_num_seqs
    assert seqs is not None and 16 <= seqs < 4096
    assert first.max_model_len == 32768
    # one graph step more no longer gives the context asked, with every other flag the same
    more = s.score(first.replace(max_num_seqs=seqs + S.SEQS_STEP), margin=True)
    assert more is None or more.context < 32768
    reduced = s.reduction(first)
    assert reduced is not None and reduced.max_num_seqs == seqs and reduced.wanted_max_num_seqs == 4096
    assert reduced.reason.startswith(f"reduced: {seqs} requests at once of the 4096 asked")
    assert "\n" not in reduced.reason


@pytest.mark.parametrize("floor", [16, 64])
def test_max_num_seqs_never_goes_below_the_ladders_floor(floor: int) -> None:
    # 70B on an H200 beside 0.6 GiB of another process: nothing gives 32768 tokens; the longest context
    # comes with the fewest sequences, and those stay at search.min_max_num_seqs or more
    user = EngineFlags(max_model_len=32768)
    s = search(L70, card("H200 141GB", others_gib=0.6), user, min_max_num_seqs=floor)
    for c in s.ranked(margin=False):
        assert c.seqs >= floor
    first = s.recommend().flags
    assert seqs_of(s, first) >= floor


def test_a_users_max_num_seqs_below_the_floor_is_kept() -> None:
    user = EngineFlags(max_model_len=32768, max_num_seqs=4)
    s = search(Q7, card("RTX 4090"), user)
    assert s.recommend().flags.max_num_seqs == 4


def test_a_result_that_gives_up_most_of_the_context_names_the_ways_out() -> None:
    user = EngineFlags(max_model_len=32768)
    s = search(L70, card("H200 141GB", others_gib=0.6), user)
    first = s.recommend().flags
    reduced = s.reduction(first)
    assert reduced is not None and reduced.context * 2 < 32768
    ways = " ".join(reduced.ways_out)
    assert "--quantization fp8_per_tensor" in ways  # as vLLM 0.33 spells fp8 weights
    assert "--tensor-parallel-size 2" in ways
    # each way out is the same search with that one thing changed: fp8 weights allowed gives the context
    wider = (
        search(L70, card("H200 141GB", others_gib=0.6), user, allow_weight_quantization=True)
        .recommend()
        .flags
    )
    assert wider.max_model_len == 32768 and wider.quantization == "fp8"


def test_lowering_sequences_costs_in_proportion_to_the_concurrency_given_up() -> None:
    s = search(Q7, card("H100 80GB"), EngineFlags(max_model_len=32768))
    assert s.wanted_seqs() == 1024
    f = EngineFlags(max_model_len=32768)
    costs = [s._cost(f.replace(max_num_seqs=n), n, 32768)[1] for n in (1024, 768, 512, 16)]
    assert costs[0] == 0 and costs[0] < costs[1] < costs[2] < costs[3]
    assert costs[2] == pytest.approx(2 * costs[1])


def test_a_passed_launch_below_the_asked_context_is_refined_to_what_its_kv_figure_allows() -> None:
    # the 70B on a 141 GiB H200 beside 0.6 GiB of another process: a launch passed at 2656
    # tokens and vLLM printed "GPU KV cache size: 9,184 tokens" (and no other memory figure)
    one = GpuInfo(0, "NVIDIA H200", 141 * GIB, int(140.4 * GIB), (9, 0))
    device = DeviceFacts(backend="cuda", gpus=(one,))
    s = search(L70, device, EngineFlags(max_model_len=32768))
    passed = EngineFlags(
        max_model_len=2656,
        gpu_memory_utilization=0.95,
        kv_cache_dtype="fp8",
        enforce_eager=True,
        max_num_seqs=16,
    )
    better = s.refine(passed, Figures(kv_cache_tokens=9184))
    assert better is not None
    allowed = (9184 // 16 - 1) * 16  # one request of the usable blocks (V1 keeps one back)
    assert 0.95 * allowed <= (better.max_model_len or 0) <= 32768
    # once refined, a launch that passed at what its figure allows is not refined again
    assert s.refine(better, Figures(kv_cache_tokens=(better.max_model_len or 0) + 16)) is None


NO_KV_TEXT = (
    "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
    "initializing the engine."
)


def no_kv_memory(flags: EngineFlags, kv_gib: float, batched: int) -> S.Outcome:
    """A launch that failed as vLLM says it when its budget leaves nothing for the KV cache: it printed
    the weights it loaded and "Available KV cache memory: <kv_gib> GiB"."""
    printed = {"max_model_len": flags.max_model_len, "max_num_batched_tokens": batched}
    printed |= {"weights_gib": 14.96, "kv_cache_gib": kv_gib}
    failure = Failure(F.NO_KV_MEMORY, F.PHASE_KV_CACHE, NO_KV_TEXT, Numbers.from_dict(printed))
    figures = Figures(weights_gib=14.96, kv_cache_gib=kv_gib, max_model_len=flags.max_model_len)
    return S.Outcome(flags, failure, replace(figures, max_num_batched_tokens=batched), WF_4090)


# bench_scenarios' wf-l8-16g: Llama-8B (15.0 GiB of weights) on a 16.5 GiB RTX 4090 (cc 8.6), 1 x 2,048
WF_4090 = DeviceFacts(
    backend="cuda", gpus=(GpuInfo(0, "NVIDIA GeForce RTX 4090", int(16.5 * GIB), int(16.5 * GIB), (8, 6)),)
)


def test_a_give_up_predicted_within_the_models_error_is_decided_by_one_launch() -> None:
    # the planned launch (batched tokens 2048, 128 sequences) printed "Available KV cache memory: -0.11
    # GiB"; calibrated by it, the model predicts 1,456 tokens at 512 batched tokens and 16 sequences,
    # 0.04 GiB short of the 2,048 asked: within its 0.2 GiB error, so a launch decides (the fake engine
    # has 0.19 GiB of KV cache there), not the prediction
    s = search(L8, WF_4090, EngineFlags(), target_concurrency=1, target_context=2048)
    first = s.recommend().flags
    assert first.max_model_len == 2048 and first.max_num_batched_tokens is None
    d = s.after(no_kv_memory(first, -0.11, 2048))
    assert isinstance(d, S.Next), d
    near = d.flags
    assert near.max_model_len == 2048  # the target's context, the least the bounds accept
    assert near.max_num_seqs == 16  # search.min_max_num_seqs: the launch most likely to start
    assert near.max_num_batched_tokens is not None and near.max_num_batched_tokens < 2048
    assert "vLLM's figures decide" in d.reason
    # that launch measured its own KV memory: short again, the search stops on vLLM's figure (once)
    stop = s.after(no_kv_memory(near, -0.02, near.max_num_batched_tokens))
    assert isinstance(stop, S.GiveUp) and stop.exit_code == EXIT_NO_WORKING_CONFIG
    assert "calibrated by 2 launch(es)" in stop.reason
    # 0.6 GiB less for the KV cache: no configuration comes within the 0.2 GiB error of 2,048 tokens
    again = search(L8, WF_4090, EngineFlags(), target_concurrency=1, target_context=2048)
    far = again.after(no_kv_memory(first, -0.71, 2048))
    assert isinstance(far, S.GiveUp) and "calibrated by 1 launch(es)" in far.reason


def test_a_launch_made_within_the_models_error_is_not_refined_on_the_models_candidates() -> None:
    # bench_scenarios' wf-h200-l70: Llama-70B (131.4 GiB of weights) on an H200 (139.7 GiB), 1 x 2,048
    # asked beside --max-model-len 32768. The planned launch (3,536 tokens, 216 sequences) printed 0.14
    # GiB of KV; predicted short within the error, 16 sequences at 2,048 tokens started with "GPU KV cache
    # size: 2,192 tokens". Refined, the bench's tune then launched the calibrated model's 208 sequences at
    # 2,192 tokens, which vLLM refused (the sampler for 208 sequences took the KV), and went back: 4
    # launches. After a launch vLLM decided within the model's error, nothing is refined
    one = GpuInfo(0, "NVIDIA H200", int(139.72 * GIB), int(139.72 * GIB), (9, 0))
    device = DeviceFacts(backend="cuda", gpus=(one,))
    s = search(L70, device, EngineFlags(max_model_len=32768), target_concurrency=1, target_context=2048)
    first = EngineFlags(
        max_model_len=3536,
        gpu_memory_utilization=0.95,
        kv_cache_dtype="fp8",
        enforce_eager=True,
        max_num_seqs=216,
        max_num_batched_tokens=2048,
    )
    printed = {"max_model_len": 3536, "max_num_batched_tokens": 2048, "weights_gib": 131.42}
    printed |= {"kv_cache_gib": 0.15, "kv_available_gib": 0.14, "estimated_max_model_len": 928}
    text = (
        "ValueError: To serve at least one request with the model's max seq len (3536), (0.54 GiB KV cache "
        "is needed, which is larger than the available KV cache memory (0.14 GiB). Based on the available "
        "memory, the estimated maximum model length is 928."
    )
    failure = Failure(F.KV_INSUFFICIENT, F.PHASE_KV_CACHE, text, Numbers.from_dict(printed))
    figures = Figures(weights_gib=131.42, kv_cache_gib=0.15, max_model_len=3536, max_num_batched_tokens=2048)
    d = s.after(S.Outcome(first, failure, figures, device))
    assert isinstance(d, S.Next) and "vLLM's figures decide" in d.reason, d
    assert d.flags.max_model_len == 2048 and d.flags.max_num_seqs == 16
    passed = Figures(weights_gib=131.42, kv_cache_gib=0.34, kv_cache_tokens=2192, max_model_len=2048)
    assert s.refine(d.flags, passed) is None
