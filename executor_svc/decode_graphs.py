"""Decode steps per bucket, captured as CUDA graphs and replayed: inputs -> forward -> sample -> loop-back ->
advance, all read off the slot store by slot."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import structlog
import torch

from executor_svc.attention import DecodeAttention
from executor_svc.models.family import ExecutorModel
from executor_svc.plan import CheckedPlan
from executor_svc.sampler import sample
from executor_svc.sampler_controls import sample_controlled
from executor_svc.slot_store import CONTROLLED, GREEDY, SAMPLED, SlotStore
from executor_svc.state_pool import StateInputs, StatePool

if TYPE_CHECKING:
    # what torch.cuda.graph_pool_handle() returns and torch.cuda.graph(pool=) takes: a tuple[int, int]
    from torch.cuda import _POOL_HANDLE as GraphPool

log = structlog.get_logger("deltaserve.executor.graphs")

WARMUP_STEPS = 2  # eager runs before a capture: Triton compiles, cuBLAS picks its kernels


def capture_order(buckets: Iterable[int]) -> list[int]:
    """Widest first, so the narrower graphs reuse the memory the widest one's capture reserved."""
    return sorted(set(buckets), reverse=True)


Sampled = tuple[torch.Tensor, torch.Tensor | None]  # a step's tokens i64[B] and logprob table (CONTROLLED)


def capture_step(
    step: Callable[[], Sampled], device: torch.device, pool: GraphPool | None
) -> tuple[torch.cuda.CUDAGraph, Sampled]:
    """Run `step` eagerly on a side stream WARMUP_STEPS times, then capture it into `pool`; returns the graph
    and the output tensors its replays refill."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(WARMUP_STEPS):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
        output = step()
    return graph, output


class DecodeGraphs:
    """One decode step per bucket over the slot store, captured on CUDA (eager elsewhere, and for any
    bucket whose capture failed: it logs why).

    Three graphs per bucket, one per sampler variant: the argmax alone for steps whose rows are all greedy,
    the sampler's sort and noise, and that with the sampling controls and logprobs where a row has them; the
    slot store says which (`variant`), reading nothing back, so rows without controls pay nothing for them. The attention backend makes the step's inputs and reads the pages; the resident one and the
    host-planned one differ only in the host work they do before the replay.
    """

    def __init__(
        self,
        model: ExecutorModel,
        store: SlotStore,
        attention: DecodeAttention,
        buckets: Iterable[int],
        *,
        capture: bool | None = None,
        state_pool: StatePool | None = None,
    ) -> None:
        self.model = model
        self.state_pool = state_pool  # the recurrent-state pool, read and written by each row's STATE_SLOT
        self.store = store
        self.attention = attention
        self.buckets = tuple(sorted(set(buckets)))
        cuda = store.device.type == "cuda"
        self.capture = cuda if capture is None else capture
        if self.capture and not cuda:
            raise ValueError("CUDA graphs need a CUDA device")
        # The Triton step advances the rows in a kernel (the torch one, SlotStore.advance, is its reference).
        self._advance_kernel = None
        if attention.fused:
            from executor_svc.kernels.slot_ops import advance

            self._advance_kernel = advance
        self._stream = torch.cuda.default_stream(store.device) if cuda else None
        self._graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}  # (bucket, variant) -> graph
        self._outputs: dict[tuple[int, str], Sampled] = {}  # each captured graph's output
        self.states: dict[int, str] = {}  # bucket -> what the log line said
        self.planned_at = 0.0  # perf_counter once the last launch's host planning was done
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        for bucket in capture_order(self.buckets):
            self._build(bucket)

    @property
    def pool(self) -> GraphPool | None:
        """The memory pool of the decode graphs' captures, for other graphs that never run alongside them."""
        return self._pool

    def launch(
        self, plan: CheckedPlan, timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    ) -> Sampled | None:
        """The plan's decode steps: the attention takes note of the plan, then per step (and plans it,
        host-planned) the bucket's graph replays (or the step runs eagerly); their tokens i64[steps * B], step
        after step, and, CONTROLLED (one step), the logprob table, still on the device, or None for a plan
        without a decode step. `timing`: CUDA events to record around the replays."""
        attention, bucket = self.attention, plan.bucket
        attention.plan(plan)
        if not bucket:
            return None
        variant = (bucket, self.store.variant(bucket))
        graph = self._graphs.get(variant)
        parts: list[torch.Tensor] = []  # each step's tokens i64[B]
        for _ in range(plan.steps):
            attention.prepare(bucket)
            self.planned_at = time.perf_counter()
            if timing is not None and not parts:
                timing[0].record(self._stream)
            if graph is None:
                with torch.inference_mode():
                    sampled = self._step(*variant)
            else:
                graph.replay()
                sampled = self._outputs[variant]
            # A replay refills its graph's output tensors: the next replay would overwrite this step's tokens.
            parts.append(sampled[0].clone() if graph is not None and plan.steps > 1 else sampled[0])
            attention.stepped(bucket)
        if timing is not None:
            timing[1].record(self._stream)
        return (parts[0], sampled[1]) if len(parts) == 1 else (torch.cat(parts), None)

    def _step(self, bucket: int, variant: str) -> Sampled:
        """The body of a bucket's graph: nothing here may read the device back or depend on the step."""
        store = self.store
        inputs = self.attention.inputs(bucket)
        if self.state_pool is not None:
            inputs = inputs._replace(states=StateInputs(self.state_pool, store.state_slots(bucket)))
        logits = self.model.forward(
            inputs, self.attention
        )  # logits: [B, V]; None before a split's last stage
        slots, table, tokens = store.step_slots[:bucket], None, None
        if logits is None:
            pass  # a stage before the last: the last samples
        elif variant == GREEDY:  # `sample`'s argmax for greedy rows, without the rest or a float32 copy
            tokens = logits.argmax(dim=-1)
        elif variant == SAMPLED:
            tokens = sample(logits, *store.sampler_params(slots), inputs.positions + 1)
        else:
            store.controls.count_inputs(slots, inputs.tokens)
            params = store.sampler_params(slots)
            tokens, table = sample_controlled(logits, params, store.controls, slots, inputs.positions + 1)
        tokens = self.model.stage.loop_back(tokens, bucket, store.device)  # a split's last stage to its first
        store.store_tokens(bucket, tokens)
        if self._advance_kernel is None:
            store.advance(bucket)
        else:
            self._advance_kernel(store.rows, store.step_slots[:bucket])
        return tokens, table

    def _build(self, bucket: int) -> None:
        """Warm the bucket's three steps up and capture them; every row of the store's step slots is padding
        meanwhile, so the warm-up steps write only the sink page and change no row."""
        self.store.pad_slots(bucket)
        if not self.capture:
            self.states[bucket] = "eager (no CUDA graphs on this device)"
            return
        captured = {}
        try:
            self.attention.prepare(bucket)
            for variant in (CONTROLLED, SAMPLED, GREEDY):
                captured[(bucket, variant)] = capture_step(
                    lambda: self._step(bucket, variant),  # noqa: B023 (called at once)
                    self.store.device,
                    self._pool,
                )
            torch.cuda.synchronize()
        except Exception as err:  # any failure leaves the bucket eager, said why
            self.states[bucket] = f"eager (capture failed: {type(err).__name__}: {err})"
            log.warning(f"bucket {bucket}: {self.states[bucket]}")
            return
        for key, (graph, sampled) in captured.items():
            self._graphs[key] = graph
            self._outputs[key] = sampled
        self.states[bucket] = f"captured, {self.attention.kind}"
        log.info(f"bucket {bucket}: {self.states[bucket]}")
