"""RMSNorm with the residual add, as eager torch rounds it: the step's final norm (the norms inside a layer are
fused into its projections, kernels/linear.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_residual_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    normed_ptr,
    new_residual_ptr,
    stride_x,
    stride_residual,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    live = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=live, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * hidden + cols, x, mask=live)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, 0) / hidden + eps)
    weight = tl.load(weight_ptr + cols, mask=live, other=0.0).to(tl.float32)
    # As the torch RMSNorm: normalise in float32, round to the input dtype, then scale by the weight.
    normed = (x32 * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32) * weight
    tl.store(normed_ptr + row * hidden + cols, normed.to(normed_ptr.dtype.element_ty), mask=live)


def rmsnorm_residual(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x[B, hidden] (+ residual[B, hidden]) -> (rmsnorm(sum) * weight, sum); residual None = no add, sum = x."""
    batch, hidden = x.shape
    if weight.shape != (hidden,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(
            f"weight must be [{hidden}] and residual [{batch}, {hidden}], got {tuple(weight.shape)}, "
            f"{None if residual is None else tuple(residual.shape)}"
        )
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1) or not weight.is_contiguous():
        raise ValueError("x, residual and weight must be contiguous along hidden")
    normed = torch.empty(batch, hidden, dtype=x.dtype, device=x.device)
    new_residual = x if residual is None else torch.empty(batch, hidden, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(hidden)
    _rmsnorm_residual_kernel[(batch,)](
        x,
        x if residual is None else residual,
        weight,
        normed,
        new_residual,
        x.stride(0),
        x.stride(0) if residual is None else residual.stride(0),
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),  # about 8 values a thread, whatever the hidden size
    )
    return normed, new_residual
