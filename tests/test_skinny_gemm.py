"""The skinny GEMM against F.linear: one row block, ragged N and K, K split between programs (whose partial
sums meet in the kernel, in a fixed order) and not; under TRITON_INTERPRET=1 on the CPU unless
TRITON_INTERPRET=0 picks the GPU."""

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

from executor_svc.kernels.skinny_gemm import (
    MAX_ROWS,
    MIN_ROWS,
    SkinnyConfig,
    default_config,
    skinny_gemm,
    wins,
)
from tests.test_kernels import tolerance

DEVICE = torch.device("cpu" if interpreting() else "cuda")
EPS = 1e-6


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows, k_in, n_out, split_k",
    [(MIN_ROWS, 40, 24, 1), (9, 100, 70, 3), (17, 96, 33, 2), (MAX_ROWS, 72, 16, 4)],
)
def test_skinny_gemm_matches_linear(rows: int, k_in: int, n_out: int, split_k: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(rows)
    x, weight = randn(rows, k_in, gen=gen, dtype=dtype), randn(n_out, k_in, gen=gen, dtype=dtype, scale=0.05)
    config = SkinnyConfig(block_n=16, block_k=16, split_k=split_k, warps=4, stages=2)
    out = skinny_gemm(x, weight, config)
    assert out.shape == (rows, n_out) and out.dtype == dtype
    torch.testing.assert_close(out, F.linear(x, weight), **tolerance(dtype))
    # the counters are left zero for the next projection, which then sums alike
    torch.testing.assert_close(skinny_gemm(x, weight, config), out, atol=0.0, rtol=0.0)


def test_skinny_gemm_takes_a_strided_input():
    gen = torch.Generator().manual_seed(1)
    wide = randn(8, 80, gen=gen, dtype=torch.float32)
    weight = randn(20, 48, gen=gen, dtype=torch.float32, scale=0.1)
    x = wide[:, 16:64]  # rows 80 apart
    out = skinny_gemm(x, weight, SkinnyConfig(block_n=16, block_k=16, split_k=2, warps=4, stages=2))
    torch.testing.assert_close(out, F.linear(x, weight), **tolerance(torch.float32))


def test_default_config_splits_narrow_projections_to_fill_the_gpu():
    narrow = default_config(16, 1024, 3584, torch.bfloat16)
    middling = default_config(16, 5120, 1024, torch.bfloat16)
    wide = default_config(16, 8224, 1024, torch.bfloat16)
    assert narrow.split_k > 1 and 1024 // narrow.block_n * narrow.split_k >= 128
    assert middling.split_k == 1 and middling.block_n == 32
    assert wide == SkinnyConfig(block_n=64, block_k=128, split_k=1, warps=4, stages=4)


def test_wins_only_where_measured():
    assert wins(16, 1024, 3584, torch.bfloat16) and wins(MAX_ROWS, 1024, 2048, torch.bfloat16)
    # the widest (7 outputs an input and more, inputs up to 1,024) from 16 rows; 5,120 x 1,024: cuBLAS
    assert wins(16, 8224, 1024, torch.bfloat16) and wins(MAX_ROWS, 7168, 1024, torch.bfloat16)
    assert not wins(8, 8224, 1024, torch.bfloat16) and not wins(16, 5120, 1024, torch.bfloat16)
    assert not wins(16, 16384, 2048, torch.bfloat16)  # an input wider than measured
    assert not wins(16, 3072, 576, torch.bfloat16)  # SmolLM2's gate_up: 5.3 outputs an input
    assert not wins(16, 576, 1536, torch.bfloat16)  # narrower than measured: cuBLAS
    assert not wins(16, 1024, 3584, torch.float32)
    assert not wins(MIN_ROWS - 1, 1024, 3584, torch.bfloat16) and not wins(
        MAX_ROWS + 1, 1024, 3584, torch.bfloat16
    )


def test_skinny_gemm_refuses_what_it_does_not_take():
    x = torch.zeros(MAX_ROWS + 1, 32, device=DEVICE)
    with pytest.raises(ValueError, match="skinny_gemm takes"):
        skinny_gemm(x, torch.zeros(16, 32, device=DEVICE))
    with pytest.raises(ValueError, match="share a dtype"):
        skinny_gemm(x[:8], torch.zeros(16, 32, device=DEVICE, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    ("rows", "hidden", "n_out"), [(8, 2048, 1024), (16, 1024, 7168)], ids=["narrow", "widest"]
)
def test_projections_route_bfloat16_projections_here_with_their_bias(rows: int, hidden: int, n_out: int):
    from executor_svc.kernels.fused import rmsnorm_residual
    from executor_svc.models.dense_kernels import Projections

    gen = torch.Generator().manual_seed(3)
    assert wins(rows, n_out, hidden, torch.bfloat16)
    x, residual = (
        randn(rows, hidden, gen=gen, dtype=torch.bfloat16),
        randn(rows, hidden, gen=gen, dtype=torch.bfloat16),
    )
    weight, bias = (
        randn(n_out, hidden, gen=gen, dtype=torch.bfloat16, scale=0.1),
        randn(n_out, gen=gen, dtype=torch.bfloat16),
    )
    norm_weight = randn(hidden, gen=gen, dtype=torch.bfloat16)
    projections = Projections(rows, EPS)
    tol = tolerance(torch.bfloat16)
    torch.testing.assert_close(projections.project(x, weight, bias), F.linear(x, weight, bias), **tol)
    out, new_residual = projections.norm_project(x, residual, norm_weight, weight, bias)
    h, expected_residual = rmsnorm_residual(x, residual, norm_weight, EPS)
    torch.testing.assert_close(new_residual, expected_residual, atol=0.0, rtol=0.0)
    torch.testing.assert_close(out, F.linear(h, weight, bias), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_k", [1, 3])
def test_split_sums_added_by_the_norm_equal_the_summed_projection(split_k: int, dtype: torch.dtype):
    """The splits' sums left to rmsnorm_residual give, bit for bit, what the kernel's own last split sums."""
    from executor_svc.kernels.fused import rmsnorm_residual
    from executor_svc.kernels.skinny_gemm import skinny_sums

    gen = torch.Generator().manual_seed(split_k)
    rows, k_in, n_out = 9, 100, 70
    x, weight = randn(rows, k_in, gen=gen, dtype=dtype), randn(n_out, k_in, gen=gen, dtype=dtype, scale=0.05)
    residual, norm_weight = randn(rows, n_out, gen=gen, dtype=dtype), randn(n_out, gen=gen, dtype=dtype)
    config = SkinnyConfig(block_n=16, block_k=16, split_k=split_k, warps=4, stages=2)
    summed = skinny_gemm(x, weight, config)
    sums = skinny_sums(x, weight, config)
    assert sums.sums.shape == (split_k, rows, n_out) and sums.dtype == dtype
    # torch rounds to bfloat16 to nearest, Triton's interpreter toward zero: a unit apart there
    one_unit = (
        dict(atol=0.0, rtol=2**-7) if interpreting() and dtype == torch.bfloat16 else dict(atol=0.0, rtol=0.0)
    )
    torch.testing.assert_close(sums.total(), summed, **one_unit)
    expected = rmsnorm_residual(summed, residual, norm_weight, EPS)
    for got, want in zip(rmsnorm_residual(sums, residual, norm_weight, EPS), expected, strict=True):
        torch.testing.assert_close(got, want, atol=0.0, rtol=0.0)
    with pytest.raises(ValueError, match="split sums take a residual"):
        rmsnorm_residual(sums, None, norm_weight, EPS)


@pytest.mark.parametrize("rows", [2, 8])  # the GEMV's, the skinny GEMM's
def test_a_projection_into_a_norm_leaves_the_skinny_gemms_sums_to_it(rows: int):
    from executor_svc.kernels.skinny_gemm import SplitSums
    from executor_svc.models.dense_kernels import Projections, tensor

    gen = torch.Generator().manual_seed(rows)
    hidden, narrow = 2048, 1024
    x = randn(rows, hidden, gen=gen, dtype=torch.bfloat16)
    residual = randn(rows, narrow, gen=gen, dtype=torch.bfloat16)
    weight = randn(narrow, hidden, gen=gen, dtype=torch.bfloat16, scale=0.05)
    norm_weight, next_weight = (
        randn(narrow, gen=gen, dtype=torch.bfloat16),
        randn(narrow, narrow, gen=gen, dtype=torch.bfloat16, scale=0.05),
    )
    bias = randn(narrow, gen=gen, dtype=torch.bfloat16)
    projections = Projections(rows, EPS)
    into_norm = projections.project_to_norm(x, weight)
    assert isinstance(into_norm, SplitSums) == (rows > 4)
    plain = projections.project(x, weight)
    one_unit = dict(atol=0.0, rtol=2**-7) if interpreting() else dict(atol=0.0, rtol=0.0)  # as above
    torch.testing.assert_close(tensor(into_norm), plain, **one_unit)
    got = projections.norm_project(into_norm, residual, norm_weight, next_weight)
    for a, b in zip(got, projections.norm_project(plain, residual, norm_weight, next_weight), strict=True):
        torch.testing.assert_close(a, b, atol=0.0, rtol=0.0)
    # a bias follows the product: the sum is made first
    assert isinstance(projections.project_to_norm(x, weight, bias), torch.Tensor)
