"""The slot store: the one owner of the device rows, each slot's sampler state and loop-back token, the step's
slots (device and host copy) and which slots sample (DESIGN §2). `apply` writes a checked plan into it; the
decode graphs and the attention backends only read what it holds."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from executor_svc.plan import SAMPLER_F32, SAMPLER_I32, CheckedPlan
from executor_svc.row_runs import RowWrites
from executor_svc.sampler_controls import SamplerControls
from executor_svc.staging import Staging
from protos.layout import RowLayout

_SAMPLER_WORDS = 1 + SAMPLER_F32 + SAMPLER_I32  # staged per slot: the slot, then its values
# The sampler variants a step runs: the argmax alone; temperature, top-k/p and noise; and that with the
# sampling controls and logprobs (sampler_controls.py) besides.
GREEDY, SAMPLED, CONTROLLED = "greedy", "sampled", "controlled"


class SamplerParams(NamedTuple):
    temperature: torch.Tensor  # f32[B]
    top_p: torch.Tensor  # f32[B]
    top_k: torch.Tensor  # i32[B]
    seed: torch.Tensor  # i64[B]


class DecodeInputs(NamedTuple):
    tokens: torch.Tensor  # i64[B]: each row's loop-back token
    positions: torch.Tensor  # i64[B]: KV_LEN + POS_OFFSET
    kv_lens: torch.Tensor  # i32[B]: stored length before the step
    block_tables: torch.Tensor  # i32[B, W]


class SlotStore:
    """`rows: int32[S, C]` on the device and per-slot sampler state; row 0 is the sink row, zero forever.

    `apply` is how a plan comes in (its parts, `set_slots`, `write_runs` and `write_sampler`, are public for
    the tests alone). The step's slots are held here once, on the device for the graphs (`step_slots`) and
    on the host (`host_slots`) for what the host decides: which graph variant (`greedy`), the host-planned
    attention's plan, the row check. Nothing is read back from the device (but `mismatches`, a debug check)
    and nothing grows after construction.
    """

    def __init__(self, layout: RowLayout, device: torch.device, vocab_size: int = 0) -> None:
        """`vocab_size`: the model's, for the sampling controls' per-slot token tables (0: no controls)."""
        self.layout = layout
        self.device = device
        slots, columns, widest = layout.slots, layout.columns, layout.widest_bucket
        self.rows = torch.zeros(slots, columns, dtype=torch.int32, device=device)  # rows: [S, C]
        self.temperature = torch.zeros(slots, dtype=torch.float32, device=device)  # 0 = greedy
        self.top_p = torch.ones(slots, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(slots, dtype=torch.int32, device=device)  # 0 = off
        self.seed = torch.zeros(slots, dtype=torch.int64, device=device)
        self.last_token = torch.zeros(slots, dtype=torch.int64, device=device)  # loop-back: [S]
        self.step_slots = torch.zeros(widest, dtype=torch.int64, device=device)  # the bucket's slots: [B]
        self._host_slots = np.zeros(widest, dtype=np.int32)  # step_slots' host copy: [B]
        self.bucket = 0  # the bucket whose slots are held (0 before the first decode step)
        self.controls = SamplerControls(slots, vocab_size, device)
        self._samples = np.zeros(slots, dtype=bool)  # by slot: temperature > 0
        self._variants: dict[
            int, str
        ] = {}  # bucket -> variant(bucket), until a plan changes slots or sampling
        # The largest flush: B whole rows as runs, every slot's sampler state.
        self._staging = Staging(
            {"slots": widest, "runs": widest * columns, "sampler": _SAMPLER_WORDS * (slots - 1)}, device
        )
        self._flat_rows = self.rows.view(-1)
        self._kernels = None
        if device.type == "cuda":  # one Triton launch per sampler write; compiled here, not in a step
            from executor_svc.kernels import slot_ops as kernels

            self._kernels = kernels
            state = kernels.SamplerState(self.temperature, self.top_p, self.top_k, self.seed, self.last_token)
            self._sampler_state = state
            kernels.scatter_sampler(self._staging.device("sampler"), 0, state)

    @property
    def max_run_cells(self) -> int:
        return self._staging.capacity("runs")

    # --- writes: a plan, applied ------------------------------------------------------------------------

    def apply(self, plan: CheckedPlan) -> None:
        """Write a checked plan: the step's slots, the row runs, the sampler state. A steady step's plan
        holds none of them and costs three tests."""
        if plan.slots is not None:
            self.set_slots(plan.slots)
        if plan.rows.segments:
            self.write_runs(plan.rows)
        if len(plan.sampler_slots):
            device_slots = self.write_sampler(plan.sampler_slots, plan.sampler_f32, plan.sampler_i32)
            self.controls.write(plan.sampler_slots, device_slots, plan.controls)

    def set_slots(self, slots: np.ndarray) -> None:
        """The slot of each row of the next decode buckets (0 for padding rows)."""
        bucket = len(slots)
        self._host_slots[:bucket] = slots
        staged = self._staging.host("slots")
        staged[:bucket] = slots
        self.step_slots[:bucket].copy_(self._staging.upload("slots", bucket))
        self.bucket = bucket
        self._variants.clear()

    def reset(self) -> None:
        """Zero rows and no decode step held, as after a restart (a new stream of plans starts here; the
        planner writes every row it uses whole)."""
        self.rows.zero_()
        self.step_slots.zero_()
        self._host_slots[:] = 0
        self.bucket = 0
        self._variants.clear()

    def pad_slots(self, bucket: int) -> None:
        """Every row of the bucket padding and no bucket held (the graphs' warm-up and capture: their steps
        write only the sink page and change no row)."""
        self.step_slots[:bucket].zero_()
        self._host_slots[:bucket] = 0
        self.bucket = 0
        self._variants.clear()

    def write_runs(self, writes: RowWrites) -> None:
        """Copy parsed row runs into the rows: one upload, then one copy per segment (joined whole rows are
        one segment)."""
        values = writes.values
        self._staging.host("runs")[: len(values)] = values
        cells = self._staging.upload("runs", len(values))
        at = 0
        for segment in writes.segments:
            end = segment.flat_start + segment.n_cells
            self._flat_rows[segment.flat_start : end].copy_(cells[at : at + segment.n_cells])
            at += segment.n_cells

    def write_sampler(self, slots: np.ndarray, f32: np.ndarray, i32: np.ndarray) -> torch.Tensor:
        """Sampler state of slots written whole: f32[k, 2] (temperature, top_p) and i32[k, 4]
        (top_k, seed_lo, seed_hi, last_token); the seed is the two uint32 halves, and last_token < 0
        keeps the loop-back value on the device. Returns the slots as uploaded: i32[k] on the device."""
        k = len(slots)
        self._samples[slots] = f32[:, 0] > 0
        self._variants.clear()
        staged = self._staging.host("sampler")
        staged[:k] = slots
        staged[k : 3 * k] = np.ascontiguousarray(f32, dtype=np.float32).reshape(-1).view(np.int32)
        staged[3 * k : 7 * k] = np.asarray(i32).reshape(-1)
        words = self._staging.upload("sampler", _SAMPLER_WORDS * k)
        if self._kernels is not None:
            self._kernels.scatter_sampler(words, k, self._sampler_state)
            return words[:k]
        index = words[:k].long()
        floats = words[k : 3 * k].view(torch.float32).view(k, SAMPLER_F32)
        ints = words[3 * k : 7 * k].view(k, SAMPLER_I32)
        self.temperature[index] = floats[:, 0]
        self.top_p[index] = floats[:, 1]
        self.top_k[index] = ints[:, 0]
        # hi sign-extended and shifted fits int64 exactly; lo masked to its 32 bits: the uint64 pattern.
        self.seed[index] = (ints[:, 2].long() << 32) | (ints[:, 1].long() & 0xFFFFFFFF)
        last = ints[:, 3].long()
        self.last_token[index] = torch.where(last >= 0, last, self.last_token[index])
        return words[:k]

    # --- the step's slots, read -------------------------------------------------------------------------

    def host_slots(self, bucket: int) -> np.ndarray:
        """The host copy of the bucket's slots (0 = padding): what the step reads, for the host's decisions."""
        return self._host_slots[:bucket]

    def variant(self, bucket: int) -> str:
        """The sampler variant of the bucket's step (`variant_of` its slots). Kept from step to step while the
        plans change neither slots nor sampling: a steady step reads nothing."""
        variant = self._variants.get(bucket)
        if variant is None:
            variant = self._variants[bucket] = self.variant_of(self._host_slots[:bucket])
        return variant

    def variant_of(self, slots: np.ndarray) -> str:
        """By the sampler state the plans wrote: CONTROLLED where one of `slots` has sampling controls or
        returns logprobs, else GREEDY where every one samples greedily (padding rows read the sink row, which
        does), else SAMPLED."""
        if self.controls.any_on(slots):
            return CONTROLLED
        return SAMPLED if self._samples[slots].any() else GREEDY

    def sampler_params(self, slots: torch.Tensor | slice) -> SamplerParams:
        """The sampler state of `slots` (an index tensor, or a slice to index with no host-to-device copy)."""
        return SamplerParams(self.temperature[slots], self.top_p[slots], self.top_k[slots], self.seed[slots])

    def gather(self, bucket: int) -> DecodeInputs:
        """The decode inputs of the bucket's rows, read by slot (padding rows read the sink row)."""
        slots = self.step_slots[:bucket]
        rows = self.rows.index_select(0, slots)  # rows: [B, C]
        kv_lens = rows[:, RowLayout.KV_LEN]
        positions = kv_lens.long() + rows[:, RowLayout.POS_OFFSET].long()
        return DecodeInputs(
            tokens=self.last_token.index_select(0, slots),
            positions=positions,
            kv_lens=kv_lens.contiguous(),
            block_tables=rows[:, RowLayout.BLOCK_TABLE :].contiguous(),
        )

    def state_slots(self, bucket: int) -> torch.Tensor:
        """i64[B]: the recurrent-state slot of each row of the bucket, read by slot (padding rows: the sink)."""
        rows = self.rows.index_select(0, self.step_slots[:bucket])
        return rows[:, RowLayout.STATE_SLOT].long()

    # --- the step's own writes (inside the graphs: no host work) ----------------------------------------

    def advance(self, bucket: int) -> None:
        """KV_LEN += 1 for each real row of the bucket; padding rows (slot 0) add nothing. (The Triton step
        uses kernels.slot_ops.advance, which this is the reference of.)"""
        slots = self.step_slots[:bucket]
        self.rows[:, RowLayout.KV_LEN].index_add_(0, slots, (slots != 0).to(torch.int32))

    def store_tokens(self, bucket: int, tokens: torch.Tensor) -> None:
        """Loop-back: last_token[slot] = token for each row; the sink's stays 0 (padding writes 0 there)."""
        slots = self.step_slots[:bucket]
        self.last_token[slots] = torch.where(slots != 0, tokens, 0)

    def store_prefill_tokens(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Loop-back of the tokens the prompts' last chunks sampled: last_token[slots[i]] = tokens[i] (both on
        the device, i64); the sink's stays 0 (a padded batch's samples write 0 there)."""
        self.last_token[slots] = torch.where(slots != 0, tokens, 0)

    # --- the row check (debug) --------------------------------------------------------------------------

    def mismatches(self, bucket: int, mirror: np.ndarray) -> int:
        """Cells of the bucket's real rows that differ from the planner's mirror (int32[B, C]); reads back."""
        slots = self.step_slots[:bucket]
        expected = torch.from_numpy(np.array(mirror, dtype=np.int32).reshape(bucket, self.layout.columns))
        differ = self.rows.index_select(0, slots) != expected.to(self.device)
        return int((differ & (slots != 0)[:, None]).sum())

    def row_check(self, bucket: int, mirror: np.ndarray) -> int:
        """The row check after a decode step: the planner's mirror holds the rows as the step read them, and
        the step has since advanced each real row's length by one. Waits for the step."""
        expected = np.array(mirror, dtype=np.int32).reshape(bucket, self.layout.columns)
        expected[self._host_slots[:bucket] != 0, RowLayout.KV_LEN] += 1
        return self.mismatches(bucket, expected)
