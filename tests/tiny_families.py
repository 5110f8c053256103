"""Tiny random checkpoints of each dense family variant, built with transformers' own classes and saved with
`save_pretrained` (no download), and transformers' fp32 greedy tokens on them: what tests/test_e2e_families.py
and bench/gpu_parity.py's `families` compare deltaserve against."""

from __future__ import annotations

import random
from pathlib import Path

import torch

VOCAB = 512
NEW_TOKENS = 8
# head_dim 16 (hidden 64 over 4 heads) for Llama; Qwen3 names its own (32). 2 KV heads: GQA.
_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,  # room for the prompts over 1,000 tokens
    initializer_range=0.1,  # wider logit gaps than the default 0.02: no near-ties for fp32 rounding to flip
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# variant -> (family, config fields beyond _SHAPE). Rope scalings with original contexts well under the
# prompts' lengths, so the scaling shows in the tokens.
VARIANTS: dict[str, tuple[str, dict]] = {
    # Llama 3.2's kind: llama3 rope, tied embeddings, several EOS ids (the second picked from the tokens)
    "llama3": (
        "llama",
        dict(
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        ),
    ),
    # yarn (its attention factor scales cos and sin), untied head, saved in several shards
    "yarn": (
        "llama",
        dict(
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 512,
            },
        ),
    ),
    # linear rope, bias in every attention and MLP projection
    "linear_biases": (
        "llama",
        dict(
            tie_word_embeddings=False,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        ),
    ),
    # Qwen3: q/k norms, an explicit head_dim unlike hidden / heads, its theta, tied embeddings
    "qwen3": (
        "qwen3",
        dict(
            head_dim=32, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
        ),
    ),
}
SHARDED = "yarn"
EOS_LIST = "llama3"


def hf_config(variant: str, **overrides):
    from transformers import LlamaConfig, Qwen3Config

    family, fields = VARIANTS[variant]
    config_class = {"llama": LlamaConfig, "qwen3": Qwen3Config}[family]
    return config_class(**{**_SHAPE, **fields, **overrides})


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Random token ids (no special ones), one prompt per length."""
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def hf_greedy(model, prompt: list[int], new_tokens: int, eos: list[int] | None) -> list[int]:
    """transformers' greedy continuation, stopping after any of `eos` (included), as `generate` does."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def save_variant(variant: str, directory: Path, tokenizer, probe: list[int]) -> None:
    """The variant's random checkpoint as safetensors in `directory`, with `tokenizer` beside it (the planner
    reads it there). The EOS-list variant's second stop id is a token it generates from `probe` (so a request
    ends on it)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(len(variant))
    model = AutoModelForCausalLM.from_config(hf_config(variant), dtype=torch.float32).eval()
    if variant == EOS_LIST:
        stop = hf_greedy(model, probe, NEW_TOKENS, None)[NEW_TOKENS // 2]
        model.config.eos_token_id = model.generation_config.eos_token_id = [2, stop]
    model.save_pretrained(directory, max_shard_size="100KB" if variant == SHARDED else "50GB")
    tokenizer.save_pretrained(directory)


def reference(directory: Path, prompt_ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' fp32 greedy tokens for each prompt, from the saved checkpoint, stopping on its EOS ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    return [hf_greedy(model, prompt, new_tokens, eos) for prompt in prompt_ids]
