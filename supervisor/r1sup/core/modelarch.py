"""What the memory model needs from a model's ``config.json`` (:class:`ModelArch`,
:func:`arch_from_config`): the second of the memory model's three parts (:mod:`r1sup.core.vllmversion`
holds the version rules; :mod:`r1sup.core.memmodel` puts the terms together). Pure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_VERIFIED_TYPES = frozenset({"qwen2", "llama", "mistral", "qwen3"})
_QKV_BIAS_TYPES = frozenset({"qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl"})
_NON_GATED_TYPES = frozenset(
    {"gpt2", "gpt_neox", "gptj", "opt", "falcon", "bloom", "starcoder2", "phi", "gpt_bigcode", "mpt"}
)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "bf16": 2, "fp16": 2, "float32": 4, "float": 4}


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
    weight_group_size: int | None = None  # quantization group (-1: per channel)
    double_quant: bool = False  # bitsandbytes 4-bit with quantized absmax
    approximations: tuple[str, ...] = ()
    name: str | None = None
    # pipeline parallelism (see :func:`pipeline_stages`): the whole model split over this many stages, or
    # one stage of it (``pipeline_parallel_size`` 1) holding the embeddings when first and the final norm
    # and LM head when last
    pipeline_parallel_size: int = 1
    first_stage: bool = True
    last_stage: bool = True

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
        return self.layers * per_layer + (self.hidden if self.last_stage else 0)

    def embedding_params(self) -> int:
        """Input embedding (first stage) plus the LM head (last stage) when it is not tied to it; a last
        pipeline stage without the embedding holds its own copy of a tied LM head."""
        embed = self.vocab * self.hidden if self.first_stage else 0
        head = self.vocab * self.hidden if self.last_stage and not (self.tied and self.first_stage) else 0
        return embed + head

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
            "pipeline_parallel_size": self.pipeline_parallel_size,
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


def _checkpoint_quantization(config: Mapping[str, Any]) -> dict[str, Any]:
    """Method, weight bits, group size and double quantization of a checkpoint's ``quantization_config``
    (AWQ, GPTQ, fp8, compressed-tensors, bitsandbytes); {} for a 16-bit checkpoint."""
    qc = config.get("quantization_config")
    if not isinstance(qc, Mapping):
        return {}
    method = str(qc.get("quant_method") or qc.get("quant_type") or "").lower() or None
    bits = qc.get("bits") or qc.get("w_bit") or qc.get("weight_bits")
    group = qc.get("group_size") or qc.get("q_group_size")
    if bits is None and method and "fp8" in method:
        bits = 8
    if method == "compressed-tensors":
        groups = qc.get("config_groups")
        if isinstance(groups, Mapping):
            for spec in groups.values():
                weights = spec.get("weights") if isinstance(spec, Mapping) else None
                if isinstance(weights, Mapping) and weights.get("num_bits"):
                    bits = bits or weights["num_bits"]
                    if weights.get("strategy") == "group":
                        group = weights.get("group_size") or group
                    elif weights.get("strategy") in ("channel", "tensor"):
                        group = -1
                    break
    double = False
    if method == "bitsandbytes":
        bits = bits or (8 if qc.get("load_in_8bit") else 4)
        double = bool(qc.get("bnb_4bit_use_double_quant"))
    return {
        "quantization": method,
        "weight_bits": int(bits) if isinstance(bits, (int, float)) and not isinstance(bits, bool) else None,
        "weight_group_size": int(group)
        if isinstance(group, (int, float)) and not isinstance(group, bool)
        else None,
        "double_quant": double,
    }


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
    dtype_bytes = DTYPE_BYTES.get(dtype, 2)
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

    quantized = _checkpoint_quantization(config)
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
        **quantized,
        approximations=tuple(notes),
        name=name,
        **mla,
    )


def with_dtype(arch: ModelArch, dtype: str) -> ModelArch:
    """The architecture served in ``dtype`` (vLLM's ``--dtype``: auto, bfloat16, float16, float32)."""
    name = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(dtype, dtype)
    if name == "auto":
        return arch
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r} (auto, bfloat16, float16 or float32)")
    return dataclasses.replace(arch, dtype=name, dtype_bytes=DTYPE_BYTES[name])
