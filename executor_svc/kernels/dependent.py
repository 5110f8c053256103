"""Programmatic dependent launch (Hopper and newer) for the decode step's kernels. A step of a few rows is a
chain of short, latency-bound kernels; launched as dependents, each kernel's programs start while the kernel
before it drains, read what is constant (weights) and then wait for their inputs: the launch, and the first
weight loads, no longer sit between two kernels. Every kernel launched so must call `await_inputs` before it
reads anything an earlier kernel wrote and before it writes anything, or it races that kernel (the one
exception, gated_delta_slots.prefetch_state's slot, is only a guess where to prefetch); and every program must
call it, with no way out before: a kernel whose programs all skipped it could end before the kernel before it,
and the one after would wait on it alone."""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
import triton
import triton.language as tl

from executor_svc.kernels import interpreting

LINE = 128  # bytes one L2 prefetch brings in


@cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def dependent(device: torch.device) -> dict[str, Any]:
    """A launch's arguments: the kernel's `DEPENDENT` constexpr, and the launch as a programmatic dependent
    where the GPU has it (compute capability 9 and newer; never interpreted)."""
    # (griddepcontrol is NVIDIA's: a ROCm build of torch says "cuda" too)
    if device.type != "cuda" or torch.version.hip or interpreting() or not _supported(device.index or 0):
        return {"DEPENDENT": False}
    return {"DEPENDENT": True, "launch_pdl": True}


@triton.jit
def await_inputs(DEPENDENT: tl.constexpr):
    """Wait until the kernel before this one has finished and its writes are visible, then let the kernel after
    this one start its programs. Without DEPENDENT (launched as usual) nothing."""
    if DEPENDENT:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Bring the L2 lines holding `ptrs` (a block of pointers; repeats cost one request a warp) into L2: weights
    or states, read while the kernel before drains (so only in a kernel launched as a dependent)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
