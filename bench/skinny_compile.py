"""The skinny GEMM compiled for sm90 on this machine (no GPU needed), as tests/test_kernels_compile.py compiles
it: for each launch, whether its K loop's loads pipeline (async copies in the TTGIR), its registers and its
stack (spilled registers) a thread; compiled with the sizes unspecialized (the probe's old build) and as a
launch at Qwen3.5-0.8B's 64-row shapes specializes them (multiples of 16).

    python bench/skinny_compile.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from executor_svc.kernels.skinny_gemm import _skinny_gemm_kernel
from tests.test_kernels_compile import compile_for_sm90, resource_usage

_SIZES = ("rows", "n_out", "k_in", "k_per_split")  # a multiple of 16 each at 64 rows of the model's shapes
# (rows, column block, K chunk, warps, splits, stages): the night session's table, wider blocks, then the wide
# projections' launch (skinny_gemm._WIDE_CONFIG) at 64 rows and at 16
LAUNCHES = (
    *(
        (rows, 32, k, warps, 2, 3)
        for rows, k, warps in ((16, 128, 4), (16, 256, 4), (64, 64, 4), (64, 128, 4))
    ),
    *((64, 32, k, warps, 2, 3) for k, warps in ((128, 8), (256, 4), (256, 8))),
    *((64, block_n, k, 8, 1, 3) for block_n, k in ((128, 64), (128, 128), (256, 64))),
    *((rows, 64, 128, 4, 1, 4) for rows in (64, 16)),
)


def main() -> None:
    print(
        "rows block_n block_k warps splits stages | unspecialized: pipelined registers stack | specialized: the same"
    )
    for rows, block_n, block_k, warps, splits, stages in LAUNCHES:
        cells = []
        for divisible in ((), _SIZES):
            compiled = compile_for_sm90(
                _skinny_gemm_kernel,
                dict(SPLIT_K=splits, SUMS_ONLY=False, BLOCK_M=rows, BLOCK_N=block_n, BLOCK_K=block_k)
                | dict(DOT_IN_F32=False, LINE_ELEMENTS=64),
                warps=warps,
                divisible=divisible,
                stages=stages,
            )
            pipelined = "async_copy_global_to_local" in compiled.asm["ttgir"]
            usage = resource_usage(compiled)
            cells.append(f"{pipelined} {usage['REG']} {usage['STACK']}")
        print(rows, block_n, block_k, warps, splits, stages, "|", " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
