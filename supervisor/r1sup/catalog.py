"""Built-in catalogs: the DeepSeek-R1 distills' architectures and common GPUs. Plain data, no I/O.

``MODELS`` holds the fields of each model's published ``config.json`` that matter for memory (the
six ``deepseek-ai/DeepSeek-R1-Distill-*`` checkpoints: Qwen2.5-Math-1.5B/7B, Qwen2.5-14B/32B,
Llama-3.1-8B and Llama-3.3-70B-Instruct bases), so ``r1sup plan`` works before anything is
downloaded. ``GPUS`` holds each card's memory as CUDA reports it (``torch.cuda.mem_get_info``'s
total, which is what vLLM multiplies by ``gpu_memory_utilization``; a little below the marketing
size) and its compute capability.
"""

from __future__ import annotations

import re
from typing import Any

_QWEN_COMMON: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-06,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_mrope": False,
    "use_sliding_window": False,
}

_LLAMA_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 128,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
}


def _qwen(**fields: Any) -> dict[str, Any]:
    return {**_QWEN_COMMON, **fields}


def _llama(**fields: Any) -> dict[str, Any]:
    return {**_LLAMA_COMMON, **fields}


MODELS: dict[str, dict[str, Any]] = {
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": _qwen(
        hidden_size=1536,
        intermediate_size=8960,
        max_window_layers=21,
        num_attention_heads=12,
        num_hidden_layers=28,
        num_key_value_heads=2,
        rope_theta=10000,
        vocab_size=151936,
    ),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": _qwen(
        hidden_size=3584,
        intermediate_size=18944,
        max_window_layers=28,
        num_attention_heads=28,
        num_hidden_layers=28,
        num_key_value_heads=4,
        rope_theta=10000,
        vocab_size=152064,
    ),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B": _qwen(
        hidden_size=5120,
        intermediate_size=13824,
        max_window_layers=48,
        num_attention_heads=40,
        num_hidden_layers=48,
        num_key_value_heads=8,
        rope_theta=1000000.0,
        vocab_size=152064,
    ),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B": _qwen(
        hidden_size=5120,
        intermediate_size=27648,
        max_window_layers=64,
        num_attention_heads=40,
        num_hidden_layers=64,
        num_key_value_heads=8,
        rope_theta=1000000.0,
        vocab_size=152064,
    ),
    "deepseek-ai/DeepSeek-R1-Distill-Llama-8B": _llama(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_hidden_layers=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "deepseek-ai/DeepSeek-R1-Distill-Llama-70B": _llama(
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_hidden_layers=80,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
}


def find_model(name: str) -> tuple[str, dict[str, Any]] | None:
    """A catalog model by HF id, case-insensitive, with or without the ``deepseek-ai/`` owner."""
    wanted = name.strip().lower().rstrip("/")
    for model_id, config in MODELS.items():
        if wanted in (model_id.lower(), model_id.split("/", 1)[1].lower()):
            return model_id, dict(config)
    return None


GIB = 1024**3

# total_gib: what CUDA reports as total (vLLM's base for gpu_memory_utilization).
GPUS: dict[str, dict[str, Any]] = {
    "RTX 3090": {"total_gib": 23.56, "compute_capability": (8, 6), "aliases": ["rtx3090", "3090"]},
    "RTX 4090": {"total_gib": 23.55, "compute_capability": (8, 9), "aliases": ["rtx4090", "4090"]},
    "L4": {"total_gib": 22.03, "compute_capability": (8, 9), "aliases": ["l4", "l424"]},
    "A10": {"total_gib": 22.06, "compute_capability": (8, 6), "aliases": ["a10", "a1024", "a10g", "a10g24"]},
    "L40S": {"total_gib": 44.53, "compute_capability": (8, 9), "aliases": ["l40s", "l40s48"]},
    "A100 40GB": {"total_gib": 39.39, "compute_capability": (8, 0), "aliases": ["a10040"]},
    "A100 80GB": {"total_gib": 79.15, "compute_capability": (8, 0), "aliases": ["a10080"]},
    "H100 80GB": {"total_gib": 79.11, "compute_capability": (9, 0), "aliases": ["h100", "h10080"]},
    "H200 141GB": {"total_gib": 139.81, "compute_capability": (9, 0), "aliases": ["h200", "h200141"]},
}

# Words that NVML names and people add but that do not tell cards apart.
_NOISE = ("nvidia", "geforce", "tesla", "hbm3e", "hbm3", "hbm2e", "sxm5", "sxm4", "sxm", "pcie", "nvl", "gb")


def normalize_gpu_name(name: str) -> str:
    """``"NVIDIA A100-SXM4-80GB"`` -> ``"a10080"``; ``"RTX 4090"`` -> ``"rtx4090"``."""
    text = re.sub(r"[^a-z0-9]", "", name.lower())
    for word in _NOISE:
        text = text.replace(word, "")
    return text


def find_gpu(name: str) -> tuple[str, dict[str, Any]] | None:
    """A catalog GPU by name, alias or NVML name; case, space and dash insensitive. None if unknown."""
    key = normalize_gpu_name(name)
    if not key:
        return None
    for canonical, info in GPUS.items():
        names = {normalize_gpu_name(canonical), *info["aliases"]}
        if key in names:
            return canonical, dict(info)
    return None


def gpu_names() -> list[str]:
    return list(GPUS)
