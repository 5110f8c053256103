"""GGUF of each dense family: a tiny random transformers checkpoint written as llama.cpp's converter writes it
(its metadata keys and tensor names; Llama's q/k rows permuted; Llama 3's rope scaling as `rope_freqs.weight`
factors) loads and generates transformers' greedy tokens."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from executor_svc.models.loader import load_model
from tests import tiny_families
from tests.conftest import decode_logits, prefill_logits

NEW_TOKENS = 8
PROMPT = tiny_families.prompts([300], seed=3)[0]  # long enough that llama3's scaled frequencies show

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: each head's rope halves interleaved."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _llama3_factors(config) -> np.ndarray:
    """convert_hf_to_gguf's rope_freqs for a llama3 rope: per frequency, the factor llama.cpp divides it by."""
    rope = config.rope_parameters
    head_dim = config.hidden_size // config.num_attention_heads
    base, factor = rope["rope_theta"], rope["factor"]
    low, high, old = (
        rope["low_freq_factor"],
        rope["high_freq_factor"],
        rope["original_max_position_embeddings"],
    )
    factors = []
    for freq in 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(model, path: Path, arch: str) -> None:
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(7)  # Llama 3's <|eot_id|> beside its EOS: both end a request
    writer.add_bos_token_id(1)
    if config.rope_parameters["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_factors(config))
    for name, tensor in model.state_dict().items():
        array = tensor.float().numpy()
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = _permute(array, config.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = _permute(array, config.num_key_value_heads)
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            gguf_name = f"blk.{parts[2]}.{_LAYER_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"
        else:
            gguf_name = f"{_TOP_NAMES['.'.join(parts[:-1])]}.{parts[-1]}"
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Our model's greedy tokens, prefilled then decoded one at a time over a paged pool."""
    kv = model.make_kv_pool(num_pages=2 + (len(prompt) + new_tokens) // 16, page_size=16)
    pages = torch.arange(1, kv.num_pages, dtype=torch.int32)
    generated = [int(prefill_logits(model, kv, torch.tensor(prompt), 0, pages).argmax())]
    while len(generated) < new_tokens:
        kv_len = len(prompt) + len(generated) - 1
        position = torch.tensor([kv_len])
        logits = decode_logits(
            model, kv, torch.tensor([generated[-1]]), position, position.to(torch.int32), pages[None, :]
        )
        generated.append(int(logits[0].argmax()))
    return generated


@pytest.mark.parametrize(("variant", "arch"), [("llama3", "llama"), ("qwen3", "qwen3")])
def test_gguf_of_each_family_generates_transformers_tokens(variant: str, arch: str, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_families.hf_config(variant), dtype=torch.float32).eval()
    write_gguf(hf, tmp_path / "tiny.gguf", arch)
    ours = load_model(str(tmp_path / "tiny.gguf"), "cpu", torch.float32)
    assert ours.config.rope_type == tiny_families.VARIANTS[variant][1]["rope_parameters"]["rope_type"]
    assert ours.config.eos_token_ids == (2, 7)
    assert greedy(ours, PROMPT, NEW_TOKENS) == tiny_families.hf_greedy(hf, PROMPT, NEW_TOKENS, None)
