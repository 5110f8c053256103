"""Prefill steps per padded token count, captured as CUDA graphs: forward -> sample -> loop-back."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import structlog
import torch

from executor_svc.graphs import capture_order, capture_step
from executor_svc.kv_pool import KVPool
from executor_svc.models.llama import LlamaModel
from executor_svc.prefill_batch import PrefillBatch, PrefillShape
from executor_svc.prefill_step import prefill_step
from executor_svc.tables import SlotStore

log = structlog.get_logger("deltaserve.executor.prefill_graphs")


def bucket_shapes(
    token_buckets: Iterable[int], widest: int, max_seq_len: int, page_size: int
) -> list[PrefillShape]:
    """The padded shape of each token bucket, smallest first. A step's chunks: every one but the last ends its
    prompt, and at most the widest decode bucket's prompts end (check_plan), so no more chunks than that plus
    one, nor samples than that, nor pages than a sequence of max_seq_len holds."""
    width = -(-max_seq_len // page_size)
    return [
        PrefillShape(
            tokens=tokens, chunks=min(tokens, widest + 1), samples=min(tokens, widest), table_width=width
        )
        for tokens in sorted(set(token_buckets))
    ]


def smallest_holding(shapes: Sequence[PrefillShape], batch: PrefillShape) -> PrefillShape | None:
    """The first of `shapes` (smallest first) that a batch of shape `batch` fits, or None."""
    return next((shape for shape in shapes if shape.holds(batch)), None)


class PrefillGraphs:
    """One prefill step per token bucket, captured on CUDA, two variants each (greedy, sampling) as the decode
    graphs have. A step's batch is padded to the smallest bucket that holds it and laid out in one input buffer
    that every graph reads; a batch no bucket holds runs eagerly (`launch` returns None).

    Eager, the step is ~300 kernel launches (~20 ms of host time for 2048 tokens on the H200, against ~2 ms
    of GPU work); replayed, one launch.
    """

    def __init__(
        self,
        model: LlamaModel,
        kv_pool: KVPool,
        store: SlotStore,
        token_buckets: Iterable[int],
        *,
        max_seq_len: int,
        pool: tuple[int, int] | None = None,
    ) -> None:
        if store.device.type != "cuda":
            raise ValueError("prefill graphs need a CUDA device")
        self.model = model
        self.kv_pool = kv_pool
        self.store = store
        self.max_seq_len = max_seq_len
        self.shapes = bucket_shapes(token_buckets, store.layout.widest_bucket, max_seq_len, kv_pool.page_size)
        device = store.device
        self._input = torch.zeros(
            max((s.words for s in self.shapes), default=0), dtype=torch.int64, device=device
        )
        # The sampled tokens, outside the graphs' memory pool: the step's decode replay, between this replay and
        # the read-back, may reuse the pool's memory (the pool is the decode graphs', and a graph's outputs in
        # it are safe only until another graph of the pool runs).
        self._sampled = torch.zeros(
            max((s.samples for s in self.shapes), default=0), dtype=torch.int64, device=device
        )
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.states: dict[int, str] = {}  # token bucket -> what the log line said
        self._pool = torch.cuda.graph_pool_handle() if pool is None else pool
        for tokens in capture_order(s.tokens for s in self.shapes):
            self._build(next(s for s in self.shapes if s.tokens == tokens))

    def launch(
        self, chunks: Sequence[tuple[np.ndarray, int, np.ndarray]], sample_slots: Sequence[int], greedy: bool
    ) -> torch.Tensor | None:
        """Replay the step of the smallest bucket that holds the chunks; their sampled tokens i64[S] on the
        device, or None when no captured bucket holds them."""
        own = PrefillBatch.exact_shape(chunks, sum(1 for slot in sample_slots if slot))
        shape = smallest_holding([s for s in self.shapes if (s.tokens, greedy) in self._graphs], own)
        if shape is None:
            return None
        page_size = self.kv_pool.page_size
        PrefillBatch.build(
            chunks,
            page_size,
            self.max_seq_len,
            self.store.device,
            sample_slots=sample_slots,
            shape=shape,
            into=self._input,
        )
        self._graphs[(shape.tokens, greedy)].replay()
        return self._sampled[: own.samples]

    def _build(self, shape: PrefillShape) -> None:
        """Warm the bucket's two steps up on a batch of padding alone (it writes only the sink page and slot),
        then capture them."""
        batch = PrefillBatch.build(
            [], self.kv_pool.page_size, self.max_seq_len, self.store.device, shape=shape, into=self._input
        )

        def step(greedy: bool) -> torch.Tensor:
            tokens = prefill_step(self.model.prefill_fused, batch, self.kv_pool, self.store, greedy)
            return self._sampled[: shape.samples].copy_(tokens)

        captured = {}
        try:
            for greedy in (False, True):
                graph, _ = capture_step(lambda: step(greedy), self.store.device, self._pool)  # noqa: B023 (called at once)
                captured[(shape.tokens, greedy)] = graph
            torch.cuda.synchronize()
        except Exception as err:  # any failure leaves the bucket eager, said why
            self.states[shape.tokens] = f"eager (capture failed: {type(err).__name__}: {err})"
            log.warning(f"prefill bucket {shape.tokens}: {self.states[shape.tokens]}")
            return
        self._graphs.update(captured)
        self.states[shape.tokens] = "captured"
        log.info(
            f"prefill bucket {shape.tokens} tokens: captured", chunks=shape.chunks, samples=shape.samples
        )
