"""The host-planned decode arm (the way engines do it today; the benchmarks' baseline): a host copy of the
rows, each step's page lists, lengths and positions rebuilt from it on the host, and the attention planned
there (FlashInfer's plan() on CUDA, torch's block tables on the CPU) before the replay."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from executor_svc.attention import StepInputs
from executor_svc.attention.torch_ref import decode_attention
from executor_svc.kv_pool import KVPool
from executor_svc.plan import CheckedPlan
from executor_svc.row_runs import RowWrites
from executor_svc.slot_store import SlotStore
from protos.layout import RowLayout

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace (split-K partials)


class HostDecodePlan(NamedTuple):
    """What the host works out for one decode step of B rows (padding rows read the sink row)."""

    positions: np.ndarray  # int64[B]: KV_LEN + POS_OFFSET
    write_page: np.ndarray  # int32[B]: the page the step's K/V goes to
    write_offset: np.ndarray  # int32[B]
    lengths: np.ndarray  # int32[B]: positions attended, the step's own included
    indptr: np.ndarray  # int32[B + 1]: FlashInfer's CSR page lists
    indices: np.ndarray  # int32[indptr[-1]]
    last_page_len: np.ndarray  # int32[B]
    tables: np.ndarray  # int32[B, W]: the same pages as dense block tables (the torch arm's input)


def plan_from_rows(rows: np.ndarray, slots: np.ndarray, page_size: int, max_seq_len: int) -> HostDecodePlan:
    """Each step row's pages, length and position from a host copy of the rows (int32[S, C]), by slot.
    Positions are clamped below max_seq_len, as the gather kernel clamps them."""
    picked = rows[slots]  # picked: [B, C]
    kv_len = picked[:, RowLayout.KV_LEN].astype(np.int64)
    tables = np.ascontiguousarray(picked[:, RowLayout.BLOCK_TABLE :])
    span = tables.shape[1]
    lengths = np.minimum(kv_len + 1, span * page_size)  # a row past its span reads its own pages only
    n_pages = np.minimum(-(-lengths // page_size), span)
    indptr = np.zeros(len(slots) + 1, dtype=np.int32)
    np.cumsum(n_pages, out=indptr[1:])
    held = np.arange(span)[None, :] < n_pages[:, None]
    # A row at its span's end (the planner never sends one) writes to the sink page, as the gather kernel does.
    page_index = kv_len // page_size
    inside = page_index < span
    write_page = np.where(inside, tables[np.arange(len(slots)), np.minimum(page_index, span - 1)], 0)
    return HostDecodePlan(
        positions=np.minimum(kv_len + picked[:, RowLayout.POS_OFFSET], max_seq_len - 1),
        write_page=write_page.astype(np.int32),
        write_offset=(kv_len % page_size).astype(np.int32),
        lengths=lengths.astype(np.int32),
        indptr=indptr,
        indices=tables[held],
        last_page_len=(lengths - (n_pages - 1) * page_size).astype(np.int32),
        tables=tables,
    )


class HostRows:
    """The host copy of the slot store's rows that a host-planned executor keeps, written as the store is."""

    def __init__(self, layout: RowLayout) -> None:
        self.layout = layout
        self.rows = np.zeros((layout.slots, layout.columns), dtype=np.int32)  # rows: [S, C]
        self._flat = self.rows.reshape(-1)

    def apply(self, writes: RowWrites) -> None:
        """A plan's row writes, as SlotStore.write_runs makes them."""
        at = 0
        for segment in writes.segments:
            end = at + segment.n_cells
            self._flat[segment.flat_start : segment.flat_start + segment.n_cells] = writes.values[at:end]
            at = end

    def advance(self, slots: np.ndarray) -> None:
        """KV_LEN += 1 for the real rows of a step (slots of a bucket are distinct; 0 is padding)."""
        self.rows[slots[slots != 0], RowLayout.KV_LEN] += 1


class TorchPagedDecode:
    """Host-planned attention in plain torch over the host's block tables (the CPU arm, for checks)."""

    def __init__(self, buckets: tuple[int, ...], kv: KVPool, span: int, scale: float) -> None:
        device = kv.k.device
        widest = max(buckets)
        self._kv = kv
        self._scale = scale
        self._tables = torch.zeros(widest, span, dtype=torch.int32, device=device)  # tables: [B, W]
        self._lengths = torch.zeros(widest, dtype=torch.int32, device=device)

    def plan(self, bucket: int, plan: HostDecodePlan) -> None:
        self._tables[:bucket].copy_(torch.from_numpy(plan.tables))
        self._lengths[:bucket].copy_(torch.from_numpy(plan.lengths))

    def attend(self, bucket: int, layer: int, q: torch.Tensor) -> torch.Tensor:
        kv = self._kv
        return decode_attention(
            q, kv.k[layer], kv.v[layer], self._tables[:bucket], self._lengths[:bucket], self._scale
        )


def import_flashinfer():
    """flashinfer, or a ValueError that says the host-planned path needs it."""
    try:
        import flashinfer
    except ImportError as err:
        raise ValueError(
            f"decode_path=host-planned needs FlashInfer (pip install flashinfer-python): {err}"
        ) from err
    return flashinfer


class FlashInferDecode:
    """FlashInfer's paged decode (NHD pages, as the pool holds them), planned on the host every step.

    One wrapper per bucket with fixed CUDA-graph buffers, so the forward that calls `attend` can be
    captured; `plan` rewrites those buffers and the wrapper's schedule before each replay.
    """

    def __init__(self, buckets: tuple[int, ...], kv: KVPool, num_heads: int, span: int, scale: float) -> None:
        flashinfer = import_flashinfer()
        _, _, page_size, kv_heads, head_dim = kv.k.shape
        device = kv.k.device
        self._kv = kv
        self._shape = (num_heads, kv_heads, head_dim, page_size)
        self._scale = scale
        self._dtype = kv.k.dtype
        # One float workspace for all buckets: steps never run at once.
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrappers = {
            bucket: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                kv_layout="NHD",
                use_cuda_graph=True,
                paged_kv_indptr_buffer=torch.zeros(bucket + 1, dtype=torch.int32, device=device),
                paged_kv_indices_buffer=torch.zeros(bucket * span, dtype=torch.int32, device=device),
                paged_kv_last_page_len_buffer=torch.zeros(bucket, dtype=torch.int32, device=device),
            )
            for bucket in buckets
        }

    def plan(self, bucket: int, plan: HostDecodePlan) -> None:
        num_heads, kv_heads, head_dim, page_size = self._shape
        self._wrappers[bucket].plan(
            torch.from_numpy(plan.indptr),
            torch.from_numpy(plan.indices),
            torch.from_numpy(plan.last_page_len),
            num_heads,
            kv_heads,
            head_dim,
            page_size,
            pos_encoding_mode="NONE",
            q_data_type=self._dtype,
            kv_data_type=self._dtype,
            sm_scale=self._scale,
        )

    def attend(self, bucket: int, layer: int, q: torch.Tensor) -> torch.Tensor:
        # q comes as a view into the fused qkv projection; FlashInfer is given a dense copy.
        return self._wrappers[bucket].run(q.contiguous(), (self._kv.k[layer], self._kv.v[layer]))


class HostPlannedDecode:
    """The decode attention planned on the host every step from HostRows, the executor's host copy of the
    rows (fed each plan's parsed row writes): FlashInfer on CUDA, torch over the same block tables on the
    CPU (for checks). The step's inputs (positions, write locations) are planned on the host too."""

    fused = True
    kind = "host-planned (attention planned on the host)"

    def __init__(
        self,
        store: SlotStore,
        kv: KVPool,
        scale: float,
        buckets: tuple[int, ...],
        num_heads: int,
        max_seq_len: int,
    ):
        layout = store.layout
        device = store.device
        cuda = device.type == "cuda"
        self.store = store
        self.kv = kv
        self.max_seq_len = max_seq_len
        self.host_rows = HostRows(layout)
        widest, span = layout.widest_bucket, layout.block_span
        # The host's inputs of a step: [positions (i64) | write_page | write_offset], filled then uploaded.
        self._host_inputs = torch.zeros(widest, 4, dtype=torch.int32, pin_memory=cuda)  # [B, 4]
        self._device_inputs = torch.zeros(widest, 4, dtype=torch.int32, device=device)  # [B, 4]
        # Recorded after each replay: the host buffers above and FlashInfer's plan buffers are single, so
        # the next step's planning waits for the step that reads them (the host-planned arm's price for
        # launching ahead).
        self._replayed = torch.cuda.Event() if cuda else None
        self._attention = (
            FlashInferDecode(buckets, kv, num_heads, span, scale)
            if cuda
            else TorchPagedDecode(buckets, kv, span, scale)
        )

    def plan(self, plan: CheckedPlan) -> None:
        if plan.rows.segments:
            self.host_rows.apply(plan.rows)

    def prepare(self, bucket: int) -> None:
        """Build the step's page lists, lengths and positions from the host rows, upload the inputs and plan
        the attention."""
        if self._replayed is not None:
            self._replayed.synchronize()
        slots = self.store.host_slots(bucket)
        plan = plan_from_rows(self.host_rows.rows, slots, self.kv.page_size, self.max_seq_len)
        staged = self._host_inputs[:bucket].numpy()
        staged[:, 0:2] = plan.positions.astype(np.int64)[:, None].view(np.int32)
        staged[:, 2] = plan.write_page
        staged[:, 3] = plan.write_offset
        # Non-blocking from pinned memory: the wait above saw the previous copy done.
        self._device_inputs[:bucket].copy_(self._host_inputs[:bucket], non_blocking=True)
        self._attention.plan(bucket, plan)

    def inputs(self, bucket: int) -> StepInputs:
        store, inputs = self.store, self._device_inputs[:bucket]
        return StepInputs(
            tokens=store.last_token.index_select(0, store.step_slots[:bucket]),
            positions=inputs[:, 0:2].contiguous().view(torch.int64)[:, 0],
            kv_lens=inputs[:, 2],  # unused by the forward; the write location says it all
            write_page=inputs[:, 2].contiguous(),
            write_offset=inputs[:, 3].contiguous(),
        )

    def forward(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return self._attention.attend(q.shape[0], layer, q)

    def stepped(self, bucket: int) -> None:
        self.host_rows.advance(self.store.host_slots(bucket))
        if self._replayed is not None:
            self._replayed.record()
