"""Rotary position tables: the inverse frequencies of a checkpoint's rope type, from transformers'
`modeling_rope_utils` so they are Hugging Face's own, turned into the static cos/sin tables the graphs read."""

from __future__ import annotations

from typing import Any

import torch

# Rope types whose frequencies are fixed per checkpoint: one table serves every batch.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Rope types whose frequencies change with the sequence at run time (transformers' dynamic_rope_update).
DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


class RopeError(ValueError):
    """A checkpoint's rope settings that deltaserve cannot serve."""


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """float32[dim / 2]: Hugging Face's default rope frequencies over `dim` rotated dims (the head's, or its
    first ones where the rotary is partial), with its arithmetic (on the CPU, as it
    computes them when a model is built)."""
    steps = torch.arange(0, dim, 2, dtype=torch.int64).float()
    return 1.0 / (theta ** (steps / dim))


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rope settings of a transformers config, whichever spelling its version uses (rope_parameters, or
    the older rope_scaling beside rope_theta), with rope_type and rope_theta always set."""
    params = dict(
        getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    )
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def hf_rope(hf_config: Any, head_dim: int) -> tuple[str, float, tuple[float, ...] | None, float]:
    """(rope type, theta, inverse frequencies or None for the default ones, attention factor) of a
    transformers config; raises RopeError for a rope type whose tables cannot be static."""
    params = rope_parameters(hf_config)
    rope_type, theta = str(params["rope_type"]), float(params["rope_theta"])
    if rope_type == "default":
        return rope_type, theta, None, 1.0
    if rope_type in DYNAMIC_ROPE_TYPES:
        raise RopeError(
            f"rope type {rope_type!r} changes its frequencies with the sequence length at run time, which "
            f"the static rope tables of the captured graphs cannot follow; supported: {', '.join(STATIC_ROPE_TYPES)}"
        )
    if rope_type not in STATIC_ROPE_TYPES:
        raise RopeError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}"
        )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    if inv_freq.shape != (head_dim // 2,):
        raise RopeError(f"rope frequencies have shape {tuple(inv_freq.shape)}, expected ({head_dim // 2},)")
    return rope_type, theta, tuple(inv_freq.float().tolist()), float(attention_factor)


def rope_tables(
    inv_freq: torch.Tensor,
    attention_factor: float,
    max_seq_len: int,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [max_seq_len, dim] (dim = 2 * len(inv_freq), the rotated dims) in `dtype`: Hugging
    Face's arithmetic (angles in float32, both scaled by the attention factor, then rounded), so the tables
    match its own."""
    positions = torch.arange(max_seq_len, dtype=torch.float, device=device)
    freqs = positions[:, None] * inv_freq.to(device)[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)  # angles: [max_seq_len, dim]
    return (angles.cos() * attention_factor).to(dtype), (angles.sin() * attention_factor).to(dtype)
