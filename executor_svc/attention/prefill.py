"""A packed prefill batch's causal attention: the Triton kernel (every chunk in one launch a layer) or torch
chunk by chunk (the CPU path)."""

from __future__ import annotations

import torch

from executor_svc.attention.torch_ref import prefill_attention_batch
from executor_svc.kv_pool import KVPool
from executor_svc.prefill.batch import PrefillBatch


class PrefillAttention:
    """The attention of one batch (its query blocks and page tables are fixed views: a graph can hold it)."""

    def __init__(self, kv: KVPool, scale: float, batch: PrefillBatch, fused: bool) -> None:
        self.kv = kv
        self.scale = scale
        self.batch = batch
        self.fused = fused
        self._attend = prefill_attention_batch
        if fused:
            from executor_svc.kernels.prefill_attention import paged_prefill_attention  # Triton: CUDA only

            self._attend = paged_prefill_attention

    def forward(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        kv = self.kv
        return self._attend(q, kv.k[layer], kv.v[layer], self.batch, self.scale)
