"""The body of a prefill step, captured or eager: forward, sample the chunks that end their prompt, loop back."""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor_svc.kv_pool import KVPool
from executor_svc.prefill_batch import PrefillBatch
from executor_svc.sampler import sample
from executor_svc.tables import SlotStore

Forward = Callable[..., torch.Tensor]  # LlamaModel.prefill (torch ops) or prefill_fused (Triton kernels)


def prefill_step(
    forward: Forward, batch: PrefillBatch, kv: KVPool, store: SlotStore, greedy: bool
) -> torch.Tensor:
    """The batch's forward, then the tokens of its sampling chunks (i64[S], on the device), looped back into
    their slots. Reads nothing back: a CUDA graph can hold it."""
    logits = forward(batch, kv, select=batch.sample_index)  # logits: [S, V]
    if greedy:  # the argmax that `sample` takes for greedy rows, without the rest
        tokens = logits.argmax(dim=-1)
    else:
        tokens = sample(logits, *store.sampler_params(batch.sample_slots), batch.sample_counters)
    store.store_prefill_tokens(batch.sample_slots, tokens)
    return tokens
