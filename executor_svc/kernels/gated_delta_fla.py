"""The gated delta rule's prefill in flash-linear-attention's chunked Triton kernel (fla-core, the `gpu` extra;
vLLM and SGLang use it). Same contract as gated_delta_ref's, which stays the CPU path and the fallback where
fla-core is missing or fails. (The decode step is gated_delta_slots', which reads the states by slot.)"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import structlog
import torch

from executor_svc.kernels import gated_delta_ref

SequenceRule = Callable[..., tuple[torch.Tensor, torch.Tensor]]
log = structlog.get_logger("deltaserve.executor.kernels")


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def delta_rule_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's T tokens in fla's chunked kernel, the contract of gated_delta_ref.delta_rule_sequence:
    q, k [T, Hk, Dk], v [T, H, Dv], g, beta [T, H], state [H, Dk, Dv] or None. Returns (out [T, H, Dv],
    final state float32)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    out, final = chunk_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g[None].float(),
        beta[None],
        scale=q.shape[-1] ** -0.5,
        initial_state=None if state is None else state[None].float(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out[0], final[0]


class _FallBack:
    """fla's chunked kernel, and the torch reference from its first failure on (logged once): a prefill that
    the kernel cannot run still gives the right state."""

    def __init__(self) -> None:
        self.failed = False

    def __call__(self, *args: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.failed:
            try:
                return delta_rule_sequence(*args)  # type: ignore[arg-type]
            except Exception as err:  # any failure of the kernel falls back, said why
                self.failed = True
                log.warning(
                    f"fla-core's chunked gated delta rule failed ({type(err).__name__}: {err}); prefill "
                    "runs the torch reference from now on"
                )
        return gated_delta_ref.delta_rule_sequence(*args)  # type: ignore[arg-type]


def sequence_rule_for(device: torch.device, dtype: torch.dtype) -> SequenceRule:
    """fla's chunked kernel on CUDA for 16-bit models (its matmuls run in TF32 on float32 inputs, off from
    transformers' fp32 by more than the parity checks allow), the torch reference otherwise."""
    if fla_available() and device.type == "cuda" and dtype != torch.float32:
        return _FallBack()
    return gated_delta_ref.delta_rule_sequence
