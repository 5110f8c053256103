"""The fused projections (norm_linear, silu_mul_linear, norm_qkv_rope) against the unfused norm kernel, eager torch and its matmul, under
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
from executor_svc.kernels.linear import norm_linear, norm_qkv_rope, silu_mul_linear
from executor_svc.kv_pool import KVPool
from executor_svc.models.llama import _rotate_half
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 64, 128])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_qkv_rope_matches_norm_matmul_rope_and_pool_write(with_residual: bool, head_dim: int, dtype: torch.dtype):
    heads, kv_heads, hidden, rows, page_size, max_seq_len = 9, 3, 96, 5, 4, 32
    x = randn(rows, hidden, dtype=dtype, seed=7)
    residual = randn(rows, hidden, dtype=dtype, seed=8) if with_residual else None
    norm_weight = randn(hidden, dtype=dtype, seed=9)
    qkv_weight = randn((heads + 2 * kv_heads) * head_dim, hidden, dtype=dtype, seed=10) * 0.1
    # The model's rope tables (LlamaModel's arithmetic, theta as SmolLM2's).
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = torch.arange(max_seq_len, dtype=torch.float)[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)  # angles: [max_seq_len, head_dim]
    cos, sin = angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)
    positions = torch.tensor([7, 0, 31, 12, 3], device=DEVICE)
    write_page = torch.tensor([3, 0, 5, 1, 4], dtype=torch.int32, device=DEVICE)
    write_offset = torch.tensor([3, 0, 1, 2, 0], dtype=torch.int32, device=DEVICE)
    pool = KVPool(1, 6, page_size, kv_heads, head_dim, dtype, DEVICE)
    expected_pool = KVPool(1, 6, page_size, kv_heads, head_dim, dtype, DEVICE)

    q, new_residual = norm_qkv_rope(
        x, residual, norm_weight, 1e-5, qkv_weight, heads, kv_heads, positions, cos, sin, pool.k[0], pool.v[0],
        write_page, write_offset,
    )
    normed, expected_residual = rmsnorm_residual(x, residual, norm_weight, 1e-5)
    qkv = F.linear(normed.float(), qkv_weight.float()).to(dtype)
    eq, ek, ev = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    eq, ek, ev = eq.view(rows, heads, head_dim), ek.view(rows, kv_heads, head_dim), ev.view(rows, kv_heads, head_dim)
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    eq = eq * c + _rotate_half(eq) * s
    ek = ek * c + _rotate_half(ek) * s
    expected_pool.write(0, write_page, write_offset, ek, ev)
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)
    torch.testing.assert_close(q.float(), eq.float(), **matmul_tolerance(dtype))
    torch.testing.assert_close(pool.k.float(), expected_pool.k.float(), **matmul_tolerance(dtype))
    torch.testing.assert_close(pool.v.float(), expected_pool.v.float(), **matmul_tolerance(dtype))
