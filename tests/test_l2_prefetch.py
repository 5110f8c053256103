"""The L2 prefetch's split of a weight's lines over a kernel's grid (l2_prefetch.line_share): every line falls
to exactly one program, whatever the grid's shape. The prefetch instruction itself is PTX, which the CPU
interpreter does not run; tests/test_kernels_compile.py finds it in each prefetching kernel's sm90 code."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from executor_svc.kernels import interpreting, triton_available

if not triton_available():
    pytest.skip("triton cannot run here: no CUDA device and TRITON_INTERPRET is off", allow_module_level=True)

import triton
import triton.language as tl

from executor_svc.kernels.l2_prefetch import line_share

DEVICE = "cpu" if interpreting() else "cuda"


@triton.jit
def _count_lines(counts_ptr, lines, BLOCK: tl.constexpr):
    first, end = line_share(lines)
    for start in range(first, end, BLOCK):
        line = start + tl.arange(0, BLOCK)
        tl.atomic_add(counts_ptr + line, 1, mask=line < end)


@pytest.mark.parametrize("grid", [(1,), (128,), (5, 16, 3), (130, 4)])
@pytest.mark.parametrize("lines", [1, 4, 1001, 40_000])
def test_every_line_falls_to_one_program(grid: tuple[int, ...], lines: int):
    counts = torch.zeros(lines, dtype=torch.int32, device=DEVICE)
    _count_lines[grid](counts, lines, BLOCK=256)
    assert (counts == 1).all()
