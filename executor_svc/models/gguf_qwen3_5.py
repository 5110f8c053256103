"""The Qwen3.5 hybrid from a GGUF file (llama.cpp's `qwen35` architecture): its metadata -> Qwen35Config, its
tensors -> Qwen35Model's parameters, with llama.cpp's converter's transforms undone (convert_hf_to_gguf's
Qwen3_5TextModel: Qwen3NextModel.modify_tensors and _LinearAttentionVReorderBase.modify_tensors):

- the (1 + w) RMSNorm weights are stored with the 1 added (all but the gated norm `ssm_norm`): subtract it;
- `ssm_a` holds -exp(A_log): A_log = log(-ssm_a);
- `ssm_conv1d` is squeezed to [channels, width]: back to [channels, 1, width];
- where key heads are fewer than value heads, the value heads are tiled ([v0 of k0, v0 of k1, ..., v1 of k0,
  ...]) where Hugging Face groups them by key head ([v0 of k0, v1 of k0, ..., v0 of k1, ...]), on every tensor
  indexed by value head: the value rows of `attn_qkv` and `ssm_conv1d`, the rows of `attn_gate`, `ssm_alpha`,
  `ssm_beta`, `ssm_dt`, `ssm_a`, and the columns of `ssm_out`: put back in grouped order;
- the multi-token-prediction block, when written, is the last `nextn_predict_layers` blocks: skipped.

The full attention's `attn_q` keeps Hugging Face's rows (each head's query then its output gate), and its rope
rows are not permuted (llama.cpp rotates Qwen's NEOX halves). llama.cpp's multi-section rope of Qwen3.5 turns
every section by the same position for text, which is the one-position partial rope Qwen35Model applies.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import structlog
import torch

from executor_svc.models.gguf_dense import dequantized, end_ids, metadata
from executor_svc.models.qwen3_5_config import FULL, LINEAR, Qwen35Config
from protos.progress import Progress

log = structlog.get_logger("deltaserve.executor.models")

ARCHITECTURE = "qwen35"

# GGUF tensor names per layer -> Qwen35Model's (Hugging Face's) names.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
# Norms stored as 1 + w (the converter adds 1 to every `norm.weight` but the gated delta net's).
_PLUS_ONE = {"attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm"}


def read_qwen35_config(reader: Any, path: str) -> tuple[Qwen35Config, int]:
    """The config of a `qwen35` GGUF, and the number of blocks the file holds (the decoder's, then the MTP's)."""
    meta = metadata(reader, path)
    arch = meta("general.architecture")

    def count(key: str, *default: int) -> int:
        return int(meta(f"{arch}.{key}", *default))

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: tensor 'token_embd.weight' is missing")
    scaling = meta(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"{path}: GGUF rope scaling {scaling!r} is not supported for Qwen3.5 (only none)")
    blocks = count("block_count")
    mtp = count("nextn_predict_layers", 0)
    layers = blocks - mtp
    if mtp and "blk.0.attn_norm.weight" not in tensors:  # llama.cpp's test for the converter's mtp-*.gguf
        raise ValueError(f"{path}: an MTP-only (draft) GGUF, not the model: it holds no decoder layers")
    heads = count("attention.head_count")
    head_dim = count("attention.key_length")
    if count("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"{path}: attention key and value lengths differ; Qwen3.5 has one head_dim")
    value_heads, value_size = count("ssm.time_step_rank"), count("ssm.inner_size")
    for key in ("ssm.time_step_rank", "ssm.group_count", "attention.head_count"):
        if count(key) <= 0:
            raise ValueError(f"{path}: {arch}.{key} is {count(key)}; it must be positive")
    if value_size % value_heads:
        raise ValueError(
            f"{path}: ssm.inner_size {value_size} is not a multiple of ssm.time_step_rank {value_heads}"
        )
    config = Qwen35Config(
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # ggml lists the fastest axis first
        hidden_size=count("embedding_length"),
        layer_types=_layer_types(meta(f"{arch}.attention.recurrent_layers", None), count, layers),
        num_heads=heads,
        num_kv_heads=count("attention.head_count_kv", heads),
        head_dim=head_dim,
        rotary_dim=count("rope.dimension_count", head_dim),  # llama.cpp's default: the whole head
        linear_key_heads=count("ssm.group_count"),
        linear_value_heads=value_heads,
        linear_key_dim=count("ssm.state_size"),
        linear_value_dim=value_size // value_heads,
        conv_width=count("ssm.conv_kernel"),
        intermediate_size=count("feed_forward_length"),
        rope_theta=float(meta(f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(meta(f"{arch}.attention.layer_norm_rms_epsilon")),
        max_seq_len=count("context_length"),
        tie_embeddings="output.weight" not in tensors,
        eos_token_ids=end_ids(meta),
        bos_token_id=meta("tokenizer.ggml.bos_token_id", None),
        name=str(meta("general.name", os.path.basename(path))),
    )
    return config, blocks


def _layer_types(recurrent: Any, count: Callable[..., int], layers: int) -> tuple[str, ...]:
    """llama.cpp's rule: `attention.recurrent_layers` (one flag per block, or one for all) where the file has it,
    else every `full_attention_interval`-th layer (default 4) is full attention, the rest gated delta nets."""
    if recurrent is None:
        interval = count("full_attention_interval", 4)
        return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers))
    flags = recurrent if isinstance(recurrent, list) else [recurrent] * layers
    if len(flags) not in (layers, count("block_count")):
        raise ValueError(
            f"attention.recurrent_layers has {len(flags)} flags; it needs one per block ({count('block_count')}, "
            f"the decoder's {layers} first)"
        )
    return tuple(LINEAR if flag else FULL for flag in flags[:layers])


def read_qwen35_gguf(reader: Any, path: str, pack: bool) -> tuple[Qwen35Config, dict[str, torch.Tensor]]:
    """The config and the weights (de-quantized to float32) of a `qwen35` GGUF. Qwen35Model has no packed
    linear layers, so `pack` de-quantizes too."""
    config, blocks = read_qwen35_config(reader, path)
    if pack:
        log.info(f"{path}: Qwen3.5 keeps no packed weights; its quantized matrices are de-quantized")
    untile = _Untile(config)
    weights: dict[str, torch.Tensor] = {}
    with Progress(f"de-quantizing {config.name}", total=len(reader.tensors), unit="tensors") as progress:
        for tensor in reader.tensors:
            progress.advance()
            block = tensor.name.split(".")[1] if tensor.name.startswith("blk.") else ""
            if block.isdecimal() and config.num_layers <= int(block) < blocks:
                continue  # the multi-token-prediction block: this serves one token a step
            ours, kind = _our_name(path, tensor.name)
            weights[ours] = torch.from_numpy(
                np.require(untile(kind, dequantized(tensor)), np.float32, ["C", "W"])
            )
    return config, weights


def _our_name(path: str, name: str) -> tuple[str, str]:
    """A GGUF tensor name -> (Qwen35Model's parameter name, the GGUF leaf kind, e.g. 'ssm_a')."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name], name.removesuffix(".weight")
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) in (3, 4) and parts[1].isdecimal():
        layer, kind, suffix = parts[1], parts[2], parts[3:]
        if kind == "ssm_a" and not suffix:
            return f"layers.{layer}.linear_attn.A_log", kind
        if kind == "ssm_dt" and suffix == ["bias"]:
            return f"layers.{layer}.linear_attn.dt_bias", kind
        if kind in _LAYER_NAMES and suffix == ["weight"]:
            return f"layers.{layer}.{_LAYER_NAMES[kind]}.weight", kind
    raise ValueError(f"{path}: unexpected tensor {name!r} for a {ARCHITECTURE} model")


class _Untile:
    """Undoes the converter's value transforms on one tensor, by its GGUF leaf kind."""

    def __init__(self, config: Qwen35Config) -> None:
        self.key_heads = config.linear_key_heads
        self.per_key = config.linear_value_heads // config.linear_key_heads
        self.value_dim = config.linear_value_dim
        self.key_rows = 2 * config.linear_key_heads * config.linear_key_dim  # q then k, before v

    def __call__(self, kind: str, array: np.ndarray) -> np.ndarray:
        if kind in _PLUS_ONE or kind == "output_norm":
            return array - 1.0
        if kind == "ssm_a":
            return self._grouped(np.log(-array), 1)  # ssm_a = -exp(A_log)
        if kind in ("ssm_dt", "ssm_alpha", "ssm_beta"):
            return self._grouped(array, 1)
        if kind == "attn_gate":
            return self._grouped(array, self.value_dim)
        if kind == "attn_qkv":
            return np.concatenate(
                [array[: self.key_rows], self._grouped(array[self.key_rows :], self.value_dim)]
            )
        if kind == "ssm_conv1d":  # [channels, width] -> [channels, 1, width]
            rows = np.concatenate(
                [array[: self.key_rows], self._grouped(array[self.key_rows :], self.value_dim)]
            )
            return rows[:, None, :]
        if kind == "ssm_out":  # its columns are the value heads'
            return self._grouped(array.T, self.value_dim).T
        return array

    def _grouped(self, array: np.ndarray, head_dim: int) -> np.ndarray:
        """Rows of value heads in tiled order [per_key, key_heads, head_dim] -> grouped [key_heads, per_key,
        head_dim] (the inverse of the converter's _reorder_v_heads)."""
        if self.per_key == 1:
            return array
        tiled = array.reshape(self.per_key, self.key_heads, head_dim, *array.shape[1:])
        return tiled.swapaxes(0, 1).reshape(array.shape)
