"""The MLP's activation as a Triton function, for the kernels that apply it on the way: the SiLU-mul kernel and
the skinny GEMM reading a gate_up projection's output."""

import triton
import triton.language as tl


@triton.jit
def silu_times(gate, up):
    """SiLU(gate) * up in their dtype, as eager torch: F.silu rounds to the dtype, then the product rounds again."""
    dtype = gate.dtype
    gate = gate.to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    return (silu * up.to(tl.float32)).to(dtype)
