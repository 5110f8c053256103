"""A projection's weights pulled into the GPU's L2 by the kernel that runs before it. In a decode step of a few
rows each projection reads its weights once, a few megabytes, and the kernels between projections (the norms,
the gated delta net's step, SiLU) are latency-bound, leaving memory idle: those kernels issue L2 prefetches of
the next projection's weights first thing, so the projection reads them from L2. A prefetch has no result and
changes no value; where Triton interprets (the CPU tests) nothing is prefetched."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from executor_svc.kernels import interpreting

LINE = 128  # bytes of an L2 line, what one prefetch instruction brings in
# Weights larger than this are not prefetched: they would push the step's other data out of L2 (the H100's and
# H200's L2 is 50 MiB; Qwen3.5-0.8B's widest projection is 16.1 MiB)
MOST_BYTES = 24 * 2**20
# The programs a prefetching kernel spreads its prefetches over at least (a program issues its share of the
# lines; a kernel of fewer programs, a norm over 16 rows, gets prefetch-only programs up to this many)
PROGRAMS = 128
_MOST_AT_ONCE = 256  # lines a program issues at a time


@triton.jit
def line_share(lines):
    """This program's lines [first, end) of `lines`, split evenly over every program of the grid."""
    program = tl.program_id(0) + tl.num_programs(0) * (
        tl.program_id(1) + tl.num_programs(1) * tl.program_id(2)
    )
    programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    share = tl.cdiv(lines, programs)
    first = program * share
    return first, tl.minimum(first + share, lines)


@triton.jit
def prefetch_l2(ptr, lines, ELEMENTS_PER_LINE: tl.constexpr, BLOCK: tl.constexpr):
    """This program's share of `lines` L2 lines from `ptr` (each ELEMENTS_PER_LINE of ptr's elements), BLOCK
    at a time."""
    first, end = line_share(lines)
    for start in range(first, end, BLOCK):
        # past the share's end: its last line again (an instruction takes no mask; a warp's repeats of one
        # address are one request)
        line = tl.minimum(start + tl.arange(0, BLOCK), end - 1).to(tl.int64)
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
            "=r,l",
            [ptr + line * ELEMENTS_PER_LINE],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


def worth_prefetching(weight: torch.Tensor | None) -> bool:
    """Whether a kernel should prefetch `weight`: on a GPU (not interpreted), contiguous, at most MOST_BYTES."""
    if weight is None or weight.device.type != "cuda" or interpreting():
        return False
    return weight.is_contiguous() and weight.numel() * weight.element_size() <= MOST_BYTES


def prefetch_args(weight: torch.Tensor | None, stand_in: torch.Tensor, programs: int) -> dict[str, Any]:
    """The prefetch arguments of a kernel launched on `programs` programs (`prefetch_ptr`, `prefetch_lines`,
    constexprs `PREFETCH`, `ELEMENTS_PER_LINE` and `PREFETCH_BLOCK`, a program's share rounded up to a power of
    two, at most _MOST_AT_ONCE): `weight`'s lines where worth_prefetching, else none (stand_in: any tensor as
    the pointer the kernel does not read)."""
    if not worth_prefetching(weight):
        return dict(
            prefetch_ptr=stand_in, prefetch_lines=0, PREFETCH=False, ELEMENTS_PER_LINE=1, PREFETCH_BLOCK=1
        )
    assert weight is not None
    size = weight.element_size()
    lines = triton.cdiv(weight.numel() * size, LINE)
    return dict(
        prefetch_ptr=weight,
        prefetch_lines=lines,
        PREFETCH=True,
        ELEMENTS_PER_LINE=LINE // size,
        PREFETCH_BLOCK=min(_MOST_AT_ONCE, triton.next_power_of_2(triton.cdiv(lines, programs))),
    )


def grid_rows(rows: int, programs_per_row: int, weight: torch.Tensor | None) -> int:
    """The rows of a kernel's grid whose axis 0 is its rows, `programs_per_row` programs each: `rows`, or more
    (prefetch-only programs) where it prefetches `weight` over fewer than PROGRAMS programs."""
    if not worth_prefetching(weight):
        return rows
    return max(rows, triton.cdiv(PROGRAMS, programs_per_row))
