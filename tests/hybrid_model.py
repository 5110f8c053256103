"""A tiny Qwen3.5 hybrid (three gated delta net layers, then full attention) with random weights, saved in both
published layouts by transformers' own classes, and its fp32 greedy continuations."""

from __future__ import annotations

import os

import torch

TEXT_CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,  # layer_types: linear, linear, linear, full
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    max_position_embeddings=2048,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def build_text_model(seed: int = 0, **overrides):
    """Qwen3_5ForCausalLM with random weights, its norms random too (their init is the identity); `overrides`
    change TEXT_CONFIG's fields."""
    from transformers import Qwen3_5TextConfig

    from tests.torch_only import qwen3_5_modeling

    torch.manual_seed(seed)
    model = qwen3_5_modeling().Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**TEXT_CONFIG, **overrides})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
    return model


def save_layouts(model, directory: str, tokenizer) -> tuple[str, str]:
    """The model saved as `qwen3_5_text` and, with the same text weights under `model.language_model.*` and
    a small vision tower, as `qwen3_5` (Qwen3_5ForConditionalGeneration); each directory with `tokenizer`."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text_dir, multimodal_dir = os.path.join(directory, "text"), os.path.join(directory, "multimodal")
    model.save_pretrained(text_dir)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    multimodal = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=TEXT_CONFIG, vision_config=vision))
    text_weights = {
        (
            "lm_head.weight"
            if name == "lm_head.weight"
            else "model.language_model." + name.removeprefix("model.")
        ): w
        for name, w in model.state_dict().items()
    }
    missing, _ = multimodal.load_state_dict(text_weights, strict=False)
    assert all(name.startswith("model.visual.") for name in missing), missing
    multimodal.save_pretrained(
        multimodal_dir, max_shard_size="200KB"
    )  # sharded, as published checkpoints are
    for path in (text_dir, multimodal_dir):
        tokenizer.save_pretrained(path)
    return text_dir, multimodal_dir


def greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' fp32 greedy continuation, stopping after EOS (included) as the planner does."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=TEXT_CONFIG["eos_token_id"],
            pad_token_id=TEXT_CONFIG["eos_token_id"],
        )
    return out[0, len(prompt) :].tolist()


async def start_with_cache(
    model_dir: str, cache_dir: str, state_slots: int, row_check: bool = False, **executor
):
    """The hybrid served on the CPU in-process (tests.conftest's stack) over a cache service of its own:
    (stack, servers, cache). `executor`: more ExecutorConfig fields (shard_layers, device)."""
    from cache_svc.server import start_cache_server
    from executor_svc.config import ExecutorConfig
    from planner_svc.config import PlannerConfig, SchedulingConfig
    from tests.conftest import start_stack

    cache = await start_cache_server(cache_dir, budget_bytes=1 << 30)
    address = f"127.0.0.1:{cache.port}"
    config = ExecutorConfig(
        **{"device": "cpu", **executor},
        model=model_dir,
        dtype="float32",
        pool_pages=64,
        page_size=16,
        buckets=(1, 2),
        state_slots=state_slots,
        cache=address,
        row_check=row_check,
    )
    planner = PlannerConfig(model=model_dir, cache=address, scheduling=SchedulingConfig(row_check=row_check))
    stack, servers = await start_stack(config, planner)
    return stack, servers, cache
