"""The slot store: device-resident decode rows, per-slot sampler state and loop-back tokens (DESIGN §2)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from protos.layout import RowLayout

RUN_HEADER = 3  # (slot, first_col, n_cells) before a run's cells
CELL_TRIPLE = 3  # (slot, col, value)
SAMPLER_F32 = 2  # temperature, top_p
SAMPLER_I32 = 4  # top_k, seed_lo, seed_hi, last_token
_SAMPLER_WORDS = 1 + SAMPLER_F32 + SAMPLER_I32  # staged per slot: the slot, then its values


class Run(NamedTuple):
    slot: int
    first_col: int
    n_cells: int
    offset: int  # index of the run's first cell in the packed array


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
    sampler: SamplerParams


class Segment(NamedTuple):
    flat_start: int  # slot * C + first_col of its first run, in the flattened rows
    n_cells: int


def parse_runs(runs: np.ndarray) -> list[Run]:
    """Split packed runs `(slot, first_col, n_cells, cells...)...` into headers; ValueError if truncated."""
    parsed = []
    at, end = 0, len(runs)
    while at < end:
        if at + RUN_HEADER > end:
            raise ValueError(f"row_runs: a run header at int {at} is cut short ({end - at} ints left)")
        slot, first_col, n_cells = int(runs[at]), int(runs[at + 1]), int(runs[at + 2])
        if n_cells < 1:
            raise ValueError(f"row_runs: the run at int {at} has {n_cells} cells; a run has at least one")
        if at + RUN_HEADER + n_cells > end:
            raise ValueError(f"row_runs: the run at int {at} names {n_cells} cells but the bytes end first")
        parsed.append(Run(slot, first_col, n_cells, at + RUN_HEADER))
        at += RUN_HEADER + n_cells
    return parsed


class RunCells(NamedTuple):
    flat: np.ndarray  # int64[n]: each cell's place in the flattened rows (slot * C + col, runs continuing on)
    values: np.ndarray  # int32[n]: what it holds


def run_cells(runs: np.ndarray, parsed: list[Run], columns: int) -> RunCells:
    """Every cell of the parsed runs at once, in run order: a few numpy passes, whatever the number of runs
    (a plan of new rows has one run each)."""
    count = len(parsed)
    starts = np.fromiter((run.slot * columns + run.first_col for run in parsed), np.int64, count)
    offsets = np.fromiter((run.offset for run in parsed), np.int64, count)
    lengths = np.fromiter((run.n_cells for run in parsed), np.int64, count)
    # within[i]: cell i's index inside its own run
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return RunCells(np.repeat(starts, lengths) + within, runs[np.repeat(offsets, lengths) + within])


def join_runs(parsed: list[Run], columns: int) -> list[Segment]:
    """Runs in order, each joined to the one before when it starts where that one ended (row-major)."""
    segments: list[Segment] = []
    for run in parsed:
        flat_start = run.slot * columns + run.first_col
        if segments and segments[-1].flat_start + segments[-1].n_cells == flat_start:
            segments[-1] = Segment(segments[-1].flat_start, segments[-1].n_cells + run.n_cells)
        else:
            segments.append(Segment(flat_start, run.n_cells))
    return segments


def last_writes(flat: np.ndarray) -> np.ndarray:
    """Indices into `flat` (flattened cell positions) of the last write to each cell."""
    # np.unique keeps the first occurrence, so look from the end to keep the last.
    _, last_from_end = np.unique(flat[::-1], return_index=True)
    return len(flat) - 1 - last_from_end


class _Staging:
    """One int32 host buffer (pinned on CUDA) cut into named regions, with a device twin on CUDA.

    A region is refilled only once its last upload has finished (an event per region), so a plan that
    reads nothing back cannot have its bytes overwritten by the next one mid-copy. On the CPU the host
    buffer is the device buffer and nothing is copied.
    """

    def __init__(self, regions: dict[str, int], device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        total = sum(regions.values())
        self._host = torch.zeros(total, dtype=torch.int32, pin_memory=self._cuda)
        self._twin = torch.zeros(total, dtype=torch.int32, device=device) if self._cuda else self._host
        self._host_np = self._host.numpy()
        self._bounds: dict[str, tuple[int, int]] = {}
        self._uploaded: dict[str, torch.cuda.Event] = {}
        # Uploads run on the step thread's stream, the device's default one; named in each record, since
        # finding the current stream costs a record ~20 µs of Python.
        self._stream = torch.cuda.default_stream(device) if self._cuda else None
        start = 0
        for name, words in regions.items():
            self._bounds[name] = (start, words)
            if self._cuda:
                self._uploaded[name] = torch.cuda.Event()
            start += words

    def capacity(self, region: str) -> int:
        return self._bounds[region][1]

    def host(self, region: str) -> np.ndarray:
        """The region's host words, free to fill (waits only for this region's previous upload)."""
        start, words = self._bounds[region]
        if self._cuda:
            self._uploaded[region].synchronize()
        return self._host_np[start : start + words]

    def device(self, region: str) -> torch.Tensor:
        """The whole region on the device (the host buffer itself on the CPU), at a fixed address."""
        start, words = self._bounds[region]
        return self._twin[start : start + words]

    def upload(self, region: str, words: int) -> torch.Tensor:
        """The first `words` of the region on the device (one non-blocking copy on CUDA)."""
        start, capacity = self._bounds[region]
        if words > capacity:
            raise ValueError(f"{words} ints do not fit the {region} staging of {capacity}")
        if not self._cuda:
            return self._host[start : start + words]
        staged = self._twin[start : start + words]
        staged.copy_(self._host[start : start + words], non_blocking=True)
        self._uploaded[region].record(self._stream)
        return staged


class SlotStore:
    """`rows: int32[S, C]` on the device and per-slot sampler state; row 0 is the sink row, zero forever.

    Every method is tensor work on the device: nothing is read back (but `mismatches`, a debug check)
    and nothing grows after construction.
    """

    def __init__(self, layout: RowLayout, device: torch.device) -> None:
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
        # The largest flush: B whole rows as runs, as many cells as triples, every slot's sampler state.
        self._staging = _Staging(
            {
                "slots": widest,
                "runs": widest * columns,
                "cells": 2 * widest * columns,
                "cell_triples": 1 + CELL_TRIPLE * widest * columns,  # count, then as many triples as "cells"
                "sampler": _SAMPLER_WORDS * (slots - 1),
            },
            device,
        )
        self._flat_rows = self.rows.view(-1)
        self._scatter_sampler = None
        if device.type == "cuda":  # one Triton launch per sampler write; compiled here, not in a step
            from executor_svc.kernels.tables import SamplerState, scatter_sampler

            state = SamplerState(self.temperature, self.top_p, self.top_k, self.seed, self.last_token)
            self._sampler_state = state
            self._scatter_sampler = scatter_sampler
            scatter_sampler(self._staging.device("sampler"), 0, self._sampler_state)

    @property
    def max_run_cells(self) -> int:
        return self._staging.capacity("runs")

    @property
    def max_cells(self) -> int:
        return self._staging.capacity("cells") // 2

    def set_slots(self, slots: np.ndarray) -> None:
        """The slot of each row of the next decode buckets (0 for padding rows)."""
        staged = self._staging.host("slots")
        staged[: len(slots)] = slots
        self.step_slots[: len(slots)].copy_(self._staging.upload("slots", len(slots)))

    def write_runs(self, runs: np.ndarray) -> None:
        """Copy packed runs into the rows. A run covers n_cells of the flattened rows from (slot, first_col),
        so joined whole rows are one run; runs that continue one another are one copy."""
        parsed = parse_runs(runs)
        if not parsed:
            return
        values = run_cells(runs, parsed, self.layout.columns).values
        filled = len(values)
        self._staging.host("runs")[:filled] = values
        cells = self._staging.upload("runs", filled)
        at = 0
        for segment in join_runs(parsed, self.layout.columns):
            end = segment.flat_start + segment.n_cells
            self._flat_rows[segment.flat_start : end].copy_(cells[at : at + segment.n_cells])
            at += segment.n_cells

    def write_cells(self, triples: np.ndarray) -> None:
        """Packed `(slot, col, value)` triples; where a cell repeats, the last triple wins."""
        if len(triples) == 0:
            return
        triples = triples.reshape(-1, CELL_TRIPLE)
        flat = triples[:, 0].astype(np.int64) * self.layout.columns + triples[:, 1]
        chosen = last_writes(flat)
        n = len(chosen)
        staged = self._staging.host("cells")
        staged[:n] = flat[chosen]
        staged[n : 2 * n] = triples[chosen, 2]
        cells = self._staging.upload("cells", 2 * n)
        self._flat_rows[cells[:n].long()] = cells[n:]

    def stage_cells(self, triples: np.ndarray) -> None:
        """Stage packed `(slot, col, value)` triples for the scatter that opens a decode graph: the count, then
        the triples (the last of repeats kept), in one upload; nothing staged leaves the count as the step
        left it (zero)."""
        if len(triples) == 0:
            return
        triples = triples.reshape(-1, CELL_TRIPLE)
        chosen = last_writes(triples[:, 0].astype(np.int64) * self.layout.columns + triples[:, 1])
        n = len(chosen)
        staged = self._staging.host("cell_triples")
        staged[0] = n
        staged[1 : 1 + CELL_TRIPLE * n] = triples[chosen].reshape(-1)
        self._staging.upload("cell_triples", 1 + CELL_TRIPLE * n)

    def staged_cells(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What `stage_cells` fills, at fixed device addresses: triples int32[capacity, 3] and count int32[1]."""
        region = self._staging.device("cell_triples")
        return region[1:].view(-1, CELL_TRIPLE), region[:1]

    def write_sampler(self, slots: np.ndarray, f32: np.ndarray, i32: np.ndarray) -> None:
        """Sampler state of slots written whole: f32[k, 2] (temperature, top_p) and i32[k, 4]
        (top_k, seed_lo, seed_hi, last_token); the seed is the two uint32 halves, and last_token < 0
        keeps the loop-back value on the device."""
        k = len(slots)
        if k == 0:
            return
        staged = self._staging.host("sampler")
        staged[:k] = slots
        staged[k : 3 * k] = np.ascontiguousarray(f32, dtype=np.float32).reshape(-1).view(np.int32)
        staged[3 * k : 7 * k] = np.asarray(i32).reshape(-1)
        words = self._staging.upload("sampler", _SAMPLER_WORDS * k)
        if self._scatter_sampler is not None:
            self._scatter_sampler(words, k, self._sampler_state)
            return
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
            sampler=self.sampler_params(slots),
        )

    def advance(self, bucket: int) -> None:
        """KV_LEN += 1 for each real row of the bucket; padding rows (slot 0) add nothing."""
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

    def mismatches(self, bucket: int, mirror: np.ndarray) -> int:
        """Cells of the bucket's real rows that differ from the planner's mirror (int32[B, C]); reads back."""
        slots = self.step_slots[:bucket]
        expected = torch.from_numpy(np.array(mirror, dtype=np.int32).reshape(bucket, self.layout.columns))
        differ = self.rows.index_select(0, slots) != expected.to(self.device)
        return int((differ & (slots != 0)[:, None]).sum())
