"""Decode steps per bucket, captured as CUDA graphs: scatter -> forward -> sample -> loop-back -> advance."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import structlog
import torch

from executor_svc.attention.flashinfer_decode import (
    FlashInferDecode,
    HostRows,
    TorchPagedDecode,
    plan_from_rows,
)
from executor_svc.config import DECODE_PATHS
from executor_svc.kernels.attention import decode_splits
from executor_svc.kernels.tables import StepInputs, advance, scatter_cells
from executor_svc.kv_pool import KVPool
from executor_svc.models.llama import LlamaModel
from executor_svc.sampler import sample
from executor_svc.tables import SlotStore
from protos.layout import RowLayout

log = structlog.get_logger("deltaserve.executor.graphs")

WARMUP_STEPS = 2  # eager runs before a capture: Triton compiles, cuBLAS picks its kernels


def capture_order(buckets: Iterable[int]) -> list[int]:
    """Widest first, so the narrower graphs reuse the memory the widest one's capture reserved."""
    return sorted(set(buckets), reverse=True)


def capture_step(
    step: Callable[[], torch.Tensor], device: torch.device, pool: tuple[int, int] | None
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Run `step` eagerly on a side stream WARMUP_STEPS times, then capture it into `pool`; returns the graph
    and the output tensor its replays refill."""
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

    Two graphs per bucket: one that samples, and one for steps whose rows are all greedy, which takes the
    argmax and skips the sampler's sort and noise. The host knows which slots sample from the sampler state
    the plans write, so picking the graph reads nothing back.

    `resident`: every input is read on the device by slot (the bucket is host-plan-free).
    `host-planned`: the executor keeps a host copy of the rows, rebuilds each row's pages, length and
    position every step, and plans the attention on the host (FlashInfer on CUDA, torch on the CPU)
    before the replay; the same graph body otherwise, so the two paths differ only in that host work.
    """

    def __init__(
        self,
        model: LlamaModel,
        kv_pool: KVPool,
        store: SlotStore,
        buckets: Iterable[int],
        *,
        max_seq_len: int,
        decode_path: str = "resident",
        capture: bool | None = None,
    ) -> None:
        if decode_path not in DECODE_PATHS:
            raise ValueError(f"decode_path must be one of {DECODE_PATHS}, got {decode_path!r}")
        self.model = model
        self.kv_pool = kv_pool
        self.store = store
        self.buckets = tuple(sorted(set(buckets)))
        device = store.device
        self._cuda = device.type == "cuda"
        self.capture = self._cuda if capture is None else capture
        if self.capture and not self._cuda:
            raise ValueError("CUDA graphs need a CUDA device")
        layout = store.layout
        config = model.config
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count if self._cuda else 0
        # Split-K partitions fixed per bucket (a graph cannot change them): enough to fill the GPU.
        self.splits = {
            bucket: decode_splits(bucket, config.num_kv_heads, max_seq_len, kv_pool.page_size, sm_count)
            if self._cuda
            else 1
            for bucket in self.buckets
        }
        # The split-K partitions' arrival counters, one per (row, KV head): the attention leaves them zero.
        self._split_counters = torch.zeros(
            layout.widest_bucket * config.num_kv_heads, dtype=torch.int32, device=device
        )
        self._step_slots = np.zeros(layout.widest_bucket, dtype=np.int32)  # host copy of store.step_slots
        self._samples = np.zeros(layout.slots, dtype=bool)  # by slot: temperature > 0
        self._greedy: dict[int, bool] = {}  # bucket -> greedy(bucket), until a plan changes slots or sampling
        self.host_rows: HostRows | None = None
        if decode_path == "host-planned":
            self.host_rows = HostRows(layout)
            widest = layout.widest_bucket
            # The host's inputs of a step: [positions (i64) | write_page | write_offset], filled then uploaded.
            self._host_inputs = torch.zeros(widest, 4, dtype=torch.int32, pin_memory=self._cuda)
            self._device_inputs = torch.zeros(widest, 4, dtype=torch.int32, device=device)
            # Recorded after each replay: the host buffers above and FlashInfer's plan buffers are single, so
            # the next step's planning waits for the step that reads them (the host-planned arm's price for
            # launching ahead).
            self._replayed = torch.cuda.Event() if self._cuda else None
            span = layout.block_span
            self.attention = (
                FlashInferDecode(self.buckets, kv_pool, config.num_heads, span, model.scale)
                if self._cuda
                else TorchPagedDecode(self.buckets, kv_pool, span, model.scale)
            )
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (bucket, greedy) -> graph
        self._tokens: dict[tuple[int, bool], torch.Tensor] = {}  # each captured graph's output: i64[B]
        self.states: dict[int, str] = {}  # bucket -> what the log line said
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        for bucket in capture_order(self.buckets):
            self._build(bucket)

    # --- host side ------------------------------------------------------------------------------------

    def note_plan(
        self,
        slots: np.ndarray | None,
        runs: np.ndarray,
        cells: np.ndarray,
        sampler_slots: np.ndarray,
        sampler_f32: np.ndarray,
    ) -> None:
        """What the host keeps of a plan: the step's slots and which slots sample; host-planned also the
        table writes, for its host copy of the rows (resident keeps none)."""
        if slots is not None:
            self._step_slots[: len(slots)] = slots
            self._greedy.clear()
        if len(sampler_slots):
            self._samples[sampler_slots] = sampler_f32[:, 0] > 0
            self._greedy.clear()
        if self.host_rows is not None:
            self.host_rows.apply(runs, cells)

    def greedy(self, bucket: int) -> bool:
        """Whether every row of the bucket's step is greedy (padding rows read the sink row, which is). Kept
        from step to step while the plans change neither: a steady step reads nothing."""
        greedy = self._greedy.get(bucket)
        if greedy is None:
            greedy = self._greedy[bucket] = self.greedy_slots(self._step_slots[:bucket])
        return greedy

    def greedy_slots(self, slots: np.ndarray) -> bool:
        """Whether every one of `slots` samples greedily, by the sampler state the plans wrote."""
        return not self._samples[slots].any()

    @property
    def pool(self) -> tuple[int, int] | None:
        """The memory pool of the decode graphs' captures, for other graphs that never run alongside them."""
        return self._pool

    def prepare(self, bucket: int) -> None:
        """Host-planned: build the step's page lists, lengths and positions from the host rows, upload the
        inputs and plan the attention. Resident: nothing (the graph reads the rows itself)."""
        if self.host_rows is None:
            return
        if self._replayed is not None:
            self._replayed.synchronize()
        plan = plan_from_rows(self.host_rows.rows, self._step_slots[:bucket], self.kv_pool.page_size)
        staged = self._host_inputs[:bucket].numpy()
        staged[:, 0:2] = plan.positions.astype(np.int64)[:, None].view(np.int32)
        staged[:, 2] = plan.write_page
        staged[:, 3] = plan.write_offset
        # Non-blocking from pinned memory: the wait above saw the previous copy done.
        self._device_inputs[:bucket].copy_(self._host_inputs[:bucket], non_blocking=True)
        self.attention.plan(bucket, plan)

    def launch(self, bucket: int) -> torch.Tensor:
        """Replay the bucket's step (or run it eagerly); returns its tokens i64[B], still on the device."""
        variant = (bucket, self.greedy(bucket))
        graph = self._graphs.get(variant)
        if graph is None:
            tokens = self._step(*variant)
        else:
            graph.replay()
            tokens = self._tokens[variant]
        if self.host_rows is not None:
            self.host_rows.advance(self._step_slots[:bucket])
            if self._replayed is not None:
                self._replayed.record()
        return tokens

    def row_mismatches(self, bucket: int, mirror: np.ndarray) -> int:
        """The row check after a replay: the planner's mirror holds the rows as the step read them, and the
        step has since advanced each real row's length by one."""
        expected = np.array(mirror, dtype=np.int32).reshape(bucket, self.store.layout.columns)
        real = self._step_slots[:bucket] != 0
        expected[real, RowLayout.KV_LEN] += 1
        return self.store.mismatches(bucket, expected)

    # --- the step -------------------------------------------------------------------------------------

    def _inputs_from_host(self, bucket: int, slots: torch.Tensor) -> StepInputs:
        inputs = self._device_inputs[:bucket]
        return StepInputs(
            tokens=self.store.last_token.index_select(0, slots),
            positions=inputs[:, 0:2].contiguous().view(torch.int64)[:, 0],
            kv_lens=inputs[:, 2],  # unused by the forward; the write location says it all
            write_page=inputs[:, 2].contiguous(),
            write_offset=inputs[:, 3].contiguous(),
        )

    def _step(self, bucket: int, greedy: bool) -> torch.Tensor:
        """The body of a bucket's graph: nothing here may read the device back or depend on the step."""
        store, kv = self.store, self.kv_pool
        slots = store.step_slots[:bucket]
        cells, count = store.staged_cells()
        scatter_cells(store.rows, cells, count)
        count.zero_()  # consumed: the next step scatters only what it stages
        if self.host_rows is None:
            logits, positions = self.model.decode_resident(
                store.rows, slots, store.last_token, kv, self.splits[bucket], self._split_counters
            )
        else:
            inputs = self._inputs_from_host(bucket, slots)
            positions = inputs.positions

            def attend(layer: int, q: torch.Tensor) -> torch.Tensor:
                return self.attention.attend(bucket, layer, q)

            logits = self.model.forward_fused(inputs, kv, attend)
        if greedy:  # the argmax that `sample` takes for greedy rows, without the rest
            tokens = logits.argmax(dim=-1)
        else:
            tokens = sample(logits, *store.sampler_params(slots), positions + 1)
        store.store_tokens(bucket, tokens)
        advance(store.rows, slots)
        return tokens

    def _build(self, bucket: int) -> None:
        """Warm the bucket's two steps up and capture them; every row of the store's step slots is padding
        meanwhile, so the warm-up steps write only the sink page and change no row."""
        self.store.step_slots[:bucket].zero_()
        self._step_slots[:bucket] = 0
        if not self.capture:
            self.states[bucket] = "eager (no CUDA graphs on this device)"
            return
        captured = {}
        try:
            self.prepare(bucket)
            for greedy in (False, True):
                captured[(bucket, greedy)] = capture_step(
                    lambda: self._step(bucket, greedy),  # noqa: B023 (called at once)
                    self.store.device,
                    self._pool,
                )
            torch.cuda.synchronize()
        except Exception as err:  # any failure leaves the bucket eager, said why
            self.states[bucket] = f"eager (capture failed: {type(err).__name__}: {err})"
            log.warning(f"bucket {bucket}: {self.states[bucket]}")
            return
        for variant, (graph, tokens) in captured.items():
            self._graphs[variant] = graph
            self._tokens[variant] = tokens
        if self.host_rows is None:
            self.states[bucket] = "captured, host-plan-free"
            log.info(f"bucket {bucket}: {self.states[bucket]}", splits=self.splits[bucket])
        else:
            self.states[bucket] = "captured, host-planned (attention planned on the host)"
            log.info(f"bucket {bucket}: {self.states[bucket]}")
