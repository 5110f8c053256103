"""The executor's step: write the tables, run the prefill chunks and the decode, sample."""

from __future__ import annotations

from collections.abc import Sequence

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


class StepRunner:
    """Runs StepPlans in order on one thread (the GPU loop); reads back only the sampled tokens."""

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
        )

    def run(self, plan: executor_pb2.StepPlan) -> executor_pb2.StepOutput:
        """One step; raises PlanError (having changed nothing) for a malformed plan."""
        checked = check_plan(plan, self.limits, self._decode_bucket)
        with torch.inference_mode():
            return self._run_checked(plan.seq, checked)

    def _run_checked(self, seq: int, plan: CheckedPlan) -> executor_pb2.StepOutput:
        store = self.store
        if plan.slots is not None:
            store.set_slots(plan.slots)
            self._decode_bucket = plan.bucket
        store.write_runs(plan.runs)
        store.write_cells(plan.cells)
        store.write_sampler(plan.sampler_slots, plan.sampler_f32, plan.sampler_i32)

        sampled: list[torch.Tensor] = []  # device tokens, read back together at the end
        prefill_tokens = np.full(len(plan.prefill), -1, dtype=np.int32)
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

        host = torch.cat(sampled).to(torch.int32).cpu().numpy() if sampled else np.empty(0, dtype=np.int32)
        prefill_tokens[sampled_chunks] = host[: len(sampled_chunks)]
        return executor_pb2.StepOutput(
            seq=seq,
            tokens=pack_i32(host[len(sampled_chunks) :]),
            prefill_tokens=pack_i32(prefill_tokens),
            row_mismatches=mismatches,
        )


def build_runner(config: ExecutorConfig) -> StepRunner:
    """Resolve the device and dtype, load the model, and build its KV pool and slot store."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    path = resolve_model_path(config.model)
    model = load_model(path, device, dtype)
    max_seq_len = config.max_seq_len or model.config.max_seq_len
    kv_pool = model.make_kv_pool(config.pool_pages, config.page_size, device, dtype)
    layout = RowLayout.build(list(config.buckets), max_seq_len, config.page_size, config.pool_pages)
    store = SlotStore(layout, device)
    return StepRunner(
        model,
        kv_pool,
        store,
        layout,
        config.row_check,
        buckets=config.buckets,
        max_seq_len=max_seq_len,
        fingerprint=model_fingerprint(path),
    )
