"""The gated delta rule's decode step in flash-linear-attention's fused recurrent Triton kernel (fla-core, the
`gpu` extra; vLLM and SGLang use it): one launch a layer where the torch reference takes a dozen. Same contract
as gated_delta_ref.delta_rule_step, which stays the CPU path and the fallback where fla-core is missing."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from executor_svc.kernels import gated_delta_ref

StepFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of N sequences: q, k [N, Hk, Dk], v [N, H, Dv], g, beta [N, H], state [N, H, Dk, Dv]
    float32. Returns (out [N, H, Dv] in v's dtype, the new state float32). Each row is a batch entry of length 1."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    out, final = fused_recurrent_gated_delta_rule(
        q[:, None],
        k[:, None],
        v[:, None],
        g[:, None].float(),
        beta=beta[:, None],
        scale=q.shape[-1] ** -0.5,
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out[:, 0], final


def decode_step_for(device: torch.device) -> StepFn:
    """fla's kernel on CUDA when fla-core is installed; the torch reference otherwise (the CPU path: the tests
    check fla's kernel against it under Triton's interpreter, too slow to serve with)."""
    if fla_available() and device.type == "cuda":
        return delta_rule_step
    return gated_delta_ref.delta_rule_step
