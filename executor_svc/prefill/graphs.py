"""A step's prefill chunks as one packed batch, replayed from the graph of the smallest token bucket that
holds it (captured on CUDA), else eager: forward -> sample -> loop-back."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import structlog
import torch

from executor_svc.attention.prefill import PrefillAttention
from executor_svc.decode_graphs import Sampled, capture_order, capture_step
from executor_svc.kernels.gated_delta_fla import Packed
from executor_svc.kv_pool import KVPool
from executor_svc.models.family import ExecutorModel
from executor_svc.plan import CheckedPlan
from executor_svc.prefill.batch import PrefillBatch, PrefillShape
from executor_svc.sampler import sample
from executor_svc.sampler_controls import sample_controlled
from executor_svc.slot_store import GREEDY, SAMPLED, SlotStore
from executor_svc.staging import Staging
from executor_svc.state_pool import StateInputs, StatePool

if TYPE_CHECKING:
    from executor_svc.decode_graphs import GraphPool

log = structlog.get_logger("deltaserve.executor.prefill_graphs")


def bucket_shapes(
    token_buckets: Iterable[int], widest: int, max_seq_len: int, page_size: int, recurrent: bool = False
) -> list[PrefillShape]:
    """The padded shape of each token bucket, smallest first. A dense model's step: every chunk but the last
    ends its prompt, and at most the widest decode bucket's prompts end, so no more chunks than that plus one,
    nor samples than that, nor pages than a sequence of max_seq_len holds (a step no shape holds runs eager).

    A model with recurrent layers (`recurrent`) gets fewer chunks: every sequence a graph holds, real or
    padding, costs each gated delta net layer a whole state (1 MiB in Qwen3.5-0.8B's) made and written by fla's
    kernels (a padding one's reads from and writes to the pool skipped), so a bucket holds a few (a step of more
    runs eager), and as few samples: the head's matmul and its argmax run over the samples' rows, whether a chunk
    fills them or not."""
    width = -(-max_seq_len // page_size)
    shapes = []
    for tokens in sorted(set(token_buckets)):
        chunks = min(tokens, widest + 1)
        if recurrent:
            chunks = min(chunks, max(4, tokens // 128))
        shapes.append(
            PrefillShape(tokens=tokens, chunks=chunks, samples=min(tokens, widest, chunks), table_width=width)
        )
    return shapes


def smallest_holding(shapes: Sequence[PrefillShape], batch: PrefillShape) -> PrefillShape | None:
    """The first of `shapes` (smallest first) that a batch of shape `batch` fits, or None."""
    return next((shape for shape in shapes if shape.holds(batch)), None)


def prefill_step(
    model: ExecutorModel,
    attention: PrefillAttention,
    store: SlotStore,
    variant: str,
    states: StateInputs | None = None,
) -> Sampled:
    """The body of a prefill step, captured or eager: the batch's forward, then the tokens of its sampling
    chunks (i64[S], on the device), looped back into their slots, and CONTROLLED their logprob table. Reads
    nothing back. `states`: the chunks' recurrent-state slots (a model with recurrent layers)."""
    batch = attention.batch
    inputs = batch.inputs if states is None else batch.inputs._replace(states=states)
    logits = model.forward(
        inputs, attention, select=batch.sample_index
    )  # [S, V]; None before a split's last stage
    slots, table, tokens = batch.sample_slots, None, None
    if logits is None:
        pass  # a stage before the last: the last samples
    elif variant == GREEDY:  # `sample`'s argmax for greedy rows, without the rest or a float32 copy
        tokens = logits.argmax(dim=-1)
    elif variant == SAMPLED:
        tokens = sample(logits, *store.sampler_params(slots), batch.sample_counters)
    else:
        params = store.sampler_params(slots)
        tokens, table = sample_controlled(logits, params, store.controls, slots, batch.sample_counters)
    tokens = model.stage.loop_back(tokens, batch.sample_index.shape[0], store.device)  # last stage to first
    store.store_prefill_tokens(slots, tokens)
    return tokens, table


class PrefillGraphs:
    """One prefill step per token bucket, captured on CUDA, two variants each (greedy, sampling) as the decode
    graphs have. A step's batch is padded to the smallest bucket that holds it and laid out in one input buffer
    that every graph reads; a batch no bucket holds (every batch, without buckets or off CUDA) runs eagerly,
    in the Triton kernels on CUDA and in torch ops elsewhere.

    Eager, the step is ~300 kernel launches (~20 ms of host time for 2048 tokens on the H200, against ~2 ms
    of GPU work); replayed, one launch. (The Qwen3.5 hybrid's, ~570 launches, ~45 ms of host against ~8 of
    GPU: its graphs also read the sequences' index, gated_delta_fla.Packed, from a buffer of their own, and are
    built only where its gated delta nets run in fla's kernels.)
    """

    def __init__(
        self,
        model: ExecutorModel,
        kv_pool: KVPool,
        store: SlotStore,
        token_buckets: Iterable[int] = (),
        *,
        max_seq_len: int,
        pool: GraphPool | None = None,
        state_pool: StatePool | None = None,
    ) -> None:
        device = store.device
        self.fused = device.type == "cuda"  # the Triton kernels, one attention launch a layer for all chunks
        token_buckets = tuple(token_buckets)
        if token_buckets and not self.fused:
            raise ValueError("prefill graphs need a CUDA device")
        if token_buckets and state_pool is not None and not getattr(model, "prefill_capturable", False):
            log.info("prefill graphs off: the recurrent layers prefill in the torch reference, eagerly")
            token_buckets = ()
        self.model = model
        self.kv_pool = kv_pool
        self.store = store
        self.state_pool = state_pool  # the recurrent-state pool, or None
        self.max_seq_len = max_seq_len
        self.shapes = bucket_shapes(
            token_buckets,
            store.layout.widest_bucket,
            max_seq_len,
            kv_pool.page_size,
            recurrent=state_pool is not None,
        )
        # The batch's words, and a recurrent model's sequences (where each starts, its chunks and state slot),
        # staged where the graphs read them
        self._staging = Staging(
            {
                "batch": max((s.words for s in self.shapes), default=0),
                "index": max(
                    (Packed.words(s.tokens, s.chunks) for s in self.shapes if state_pool), default=0
                ),
            },
            device,
            torch.int64,
        )
        # The sampled tokens, outside the graphs' memory pool: the step's decode replay, between this replay and
        # the read-back, may reuse the pool's memory (the pool is the decode graphs', and a graph's outputs in
        # it are safe only until another graph of the pool runs).
        self._sampled = torch.zeros(
            max((s.samples for s in self.shapes), default=0), dtype=torch.int64, device=device
        )
        self._graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}  # (token bucket, variant) -> graph
        self.states: dict[int, str] = {}  # token bucket -> what the log line said
        self._pool = pool if pool is not None or not self.shapes else torch.cuda.graph_pool_handle()
        for tokens in capture_order(s.tokens for s in self.shapes):
            self._build(next(s for s in self.shapes if s.tokens == tokens))

    def run(self, plan: CheckedPlan) -> Sampled | None:
        """Run the plan's prefill chunks; the tokens of those that sample (i64, on the device, in chunk order)
        and CONTROLLED their logprob table, or None where none samples. A CONTROLLED batch runs eagerly."""
        chunks, slots = plan.prefill, plan.sample_slots
        sampling = [slot for slot in slots if slot]
        variant = self.store.variant_of(np.array(sampling, dtype=np.int64))
        sampled = self.launch(chunks, slots, variant, plan.state_slots)
        if sampled is None:
            with torch.inference_mode():  # not for a replay: it costs more to enter than one
                sampled = self._eager(chunks, slots, variant, plan.state_slots)
        return sampled if sampling else None

    def _eager(
        self, chunks: Sequence[tuple], slots: Sequence[int], variant: str, state_slots: Sequence[int]
    ) -> Sampled | None:
        batch = PrefillBatch.build(
            chunks, self.kv_pool.page_size, self.max_seq_len, self.store.device, sample_slots=slots
        )
        attention = PrefillAttention(self.kv_pool, self.model.scale, batch, self.fused)
        states = None
        if self.state_pool is not None:
            host_slots = np.asarray(state_slots, dtype=np.int64)
            # on CUDA from pinned memory, queued without waiting for the device (as the batch)
            pinned = torch.from_numpy(host_slots).pin_memory() if self.fused else torch.from_numpy(host_slots)
            states = StateInputs(
                self.state_pool,
                pinned.to(self.store.device, non_blocking=True),
                seq_starts=batch.seq_starts_host,
                host_slots=host_slots,
                fresh=batch.starts == 0,
            )
        if not len(batch.sampled_chunks):  # no chunk ends its prompt: the K/V and state writes are the step
            inputs = batch.inputs if states is None else batch.inputs._replace(states=states)
            self.model.forward(inputs, attention, select=batch.last_index)
            return None
        return prefill_step(self.model, attention, self.store, variant, states)

    def launch(
        self,
        chunks: Sequence[tuple[np.ndarray, int, np.ndarray]],
        sample_slots: Sequence[int],
        variant: str,
        state_slots: Sequence[int] = (),
    ) -> Sampled | None:
        """Replay the step of the smallest bucket that holds the chunks (`state_slots`: their recurrent-state
        slots); their sampled tokens i64[S] on the device, or None when no captured bucket holds them (or none
        captures the variant)."""
        if not self._graphs:
            return None
        own = PrefillBatch.exact_shape(chunks, sum(1 for slot in sample_slots if slot))
        shape = smallest_holding([s for s in self.shapes if (s.tokens, variant) in self._graphs], own)
        if shape is None:
            return None
        page_size = self.kv_pool.page_size
        batch = PrefillBatch.build(
            chunks,
            page_size,
            self.max_seq_len,
            self.store.device,
            sample_slots=sample_slots,
            shape=shape,
            upload=functools.partial(self._staging.put, "batch"),
        )
        if self.state_pool is not None:
            self._graph_states(batch, shape, state_slots)
        self._graphs[(shape.tokens, variant)].replay()
        return self._sampled[: own.samples], None

    def _build(self, shape: PrefillShape) -> None:
        """Warm the bucket's two steps up on a batch of padding alone (it writes only the sink page and slot),
        then capture them."""
        batch = PrefillBatch.build(
            [],
            self.kv_pool.page_size,
            self.max_seq_len,
            self.store.device,
            shape=shape,
            upload=functools.partial(self._staging.put, "batch"),
        )
        attention = PrefillAttention(self.kv_pool, self.model.scale, batch, fused=True)
        states = None if self.state_pool is None else self._graph_states(batch, shape, ())

        def step(variant: str) -> Sampled:
            tokens, _ = prefill_step(self.model, attention, self.store, variant, states)
            return self._sampled[: shape.samples].copy_(tokens), None

        captured = {}
        try:
            for variant in (SAMPLED, GREEDY):  # a CONTROLLED batch runs eagerly
                graph, _ = capture_step(lambda: step(variant), self.store.device, self._pool)  # noqa: B023 (called at once)
                captured[(shape.tokens, variant)] = graph
            torch.cuda.synchronize()
            if self.state_pool is not None and not getattr(self.model, "prefill_capturable", False):
                raise RuntimeError(
                    "the recurrent layers fell back to the torch reference, which no graph holds"
                )
        except Exception as err:  # any failure leaves the bucket eager, said why
            self.states[shape.tokens] = f"eager (capture failed: {type(err).__name__}: {err})"
            log.warning(f"prefill bucket {shape.tokens}: {self.states[shape.tokens]}")
            return
        self._graphs.update(captured)
        self.states[shape.tokens] = "captured"
        log.info(
            f"prefill bucket {shape.tokens} tokens: captured",
            chunks=shape.chunks,
            samples=shape.samples,
        )

    def _graph_states(
        self, batch: PrefillBatch, shape: PrefillShape, state_slots: Sequence[int]
    ) -> StateInputs:
        """The batch's recurrent-state inputs, their sequence index laid out for the bucket where its graphs read
        it (the padding tokens in sequences at the sink slot)."""
        host_slots, fresh = np.asarray(state_slots, dtype=np.int64), batch.starts == 0
        assert self.state_pool is not None
        index = Packed.build(
            batch.seq_starts_host,
            fresh,
            host_slots,
            self.store.device,
            shape=(shape.tokens, shape.chunks),
            upload=functools.partial(self._staging.put, "index"),
        )
        return StateInputs(self.state_pool, index.slots, batch.seq_starts_host, host_slots, fresh, index)
