"""The executor's step, top to bottom: check the plan -> apply it to the slot store -> prefill -> decode (replay
the bucket's graph) -> read the sampled tokens back."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import structlog
import torch

from executor_svc.attention import decode_attention
from executor_svc.config import DEFAULT_BUCKETS, ExecutorConfig
from executor_svc.decode_graphs import DecodeGraphs, Sampled
from executor_svc.device import resolve_device, resolve_dtype
from executor_svc.grammars import Grammars
from executor_svc.kv_pool import KVPool, log_tables
from executor_svc.launched_step import READ_BACK_RING, LaunchedStep, ReadBack
from executor_svc.logprob_rows import asking_rows, gathered_table, packed
from executor_svc.models.family import ExecutorModel
from executor_svc.models.loader import load_fingerprinted
from executor_svc.plan import CheckedPlan, PlanError, PlanLimits, check_plan
from executor_svc.prefill.graphs import PrefillGraphs
from executor_svc.slot_store import CONTROLLED, SlotStore
from executor_svc.stage import stage_of
from executor_svc.state_pool import StatePool, make_state_pool
from protos import executor_pb2
from protos.layout import MAX_DECODE_STEPS, RowLayout
from protos.model_files import resolve_model_path
from protos.wire import pack_i32

log = structlog.get_logger("deltaserve.executor.runner")


@dataclass(slots=True)
class RunnerTimes:
    """Host microseconds per phase of the steps run with decode graphs, summed (for the benchmarks)."""

    steps: int = 0
    apply_us: float = 0.0  # decode and check the plan, write it into the slot store
    plan_us: float = 0.0  # host-planned only: page lists, lengths, positions and the attention's plan
    prefill_us: float = 0.0  # eager prefill chunks (launches; the GPU runs them behind)
    launch_us: float = 0.0  # the graph replay call
    sync_us: float = 0.0  # from the launch until the step is collected (the next launch runs meanwhile)
    graph_us: float = 0.0  # device time of the decode graphs (CUDA events around each replay)
    # Steady decode steps (no prefill, right after another replay): the graph's device time, and the device
    # time from the previous replay's end to this one's (the step's period on the GPU: their ratio is how
    # busy the GPU is while requests decode).
    steady_steps: int = 0
    steady_graph_us: float = 0.0
    steady_period_us: float = 0.0


UINT32_MAX = 2**32 - 1  # StepOutput.device_wait_us


class StepRunner:
    """Runs StepPlans in order on one thread (the event loop's); reads back only the sampled tokens.

    `launch` queues a step's work and returns at once on a GPU; `collect` builds its output once its tokens
    are back, so the loop can launch step N+1 while step N still runs (the tokens loop back on the device:
    step N+1 needs nothing from the host). `run` is the two in a row.

    Without `graphs` the decode step is the torch one, eager (the CPU path); without `prefill_graphs` every
    prefill runs eager.
    """

    def __init__(
        self,
        model: ExecutorModel,
        kv_pool: KVPool,
        store: SlotStore,
        layout: RowLayout,
        row_check: bool,
        *,
        buckets: Sequence[int] | None = None,
        max_seq_len: int | None = None,
        fingerprint: str = "",
        graphs: DecodeGraphs | None = None,
        prefill_graphs: PrefillGraphs | None = None,
        state_pool: StatePool | None = None,
        grammars: Grammars | None = None,  # structured output (default: built with the first grammar)
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
        self.state_pool = state_pool
        self.store = store
        self.layout = layout
        self.row_check = row_check
        self.fingerprint = fingerprint
        self.grammars = grammars or Grammars(store.controls, None)
        self.device = store.device
        cuda = self.device.type == "cuda"
        if cuda:  # "cuda" alone means the device current where the runner is built
            self._cuda_index = torch.cuda.current_device() if self.device.index is None else self.device.index
        self.limits = PlanLimits(
            layout=layout,
            buckets=buckets,
            vocab_size=model.config.vocab_size,
            max_seq_len=max_seq_len,
            page_size=kv_pool.page_size,
            pool_pages=kv_pool.num_pages,
            max_run_cells=store.max_run_cells,
            state_slots=0 if state_pool is None else state_pool.num_slots,
        )
        if graphs is None:
            attention = decode_attention("torch", model, kv_pool, store, buckets, max_seq_len)
            graphs = DecodeGraphs(model, store, attention, buckets, capture=False, state_pool=state_pool)
        self.prefill_graphs = prefill_graphs or PrefillGraphs(
            model, kv_pool, store, max_seq_len=max_seq_len, state_pool=state_pool
        )
        self.graphs = graphs
        self.times = RunnerTimes()
        self._last_replay: tuple[int, torch.cuda.Event] | None = None  # seq and end event of the last timed
        # Steps launch on the device's default stream. Named in each event record: finding the current
        # stream costs a record ~20 µs of Python.
        self._stream = torch.cuda.default_stream(self._cuda_index) if cuda else None
        # A step samples at most the widest bucket's prompts and its decode rows (check_plan).
        self._read_backs = (
            [ReadBack(MAX_DECODE_STEPS * widest, 2 * widest) for _ in range(READ_BACK_RING)] if cuda else []
        )
        self._launches = 0
        self._uncollected = 0

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
            layer_begin=self.model.stage.layers.begin,
            layer_end=self.model.stage.layers.end,
            eos_token_id=config.eos_token_ids[0],
            eos_token_ids=list(config.eos_token_ids),
            state_slots=limits.state_slots,
            stage_group=self.model.stage.group_id,
        )

    def bind_thread(self) -> None:
        """Make this runner's GPU the current device of the calling thread (the one that launches the steps, or
        copies pages): graph replays, Triton launches and event records go to the current device's stream."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self._cuda_index)

    def run(self, plan: executor_pb2.StepPlan) -> executor_pb2.StepOutput:
        """One step, start to output; raises PlanError (having changed nothing) for a malformed plan."""
        launched = self.launch(plan)
        launched.wait()
        return self.collect(launched)

    def launch(self, plan: executor_pb2.StepPlan) -> LaunchedStep:
        """Queue one step's work; raises PlanError (having changed nothing) for a malformed plan. Steps launch
        in order, from one thread."""
        began = time.perf_counter()
        self.model.stage.seq = plan.seq  # named by its transfers (a split's)
        checked = check_plan(plan, self.limits, self.store.bucket)
        if checked.steps > 1 and self.store.variant(checked.bucket) == CONTROLLED:
            raise PlanError(
                f"steps: {checked.steps} over rows with sampling controls or logprobs (one a plan)"
            )
        grammar = self.grammars.before(checked, self.store)
        self.store.apply(checked)
        if checked.state_copies is not None and self.state_pool is not None:  # before any layer reads them
            self.state_pool.copy(checked.state_copies)
        if grammar:
            self.grammars.after(checked, self.store)
        applied = time.perf_counter()
        sampled: list[Sampled] = []
        sampled_chunks: list[int] = []
        if checked.prefill:  # most steps have none
            prefill_sampled = self.prefill_graphs.run(checked)
            if prefill_sampled is not None:
                sampled.append(prefill_sampled)
                sampled_chunks = [index for index, slot in enumerate(checked.sample_slots) if slot]
        prefilled = time.perf_counter()
        timing = None
        if self.graphs.capture:
            timing = self._read_backs[self._launches % READ_BACK_RING].replay
        decode_sampled = self.graphs.launch(checked, timing)
        if decode_sampled is None:  # no decode step
            return self._read_back(plan.seq, checked, sampled, sampled_chunks, 0)
        sampled.append(decode_sampled)
        launched = time.perf_counter()
        mismatches = 0
        if self.row_check and checked.mirror is not None:  # debug: waits for the step
            mismatches = self.store.row_check(checked.bucket, checked.mirror)
        step = self._read_back(plan.seq, checked, sampled, sampled_chunks, mismatches)
        step.marks = (began, applied, prefilled, self.graphs.planned_at, launched)
        step.replay = timing
        return step

    def _read_back(
        self,
        seq: int,
        plan: CheckedPlan,
        sampled: list[Sampled],
        sampled_chunks: list[int],
        mismatches: int,
    ) -> LaunchedStep:
        """Queue one copy of every token sampled this step (prefill chunks first, then the decode rows) to
        the host, and of the logprob tables where a row asked, behind the step's work: no wait here."""
        if not sampled:
            tokens = torch.empty(0, dtype=torch.int64, device=self.device)
        elif len(sampled) == 1:  # no concatenation kernel to launch
            tokens = sampled[0][0]
        else:
            tokens = torch.cat([part[0] for part in sampled])
        asking = asking_rows(self.store, plan, sampled)
        table = None
        if asking is not None and asking.any():
            table = gathered_table([(len(part[0]), part[1]) for part in sampled], self.device)
        done = None
        if self._read_backs and sampled:
            if self._uncollected == READ_BACK_RING:
                raise RuntimeError(
                    f"{READ_BACK_RING} steps launched and not collected: their read-backs are all taken"
                )
            read_back = self._read_backs[self._launches % READ_BACK_RING]
            self._launches += 1
            self._uncollected += 1
            host = read_back.tokens[: len(tokens)]
            host.copy_(tokens, non_blocking=True)
            if table is not None:
                table = read_back.tables[: len(table)].copy_(table, non_blocking=True)
            done = read_back.done
            done.record(self._stream)
        else:
            host = tokens.cpu()
            table = table.cpu() if table is not None else None
        step = LaunchedStep(seq, plan, sampled_chunks, host, done, mismatches)
        if table is not None and asking is not None:
            step.logprobs = (table, asking)
        self.grammars.launched(step, self.store)
        return step

    def forget_launched(self) -> None:
        """The steps launched and not collected never will be (their stream ended): their read-backs are free
        again. Reuse is safe on the device too, since a new copy queues behind theirs."""
        self._uncollected = 0
        self.grammars.forget_launched()

    def collect(self, step: LaunchedStep) -> executor_pb2.StepOutput:
        """The output of a launched step whose tokens are back (`collect_when_ready`, or after `step.wait()`)."""
        plan, chunks = step.plan, step.sampled_chunks
        self.grammars.feed(step)
        if step.done is not None:
            self._uncollected -= 1
        host = step.host_tokens.to(torch.int32).numpy()
        prefill_tokens = np.full(len(plan.prefill), -1, dtype=np.int32)
        prefill_tokens[chunks] = host[: len(chunks)]
        device_wait_us = self._note_times(step) if step.marks else 0.0
        output = executor_pb2.StepOutput(
            seq=step.seq,
            tokens=pack_i32(host[len(chunks) :]),
            prefill_tokens=pack_i32(prefill_tokens),
            row_mismatches=step.mismatches,
            device_wait_us=min(round(device_wait_us), UINT32_MAX),
        )
        if step.logprobs is not None:
            table, asking = step.logprobs
            output.logprobs, output.logprob_ids = packed(table.numpy(), asking)
        return output

    def _note_times(self, step: LaunchedStep) -> float:
        """Adds the step to `times`; returns how long the device waited for the step's plan to arrive (µs, 0
        where not measured): its idle gap before the replay, less this executor's own host work on the step
        (the host-planned arm's planning, say), which no planner can hurry."""
        began, applied, prefilled, planned, launched = step.marks
        times = self.times
        times.steps += step.plan.steps  # decode steps, several in a plan of several
        times.apply_us += (applied - began) * 1e6
        times.prefill_us += (prefilled - applied) * 1e6
        times.plan_us += (planned - prefilled) * 1e6
        times.launch_us += (launched - planned) * 1e6
        times.sync_us += (time.perf_counter() - launched) * 1e6
        if step.replay is None:
            return 0.0
        graph_us = step.replay[0].elapsed_time(step.replay[1]) * 1e3
        times.graph_us += graph_us
        last, wait_us = self._last_replay, 0.0
        if last is not None and last[0] == step.seq - 1 and not step.plan.prefill:
            period_us = last[1].elapsed_time(step.replay[1]) * 1e3
            times.steady_steps += 1
            times.steady_graph_us += graph_us
            times.steady_period_us += period_us
            wait_us = max(period_us - graph_us - (launched - began) * 1e6, 0.0)
        self._last_replay = (step.seq, step.replay[1])
        return wait_us


def build_runner(config: ExecutorConfig) -> StepRunner:
    """Resolve the device and dtype, load the model, and build its KV pool, slot store and decode graphs."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    path = resolve_model_path(config.model)
    model, fingerprint = load_fingerprinted(path, device, dtype, config.weights, stage_of(config, device))
    return runner_for_model(model, config, fingerprint)


def runner_for_model(model: ExecutorModel, config: ExecutorConfig, fingerprint: str) -> StepRunner:
    """The runner of a model already on its device: KV pool, slot store, and on CUDA one captured decode
    graph per bucket (config.decode_path picks resident or host-planned attention) and one prefill graph
    per token bucket; on the CPU the eager torch step."""
    device, dtype = model.device, model.dtype
    cuda = device.type == "cuda"
    if not cuda and config.decode_path != "resident":
        raise ValueError(f"decode_path={config.decode_path} needs a CUDA device (FlashInfer), not {device}")
    max_seq_len = config.max_seq_len or model.config.max_seq_len
    kv_pool = model.make_kv_pool(config.pool_pages, config.page_size, device, dtype)
    layout = RowLayout.build(list(config.buckets), max_seq_len, config.page_size, config.pool_pages)
    store = SlotStore(layout, device, model.config.vocab_size)
    log_tables(kv_pool, store)
    state_pool = make_state_pool(model, config.state_slots, layout.widest_bucket)
    graphs = prefill_graphs = None
    if cuda:
        attention = decode_attention(config.decode_path, model, kv_pool, store, config.buckets, max_seq_len)
        # A stage's transfers are not captured: a split's steps run eager.
        graphs = DecodeGraphs(
            model, store, attention, config.buckets, state_pool=state_pool, capture=not model.stage.split
        )
        if config.prefill_buckets and graphs.capture:
            prefill_graphs = PrefillGraphs(
                model,
                kv_pool,
                store,
                config.prefill_buckets,
                max_seq_len=max_seq_len,
                pool=graphs.pool,
                state_pool=state_pool,
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
        grammars=Grammars(
            store.controls,
            config.model,
            warm=True,
            cache_size=config.grammar_cache,
            eos_token_ids=model.config.eos_token_ids,
        ),
        graphs=graphs,
        prefill_graphs=prefill_graphs,
        state_pool=state_pool,
    )
