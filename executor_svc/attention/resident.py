"""The resident decode attention: Triton kernels that read each row's length and pages off the slot store on
the device, by slot, so a step needs no host planning (the bucket's graph is host-plan-free)."""

from __future__ import annotations

import torch

from executor_svc.attention import StepInputs
from executor_svc.kernels.attention import decode_splits, paged_decode_attention
from executor_svc.kernels.slot_ops import gather_inputs
from executor_svc.kv_pool import KVPool
from executor_svc.plan import CheckedPlan
from executor_svc.slot_store import SlotStore
from protos.layout import RowLayout


class ResidentDecode:
    fused = True
    kind = "host-plan-free"

    def __init__(
        self,
        store: SlotStore,
        kv: KVPool,
        scale: float,
        buckets: tuple[int, ...],
        *,
        num_kv_heads: int,
        max_seq_len: int,
    ) -> None:
        self.store = store
        self.kv = kv
        self.scale = scale
        self.max_seq_len = max_seq_len
        device = store.device
        cuda = device.type == "cuda"
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 0
        # Split-K partitions fixed per bucket (a graph cannot change them): enough to fill the GPU.
        self.splits = {
            bucket: decode_splits(bucket, num_kv_heads, max_seq_len, kv.page_size, sm_count) if cuda else 1
            for bucket in buckets
        }
        # The split-K partitions' arrival counters, one per (row, KV head): the attention leaves them zero.
        widest = store.layout.widest_bucket
        self._split_counters = torch.zeros(widest * num_kv_heads, dtype=torch.int32, device=device)
        self._slots = store.step_slots[:widest]  # the step's slots, set by `inputs`: [B]

    def plan(self, plan: CheckedPlan) -> None:
        pass

    def prepare(self, bucket: int) -> None:
        pass

    def inputs(self, bucket: int) -> StepInputs:
        store = self.store
        self._slots = store.step_slots[:bucket]
        return gather_inputs(store.rows, self._slots, store.last_token, self.kv.page_size, self.max_seq_len)

    def forward(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        kv = self.kv
        return paged_decode_attention(
            q,
            kv.k[layer],
            kv.v[layer],
            self.store.rows,
            self._slots,
            RowLayout.BLOCK_TABLE,
            kv.page_size,
            self.scale,
            self.splits[q.shape[0]],
            self._split_counters,
        )

    def stepped(self, bucket: int) -> None:
        pass
