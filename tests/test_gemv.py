"""The few-row projection kernel against torch: plain, with the RMSNorm (and residual add) before it, and with
SiLU(gate) * up after it; under TRITON_INTERPRET=1 on the CPU unless TRITON_INTERPRET=0 picks the GPU."""

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

from executor_svc.kernels.gemv import MAX_ROWS, gemv
from executor_svc.models.layers import RMSNorm
from tests.test_kernels import tolerance

DEVICE = torch.device("cpu" if interpreting() else "cuda")
EPS = 1e-5


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, k_in, n_out", [(1, 40, 24), (3, 576, 70), (MAX_ROWS, 1536, 9)])
def test_gemv_matches_linear(rows: int, k_in: int, n_out: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(rows)
    x, weight = randn(rows, k_in, gen=gen, dtype=dtype), randn(n_out, k_in, gen=gen, dtype=dtype, scale=0.05)
    out, same = gemv(x, weight)
    assert same is x and out.shape == (rows, n_out) and out.dtype == dtype
    torch.testing.assert_close(out, F.linear(x, weight), **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_gemv_norms_its_input_as_the_model_does(with_residual: bool, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(5)
    rows, hidden, n_out = 2, 96, 33
    x, residual = randn(rows, hidden, gen=gen, dtype=dtype), randn(rows, hidden, gen=gen, dtype=dtype)
    weight = randn(n_out, hidden, gen=gen, dtype=dtype, scale=0.1)
    norm = RMSNorm(hidden, EPS, DEVICE, dtype)
    norm.weight.copy_(torch.rand(hidden, generator=gen) + 0.5)
    out, new_residual = gemv(x, weight, norm=(residual if with_residual else None, norm.weight, EPS))
    total = x + residual if with_residual else x
    if with_residual:
        torch.testing.assert_close(new_residual, total, **tolerance(dtype))
    else:
        assert new_residual is x
    torch.testing.assert_close(out, F.linear(norm(total), weight), **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_gemv_is_silu_of_gate_times_up(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(6)
    rows, hidden, intermediate = 3, 64, 50
    x, residual = randn(rows, hidden, gen=gen, dtype=dtype), randn(rows, hidden, gen=gen, dtype=dtype)
    gate_up = randn(2 * intermediate, hidden, gen=gen, dtype=dtype, scale=0.15)
    norm = RMSNorm(hidden, EPS, DEVICE, dtype)
    norm.weight.copy_(torch.rand(hidden, generator=gen) + 0.5)
    act, _ = gemv(x, gate_up, norm=(residual, norm.weight, EPS), gated=True)
    gate, up = F.linear(norm(x + residual), gate_up).chunk(2, dim=1)
    assert act.shape == (rows, intermediate)
    tol = tolerance(dtype)
    if dtype == torch.bfloat16 and interpreting():
        tol["rtol"] = 4e-2  # six roundings in a row (norm, gate, up, SiLU, product), each truncating here
    torch.testing.assert_close(act, F.silu(gate) * up, **tol)


def test_gemv_refuses_what_it_cannot_take():
    x = torch.zeros(MAX_ROWS + 1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="gemv takes x"):
        gemv(x, torch.zeros(4, 8, device=DEVICE))
    with pytest.raises(ValueError, match="gemv takes x"):
        gemv(x[:2], torch.zeros(4, 6, device=DEVICE))
    with pytest.raises(ValueError, match="gemv takes x"):
        gemv(x[:2], torch.zeros(5, 8, device=DEVICE), gated=True)
    with pytest.raises(ValueError, match="share a dtype"):
        gemv(x[:2], torch.zeros(4, 8, device=DEVICE, dtype=torch.float64))
    with pytest.raises(ValueError, match="norm weight must be"):
        gemv(x[:2], torch.zeros(4, 8, device=DEVICE), norm=(None, torch.ones(7, device=DEVICE), EPS))
