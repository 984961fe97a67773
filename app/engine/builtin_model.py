"""The tiny built-in models: a random-weights Qwen2 LM (`builtin:tiny`), a random-weights
Qwen3-MoE LM (`builtin:tiny-moe`, for routed experts) and a random-weights Qwen2 reward model
(`builtin:tiny-reward`: a sequence-classification head of one label), each with a byte-level
ChatML tokenizer, for fast tests.

It is built offline and deterministically from a seed, so tests and newcomers never need a hub.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Every assistant turn sits inside {% generation %} tags, so that
# `return_assistant_tokens_mask=True` marks the assistant content and its end-of-turn token.
# With `tools`, a system turn lists them and teaches the Hermes-style call
# `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (as Qwen's templates do); an
# assistant turn's tool calls render the same way, and tool results are their own role.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    '{{- \'</tools>\\nCall a tool with <tool_call>{\\"name\\": ..., \\"arguments\\": {...}}'
    "</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{- '<tool_call>' }}{{- {'name': call['function']['name'], "
    "'arguments': call['function']['arguments']} | tojson }}{{- '</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
DEMO_MARKER = "rlserve_builtin.json"
# Bump when the builder changes what it writes, so cached copies are rebuilt.
BUILDER_VERSION = 5
# vLLM's CPU attention supports head sizes from 32 up.
HEAD_DIM = 32


def build_tokenizer():  # type: ignore[no-untyped-def]
    """A byte-level tokenizer: one token per byte (ids 0-255) plus the ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_symbols = sorted(alphabet, key=lambda s: _byte_of_symbol(s))
    vocab = {symbol: i for i, symbol in enumerate(byte_symbols)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _byte_of_symbol(symbol: str) -> int:
    """GPT-2 byte-to-unicode inverse: the byte that a ByteLevel alphabet symbol stands for."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codepoints = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codepoints.append(256 + extra)
            extra += 1
    return dict(zip(codepoints, printable, strict=True))[ord(symbol)]


def build_model(
    directory: Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    tie_embeddings: bool = False,
    moe: bool = False,
    num_experts: int = 8,
    top_k: int = 2,
    reward: bool = False,
) -> Path:
    """Write the built-in model and tokenizer to `directory` with `save_pretrained`. With `moe`,
    a Qwen3-MoE model: `num_experts` experts, `top_k` per token, and with more than two layers
    layer 1 dense (as `mlp_only_layers` makes some layers of real MoE models). With `reward`, a
    Qwen2 reward model: a sequence-classification head of one label."""
    import json

    import torch
    from transformers import (
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2ForSequenceClassification,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    if hidden_size % HEAD_DIM:
        raise ValueError(f"hidden_size must be a multiple of {HEAD_DIM}, got {hidden_size}")
    tokenizer = build_tokenizer()
    num_heads = hidden_size // HEAD_DIM
    config_class: Any = Qwen2Config
    model_class: Any = Qwen2ForCausalLM
    extra: dict[str, Any] = {}
    if moe:
        config_class, model_class = Qwen3MoeConfig, Qwen3MoeForCausalLM
        extra = {
            "head_dim": HEAD_DIM,
            "num_experts": num_experts,
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": hidden_size,
            "norm_topk_prob": True,
            "mlp_only_layers": [1] if num_layers > 2 else [],
        }
    if reward:
        model_class, extra = Qwen2ForSequenceClassification, {"num_labels": 1}
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(num_heads // 2, 1),
        max_position_embeddings=4096,
        # Wide initialisation so that the random model has peaked, non-uniform distributions.
        initializer_range=0.2,
        # Untied by default: vLLM cannot update tied-embedding models in place
        # (app.engine.vllm.backend).
        tie_word_embeddings=tie_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **extra,
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = model_class(config).eval()
    finally:
        torch.random.set_rng_state(generator_state)
    if not reward:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    marker = {
        "builder_version": BUILDER_VERSION,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "seed": seed,
        "tie_embeddings": tie_embeddings,
        "moe": moe,
        "reward": reward,
        **({"num_experts": num_experts, "top_k": top_k} if moe else {}),
    }
    (directory / DEMO_MARKER).write_text(json.dumps(marker))
    return directory
