"""A gated delta net layer's prefill on CUDA: every sequence of the batch in one packed conv and one varlen call
of flash-linear-attention's chunked Triton kernel (fla-core, the `gpu` extra; vLLM and SGLang use it). Same
contract as gated_delta_ref.prefill_at_slots, which stays the CPU path and the fallback where fla-core is
missing or fails. (The decode step is gated_delta_slots', which reads the states by slot.)"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import structlog
import torch
import torch.nn.functional as F

from executor_svc.kernels import gated_delta_ref

if TYPE_CHECKING:
    from executor_svc.state_pool import StateInputs

log = structlog.get_logger("deltaserve.executor.kernels")
Prefill = Callable[..., torch.Tensor]  # gated_delta_ref.prefill_at_slots' contract


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def conv1d_packed(
    x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor, seq_starts: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """conv1d_sequence of every sequence of a packed batch at once: x [T, C] (sequence i is tokens
    [seq_starts[i], seq_starts[i + 1])), weight [C, K], windows [N, C, K - 1] the windows they start after
    (zeros for a fresh one). Returns (out [T, C], the new windows [N, C, K - 1])."""
    tokens, channels = x.shape
    n, width = len(seq_starts) - 1, weight.shape[1] - 1
    lengths = np.diff(seq_starts)
    # The sequences laid end to end, each after its window: sequence i's W window entries then its tokens.
    owner = np.repeat(np.arange(n), lengths)
    token_at = np.arange(tokens) + width * (owner + 1)
    segment_start = seq_starts[:-1] + width * np.arange(n)
    window_at = (segment_start[:, None] + np.arange(width)[None, :]).reshape(-1)
    ends = seq_starts[1:] + width * np.arange(1, n + 1)
    new_window_at = (ends[:, None] - width + np.arange(width)[None, :]).reshape(-1)

    def to_device(index: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64)).to(x.device)

    token_at_d = to_device(token_at)
    laid = x.new_empty(tokens + n * width, channels)  # laid: [T + N W, C]
    laid[token_at_d] = x
    laid[to_device(window_at)] = windows.transpose(1, 2).reshape(n * width, channels).to(x.dtype)
    # full[:, p - W]: the conv at laid position p over laid[p - W .. p] (only a token's position is read)
    full = F.conv1d(laid.t()[None].float(), weight.float()[:, None, :], groups=channels)[
        0
    ]  # full: [C, T + N W - W]
    out = F.silu(full[:, token_at_d - width]).t().to(x.dtype)
    new_windows = laid[to_device(new_window_at)].view(n, width, channels).transpose(1, 2)
    return out, new_windows


def _prefill_fla(mixed, weight, g, beta, conv, recurrent, states: StateInputs, split) -> torch.Tensor:
    """gated_delta_ref.prefill_at_slots with the batch's sequences in one conv and one varlen call of fla's
    chunked kernel; nothing is written to the pools until both have run."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    assert states.seq_starts is not None and states.fresh is not None
    slots = states.slots
    kept = torch.from_numpy(~states.fresh).to(
        conv.device
    )  # kept: bool[N], the sequences that continue a state
    windows = conv.index_select(0, slots) * kept[:, None, None]
    out_mixed, new_windows = conv1d_packed(mixed, weight, windows, states.seq_starts)
    q, k, v = split(out_mixed)
    initial = recurrent.index_select(0, slots) * kept[:, None, None, None]
    out, final = chunk_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g[None].float(),
        beta[None],
        scale=q.shape[-1] ** -0.5,
        initial_state=initial,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=torch.from_numpy(states.seq_starts.astype(np.int64)).to(conv.device),
    )
    conv.index_copy_(0, slots, new_windows.to(conv.dtype))
    recurrent.index_copy_(0, slots, final.float())
    return out[0]


class _FallBack:
    """fla's chunked kernel, and the torch reference from its first failure on (logged once): a prefill that
    the kernel cannot run still gives the right state (the kernel writes nothing before it has run)."""

    def __init__(self) -> None:
        self.failed = False

    def __call__(self, *args) -> torch.Tensor:
        if not self.failed:
            try:
                return _prefill_fla(*args)
            except Exception as err:  # any failure of the kernel falls back, said why
                self.failed = True
                log.warning(
                    f"fla-core's chunked gated delta rule failed ({type(err).__name__}: {err}); prefill "
                    "runs the torch reference from now on"
                )
        return gated_delta_ref.prefill_at_slots(*args)


def prefill_for(device: torch.device, dtype: torch.dtype) -> Prefill:
    """fla's chunked kernel on CUDA for 16-bit models (its matmuls run in TF32 on float32 inputs, off from
    transformers' fp32 by more than the parity checks allow), the torch reference otherwise."""
    if fla_available() and device.type == "cuda" and dtype != torch.float32:
        return _FallBack()
    return gated_delta_ref.prefill_at_slots
