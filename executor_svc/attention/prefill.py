"""A packed prefill batch's causal attention: the Triton kernel (every chunk in one launch a layer) or torch
chunk by chunk (the CPU path)."""

from __future__ import annotations

import numpy as np
import torch

from executor_svc.attention import paged_cpu
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

    @property
    def paged(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each token as a decode row: its chunk's block table int32[T, W] and the positions it attends
        int32[T] (its own included), where the pages can be read in place on the CPU (the C decode step reads
        them so, a few tokens at a time), else None."""
        batch = self.batch
        if self.fused or batch.num_tokens != batch.positions.shape[0] or not paged_cpu.serves(self.kv.k):
            return None  # padded (a graph's shape) or not readable in place
        chunk_of_token = torch.from_numpy(np.repeat(np.arange(len(batch.lengths)), batch.lengths))
        tables = batch.block_tables.index_select(0, chunk_of_token).to(torch.int32)
        return tables, (batch.positions + 1).to(torch.int32)

    def forward(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        kv = self.kv
        return self._attend(q, kv.k[layer], kv.v[layer], self.batch, self.scale)
