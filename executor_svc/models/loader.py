"""Load a Llama-family model from a GGUF file or a Hugging Face safetensors directory."""

from __future__ import annotations

import glob
import hashlib
import json
import os

import numpy as np
import torch

from executor_svc.models.llama import LlamaConfig, LlamaModel

_MIB = 1 << 20
_REQUIRED = object()  # marks GGUF metadata without a default

# GGUF tensor names per layer -> our (Hugging Face) names.
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


def load_model(path: str, device: torch.device | str, dtype: torch.dtype) -> LlamaModel:
    """A LlamaModel with every weight loaded, on `device` in `dtype`."""
    if os.path.isdir(path):
        config, weights = _read_hf_dir(path)
    elif os.path.isfile(path) and path.endswith(".gguf"):
        config, weights = _read_gguf(path)
    else:
        raise ValueError(f"model path {path!r} is neither a .gguf file nor a Hugging Face model directory")
    model = LlamaModel(config, device=device, dtype=dtype)
    expected = set(model.state_dict())
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
        raise ValueError(
            f"{path}: weights do not match a Llama model (missing {missing[:5]}, unexpected {extra[:5]})"
        )
    for name, param in model.named_parameters():
        if param.shape != weights[name].shape:
            raise ValueError(
                f"{path}: {name} has shape {tuple(weights[name].shape)}, expected {tuple(param.shape)}"
            )
    # assign=True adopts the converted tensors instead of copying into the placeholders (saves a pass).
    model.load_state_dict(
        {name: w.to(device=device, dtype=dtype) for name, w in weights.items()}, assign=True
    )
    return model


def model_fingerprint(path: str) -> str:
    """sha256 over the config and the name, size and first/last MiB of each weight file.

    Cheap (no full read) yet different for any other model or quantisation in practice; a GGUF keeps
    its config in its header, inside the first MiB."""
    digest = hashlib.sha256()
    if os.path.isdir(path):
        with open(os.path.join(path, "config.json"), "rb") as f:
            digest.update(f.read())
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    else:
        files = [path]
    for file in files:
        size = os.path.getsize(file)
        digest.update(os.path.basename(file).encode() + size.to_bytes(8, "little"))
        with open(file, "rb") as f:
            digest.update(f.read(_MIB))
            f.seek(max(0, size - _MIB))
            digest.update(f.read(_MIB))
    return digest.hexdigest()


def _read_gguf(path: str) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    import gguf

    reader = gguf.GGUFReader(path)

    def meta(key: str, default=_REQUIRED):
        # Read only the fields asked for: the tokenizer's arrays are large and not needed here.
        field = reader.fields.get(key)
        if field is not None:
            return field.contents()
        if default is _REQUIRED:
            raise ValueError(f"{path}: GGUF metadata {key!r} is missing")
        return default

    arch = meta("general.architecture", "")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r} is not supported (only 'llama')")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: tensor 'token_embd.weight' is missing")
    num_heads = int(meta("llama.attention.head_count"))
    num_kv_heads = int(meta("llama.attention.head_count_kv", num_heads))
    hidden = int(meta("llama.embedding_length"))
    config = LlamaConfig(
        vocab_size=int(meta("llama.vocab_size", tensors["token_embd.weight"].shape[1])),
        hidden_size=hidden,
        num_layers=int(meta("llama.block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(meta("llama.attention.key_length", hidden // num_heads)),
        intermediate_size=int(meta("llama.feed_forward_length")),
        rope_theta=float(meta("llama.rope.freq_base", 10000.0)),
        rms_eps=float(meta("llama.attention.layer_norm_rms_epsilon")),
        max_seq_len=int(meta("llama.context_length")),
        tie_embeddings="output.weight" not in tensors,
        eos_token_id=int(meta("tokenizer.ggml.eos_token_id")),
        bos_token_id=meta("tokenizer.ggml.bos_token_id", None),
        name=str(meta("general.name", os.path.basename(path))),
    )
    rope_scaling = meta("llama.rope.scaling.type", "none")
    if rope_scaling != "none":
        raise ValueError(f"{path}: rope scaling {rope_scaling!r} is not supported")

    weights = {}
    for name, tensor in tensors.items():
        # np.asarray drops the memmap subclass, whose per-slice bookkeeping doubles the dequantize time.
        array = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)  # [out, in]
        if name.endswith(".attn_q.weight"):
            array = _undo_rope_permute(array, config.num_heads)
        elif name.endswith(".attn_k.weight"):
            array = _undo_rope_permute(array, config.num_kv_heads)
        # F32 tensors come back as read-only views of the file: copy those only.
        weights[_gguf_to_hf_name(path, name)] = torch.from_numpy(np.require(array, np.float32, ["C", "W"]))
    return config, weights


def _undo_rope_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp interleaves the two rope halves of each head's rows; put them back in rotate_half order
    (the inverse of convert_hf_to_gguf's permute, as transformers' reverse_permute_weights does)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _gguf_to_hf_name(path: str, name: str) -> str:
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_LAYER_NAMES:
        return f"layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GGUF_TOP_NAMES:
        return f"{_GGUF_TOP_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"{path}: unexpected tensor {name!r} for a llama model")


def _read_hf_dir(path: str) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{path}: config.json is missing")
    with open(config_path) as f:
        hf = json.load(f)
    if hf.get("model_type") != "llama" and "LlamaForCausalLM" not in hf.get("architectures", []):
        raise ValueError(f"{path}: model type {hf.get('model_type')!r} is not supported (only Llama)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"{path}: rope type {rope.get('rope_type', rope.get('type'))!r} is not supported")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError(f"{path}: attention or MLP biases are not supported")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"{path}: no *.safetensors file")
    eos = hf.get("eos_token_id")
    num_heads = hf["num_attention_heads"]
    config = LlamaConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        intermediate_size=hf["intermediate_size"],
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_seq_len=hf.get("max_position_embeddings", 2048),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        bos_token_id=hf.get("bos_token_id"),
        name=hf.get("_name_or_path") or os.path.basename(os.path.normpath(path)),
    )
    weights = {}
    for file in files:
        for name, tensor in load_file(file).items():
            name = name.removeprefix("model.")
            if config.tie_embeddings and name == "lm_head.weight":
                continue  # a tied head is the embedding; some checkpoints store a copy anyway
            weights[name] = tensor
    return config, weights
