"""Decode-step Triton kernels compiled for the H200 (sm90) on this machine, GPU or not: Triton's front end and
ptxas check what the CPU interpreter does not (a variable rebound with another shape inside a branch compiles
nowhere but runs interpreted). For now the paged decode attention and the skinny GEMM, each variant a launch
can take, the hybrid's decode step and gated norm, and its prefill's conv and state moves, compiled in a process
without TRITON_INTERPRET (with it, @triton.jit gives interpreted functions, which do not compile); and every
kernel launched as a programmatic dependent (the gated attention's as a decode step and as a prefill launch
them), checked to store nothing before it waits for its inputs."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("triton", reason="triton is not installed")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_POINTERS_F32 = ("part_out_ptr", "part_lse_ptr", "partial_ptr")
_POINTERS_I32 = ("counters_ptr", "counter_ptr", "rows_ptr")


def compile_for_sm90(
    kernel,
    constexprs: dict,
    types: dict | None = None,
    warps: int = 4,
    divisible: tuple[str, ...] = (),
    stages: int = 3,
):
    """triton.compile of `kernel` for sm90 with these constexprs on `warps` warps and `stages` pipeline stages;
    pointers bf16 unless named above or in `types`, other arguments int32. `divisible`: integer arguments the
    launch probed passes as multiples of 16, as a launch specializes them (what lets a masked load vectorize and
    a loop from a program's own K offset pipeline its loads; left out, the build is another than the launch's)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    types = types or {}
    if "DEPENDENT" in names:  # launched as usual unless asked (as on GPUs before the H100)
        constexprs = {"DEPENDENT": False, **constexprs}

    def type_of(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        if name in types:
            return types[name]
        if name in _POINTERS_F32:
            return "*fp32"
        if name in _POINTERS_I32:
            return "*i32"
        return "*bf16" if name.endswith("_ptr") else "i32"

    signature = {name: type_of(name) for name in names}
    # as a launch specializes 16-byte aligned tensors and strides divisible by 16 (what lets loads vectorize)
    aligned = [
        i
        for i, name in enumerate(names)
        if signature[name].startswith("*") or "stride" in name or name in divisible
    ]
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(name),): value for name, value in constexprs.items()},
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned if signature[names[i]] != "constexpr"},
    )
    return triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    )


def _compile_all() -> None:
    import triton

    from executor_svc.kernels.attention import _paged_decode_kernel
    from executor_svc.kernels.skinny_gemm import _skinny_gemm_kernel

    # one partition; all combined at once; in blocks; a split 256-dim head's 32-token steps
    for splits, block, tokens in ((1, 1, 64), (8, 8, 64), (5, 2, 64), (8, 8, 32)):
        compile_for_sm90(
            _paged_decode_kernel,
            dict(
                KV_LEN=1,
                GROUP=4,
                GROUP_ROWS=16,
                HEAD_DIM=256,
                PAGE=16,
                BLOCK_N=tokens,
                SPLITS=splits,
                SPLITS_POW2=triton.next_power_of_2(splits),
                SPLIT_BLOCK=block,
                GROUP_POW2=4,
                DOT_IN_F32=False,
            ),
            {"slots_ptr": "*i64", "qk_scale": "fp32"},
        )
    # one K range; four, summed in the kernel by the last to arrive; four left as sums for the next kernel
    for split_k, sums_only in ((1, False), (4, False), (4, True)):
        compile_for_sm90(
            _skinny_gemm_kernel,
            dict(SPLIT_K=split_k, SUMS_ONLY=sums_only, BLOCK_M=32, BLOCK_N=32, BLOCK_K=256, DOT_IN_F32=False)
            | dict(LINE_ELEMENTS=64),
        )
    # at 64 rows of Qwen3.5-0.8B's shapes every size is a multiple of 16: the loads pipeline, and nothing spills
    # (the wide projections' launch: 64-wide blocks four stages deep, at 64 rows and at 16)
    for split_k, block_n, block_m, stages in (
        (1, 128, 64, 3),
        (2, 32, 64, 3),
        (1, 64, 64, 4),
        (1, 64, 16, 4),
    ):
        compiled = compile_for_sm90(
            _skinny_gemm_kernel,
            dict(SPLIT_K=split_k, SUMS_ONLY=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128)
            | dict(DOT_IN_F32=False, LINE_ELEMENTS=64),
            divisible=("rows", "n_out", "k_in", "k_per_split"),
            stages=stages,
        )
        assert "async_copy_global_to_local" in compiled.asm["ttgir"], (
            "the skinny GEMM's loads do not pipeline"
        )
        assert stack_bytes(compiled) == 0, f"the skinny GEMM spills at {block_n}-wide blocks"


def _compile_hybrid_step() -> None:
    """The hybrid's one-kernel decode step (value-major states) and its gated norm over four heads a program."""
    from executor_svc.kernels.fused import _gated_rmsnorm_kernel
    from executor_svc.kernels.gated_delta_joined import _delta_net_step_kernel

    floats = {"eps": "fp32", "scale": "fp32"}
    f32_io = {"x_ptr": "*fp32", "core_ptr": "*fp32", "decay_rate_ptr": "*fp32", "dt_bias_ptr": "*fp32"}
    kernels = (
        (
            _gated_rmsnorm_kernel,
            dict(SIZE=128, BLOCK=128, HEADS=4),
            {**floats, "x_ptr": "*fp32", "weight_ptr": "*fp32"},
        ),
        (
            _delta_net_step_kernel,
            dict(KEY_HEADS=16, GROUP=1, DK=128, DV=128, BK=128, BV=32, BD=128, WIDTH=4, BW=4),
            {
                **floats,
                **{k: v for k, v in f32_io.items() if k != "x_ptr"},
                "states_ptr": "*fp32",
                "slots_ptr": "*i64",
                "arrivals_ptr": "*i32",
                "norm_weight_ptr": "*fp32",
            },
        ),
    )
    for kernel, constexprs, types in kernels:
        compile_for_sm90(kernel, constexprs, types)


def _compile_prefill() -> None:
    """The prefill's packed conv at Qwen3.5-0.8B's heads as conv_qkv launches it by default, and on the sweep's
    runner-up: its token loads and q/k/v stores 16 bytes at a time, and no spills; and its states' moves."""
    from executor_svc.kernels.gated_delta_conv import _conv_kernel, conv_qkv
    from executor_svc.kernels.state_moves import _gather_kernel, _scatter_kernel

    states = {
        "pool_ptr": "*fp32",
        "out_ptr": "*fp32",
        "states_ptr": "*fp32",
        "slots_ptr": "*i64",
        "kept_ptr": "*i64",
    }
    for kernel in (_gather_kernel, _scatter_kernel):
        compile_for_sm90(kernel, dict(BLOCK=2048), states)

    defaults = inspect.signature(conv_qkv).parameters
    # the default launch, and the sweep's runner-up (bench/prefill_kernels.py on an H200)
    for tokens, warps in ((defaults["block_tokens"].default, defaults["warps"].default), (32, 4)):
        compiled = compile_for_sm90(
            _conv_kernel,
            dict(CHANNELS=6144, HK=16, DK=128, HV=16, DV=128, WIDTH=4, CHUNK=64, BT=tokens, BW=4, BD=128),
            {name: "*i64" for name in ("cu_ptr", "chunks_ptr", "slots_ptr", "kept_ptr")},
            warps,
        )
        ptx = compiled.asm["ptx"]
        assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx, (
            f"the packed conv's loads are not vectorized at {tokens} tokens"
        )
        assert stack_bytes(compiled) == 0, f"the packed conv spills at {tokens} tokens"


def stack_bytes(compiled) -> int:
    """A compiled kernel's stack frame a thread, in bytes: a spilling kernel has one (its local memory)."""
    return resource_usage(compiled)["STACK"]


def resource_usage(compiled) -> dict[str, int]:
    """What cuobjdump says a compiled kernel uses: REG (registers a thread), STACK (bytes a thread), SHARED..."""
    import triton

    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run(
            [triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", cubin.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    found = {name: int(value) for name, value in re.findall(r"(\w+):(\d+)", usage)}
    assert "STACK" in found and "REG" in found, usage
    return found


def _compile_dependents() -> None:
    """Every kernel that launches as a programmatic dependent, so launched: it stores nothing (and takes no
    atomic) before it waits for the kernel before it, lets the next start only after, and those that prefetch
    weights or states do it before the wait."""
    from executor_svc.kernels import attention, fused, gated_attention, gemv, skinny_gemm
    from executor_svc.kernels import gated_delta_joined as joined
    from executor_svc.kernels import gated_delta_slots as slots

    floats = {"eps": "fp32", "scale": "fp32", "qk_scale": "fp32"}
    state = {"states_ptr": "*fp32", "slots_ptr": "*i64", "decay_rate_ptr": "*fp32", "dt_bias_ptr": "*fp32"}
    positions = {"positions_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    pages = {"write_page_ptr": "*i32", "write_offset_ptr": "*i32"}
    skinny = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=256, DOT_IN_F32=False, LINE_ELEMENTS=64)
    cases = (  # kernel, constexprs, pointer and float types, warps, prefetches before its wait
        (fused._rmsnorm_residual_kernel, dict(HAS_RESIDUAL=True, SPLITS=0, BLOCK=1024), floats, 4, False),
        (
            fused._rmsnorm_residual_kernel,
            dict(HAS_RESIDUAL=True, SPLITS=4, BLOCK=1024),
            {**floats, "x_ptr": "*fp32"},
            4,
            False,
        ),
        (
            fused._rope_kv_write_kernel,
            dict(HALF=32, HEADS_POW2=16, KV_HEADS_POW2=4),
            {**positions, **pages},
            4,
            False,
        ),
        (fused._silu_mul_kernel, dict(BLOCK=1024), {}, 4, False),
        (
            fused._gated_rmsnorm_kernel,
            dict(SIZE=128, BLOCK=128, HEADS=4),
            {**floats, "x_ptr": "*fp32"},
            4,
            False,
        ),
        (
            gemv._gemv_kernel,
            dict(NORM=True, HAS_RESIDUAL=True, GATED=True, BLOCK_N=8, BLOCK_K=1024),
            floats,
            8,
            False,
        ),
        (skinny_gemm._skinny_gemm_kernel, dict(SPLIT_K=1, SUMS_ONLY=False, **skinny), {}, 4, True),
        (skinny_gemm._skinny_gemm_kernel, dict(SPLIT_K=4, SUMS_ONLY=False, **skinny), {}, 4, True),
        (skinny_gemm._skinny_gemm_kernel, dict(SPLIT_K=4, SUMS_ONLY=True, **skinny), {}, 4, True),
        (
            attention._paged_decode_kernel,
            dict(KV_LEN=1, GROUP=4, GROUP_ROWS=16, HEAD_DIM=256, PAGE=16, BLOCK_N=64, SPLITS=8, SPLITS_POW2=8)
            | dict(SPLIT_BLOCK=8, GROUP_POW2=4, DOT_IN_F32=False),
            {**floats, "slots_ptr": "*i64"},
            4,
            False,
        ),
        *(  # a row a program on 4 warps (a decode step's launch), and a prefill's blocks of rows
            case
            for rows, warps in ((1, 4), (gated_attention.PREFILL_ROWS, gated_attention.PREFILL_WARPS))
            for case in (
                (
                    gated_attention._norm_rope_kv_write_kernel,
                    dict(HEADS=8, KV_HEADS=2, D=256, ROT=64, ROWS=rows),
                    {**floats, **positions, **pages, "q_norm_ptr": "*fp32", "k_norm_ptr": "*fp32"},
                    warps,
                    False,
                ),
                (gated_attention._gate_kernel, dict(HEADS=8, D=256, ROWS=rows), {}, warps, False),
            )
        ),
        (
            slots._step_at_slots_kernel,
            dict(HEADS=16, GROUP=1, DK=128, DV=128, BK=128, BV=32, RAW_GATES=True),
            {**floats, **state, "out_ptr": "*fp32"},
            4,
            True,
        ),
        *(  # windows of 1, 3 and 4 entries (a window's BW pads them to a power of two)
            (
                slots._conv_step_at_slots_kernel,
                dict(WIDTH=w, BW=bw, BLOCK=512),
                {"slots_ptr": "*i64"},
                4,
                False,
            )
            for w, bw in ((2, 1), (4, 4), (5, 4))
        ),
        (
            joined._delta_net_step_kernel,
            dict(KEY_HEADS=16, GROUP=1, DK=128, DV=128, BK=128, BV=32, BD=128, WIDTH=4, BW=4),
            {**floats, **state, "core_ptr": "*fp32", "arrivals_ptr": "*i32", "norm_weight_ptr": "*fp32"},
            4,
            True,
        ),
    )
    for kernel, constexprs, types, warps, prefetches in cases:
        name = kernel.fn.__name__
        ptx = compile_for_sm90(kernel, {"DEPENDENT": True, **constexprs}, types, warps).asm["ptx"]
        wait = ptx.find("griddepcontrol.wait")
        assert 0 < wait < ptx.find("griddepcontrol.launch_dependents"), (
            f"{name}: no wait, or it lets the next start first"
        )
        before = ptx[:wait]
        assert not any(op in before for op in ("st.global", "atom.", "red.")), (
            f"{name} writes before its wait"
        )
        assert ("prefetch.global.L2" in before) == prefetches, (
            f"{name}: prefetch before the wait is not {prefetches}"
        )


def test_the_decode_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([REPO, *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]


if __name__ == "__main__":
    _compile_all()
    _compile_hybrid_step()
    _compile_prefill()
    _compile_dependents()
