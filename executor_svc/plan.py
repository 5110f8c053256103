"""Decoding and checking a StepPlan against what this executor holds, before anything is written."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from executor_svc.tables import CELL_TRIPLE, SAMPLER_F32, SAMPLER_I32, parse_runs, run_cells
from protos import executor_pb2
from protos.layout import RowLayout
from protos.wire import unpack_f32, unpack_i32


class PlanError(ValueError):
    """A malformed plan; the message says what is wrong, and nothing was changed."""


@dataclass(frozen=True, slots=True)
class PlanLimits:
    """What a plan may name on this executor."""

    layout: RowLayout
    buckets: tuple[int, ...]
    vocab_size: int
    max_seq_len: int
    page_size: int
    pool_pages: int
    max_run_cells: int
    max_cells: int


@dataclass(frozen=True, slots=True)
class PrefillWork:
    token_ids: np.ndarray  # int32[n]
    start: int
    pages: np.ndarray  # int32[p]
    sample_slot: int


@dataclass(frozen=True, slots=True)
class CheckedPlan:
    """A plan's arrays, decoded and checked against the limits."""

    bucket: int
    slots: np.ndarray | None  # int32[bucket]; None = the rows of the previous decode step
    runs: np.ndarray  # packed runs
    cells: np.ndarray  # packed triples
    sampler_slots: np.ndarray  # int32[k]
    sampler_f32: np.ndarray  # float32[k, 2]
    sampler_i32: np.ndarray  # int32[k, 4]
    prefill: list[PrefillWork]
    mirror: np.ndarray | None  # int32[bucket, C]


def _ints(data: bytes, field: str) -> np.ndarray:
    if len(data) % 4:
        raise PlanError(f"{field}: {len(data)} bytes is not a whole number of int32")
    return unpack_i32(data)


def _check_slots(slots: np.ndarray, low: int, limits: PlanLimits, field: str) -> None:
    bad = (slots < low) | (slots >= limits.layout.slots)
    if bad.any():
        raise PlanError(f"{field}: slot {int(slots[bad][0])} is outside [{low}, {limits.layout.slots})")


def _check_distinct(slots: np.ndarray, field: str) -> None:
    unique, counts = np.unique(slots, return_counts=True)
    if (counts > 1).any():
        raise PlanError(f"{field}: slot {int(unique[counts > 1][0])} appears more than once")


def _check_cell_values(columns: np.ndarray, values: np.ndarray, limits: PlanLimits, field: str) -> None:
    """Values the forward uses as indices must be in range: a wrong one would fault on the device."""
    checks = (
        (columns == RowLayout.KV_LEN, 0, limits.max_seq_len + 1, "KV_LEN"),
        (columns == RowLayout.POS_OFFSET, 0, limits.max_seq_len + 1, "POS_OFFSET"),
        (columns >= RowLayout.BLOCK_TABLE, 0, limits.pool_pages, "a block-table page"),
    )
    for where, low, high, name in checks:
        bad = where & ((values < low) | (values >= high))
        if bad.any():
            raise PlanError(f"{field}: {name} value {int(values[bad][0])} is outside [{low}, {high})")


def _check_runs(runs: np.ndarray, limits: PlanLimits) -> None:
    columns, slots = limits.layout.columns, limits.layout.slots
    try:
        parsed = parse_runs(runs)
    except ValueError as err:
        raise PlanError(str(err)) from None
    total = 0
    for run in parsed:
        if not 1 <= run.slot < slots:
            raise PlanError(f"row_runs: slot {run.slot} is outside [1, {slots})")
        if not 0 <= run.first_col < columns:
            raise PlanError(f"row_runs: column {run.first_col} is outside [0, {columns})")
        # A run may continue into the rows after its slot (joined whole rows), never past the last row.
        if run.slot * columns + run.first_col + run.n_cells > slots * columns:
            raise PlanError(
                f"row_runs: the run at slot {run.slot} column {run.first_col} of {run.n_cells} "
                f"cells runs past the last row"
            )
        total += run.n_cells
    if total > limits.max_run_cells:
        raise PlanError(f"row_runs: {total} cells, more than the {limits.max_run_cells} a step can write")
    if parsed:
        cells = run_cells(runs, parsed, columns)
        _check_cell_values(cells.flat % columns, cells.values, limits, "row_runs")


def _check_cells(triples: np.ndarray, limits: PlanLimits) -> None:
    if len(triples) % CELL_TRIPLE:
        raise PlanError(f"cells: {len(triples)} ints is not a whole number of (slot, col, value) triples")
    if not len(triples):  # a steady step's: no numpy passes over nothing
        return
    triples = triples.reshape(-1, CELL_TRIPLE)
    if len(triples) > limits.max_cells:
        raise PlanError(f"cells: {len(triples)} triples, more than the {limits.max_cells} a step can write")
    _check_slots(triples[:, 0], 1, limits, "cells")
    bad = (triples[:, 1] < 0) | (triples[:, 1] >= limits.layout.columns)
    if bad.any():
        raise PlanError(f"cells: column {int(triples[bad, 1][0])} is outside [0, {limits.layout.columns})")
    _check_cell_values(triples[:, 1], triples[:, 2], limits, "cells")


def _check_sampler(
    plan: executor_pb2.StepPlan, limits: PlanLimits
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    slots = _ints(plan.sampler_slots, "sampler_slots")
    k = len(slots)
    if len(plan.sampler_f32) != 4 * SAMPLER_F32 * k or len(plan.sampler_i32) != 4 * SAMPLER_I32 * k:
        raise PlanError(
            f"sampler: {k} slots need {4 * SAMPLER_F32 * k} bytes of sampler_f32 and "
            f"{4 * SAMPLER_I32 * k} of sampler_i32, got {len(plan.sampler_f32)} and {len(plan.sampler_i32)}"
        )
    floats = unpack_f32(plan.sampler_f32).reshape(k, SAMPLER_F32)
    ints = unpack_i32(plan.sampler_i32).reshape(k, SAMPLER_I32)
    if k == 0:  # a steady step's: no numpy passes over nothing
        return slots, floats, ints
    _check_slots(slots, 1, limits, "sampler_slots")
    _check_distinct(slots, "sampler_slots")
    temperature, top_p = floats[:, 0], floats[:, 1]
    if not (np.isfinite(temperature) & (temperature >= 0)).all():
        raise PlanError(f"sampler_f32: temperature must be finite and >= 0, got {temperature.tolist()}")
    if not (np.isfinite(top_p) & (top_p > 0) & (top_p <= 1)).all():
        raise PlanError(f"sampler_f32: top_p must be in (0, 1], got {top_p.tolist()}")
    if (ints[:, 0] < 0).any():
        raise PlanError(f"sampler_i32: top_k must be >= 0 (0 = off), got {ints[:, 0].tolist()}")
    if (ints[:, 3] >= limits.vocab_size).any():
        raise PlanError(
            f"sampler_i32: last_token {int(ints[:, 3].max())} is outside the vocabulary ({limits.vocab_size})"
        )
    return slots, floats, ints


def _check_prefill(chunk: executor_pb2.PrefillChunk, index: int, limits: PlanLimits) -> PrefillWork:
    field = f"prefill[{index}]"
    ids = _ints(chunk.token_ids, f"{field}.token_ids")
    pages = _ints(chunk.pages, f"{field}.pages")
    if len(ids) == 0:
        raise PlanError(f"{field}: no token ids")
    if ((ids < 0) | (ids >= limits.vocab_size)).any():
        raise PlanError(
            f"{field}: token id {int(ids[(ids < 0) | (ids >= limits.vocab_size)][0])} is outside "
            f"the vocabulary ({limits.vocab_size})"
        )
    end = chunk.start + len(ids)
    if chunk.start < 0 or end > limits.max_seq_len:
        raise PlanError(f"{field}: positions [{chunk.start}, {end}) are outside [0, {limits.max_seq_len})")
    needed = -(-end // limits.page_size)
    if len(pages) < needed:
        raise PlanError(
            f"{field}: positions [0, {end}) need {needed} pages of {limits.page_size}, got {len(pages)}"
        )
    if ((pages < 1) | (pages >= limits.pool_pages)).any():
        raise PlanError(
            f"{field}: page {int(pages[(pages < 1) | (pages >= limits.pool_pages)][0])} is outside "
            f"[1, {limits.pool_pages}) (page 0 is the sink page)"
        )
    if not 0 <= chunk.sample_slot < limits.layout.slots:
        raise PlanError(f"{field}: sample_slot {chunk.sample_slot} is outside [0, {limits.layout.slots})")
    return PrefillWork(ids, chunk.start, pages, chunk.sample_slot)


_NO_INTS = np.zeros(0, dtype=np.int32)
_NO_SAMPLER_F32 = np.zeros((0, SAMPLER_F32), dtype=np.float32)
_NO_SAMPLER_I32 = np.zeros((0, SAMPLER_I32), dtype=np.int32)
_STEADY_FIELDS = frozenset({"seq", "bucket"})  # all that a steady step's plan sets


def check_plan(plan: executor_pb2.StepPlan, limits: PlanLimits, decode_bucket: int) -> CheckedPlan:
    """Decode and check every field of `plan` before anything is written; PlanError says what is wrong.

    `decode_bucket` is the bucket whose slots the store holds (0 before the first decode step).
    """
    bucket = plan.bucket
    if bucket != 0 and bucket not in limits.buckets:
        raise PlanError(f"bucket {bucket} is not one of the buckets {list(limits.buckets)} (or 0)")
    # The steady step, most steps: no arrays to decode or check.
    if bucket == decode_bucket and all(field.name in _STEADY_FIELDS for field, _ in plan.ListFields()):
        return CheckedPlan(
            bucket, None, _NO_INTS, _NO_INTS, _NO_INTS, _NO_SAMPLER_F32, _NO_SAMPLER_I32, [], None
        )
    slots = None
    if plan.slots:
        slots = _ints(plan.slots, "slots")
        if len(slots) != bucket:
            raise PlanError(f"slots: {len(slots)} slots for bucket {bucket}")
        _check_slots(slots, 0, limits, "slots")
        _check_distinct(slots[slots != 0], "slots")
    elif bucket and bucket != decode_bucket:
        held = f"bucket {decode_bucket}" if decode_bucket else "no decode step yet"
        raise PlanError(
            f"slots: empty (the previous decode step's rows) but bucket {bucket} differs from "
            f"the rows held ({held})"
        )
    runs = _ints(plan.row_runs, "row_runs")
    _check_runs(runs, limits)
    cells = _ints(plan.cells, "cells")
    _check_cells(cells, limits)
    sampler_slots, sampler_f32, sampler_i32 = _check_sampler(plan, limits)
    prefill = [_check_prefill(chunk, index, limits) for index, chunk in enumerate(plan.prefill)]
    # The planner samples at most the widest bucket's prompts in a step (and the decode rows): the read-back
    # buffers are sized for that.
    sampling = sum(1 for chunk in prefill if chunk.sample_slot)
    if sampling > limits.layout.widest_bucket:
        raise PlanError(
            f"prefill: {sampling} chunks sample, more than the widest bucket ({limits.layout.widest_bucket})"
        )
    mirror = None
    if plan.mirror:
        columns = limits.layout.columns
        if len(plan.mirror) != 4 * bucket * columns:
            raise PlanError(
                f"mirror: {len(plan.mirror)} bytes, expected {4 * bucket * columns} "
                f"(bucket {bucket} x {columns} columns of int32)"
            )
        mirror = unpack_i32(plan.mirror).reshape(bucket, columns)
    return CheckedPlan(bucket, slots, runs, cells, sampler_slots, sampler_f32, sampler_i32, prefill, mirror)
