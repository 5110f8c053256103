"""The Qwen3.5 hybrid's configuration as the executor reads it (qwen3_5.py reads it from either published
layout): the layer pattern, the full-attention and gated delta net shapes."""

from __future__ import annotations

from dataclasses import dataclass

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(slots=True)
class Qwen35Config:
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    num_heads: int  # full attention
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # the leading dims of each head that rope turns
    linear_key_heads: int
    linear_value_heads: int
    linear_key_dim: int
    linear_value_dim: int
    conv_width: int
    intermediate_size: int
    rope_theta: float
    rms_eps: float
    max_seq_len: int
    tie_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    name: str

    def __post_init__(self) -> None:
        unknown = sorted(set(self.layer_types) - {LINEAR, FULL})
        if unknown:
            raise ValueError(f"layer_types {unknown} are not supported (only {LINEAR!r} and {FULL!r})")
        if FULL not in self.layer_types:
            raise ValueError("layer_types has no full_attention layer; the KV pool needs at least one")
        if self.num_heads % self.num_kv_heads or self.linear_value_heads % self.linear_key_heads:
            raise ValueError("query heads must be a multiple of KV heads, value heads of key heads")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and within head_dim {self.head_dim}")
        if not self.eos_token_ids or not all(0 <= e < self.vocab_size for e in self.eos_token_ids):
            raise ValueError(
                f"eos_token_ids {self.eos_token_ids} are empty or outside the vocabulary ({self.vocab_size})"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def conv_channels(self) -> int:
        return (
            2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim
        )
