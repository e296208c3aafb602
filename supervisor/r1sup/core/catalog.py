"""Built-in catalogs: the DeepSeek-R1 distills' architectures and common GPUs. Plain data, no I/O.

``MODELS`` holds the fields of each model's published ``config.json`` that matter for memory (the
six ``deepseek-ai/DeepSeek-R1-Distill-*`` checkpoints: Qwen2.5-Math-1.5B/7B, Qwen2.5-14B/32B,
Llama-3.1-8B and Llama-3.3-70B-Instruct bases, and the full DeepSeek-R1: 671B parameters, MoE with MLA
attention, an fp8 checkpoint), so ``r1sup plan`` works before anything is
downloaded. ``GPUS`` holds each card's memory as CUDA reports it (``torch.cuda.mem_get_info``'s
total, which is what vLLM multiplies by ``gpu_memory_utilization``; a little below the marketing
size) and its compute capability.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
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
    "deepseek-ai/DeepSeek-R1": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "vocab_size": 129280,
        "max_position_embeddings": 163840,
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        },
    },
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


@dataclass(frozen=True)
class GpuCard:
    """One card of the catalog: its memory as CUDA reports it (GiB), its compute capability, the names
    people and NVML give it (normalized, :func:`normalize_gpu_name`) and its platform."""

    total_gib: float
    compute_capability: tuple[int, int]
    aliases: tuple[str, ...]
    platform: str = "cuda"  # "rocm": an AMD Instinct card


# total_gib: what PyTorch reports as the device's total (``torch.cuda.mem_get_info``, printed as "GPU 0
# has a total capacity of X GiB" in out-of-memory messages): vLLM's base for gpu_memory_utilization,
# a little below the marketing size. compute_capability: NVIDIA's (major, minor); for AMD's gfx942
# (MI300X, MI325X) what PyTorch's ROCm build reports, (9, 4). ``platform``: "cuda" unless "rocm"
# (AMD Instinct: vLLM's ROCm build, same memory accounting through torch's HIP backend).
# Sources of the figures added for issue 16 (memory and compute capability from the vendors' data
# sheets; the totals as PyTorch printed them in public out-of-memory reports):
#   RTX 5090 (32 GB GDDR7, sm_120): 31.37 GiB, https://github.com/Wan-Video/Wan2.1/issues/465
#   RTX A6000 (48 GB GDDR6, sm_86): 47.53 GiB, https://github.com/allenai/open-instruct/issues/163
#   L40 (48 GB GDDR6, sm_89): 44.40 GiB, https://github.com/QwenLM/Qwen3-VL/issues/2097
#   RTX 6000 Ada (48 GB GDDR6, sm_89): 44.43 GiB, https://github.com/DINGYANB/MTVCrafter/issues/21
#   B200 (180 GB HBM3e, sm_100): 178.35 GiB in PyTorch's messages on B200 nodes; nvidia-smi shows
#     183359 MiB in https://github.com/vllm-project/vllm/issues/31272
#   GH200 (96 GB HBM3, sm_90): 94.50 GiB, the total of a 96 GB Hopper in
#     https://github.com/vllm-project/vllm/issues/9630
#   MI300X (192 GB HBM3, gfx942) and MI325X (256 GB HBM3E, gfx942): 191.98 and 255.98 GiB, the
#     totals PyTorch's ROCm build prints in "HIP out of memory" messages on those cards
GPUS: dict[str, GpuCard] = {
    "RTX 3090": GpuCard(23.56, (8, 6), ("rtx3090", "3090")),
    "RTX 4090": GpuCard(23.55, (8, 9), ("rtx4090", "4090")),
    "RTX 5090": GpuCard(31.37, (12, 0), ("rtx5090", "5090")),
    "L4": GpuCard(22.03, (8, 9), ("l4", "l424")),
    "A10": GpuCard(22.06, (8, 6), ("a10", "a1024", "a10g", "a10g24")),
    "RTX A6000": GpuCard(47.53, (8, 6), ("rtxa6000", "a6000", "a600048")),
    "L40": GpuCard(44.40, (8, 9), ("l40", "l4048")),
    "L40S": GpuCard(44.53, (8, 9), ("l40s", "l40s48")),
    "RTX 6000 Ada": GpuCard(44.43, (8, 9), ("rtx6000ada", "rtx6000adageneration", "6000ada")),
    "A100 40GB": GpuCard(39.39, (8, 0), ("a10040",)),
    "A100 80GB": GpuCard(79.15, (8, 0), ("a10080",)),
    "H100 80GB": GpuCard(79.11, (9, 0), ("h100", "h10080")),
    "GH200 96GB": GpuCard(94.50, (9, 0), ("gh200", "gh200480", "gh20096")),
    "H200 141GB": GpuCard(139.81, (9, 0), ("h200", "h200141")),
    "B200": GpuCard(178.35, (10, 0), ("b200", "b200180")),
    "MI300X": GpuCard(191.98, (9, 4), ("mi300x", "mi300x192"), platform="rocm"),
    "MI325X": GpuCard(255.98, (9, 4), ("mi325x", "mi325x256"), platform="rocm"),
}

# Words that NVML/ROCm names and people add but that do not tell cards apart. "NVL" is not one of them:
# the H100 NVL has 94 GB, not the H100's 80, so "H100 NVL" must not become the 80 GB card.
_NOISE = (
    "nvidia",
    "geforce",
    "tesla",
    "amd",
    "instinct",
    "hbm3e",
    "hbm3",
    "hbm2e",
    "sxm5",
    "sxm4",
    "sxm",
    "pcie",
    "oam",
    "gb",
)


def normalize_gpu_name(name: str) -> str:
    """``"NVIDIA A100-SXM4-80GB"`` -> ``"a10080"``; ``"RTX 4090"`` -> ``"rtx4090"``."""
    text = re.sub(r"[^a-z0-9]", "", name.lower())
    for word in _NOISE:
        text = text.replace(word, "")
    return text


def find_gpu(name: str) -> tuple[str, GpuCard] | None:
    """A catalog GPU by name, alias or NVML name; case, space and dash insensitive. None if unknown."""
    key = normalize_gpu_name(name)
    if not key:
        return None
    for canonical, info in GPUS.items():
        if key in {normalize_gpu_name(canonical), *info.aliases}:
            return canonical, info
    return None


def catalog_total_beside(name: str, total_gib: float) -> str:
    """``"; the catalog's H100 80GB (plan --gpu): 79.11 GiB"`` when a probed card is in the catalog with
    another total (``plan --gpu`` sizes with the catalog's figure, ``tune`` with NVML's), else empty: the
    two reports of one card then show both figures."""
    found = find_gpu(name)
    if found is None:
        return ""
    canonical, info = found
    if abs(info.total_gib - total_gib) < 0.005:
        return ""
    return f"; the catalog's {canonical} (plan --gpu): {info.total_gib:.2f} GiB"


def suggest_gpu(name: str) -> list[str]:
    """The catalog GPUs a mistyped or partial name most likely meant: ``"RTX 4900"`` -> ``["RTX 4090"]``,
    ``"a100"`` -> ``["A100 40GB", "A100 80GB"]``; [] when nothing is close."""
    key = normalize_gpu_name(name)
    if not key:
        return []
    by_name: dict[str, str] = {}
    for canonical, info in GPUS.items():
        for alias in (normalize_gpu_name(canonical), *info.aliases):
            by_name.setdefault(alias, canonical)
    return _closest(key, by_name)


def unknown_gpu_message(name: str) -> str:
    """One line for a ``--gpu`` name the catalog does not hold: the close catalog names (a typo, or a
    variant of a card such as "H100 NVL", which is not the H100 80GB), else all of them, and the way to
    plan for any card (``--gpu-memory-gib``)."""
    close = suggest_gpu(name) or _variant_of(normalize_gpu_name(name))
    listed = did_you_mean(close)[2:] if close else f"known: {', '.join(gpu_names())}."
    return (
        f"unknown GPU {name!r}; {listed} For a card not in the catalog give its memory: --gpu-memory-gib "
        "GIB (CUDA's total, as PyTorch's out-of-memory messages print it; --gpu NAME beside it is a label)"
    )


def _variant_of(key: str) -> list[str]:
    """The catalog card whose name ``key`` extends with a word (``h100nvl`` -> H100 80GB): the longest
    such name, when what follows it starts with a letter (``a10094`` is not a variant of the A10)."""
    best = ""
    found: list[str] = []
    for canonical, info in GPUS.items():
        for alias in (normalize_gpu_name(canonical), *info.aliases):
            rest = key[len(alias) :]
            if len(alias) >= 3 and key.startswith(alias) and rest[:1].isalpha() and len(alias) >= len(best):
                if len(alias) > len(best):
                    best, found = alias, []
                if canonical not in found:
                    found.append(canonical)
    return found


def suggest_model(name: str) -> list[str]:
    """The catalog model ids a mistyped id most likely meant; [] when nothing is close.

    Compared without case, with and without the owner (``deepseek-ai/``), so that
    ``DeepSeek-R1-Distill-Qwen-14b-instruct`` or ``deepseek/DeepSeek-R1-Distil-Qwen-14B`` find
    ``deepseek-ai/DeepSeek-R1-Distill-Qwen-14B``.
    """
    wanted = name.strip().lower().rstrip("/")
    if not wanted:
        return []
    by_name: dict[str, str] = {}
    for model_id in MODELS:
        by_name[model_id.lower()] = model_id
        by_name[model_id.split("/", 1)[1].lower()] = model_id
    short = wanted.split("/", 1)[1] if "/" in wanted else wanted
    return _closest(wanted, by_name) or _closest(short, by_name)


def did_you_mean(suggestions: list[str]) -> str:
    """``"; did you mean A?"`` / ``"; did you mean A or B?"``; empty without suggestions."""
    if not suggestions:
        return ""
    return "; did you mean " + " or ".join(suggestions) + "?"


def _closest(key: str, candidates: dict[str, str], cutoff: float = 0.75) -> list[str]:
    """Entries whose name starts with ``key`` (a partial name), else the closest by difflib's ratio."""
    import difflib

    prefixed = sorted({value for name, value in candidates.items() if name.startswith(key) and name != key})
    if 0 < len(prefixed) <= 3:
        return prefixed
    close = difflib.get_close_matches(key, list(candidates), n=3, cutoff=cutoff)
    out: list[str] = []
    for match in close:
        if candidates[match] not in out:
            out.append(candidates[match])
    return out[:1] if out else []


def gpu_names() -> list[str]:
    return list(GPUS)
