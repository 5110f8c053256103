"""A dense decoder (Llama, Qwen3) from a GGUF file: llama.cpp's metadata and tensor names -> DenseConfig and
weights named as DenseModel's parameters."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from executor_svc.models.dense import DenseConfig
from executor_svc.models.gguf_packing import PACKABLE, pack_gguf
from executor_svc.models.packed import PackedWeight
from executor_svc.models.rope import default_inv_freq
from protos.progress import Progress

_REQUIRED = object()  # marks GGUF metadata without a default

# GGUF tensor names per layer -> our (Hugging Face) names.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
# Llama 3's rope scaling, as llama.cpp's converter stores it: a factor dividing each default frequency.
_ROPE_FACTORS = "rope_freqs.weight"


def read_dense_gguf(
    reader: Any, path: str, *, permute_qk: bool, pack: bool = False
) -> tuple[DenseConfig, dict[str, torch.Tensor | PackedWeight]]:
    """The config and the weights of a dense decoder's GGUF. permute_qk: llama.cpp interleaved the rope halves
    of q and k's rows (its Llama converter does, for its "normal" rope; Qwen's NEOX rope needs no permute).
    pack: quantized matrices of a type gguf_packing maps stay packed (PackedWeight), the rest de-quantized."""
    meta = metadata(reader, path)
    arch = meta("general.architecture")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: tensor 'token_embd.weight' is missing")
    num_heads = int(meta(f"{arch}.attention.head_count"))
    hidden = int(meta(f"{arch}.embedding_length"))
    head_dim = int(meta(f"{arch}.attention.key_length", hidden // num_heads))
    theta = float(meta(f"{arch}.rope.freq_base", 10000.0))
    rope_type, inv_freq = "default", None
    scaling = meta(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        rope_type = "linear"
        inv_freq = default_inv_freq(theta, head_dim) / float(meta(f"{arch}.rope.scaling.factor"))
    elif scaling != "none":
        raise ValueError(f"{path}: GGUF rope scaling {scaling!r} is not supported (none, linear, llama3)")
    if _ROPE_FACTORS in tensors:
        rope_type = "llama3"
        factors = torch.from_numpy(np.array(tensors[_ROPE_FACTORS].data, dtype=np.float32))
        inv_freq = default_inv_freq(theta, head_dim) / factors
    config = DenseConfig(
        vocab_size=int(meta(f"{arch}.vocab_size", tensors["token_embd.weight"].shape[1])),
        hidden_size=hidden,
        num_layers=int(meta(f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        intermediate_size=int(meta(f"{arch}.feed_forward_length")),
        rope_theta=theta,
        rms_eps=float(meta(f"{arch}.attention.layer_norm_rms_epsilon")),
        max_seq_len=int(meta(f"{arch}.context_length")),
        tie_embeddings="output.weight" not in tensors,
        eos_token_ids=end_ids(meta),
        bos_token_id=meta("tokenizer.ggml.bos_token_id", None),
        name=str(meta("general.name", os.path.basename(path))),
        rope_type=rope_type,
        rope_inv_freq=None if inv_freq is None else tuple(inv_freq.tolist()),
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        mlp_bias="blk.0.ffn_up.bias" in tensors,
    )

    weights: dict[str, torch.Tensor | PackedWeight] = {}
    verb = "packing" if pack else "de-quantizing"
    with Progress(f"{verb} {config.name}", total=len(tensors), unit="tensors") as progress:
        for name, tensor in tensors.items():
            progress.advance()
            if name == _ROPE_FACTORS:
                continue  # read into the rope frequencies above
            heads = None
            if permute_qk and (name.endswith(".attn_q.weight") or name.endswith(".attn_q.bias")):
                heads = config.num_heads
            elif permute_qk and (name.endswith(".attn_k.weight") or name.endswith(".attn_k.bias")):
                heads = config.num_kv_heads
            if pack and len(tensor.shape) == 2 and tensor.tensor_type.name in PACKABLE:
                rows, cols = int(tensor.shape[1]), int(tensor.shape[0])  # ggml lists the fastest axis first
                packed = pack_gguf(np.asarray(tensor.data), tensor.tensor_type.name, rows, cols)
                if heads is not None:
                    packed = packed.take_rows(torch.from_numpy(_undo_rope_permute(np.arange(rows), heads)))
                weights[_hf_name(path, arch, name)] = packed
                continue
            array = dequantized(tensor)  # [out, in] or [out]
            if heads is not None:
                array = _undo_rope_permute(array, heads)
            # F32 tensors come back as read-only views of the file: copy those only.
            weights[_hf_name(path, arch, name)] = torch.from_numpy(np.require(array, np.float32, ["C", "W"]))
    return config, weights


def metadata(reader: Any, path: str) -> Callable[..., Any]:
    """meta(key[, default]): a GGUF metadata value; a key without a default that the file lacks is a ValueError
    naming it."""

    def meta(key: str, default: Any = _REQUIRED) -> Any:
        # Read only the fields asked for: the tokenizer's arrays are large and not needed here.
        field = reader.fields.get(key)
        if field is not None:
            return field.contents()
        if default is _REQUIRED:
            raise ValueError(f"{path}: GGUF metadata {key!r} is missing")
        return default

    return meta


def dequantized(tensor: Any) -> np.ndarray:
    """A GGUF tensor as float32 numpy in torch's axis order ([out, in] for a matrix), de-quantized by the gguf
    package (every type it knows; a ValueError names one it does not)."""
    import gguf

    try:
        # np.asarray drops the memmap subclass, whose per-slice bookkeeping doubles the dequantize time.
        array = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    except NotImplementedError as e:
        raise ValueError(
            f"tensor {tensor.name!r} is {tensor.tensor_type.name}, which cannot be read: {e}"
        ) from e
    return np.asarray(array, dtype=np.float32)


def end_ids(meta: Any) -> tuple[int, ...]:
    """The ids that end generation, as llama.cpp counts them: its EOS, and its end-of-turn and end-of-message
    ids where the file names them (Llama 3's <|eot_id|>, <|eom_id|>)."""
    ids = [int(meta("tokenizer.ggml.eos_token_id"))]
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        found = meta(key, None)
        if found is not None and int(found) not in ids:
            ids.append(int(found))
    return tuple(ids)


def _undo_rope_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp interleaves the two rope halves of each head's rows; put them back in rotate_half order
    (the inverse of convert_hf_to_gguf's permute, as transformers' reverse_permute_weights does)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _hf_name(path: str, arch: str, name: str) -> str:
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"{path}: unexpected tensor {name!r} for a {arch} model")
