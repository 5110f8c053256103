"""The prologue projections (norm_linear, silu_mul_linear) against the unfused norm kernel, eager torch and its matmul, under
TRITON_INTERPRET=1 on the CPU unless TRITON_INTERPRET=0 picks the GPU."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed")

from executor_svc.kernels import interpreting, triton_available

if not triton_available():
    pytest.skip("triton cannot run here: no CUDA device and TRITON_INTERPRET is off", allow_module_level=True)

from executor_svc.kernels.fused import rmsnorm_residual
from executor_svc.kernels.linear import norm_linear, silu_mul_linear
from tests.test_kernels import tolerance

DEVICE = torch.device("cpu" if interpreting() else "cuda")


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def matmul_tolerance(dtype: torch.dtype) -> dict[str, float]:
    # fp32: summation order differs from torch's matmul; bf16: one output rounding either way.
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else tolerance(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 70])  # one row, a padded block, two row blocks
def test_norm_linear_matches_rmsnorm_then_matmul(rows: int, with_residual: bool, dtype: torch.dtype):
    hidden, n_out = 96, 100  # neither a multiple of the blocks
    x = randn(rows, hidden, dtype=dtype, seed=1)
    residual = randn(rows, hidden, dtype=dtype, seed=2) if with_residual else None
    norm_weight = randn(hidden, dtype=dtype, seed=3)
    weight = randn(n_out, hidden, dtype=dtype, seed=4) * 0.1
    out, new_residual = norm_linear(x, residual, norm_weight, 1e-5, weight)
    normed, expected_residual = rmsnorm_residual(x, residual, norm_weight, 1e-5)
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)
    expected = F.linear(normed.float(), weight.float()).to(dtype)
    torch.testing.assert_close(out.float(), expected.float(), **matmul_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 70])
def test_silu_mul_linear_matches_silu_mul_then_matmul(rows: int, dtype: torch.dtype):
    intermediate, n_out = 80, 48
    gate_up = randn(rows, 2 * intermediate, dtype=dtype, seed=5)
    weight = randn(n_out, intermediate, dtype=dtype, seed=6) * 0.1
    out = silu_mul_linear(gate_up, weight)
    gate, up = gate_up.chunk(2, dim=1)
    expected = F.linear((F.silu(gate) * up).float(), weight.float()).to(dtype)  # eager torch's roundings
    torch.testing.assert_close(out.float(), expected.float(), **matmul_tolerance(dtype))


def test_refuses_mismatched_shapes():
    x = torch.zeros(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="weight must be"):
        norm_linear(x, None, torch.ones(16, device=DEVICE), 1e-5, torch.zeros(8, 12, device=DEVICE))
    with pytest.raises(ValueError, match="norm_weight"):
        norm_linear(x, None, torch.ones(12, device=DEVICE), 1e-5, torch.zeros(8, 16, device=DEVICE))
    with pytest.raises(ValueError, match=r"\[B, 2I\]"):
        silu_mul_linear(torch.zeros(2, 15, device=DEVICE), torch.zeros(8, 7, device=DEVICE))
