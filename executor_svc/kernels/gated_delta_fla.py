"""A gated delta net layer's prefill on CUDA: every sequence of the batch in one packed conv and one varlen call
of flash-linear-attention's chunked Triton kernel (fla-core, the `gpu` extra; vLLM and SGLang use it). Same
contract as gated_delta_ref.prefill_at_slots, which stays the CPU path and the fallback where fla-core is
missing or fails. (The decode step is gated_delta_slots', which reads the states by slot.)"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

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


class PackedIndex(NamedTuple):
    """Where a packed prefill batch's sequences lie, on the device: what every gated delta net layer of one step
    shares (made once a step, not once a layer: each costs host-to-device copies)."""

    seq_starts: np.ndarray  # int64[N + 1], host
    width: int  # the conv window, K - 1
    token_at: (
        torch.Tensor
    )  # i64[T]: each token's row in the laid-out batch (sequences end to end, each after its window)
    window_at: torch.Tensor  # i64[N W]: the rows of each sequence's starting window
    new_window_at: torch.Tensor  # i64[N W]: the rows of its window after its last token
    kept: torch.Tensor  # bool[N]: the sequences that continue a state (not fresh)
    cu_seqlens: torch.Tensor  # i64[N + 1], on the device, for fla
    cu_seqlens_cpu: torch.Tensor  # i64[N + 1], fla's host copy (no device read back)

    @staticmethod
    def build(seq_starts: np.ndarray, fresh: np.ndarray, width: int, device: torch.device) -> PackedIndex:
        n = len(seq_starts) - 1
        owner = np.repeat(np.arange(n), np.diff(seq_starts))
        segment_start = seq_starts[:-1] + width * np.arange(n)
        ends = seq_starts[1:] + width * np.arange(1, n + 1)
        steps = np.arange(width)[None, :]
        host = [
            np.arange(seq_starts[-1]) + width * (owner + 1),
            (segment_start[:, None] + steps).reshape(-1),
            (ends[:, None] - width + steps).reshape(-1),
        ]
        token_at, window_at, new_window_at = (
            torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64)).to(device) for x in host
        )
        cu_cpu = torch.from_numpy(np.asarray(seq_starts, dtype=np.int64))
        kept = torch.from_numpy(~fresh).to(device)
        return PackedIndex(
            seq_starts, width, token_at, window_at, new_window_at, kept, cu_cpu.to(device), cu_cpu
        )


_last_index: list[PackedIndex] = []  # the step's, reused by its next layers


def packed_index(states: StateInputs, width: int, device: torch.device) -> PackedIndex:
    assert states.seq_starts is not None and states.fresh is not None
    if _last_index and _last_index[0].seq_starts is states.seq_starts and _last_index[0].width == width:
        return _last_index[0]
    _last_index[:] = [PackedIndex.build(states.seq_starts, states.fresh, width, device)]
    return _last_index[0]


def conv1d_packed(
    x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor, index: PackedIndex
) -> tuple[torch.Tensor, torch.Tensor]:
    """conv1d_sequence of every sequence of a packed batch at once: x [T, C] (sequence i is tokens
    [seq_starts[i], seq_starts[i + 1])), weight [C, K], windows [N, C, K - 1] the windows they start after
    (zeros for a fresh one). Returns (out [T, C], the new windows [N, C, K - 1])."""
    tokens, channels = x.shape
    n, width = len(index.seq_starts) - 1, index.width
    laid = x.new_empty(tokens + n * width, channels)  # laid: [T + N W, C]
    laid[index.token_at] = x
    laid[index.window_at] = windows.transpose(1, 2).reshape(n * width, channels).to(x.dtype)
    # full[:, p - W]: the conv at laid position p over laid[p - W .. p] (only a token's position is read)
    full = F.conv1d(laid.t()[None].float(), weight.float()[:, None, :], groups=channels)[0]
    out = F.silu(full[:, index.token_at - width]).t().to(x.dtype)
    new_windows = laid[index.new_window_at].view(n, width, channels).transpose(1, 2)
    return out, new_windows


def _prefill_fla(mixed, weight, g, beta, conv, recurrent, states: StateInputs, split) -> torch.Tensor:
    """gated_delta_ref.prefill_at_slots with the batch's sequences in one conv and one varlen call of fla's
    chunked kernel; nothing is written to the pools until both have run."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    index = packed_index(states, weight.shape[1] - 1, conv.device)
    slots = states.slots
    windows = conv.index_select(0, slots) * index.kept[:, None, None]
    out_mixed, new_windows = conv1d_packed(mixed, weight, windows, index)
    q, k, v = split(out_mixed)
    initial = recurrent.index_select(0, slots) * index.kept[:, None, None, None]
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
        cu_seqlens=index.cu_seqlens,
        cu_seqlens_cpu=index.cu_seqlens_cpu,
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
