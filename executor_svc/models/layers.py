"""The building blocks every family's decoder shares: weights the loader fills, linear (bias optional),
embedding, RMSNorm, the SwiGLU MLP and rotate-half rope."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def empty_weight(*shape: int, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    # Uninitialised on purpose: the loader overwrites every weight, so random init would be wasted time.
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        device: torch.device,
        dtype: torch.dtype,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.weight = empty_weight(out_features, in_features, device=device, dtype=dtype)
        self.bias = empty_weight(out_features, device=device, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_weight(vocab_size, hidden_size, device=device, dtype=dtype)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x[..., hidden] -> [..., V]: the tied output head over the same table."""
        return F.linear(x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_weight(size, device=device, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the weights' dtype, as Hugging Face does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class GatedMLP(nn.Module):
    """down(SiLU(gate(x)) * up(x)), Llama's and Qwen's MLP."""

    def __init__(
        self, hidden: int, intermediate: int, device: torch.device, dtype: torch.dtype, bias: bool = False
    ) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, device, dtype, bias)
        self.up_proj = Linear(hidden, intermediate, device, dtype, bias)
        self.down_proj = Linear(intermediate, hidden, device, dtype, bias)
        self.gate_up_proj: nn.Module | None = None  # gate and up in one matmul (packed.fuse_projections)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x[n, heads, D] rotated by the rows' cos, sin [n, D] (the tables' rows at their positions)."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]
