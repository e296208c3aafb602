"""The benchmark matrix: GPUs x DeepSeek-R1 distills x targets, with what a typical user writes.

Each :class:`BenchScenario` is one box (GPU model, count, memory other processes hold), one model and
one target (``concurrency`` requests of ``context`` tokens at once), plus the ``[start]`` and ``[search]``
a user would plausibly write:

- ``[start]``: a round context (``max_model_len = 32768`` or ``16384``) or nothing at all (vLLM then uses
  the model's 131072), ``gpu_memory_utilization`` left at vLLM's 0.9, ``tensor_parallel_size`` set only
  where a user of a multi-GPU box would set it (the 70B models); no fp8 flags.
- ``[search]``: the defaults (fp8 KV, eager mode and tensor parallel allowed; weight quantization NOT
  allowed), except where the scenario says ``allow_weight_quantization``: boxes where the bf16 weights
  cannot fit and a user who accepts fp8 weights says so. Without that permission such a box has no
  feasible configuration, which is what the "cannot fit" scenarios check.

``ids`` are stable: the README table and ``--only`` use them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

MODELS = {
    "Qwen-1.5B": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
    "Qwen-7B": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
    "Qwen-14B": "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B",
    "Qwen-32B": "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B",
    "Llama-8B": "deepseek-ai/DeepSeek-R1-Distill-Llama-8B",
    "Llama-70B": "deepseek-ai/DeepSeek-R1-Distill-Llama-70B",
}

FP8_WEIGHTS = {"allow_weight_quantization": True}

# vLLM's CUDA-graph estimate / the pool it then captures, as real start-up logs print it ("CUDA graph pool
# memory: X GiB (actual), Y GiB (estimated)"; 1.2x to 3.4x, ../shared/docs/vllm-facts.md): each scenario
# gets one, in turn, so the fake engine charges the KV budget as differently as real launches do.
GRAPH_ESTIMATE_RATIOS = (1.2, 1.5, 2.1, 2.2, 3.4)


@dataclass(frozen=True)
class BenchScenario:
    id: str
    gpu: str  # a fakevllm GPU catalog name
    model: str  # a key of MODELS
    concurrency: int
    context: int
    count: int = 1
    others_gib: float = 0.0  # memory other processes hold on every GPU
    start: Mapping[str, Any] = field(default_factory=dict)  # the user's [start]
    search: Mapping[str, Any] = field(default_factory=dict)  # [search] beyond the defaults
    why: str = ""
    graph_estimate_ratio: float = GRAPH_ESTIMATE_RATIOS[0]  # set per scenario below
    family: str = "matrix"  # the adversarial family (issue 15) or "matrix" (GPU x model x target)
    total_gib: float | None = None  # a card outside the catalog: its memory (torch's total)
    compute_capability: tuple[int, int] | None = None  # with total_gib
    spike_gib: float = 0.0  # activation every request needs while serving (no max_num_seqs moves it)
    others_schedule: tuple[float, ...] = ()  # GiB other processes hold at each launch (then the last)
    fixed_ratio: bool = False  # keep graph_estimate_ratio (a family about the estimate)

    @property
    def model_id(self) -> str:
        return MODELS[self.model]

    @property
    def box(self) -> str:
        name = f"{self.count}x {self.gpu}" if self.count > 1 else self.gpu
        return name + (f" busy {self.others_gib:g}G" if self.others_gib else "")

    @property
    def target(self) -> str:
        return f"{self.concurrency}x{self.context // 1024}k" if self.concurrency else "none"

    @property
    def has_target(self) -> bool:
        return bool(self.concurrency and self.context)

    def scenario(self) -> dict[str, Any]:
        """The fake engine's scenario (without time_scale and the per-run paths)."""
        gpu: dict[str, Any] = {"name": self.gpu, "count": self.count}
        if self.total_gib is not None:
            gpu["total_gib"] = self.total_gib
            gpu["compute_capability"] = list(self.compute_capability or (8, 9))
        if self.others_gib:
            gpu["other_process_gib"] = self.others_gib
        out: dict[str, Any] = {"gpu": gpu, "cudagraph_estimate_factor": self.graph_estimate_ratio}
        if self.spike_gib:
            out["runtime"] = {"activation_spike_gib": self.spike_gib}
        if self.others_schedule:
            out["other_process_schedule"] = list(self.others_schedule)
        return out


def _s(id: str, gpu: str, model: str, conc: int, ctx: int, **kw: Any) -> BenchScenario:
    return BenchScenario(id=id, gpu=gpu, model=model, concurrency=conc, context=ctx, **kw)


CTX32 = {"max_model_len": 32768}
CTX16 = {"max_model_len": 16384}

SCENARIOS: tuple[BenchScenario, ...] = (
    # RTX 3090: compute capability 8.6, no fp8 e4m3 (KV falls back to e5m2); fp8 weights via Marlin.
    _s("3090-q1.5", "RTX 3090", "Qwen-1.5B", 16, 8192, start=CTX32, why="small model, fits as written"),
    _s("3090-q7", "RTX 3090", "Qwen-7B", 4, 16384, start=CTX32, why="fits as written"),
    _s(
        "3090-l8",
        "RTX 3090",
        "Llama-8B",
        4,
        16384,
        start=CTX32,
        why="target needs fp8 KV; e4m3 absent (cc 8.6)",
    ),
    _s(
        "3090-l8-full",
        "RTX 3090",
        "Llama-8B",
        4,
        16384,
        why="no max_model_len: one request of 131072 does not fit; 4 x 16k do (context not divided by 4)",
    ),
    _s(
        "3090-q14-fp8w",
        "RTX 3090",
        "Qwen-14B",
        2,
        8192,
        start=CTX16,
        search=FP8_WEIGHTS,
        why="bf16 weights do not fit; fp8 weights allowed",
    ),
    _s(
        "2x3090-q32",
        "RTX 3090",
        "Qwen-32B",
        1,
        4096,
        count=2,
        start=CTX16,
        why="cannot fit: 32B bf16 over 2x24 GB, no weight quantization",
    ),
    # RTX 4090 (cc 8.9)
    _s("4090-q7", "RTX 4090", "Qwen-7B", 4, 16384, start=CTX32, why="fits as written"),
    _s(
        "4090-l8-full",
        "RTX 4090",
        "Llama-8B",
        1,
        32768,
        why="no max_model_len: the model's 131072 does not fit",
    ),
    _s(
        "4090-q14",
        "RTX 4090",
        "Qwen-14B",
        1,
        8192,
        start=CTX32,
        why="cannot fit: 14B bf16 on 24 GB, no weight quantization",
    ),
    _s(
        "4090-busy-q7",
        "RTX 4090",
        "Qwen-7B",
        2,
        8192,
        others_gib=6.0,
        start=CTX16,
        why="6 GiB held by another process: util 0.9 cannot start",
    ),
    _s(
        "2x4090-q14",
        "RTX 4090",
        "Qwen-14B",
        4,
        16384,
        count=2,
        start=CTX32,
        why="needs tensor parallel 2; user left tp at 1",
    ),
    # L4 (cc 8.9, 22 GB)
    _s("l4-q7", "L4", "Qwen-7B", 2, 16384, start=CTX32, why="fits as written"),
    _s("l4-l8", "L4", "Llama-8B", 4, 8192, start=CTX32, why="context must shrink or KV go fp8"),
    _s(
        "l4-l70-fp8w",
        "L4",
        "Llama-70B",
        1,
        4096,
        start=CTX32,
        search=FP8_WEIGHTS,
        why="cannot fit at all: 70B even in fp8 is 3x the card",
    ),
    # L40S (cc 8.9, 44 GB)
    _s("l40s-q14", "L40S", "Qwen-14B", 8, 8192, start=CTX32, why="target needs fp8 KV or more utilization"),
    _s(
        "l40s-q32-fp8w",
        "L40S",
        "Qwen-32B",
        2,
        16384,
        start=CTX32,
        search=FP8_WEIGHTS,
        why="bf16 weights do not fit; fp8 weights allowed",
    ),
    _s(
        "l40s-busy-l8",
        "L40S",
        "Llama-8B",
        4,
        32768,
        others_gib=12.0,
        why="12 GiB held by another process; no max_model_len",
    ),
    # A100 40/80 (cc 8.0: fp8 KV only as e5m2)
    _s("a100-40-q14", "A100 40GB", "Qwen-14B", 4, 16384, start=CTX32, why="target needs e5m2 KV (cc 8.0)"),
    _s(
        "a100-40-q14-full",
        "A100 40GB",
        "Qwen-14B",
        2,
        16384,
        why="no max_model_len: the context shrinks to what one request fits",
    ),
    _s(
        "a100-40-q32-fp8w",
        "A100 40GB",
        "Qwen-32B",
        1,
        8192,
        start=CTX16,
        search=FP8_WEIGHTS,
        why="bf16 weights do not fit; fp8 weights allowed",
    ),
    _s("a100-80-q32", "A100 80GB", "Qwen-32B", 4, 8192, start=CTX32, why="tight: 61 GiB of weights"),
    _s(
        "a100-80-q32-full",
        "A100 80GB",
        "Qwen-32B",
        4,
        16384,
        why="no max_model_len, 61 GiB of weights: the context shrinks",
    ),
    _s(
        "2xa100-80-l70",
        "A100 80GB",
        "Llama-70B",
        4,
        8192,
        count=2,
        start={**CTX32, "tensor_parallel_size": 2},
        why="70B over two A100 80GB",
    ),
    # H100 (cc 9.0, 80 GB)
    _s("h100-l8", "H100", "Llama-8B", 16, 8192, why="no max_model_len; large box defaults"),
    _s(
        "h100-q32",
        "H100",
        "Qwen-32B",
        8,
        16384,
        start=CTX32,
        why="cannot fit: 8 x 16k = 131k tokens; fp8 KV at 0.95 holds about 98k",
    ),
    _s(
        "4xh100-l70",
        "H100",
        "Llama-70B",
        16,
        16384,
        count=4,
        start={**CTX32, "tensor_parallel_size": 4},
        why="70B over four H100, tp set by the user",
    ),
    _s(
        "4xh100-l70-tp1",
        "H100",
        "Llama-70B",
        8,
        8192,
        count=4,
        start=CTX32,
        why="70B on a 4x H100 box; user left tp at 1",
    ),
    # H200 (cc 9.0, 141 GB)
    _s(
        "h200-l70-fp8w",
        "H200",
        "Llama-70B",
        4,
        8192,
        start=CTX32,
        search=FP8_WEIGHTS,
        why="bf16 70B leaves no KV room; fp8 weights allowed",
    ),
    _s("h200-q32", "H200", "Qwen-32B", 8, 32768, why="no max_model_len; the model's 131072"),
    _s(
        "h200-busy-q32",
        "H200",
        "Qwen-32B",
        4,
        16384,
        others_gib=40.0,
        start=CTX32,
        why="40 GiB held by another process",
    ),
)


# fmt: off
# The adversarial families of issue 15: each breaks one assumption a per-class rule would make.
def _a(family: str, id: str, gpu: str, model: str, conc: int, ctx: int, **kw: Any) -> BenchScenario:
    return BenchScenario(id=id, gpu=gpu, model=model, concurrency=conc, context=ctx, family=family, **kw)


ADVERSARIAL: tuple[BenchScenario, ...] = (
    # weights fill 90-98% of the card: the KV cache lives in the last few GiB
    _a("weights-fill", "wf-q7-16g", "RTX 4090", "Qwen-7B", 1, 4096, total_gib=16.0,
       compute_capability=(8, 9), start=CTX16, why="14.2 GiB of weights on a 16 GiB card (89%)"),
    _a("weights-fill", "wf-l8-16g", "RTX 4090", "Llama-8B", 1, 2048, total_gib=16.5,
       compute_capability=(8, 6), why="15.0 GiB of weights on 16.5 GiB (91%), cc 8.6: nothing fits"),
    _a("weights-fill", "wf-q32-66g", "A100 80GB", "Qwen-32B", 1, 4096, total_gib=66.0,
       compute_capability=(8, 0), start=CTX32, why="61 GiB of weights on 66 GiB (92%)"),
    _a("weights-fill", "wf-h200-l70", "H200", "Llama-70B", 1, 2048, start=CTX32,
       why="131 GiB of bf16 weights on 139.7 GiB (94%), no weight quantization: nothing fits"),
    _a("weights-fill", "wf-h200-l70-fp8w", "H200", "Llama-70B", 2, 16384, start=CTX32, search=FP8_WEIGHTS,
       why="131 GiB of bf16 weights on 139.7 GiB (94%); fp8 weights allowed"),
    _a("weights-fill", "wf-q14-30g", "L40S", "Qwen-14B", 1, 4096, total_gib=30.5,
       compute_capability=(8, 9), start=CTX32, why="27.5 GiB of weights on 30.5 GiB (90%)"),
    # user flags far past sense
    _a("past-sense", "ps-seqs4096", "RTX 4090", "Qwen-7B", 4, 16384,
       start={"max_num_seqs": 4096}, why="max_num_seqs 4096 on a 24 GB card: the sampler warm-up fails"),
    _a("past-sense", "ps-batched64k", "L40S", "Llama-8B", 4, 16384,
       start={**CTX32, "max_num_batched_tokens": 65536}, why="max_num_batched_tokens 65536"),
    _a("past-sense", "ps-util099", "RTX 4090", "Qwen-7B", 2, 16384,
       start={**CTX32, "gpu_memory_utilization": 0.99}, why="utilization 0.99: above what is free"),
    _a("past-sense", "ps-ctx262k", "H100", "Llama-8B", 4, 32768,
       start={"max_model_len": 262144}, why="a context twice the model's limit"),
    # OOM while serving that no max_num_seqs change affects
    _a("serving-oom", "so-4090-q7", "RTX 4090", "Qwen-7B", 2, 8192, spike_gib=3.0, start=CTX16,
       why="every request needs 3 GiB more than the profile saw"),
    _a("serving-oom", "so-a100-q14", "A100 80GB", "Qwen-14B", 4, 16384, spike_gib=9.0, start=CTX32,
       why="9 GiB per-request spike on an A100 80GB"),
    # other tenants whose memory changes between launches
    _a("tenants", "tn-grows", "L40S", "Qwen-7B", 4, 16384, others_schedule=(0.0, 10.0),
       start={**CTX32, "max_num_seqs": 4096}, why="a 10 GiB job arrives after the first launch"),
    _a("tenants", "tn-leaves", "RTX 4090", "Qwen-7B", 2, 8192, others_schedule=(8.0, 0.0),
       start=CTX32, why="an 8 GiB job holds the card at the first launch, then leaves"),
    # vLLM's CUDA-graph estimate far above the captured pool (charged to the KV budget from 0.20)
    _a("graph-estimate", "ge-3090-l8", "RTX 3090", "Llama-8B", 2, 16384, start=CTX32,
       graph_estimate_ratio=3.0, fixed_ratio=True, why="graph estimate 3x the pool"),
    _a("graph-estimate", "ge-l4-q7", "L4", "Qwen-7B", 4, 8192, start=CTX32, graph_estimate_ratio=2.5,
       fixed_ratio=True, why="graph estimate 2.5x the pool"),
    # fp8 (e4m3) in the user's flags on cards without it
    _a("fp8-user", "f8-3090-l8", "RTX 3090", "Llama-8B", 4, 16384,
       start={**CTX32, "kv_cache_dtype": "fp8"}, why="user asks fp8 KV on cc 8.6 (e5m2 only)"),
    _a("fp8-user", "f8-a100-q14", "A100 40GB", "Qwen-14B", 4, 16384,
       start={**CTX32, "kv_cache_dtype": "fp8"}, why="user asks fp8 KV on cc 8.0 (e5m2 only)"),
    # tensor parallel where the communication memory decides
    _a("tp-comm", "tp-2xh100-l70", "H100", "Llama-70B", 4, 32768, count=2,
       start={**CTX32, "tensor_parallel_size": 2}, why="70B over 2x H100: NCCL buffers eat the KV room"),
    _a("tp-comm", "tp-4x4090-q32", "RTX 4090", "Qwen-32B", 2, 16384, count=4, start=CTX32,
       why="32B over 4x 4090 needs tp 4; user left tp at 1"),
    # a pinned KV size
    _a("pinned-kv", "pk-4090-q7", "RTX 4090", "Qwen-7B", 2, 16384,
       start={**CTX32, "kv_cache_memory_bytes": 12 * 1024**3},
       why="12 GiB pinned KV next to 14 GiB of weights"),
    _a("pinned-kv", "pk-h100-l8", "H100", "Llama-8B", 8, 32768,
       start={**CTX32, "kv_cache_memory_bytes": 8 * 1024**3},
       why="8 GiB pinned KV: too small for the target"),
    # concurrency targets
    _a("concurrency", "cc-h100-l8", "H100", "Llama-8B", 64, 8192, start=CTX32, why="64 requests of 8k"),
    _a("concurrency", "cc-a100-q14", "A100 80GB", "Qwen-14B", 32, 8192, why="32 requests of 8k"),
)
# fmt: on


def _v(id: str, gpu: str, model: str, start: Mapping[str, Any], **kw: Any) -> BenchScenario:
    """A "serving" scenario (issue 29): no [target]; what counts is the context asked and the sequences
    served at once (vLLM's default, or the user's max_num_seqs)."""
    return BenchScenario(
        id=id, gpu=gpu, model=model, concurrency=0, context=0, family="serving", start=start, **kw
    )


H200_141 = {"total_gib": 141.0, "compute_capability": (9, 0)}

# fmt: off
SERVING: tuple[BenchScenario, ...] = (
    _v("sv-4090-q7-128k", "RTX 4090", "Qwen-7B", {"max_model_len": 131072},
       why="fits with fp8 KV and vLLM's 256 sequences"),
    _v("sv-a100-q32", "A100 80GB", "Qwen-32B", CTX32, why="fits as written (256 sequences on an A100)"),
    _v("sv-h100-q14-busy", "H100", "Qwen-14B", {}, others_gib=20.0,
       why="another tenant holds 20 GiB; the model's 131072 tokens"),
    _v("sv-h200-l70", "H200", "Llama-70B", CTX32, others_gib=0.6, **H200_141,
       why="bf16 weights leave about a GiB: far less than the context asked"),
    _v("sv-3090-l8-busy", "RTX 3090", "Llama-8B",
       {"max_model_len": 131072, "gpu_memory_utilization": 0.85, "max_num_seqs": 4096}, others_gib=3.0,
       why="3 GiB held by others; the user's 0.85 and 4096 sequences"),
    _v("sv-4090-q7-s256", "RTX 4090", "Qwen-7B", {**CTX32, "max_num_seqs": 256}, why="the user's 256 fit"),
    _v("sv-4090-q7-s4096", "RTX 4090", "Qwen-7B", {**CTX32, "max_num_seqs": 4096},
       why="the user's 4096: more than the sampler warm-up leaves room for"),
    _v("sv-3090-l8", "RTX 3090", "Llama-8B", {}, why="the model's 131072 tokens; no fp8 e4m3 (cc 8.6)"),
    _v("sv-l40s-q14", "L40S", "Qwen-14B", CTX32, why="fits as written"),
)
# fmt: on

_RATIOS = GRAPH_ESTIMATE_RATIOS
SCENARIOS = tuple(
    s if s.fixed_ratio else replace(s, graph_estimate_ratio=_RATIOS[i % len(_RATIOS)])
    for i, s in enumerate(SCENARIOS + ADVERSARIAL + SERVING)
)

QUICK = ("4090-q7", "3090-l8", "l4-l70-fp8w")
QUICK_ADVERSARIAL = ("wf-q7-16g", "ps-seqs4096", "so-4090-q7", "tn-leaves", "pk-4090-q7")


def by_id(ids: list[str] | tuple[str, ...]) -> list[BenchScenario]:
    known = {s.id: s for s in SCENARIOS}
    missing = [i for i in ids if i not in known]
    if missing:
        raise KeyError(f"unknown scenario id(s): {', '.join(missing)} (known: {', '.join(known)})")
    return [known[i] for i in ids]
