"""The Qwen3.5 hybrid family: its checkpoints in the text layout (`qwen3_5_text`, Qwen3_5ForCausalLM, weights
under `model.*`) or the multimodal one (`qwen3_5`, Qwen3_5ForConditionalGeneration, the text model's weights
under `model.language_model.*`; the vision tower and the multi-token-prediction head are skipped: this serves
text). Safetensors, one file or sharded; or a GGUF of llama.cpp's `qwen35` architecture (gguf_qwen3_5 undoes
its converter's transforms; the MTP block it may hold is skipped too)."""

from __future__ import annotations

import os
from typing import Any

import structlog

from executor_svc.models.family import ModelFamily, check_activation, stop_ids
from executor_svc.models.gguf_qwen3_5 import ARCHITECTURE, read_qwen35_gguf
from executor_svc.models.qwen3_5_config import Qwen35Config
from executor_svc.models.qwen3_5_model import Qwen35Model

log = structlog.get_logger("deltaserve.executor.models")

TEXT_TYPE, MULTIMODAL_TYPE = "qwen3_5_text", "qwen3_5"
_SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.")  # the vision tower; the multi-token-prediction head


def hf_weight_name(stored: str) -> str | None:
    """A tensor of either layout -> Qwen35Model's parameter name; None for the vision tower and MTP head."""
    if stored.startswith(_SKIPPED_PREFIXES):
        return None
    for prefix in ("model.language_model.", "model."):
        if stored.startswith(prefix):
            return stored.removeprefix(prefix)
    return stored  # lm_head.weight


def read_hf_config(hf: dict[str, Any], path: str) -> Qwen35Config:
    """The text model's configuration, from either layout's config.json."""
    multimodal = hf.get("model_type") == MULTIMODAL_TYPE or "text_config" in hf
    text = hf.get("text_config", {}) if multimodal else hf
    if multimodal and not text:
        raise ValueError(f"{path}: a {MULTIMODAL_TYPE!r} config.json without text_config")
    if multimodal:
        log.info(f"{path}: a multimodal Qwen3.5 checkpoint; its vision tower is not loaded (text generation)")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"{path}: rope type {rope_type!r} is not supported for Qwen3.5 (only 'default')")
    if text.get("attention_bias"):
        raise ValueError(f"{path}: attention biases are not supported for Qwen3.5")
    layers = text["num_hidden_layers"]
    interval = text.get("full_attention_interval", 4)
    layer_types = text.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)
    ]
    if len(layer_types) != layers:
        raise ValueError(f"{path}: {len(layer_types)} layer_types for {layers} layers")
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    check_activation(text, path)
    eos = stop_ids({"eos_token_id": text.get("eos_token_id", hf.get("eos_token_id"))}, path)
    tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return Qwen35Config(
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        layer_types=tuple(layer_types),
        num_heads=heads,
        num_kv_heads=text.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rotary_dim=int(head_dim * factor),
        linear_key_heads=text["linear_num_key_heads"],
        linear_value_heads=text["linear_num_value_heads"],
        linear_key_dim=text["linear_key_head_dim"],
        linear_value_dim=text["linear_value_head_dim"],
        conv_width=text.get("linear_conv_kernel_dim", 4),
        intermediate_size=text["intermediate_size"],
        rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
        rms_eps=float(text.get("rms_norm_eps", 1e-6)),
        max_seq_len=text.get("max_position_embeddings", 32768),
        tie_embeddings=bool(tie),
        eos_token_ids=eos,
        bos_token_id=text.get("bos_token_id"),
        name=hf.get("_name_or_path") or os.path.basename(os.path.normpath(path)),
    )


FAMILY = ModelFamily(
    name="qwen3_5",
    model_types=(TEXT_TYPE, MULTIMODAL_TYPE),
    architectures=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
    gguf_architectures=(ARCHITECTURE,),
    read_hf_config=read_hf_config,
    hf_weight_name=hf_weight_name,
    read_gguf=read_qwen35_gguf,
    build=Qwen35Model,
)
