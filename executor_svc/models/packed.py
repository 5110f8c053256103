"""Quantized weights kept packed on the CPU: a linear layer and an embedding any model family can use in place
of the dense ones, multiplying without a de-quantized copy of the weight.

A packed weight is w = (q - offset) * scale + minv with q of 4 or 8 bits and scale, minv per group of 32 along
the input axis (float16 where gguf stores them so, else float32; no minv where it is zero); activations stay float32, so a packed matmul equals the de-quantized one up to the
order of its sums (packed_kernel.c). Few rows (a decode step) go through the kernel straight from the packed
bytes; many (a prefill chunk) de-quantize a tile of rows at a time into a small scratch matrix for torch's GEMM.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from executor_svc.models import packed_kernel
from executor_svc.models.layers import Embedding, Linear

GROUP = 32
_TILE_BYTES = 1 << 20  # a de-quantized tile of rows for many-row matmuls: stays in the cache
_scratch = threading.local()  # per thread: steps of two models in one process may run at once


@dataclass(frozen=True)
class PackedWeight:
    bits: int  # 4: two weights a byte; 8: one
    offset: int  # subtracted from q before scaling
    q: torch.Tensor  # uint8 [N, K * bits / 8], grouped as packed_kernel.c says
    scale: torch.Tensor  # float32 or float16 [N, K / GROUP]
    minv: torch.Tensor | None  # as scale; None: every minimum is 0

    def __post_init__(self) -> None:
        if self.scale.dtype not in (torch.float16, torch.float32):
            raise ValueError(f"packed scales must be float16 or float32, got {self.scale.dtype}")
        if self.minv is not None and self.minv.dtype != self.scale.dtype:
            raise ValueError(
                f"packed minimums ({self.minv.dtype}) must share the scales' dtype ({self.scale.dtype})"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return self.scale.shape[0], self.scale.shape[1] * GROUP

    @property
    def nbytes(self) -> int:
        parts = (self.q, self.scale) if self.minv is None else (self.q, self.scale, self.minv)
        return sum(t.numel() * t.element_size() for t in parts)

    def take_rows(self, rows: torch.Tensor | slice) -> PackedWeight:
        minv = None if self.minv is None else self.minv[rows]
        return PackedWeight(self.bits, self.offset, self.q[rows], self.scale[rows], minv)

    @staticmethod
    def cat(parts: list[PackedWeight]) -> PackedWeight:
        """The parts' rows one after another (fused projections); all of one bits and offset."""
        first = parts[0]
        if any(p.format != first.format for p in parts):
            raise ValueError("packed weights joined into one must share their format and input size")
        minvs = [p.minv for p in parts]
        return PackedWeight(
            first.bits,
            first.offset,
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            None if first.minv is None else torch.cat(cast(list[torch.Tensor], minvs)),
        )

    @property
    def format(self) -> tuple[int, int, int, torch.dtype, bool]:
        """What weights joined into one must share: bits, offset, input size, scale dtype, minimums or not."""
        return self.bits, self.offset, self.shape[1], self.scale.dtype, self.minv is None

    def dequantize_rows(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [len(rows) or N, K], exactly gguf's de-quantized values."""
        count = self.shape[0] if rows is None else rows.shape[0]
        out = torch.empty(count, self.shape[1], dtype=torch.float32)
        if rows is not None:
            rows = rows.to(torch.int64).contiguous()
        return packed_kernel.dequantize(
            self.bits, self.offset, self.q, self.scale, self.minv, self.shape[1], rows, out
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x[..., K] float32 @ w^T -> [..., N] float32."""
        n, k = self.shape
        x2 = x.reshape(-1, k).contiguous()  # x2: [M, K]
        if x2.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], n)
        if x2.shape[0] <= packed_kernel.MAX_ROWS:
            out = packed_kernel.matmul(self.bits, self.offset, self.q, self.scale, self.minv, x2)
        else:
            out = torch.empty(x2.shape[0], n, dtype=torch.float32)
            tile_rows = max(GROUP, _TILE_BYTES // (4 * k))
            tile = _scratch_tile(tile_rows, k)
            for start in range(0, n, tile_rows):
                rows = min(tile_rows, n - start)
                part = self.take_rows(slice(start, start + rows))
                packed_kernel.dequantize(part.bits, part.offset, part.q, part.scale, part.minv, k, None, tile)
                out[:, start : start + rows] = x2 @ tile[:rows].t()
        return out.view(*x.shape[:-1], n)


def _scratch_tile(rows: int, k: int) -> torch.Tensor:
    tile = getattr(_scratch, "tile", None)
    if tile is None or tile.numel() < rows * k:
        tile = _scratch.tile = torch.empty(rows * k, dtype=torch.float32)
    return tile[: rows * k].view(rows, k)


class PackedLinear(nn.Module):
    """A linear layer over a PackedWeight (CPU, float32 activations); the bias, if any, stays a float tensor."""

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.packed = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.packed.matmul(x)
        return out if self.bias is None else out + self.bias


class PackedEmbedding(nn.Module):
    """An embedding table kept packed: a lookup de-quantizes only the rows asked for; `project` is the tied
    output head's matmul over the same bytes."""

    def __init__(self, weight: PackedWeight) -> None:
        super().__init__()
        self.packed = weight

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        flat = token_ids.reshape(-1)
        return self.packed.dequantize_rows(flat).view(*token_ids.shape, self.packed.shape[1])

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed.matmul(x)


def install_packed(model: nn.Module, weights: dict[str, PackedWeight]) -> None:
    """Each `<module>.weight` in `weights` replaces its module (a linear layer or an embedding, with `weight`
    and an optional `bias`) by the packed one; the bias placeholder moves along, loaded later as before."""
    for name, weight in weights.items():
        path = name.removesuffix(".weight")
        module = model.get_submodule(path)
        replacement: nn.Module
        if isinstance(module, Embedding):
            replacement = PackedEmbedding(weight)
        elif isinstance(module, Linear):
            replacement = PackedLinear(weight, module.bias)
        else:
            raise ValueError(f"{name}: a {type(module).__name__} cannot take a packed weight")
        model.set_submodule(path, replacement)


def fuse_projections(model: nn.Module) -> None:
    """Every module whose q, k and v (or gate and up) projections are all packed gets them as one matmul,
    `qkv_proj` (`gate_up_proj`): one kernel call and one output where a decode step made three (two). The
    parts' weights become row views of the fused one, so memory is not doubled."""
    for module in model.modules():
        for parts, fused in (
            (("q_proj", "k_proj", "v_proj"), "qkv_proj"),
            (("gate_proj", "up_proj"), "gate_up_proj"),
        ):
            linears = [getattr(module, name, None) for name in parts]
            if hasattr(module, fused) and all(isinstance(p, PackedLinear) for p in linears):
                packed = [cast(PackedLinear, p) for p in linears]
                # All with a bias or none, all of one format (a GGUF may quantize its parts differently).
                if len({(p.bias is None, p.packed.format) for p in packed}) == 1:
                    setattr(module, fused, _fuse(packed))


def _fuse(parts: list[PackedLinear]) -> PackedLinear:
    weight = PackedWeight.cat([p.packed for p in parts])
    bias = None if parts[0].bias is None else torch.cat([cast(torch.Tensor, p.bias) for p in parts])
    start = 0
    for part in parts:
        rows = part.packed.shape[0]
        part.packed = weight.take_rows(slice(start, start + rows))
        start += rows
    return PackedLinear(weight, bias)
