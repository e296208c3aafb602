"""Write a tiny dummy-weight model directory the CPU engine can serve (demo and tests).

vLLM starts it with ``--load-format dummy``: it needs ``config.json``, a tokenizer and a chat
template, no weights. Architecture: Qwen2, 2 layers, hidden 256, 4 heads of 64, 2 KV heads, vocab 512,
so a token of KV cache is 2 x 2 x 2 x 64 x 2 = 1024 bytes in bf16.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from r1sup.core.errors import ConfigError

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 32768,
    "max_window_layers": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 2,
}
CORPUS = [
    "The supervisor starts the server and reads every line it prints.",
    "When the cache is too small for the context, the engine says how long a context would fit.",
    "A load probe sends real requests before a configuration is called good.",
    "Operators want one command that starts the model and keeps it running.",
    "Memory is measured in bytes, tokens and blocks; numbers beat guesses.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`",
]


def write_tiny_model(directory: str | os.PathLike[str]) -> Path:
    """Create (or refresh) the tiny model in ``directory`` and return its path."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as exc:  # an optional dependency: the extra r1sup[tiny-model]
        raise ConfigError(
            "tiny-model",
            f"needs the tokenizers package, which is not installed ({exc}); pip install 'r1sup[tiny-model]'",
        ) from None

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    if tokenizer.get_vocab_size() > VOCAB_SIZE:  # pragma: no cover - the trainer honours vocab_size
        raise ConfigError("tiny-model", f"tokenizer has {tokenizer.get_vocab_size()} tokens > {VOCAB_SIZE}")
    tokenizer.save(str(path / "tokenizer.json"))
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    config = dict(CONFIG, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": CONFIG["max_position_embeddings"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    generation_config = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    for name, payload in (
        ("config.json", config),
        ("tokenizer_config.json", tokenizer_config),
        ("generation_config.json", generation_config),
    ):
        (path / name).write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return path
