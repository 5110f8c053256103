"""The executor's step: write the tables, run the prefill chunks and the decode, sample."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from executor_svc.config import DEFAULT_BUCKETS, ExecutorConfig
from executor_svc.device import resolve_device, resolve_dtype
from executor_svc.kv_pool import KVPool
from executor_svc.model_files import resolve_model_path
from executor_svc.models.llama import LlamaModel
from executor_svc.models.loader import load_model, model_fingerprint
from executor_svc.plan_check import CheckedPlan, PlanLimits, check_plan
from executor_svc.sampler import sample
from executor_svc.tables import SlotStore
from protos import executor_pb2
from protos.layout import RowLayout
from protos.wire import pack_i32

if TYPE_CHECKING:
    from executor_svc.graphs import DecodeGraphs


@dataclass(slots=True)
class RunnerTimes:
    """Host microseconds per phase of the steps run with decode graphs, summed (for the benchmarks)."""

    steps: int = 0
    apply_us: float = 0.0  # decode and check the plan, write the tables, stage the cells
    plan_us: float = 0.0  # host-planned only: page lists, lengths, positions and the attention's plan
    prefill_us: float = 0.0  # eager prefill chunks (launches; the GPU runs them behind)
    launch_us: float = 0.0  # the graph replay call
    sync_us: float = 0.0  # waiting for the sampled tokens to come back
    graph_us: float = 0.0  # device time of the decode graphs (CUDA events around each replay)


class StepRunner:
    """Runs StepPlans in order on one thread (the GPU loop); reads back only the sampled tokens.

    Without `graphs` the decode step is the eager torch model (the CPU path); with them it is a replay
    of the bucket's graph, which scatters the staged cells itself.
    """

    def __init__(
        self,
        model: LlamaModel,
        kv_pool: KVPool,
        store: SlotStore,
        layout: RowLayout,
        row_check: bool,
        *,
        buckets: Sequence[int] | None = None,
        max_seq_len: int | None = None,
        fingerprint: str = "",
        graphs: DecodeGraphs | None = None,
    ) -> None:
        widest = layout.widest_bucket
        if buckets is None:  # the default buckets that fit, and the widest the layout holds
            buckets = [b for b in DEFAULT_BUCKETS if b < widest] + [widest]
        buckets = tuple(sorted(set(buckets)))
        if buckets[-1] != widest:
            raise ValueError(f"the widest bucket {buckets[-1]} does not match the layout's {widest}")
        context = model.config.max_seq_len
        max_seq_len = context if max_seq_len is None else max_seq_len
        if not 1 <= max_seq_len <= context:
            raise ValueError(f"max_seq_len {max_seq_len} is outside the model's context [1, {context}]")
        self.model = model
        self.kv_pool = kv_pool
        self.store = store
        self.layout = layout
        self.row_check = row_check
        self.fingerprint = fingerprint
        self.device = store.device
        self.limits = PlanLimits(
            layout=layout,
            buckets=buckets,
            vocab_size=model.config.vocab_size,
            max_seq_len=max_seq_len,
            page_size=kv_pool.page_size,
            pool_pages=kv_pool.num_pages,
            max_run_cells=store.max_run_cells,
            max_cells=store.max_cells,
        )
        self._decode_bucket = 0  # the bucket whose slots the store holds
        self.graphs = graphs
        self.times = RunnerTimes()
        if graphs is not None:
            self._replay_began = torch.cuda.Event(enable_timing=True) if graphs.capture else None
            self._replay_ended = torch.cuda.Event(enable_timing=True) if graphs.capture else None

    def describe(self) -> executor_pb2.ExecutorDescription:
        config, limits = self.model.config, self.limits
        return executor_pb2.ExecutorDescription(
            model_name=config.name,
            model_fingerprint=self.fingerprint,
            vocab_size=config.vocab_size,
            max_seq_len=limits.max_seq_len,
            num_layers=config.num_layers,
            page_size=limits.page_size,
            pool_pages=limits.pool_pages,
            buckets=list(limits.buckets),
            slots=self.layout.slots,
            row_columns=self.layout.columns,
            block_span=self.layout.block_span,
            device=str(self.device),
            dtype=str(self.kv_pool.k.dtype).removeprefix("torch."),
            layer_begin=0,
            layer_end=config.num_layers,
            eos_token_id=config.eos_token_id,
        )

    def run(self, plan: executor_pb2.StepPlan) -> executor_pb2.StepOutput:
        """One step; raises PlanError (having changed nothing) for a malformed plan."""
        began = time.perf_counter()
        checked = check_plan(plan, self.limits, self._decode_bucket)
        with torch.inference_mode():
            if self.graphs is None:
                return self._run_checked(plan.seq, checked)
            return self._run_replayed(plan.seq, checked, began)

    def _run_checked(self, seq: int, plan: CheckedPlan) -> executor_pb2.StepOutput:
        store = self.store
        if plan.slots is not None:
            store.set_slots(plan.slots)
            self._decode_bucket = plan.bucket
        store.write_runs(plan.runs)
        store.write_cells(plan.cells)
        store.write_sampler(plan.sampler_slots, plan.sampler_f32, plan.sampler_i32)

        sampled, sampled_chunks = self._prefill(plan)

        mismatches = 0
        if plan.bucket:
            if self.row_check and plan.mirror is not None:
                mismatches = store.mismatches(plan.bucket, plan.mirror)
            inputs = store.gather(plan.bucket)
            logits = self.model.decode(
                inputs.tokens, inputs.positions, inputs.kv_lens, inputs.block_tables, self.kv_pool
            )
            tokens = sample(logits, *inputs.sampler, inputs.positions + 1)
            store.store_tokens(plan.bucket, tokens)
            store.advance(plan.bucket)
            sampled.append(tokens)
        return self._output(seq, plan, sampled, sampled_chunks, mismatches)

    def _run_replayed(self, seq: int, plan: CheckedPlan, began: float) -> executor_pb2.StepOutput:
        """The CUDA path: table writes from the pinned staging, cells staged for the graph's own scatter,
        prefill eagerly, one replay, one read-back of the tokens."""
        store, graphs, times = self.store, self.graphs, self.times
        if plan.slots is not None:
            store.set_slots(plan.slots)
            self._decode_bucket = plan.bucket
        store.write_runs(plan.runs)
        if plan.bucket:
            store.stage_cells(plan.cells)
        else:  # no graph runs this step to scatter them
            store.write_cells(plan.cells)
        store.write_sampler(plan.sampler_slots, plan.sampler_f32, plan.sampler_i32)
        graphs.note_plan(plan.slots, plan.runs, plan.cells, plan.sampler_slots, plan.sampler_f32)
        applied = time.perf_counter()

        sampled, sampled_chunks = self._prefill(plan)
        prefilled = time.perf_counter()
        mismatches = 0
        if plan.bucket:
            graphs.prepare(plan.bucket)
            planned = time.perf_counter()
            if self._replay_began is not None:
                self._replay_began.record()
            sampled.append(graphs.launch(plan.bucket))
            if self._replay_ended is not None:
                self._replay_ended.record()
            launched = time.perf_counter()
        output = self._output(seq, plan, sampled, sampled_chunks, 0)
        if plan.bucket:
            synced = time.perf_counter()
            if self.row_check and plan.mirror is not None:
                mismatches = graphs.row_mismatches(plan.bucket, plan.mirror)
                output.row_mismatches = mismatches
            times.steps += 1
            times.apply_us += (applied - began) * 1e6
            times.prefill_us += (prefilled - applied) * 1e6
            times.plan_us += (planned - prefilled) * 1e6
            times.launch_us += (launched - planned) * 1e6
            times.sync_us += (synced - launched) * 1e6
            if self._replay_began is not None:
                times.graph_us += self._replay_began.elapsed_time(self._replay_ended) * 1e3
        return output

    def _prefill(self, plan: CheckedPlan) -> tuple[list[torch.Tensor], list[int]]:
        """Run the plan's prefill chunks; returns the device tokens sampled and the chunks they belong to."""
        store = self.store
        sampled: list[torch.Tensor] = []  # device tokens, read back together at the end
        sampled_chunks: list[int] = []
        for index, chunk in enumerate(plan.prefill):
            ids = torch.from_numpy(chunk.token_ids.astype(np.int64)).to(self.device)
            pages = torch.from_numpy(chunk.pages.copy()).to(self.device)
            logits = self.model.prefill(ids, chunk.start, pages, self.kv_pool)  # logits: [V]
            if chunk.sample_slot:
                slot = chunk.sample_slot
                # The counter is the position of the token being sampled: one past the chunk's last.
                counter = torch.full(
                    (1,), chunk.start + len(chunk.token_ids), dtype=torch.int64, device=self.device
                )
                params = store.sampler_params(slice(slot, slot + 1))
                token = sample(logits[None, :], *params, counter)
                store.store_token(slot, token)
                sampled.append(token)
                sampled_chunks.append(index)
        return sampled, sampled_chunks

    @staticmethod
    def _output(
        seq: int, plan: CheckedPlan, sampled: list[torch.Tensor], sampled_chunks: list[int], mismatches: int
    ) -> executor_pb2.StepOutput:
        """One read-back of every token sampled this step (prefill chunks first, then the decode rows)."""
        prefill_tokens = np.full(len(plan.prefill), -1, dtype=np.int32)
        host = torch.cat(sampled).to(torch.int32).cpu().numpy() if sampled else np.empty(0, dtype=np.int32)
        prefill_tokens[sampled_chunks] = host[: len(sampled_chunks)]
        return executor_pb2.StepOutput(
            seq=seq,
            tokens=pack_i32(host[len(sampled_chunks) :]),
            prefill_tokens=pack_i32(prefill_tokens),
            row_mismatches=mismatches,
        )


def build_runner(config: ExecutorConfig) -> StepRunner:
    """Resolve the device and dtype, load the model, and build its KV pool, slot store and decode graphs."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    path = resolve_model_path(config.model)
    model = load_model(path, device, dtype)
    return runner_for_model(model, config, model_fingerprint(path))


def runner_for_model(model: LlamaModel, config: ExecutorConfig, fingerprint: str) -> StepRunner:
    """The runner of a model already on its device: KV pool, slot store, and on CUDA one captured decode
    graph per bucket (config.decode_path picks resident or host-planned); on the CPU the eager step."""
    device, dtype = model.device, model.dtype
    if device.type != "cuda" and config.decode_path != "resident":
        raise ValueError(f"decode_path={config.decode_path} needs a CUDA device (FlashInfer), not {device}")
    max_seq_len = config.max_seq_len or model.config.max_seq_len
    kv_pool = model.make_kv_pool(config.pool_pages, config.page_size, device, dtype)
    layout = RowLayout.build(list(config.buckets), max_seq_len, config.page_size, config.pool_pages)
    store = SlotStore(layout, device)
    graphs = None
    if device.type == "cuda":
        from executor_svc.graphs import DecodeGraphs  # Triton and the graph machinery: CUDA only

        graphs = DecodeGraphs(
            model, kv_pool, store, config.buckets, max_seq_len=max_seq_len, decode_path=config.decode_path
        )
    return StepRunner(
        model,
        kv_pool,
        store,
        layout,
        config.row_check,
        buckets=config.buckets,
        max_seq_len=max_seq_len,
        fingerprint=fingerprint,
        graphs=graphs,
    )
