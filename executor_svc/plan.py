"""A StepPlan off the wire, parsed and checked once against what this executor holds, before anything is
written: the CheckedPlan that the slot store, the prefill and the attention backends read as it is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from executor_svc.control_writes import ControlError, ControlWrites, check_controls
from executor_svc.row_runs import RowWrites, join_runs, parse_runs, run_cells
from protos import executor_pb2
from protos.layout import MAX_DECODE_STEPS, RowLayout
from protos.wire import unpack_f32, unpack_i32

SAMPLER_F32 = 2  # temperature, top_p
SAMPLER_I32 = 4  # top_k, seed_lo, seed_hi, last_token


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
    state_slots: int = 0  # the recurrent-state pool's slots, the sink included (0: no recurrent layers)


class PrefillWork(NamedTuple):
    """One prefill chunk, in the (ids, start, pages) form PrefillBatch.build takes."""

    token_ids: np.ndarray  # int32[n]
    start: int
    pages: np.ndarray  # int32[p]: the sequence's pages covering [0, start + n)


@dataclass(frozen=True, slots=True)
class CheckedPlan:
    """A plan's arrays, decoded and checked against the limits."""

    bucket: int
    slots: np.ndarray | None  # int32[bucket]; None = the rows of the previous decode step
    rows: RowWrites  # the row runs, parsed
    sampler_slots: np.ndarray  # int32[k]
    sampler_f32: np.ndarray  # float32[k, 2]
    sampler_i32: np.ndarray  # int32[k, 4]
    prefill: list[PrefillWork]
    sample_slots: list[int]  # per prefill chunk: the slot it samples into, 0 where it does not
    state_slots: list[
        int
    ]  # per prefill chunk: its recurrent-state slot (0 for a model without recurrent layers)
    mirror: np.ndarray | None  # int32[bucket, C]
    controls: ControlWrites | None = None  # sampling controls of some of sampler_slots
    state_copies: np.ndarray | None = None  # int32[k, 2]: (source, destination) state slots, copied first
    steps: int = 1  # decode steps over the same rows (more than one: a steady plan)


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
        # A decode row's token goes to position KV_LEN + POS_OFFSET: each must leave room for it. (Their sum,
        # and lengths that steady steps grow on the device, the gathers clamp: no row indexes past a table.)
        (columns == RowLayout.KV_LEN, 0, limits.max_seq_len, "KV_LEN"),
        (columns == RowLayout.POS_OFFSET, 0, limits.max_seq_len, "POS_OFFSET"),
        (columns == RowLayout.STATE_SLOT, 0, max(limits.state_slots, 1), "STATE_SLOT"),
        (columns >= RowLayout.BLOCK_TABLE, 0, limits.pool_pages, "a block-table page"),
    )
    for where, low, high, name in checks:
        bad = where & ((values < low) | (values >= high))
        if bad.any():
            raise PlanError(f"{field}: {name} value {int(values[bad][0])} is outside [{low}, {high})")


def _check_runs(runs: np.ndarray, limits: PlanLimits) -> RowWrites:
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
    if not parsed:
        return NO_ROW_WRITES
    cells = run_cells(runs, parsed, columns)
    _check_cell_values(cells.flat % columns, cells.values, limits, "row_runs")
    return RowWrites(cells.values, join_runs(parsed, columns))


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


def _check_prefill_size(plan: executor_pb2.StepPlan, limits: PlanLimits) -> None:
    """A step's prompt chunks: at most the widest bucket's prompts end in it, and one more is cut by the token
    budget; a model with recurrent layers also cuts a prompt where its state is copied (a root or pin mark),
    one chunk per sequence holding a state slot. Their tokens: no more than the pool's pages hold. Checked
    before any chunk is read: the eager prefill would run whatever came, memory and all."""
    most = max(limits.layout.widest_bucket + 1, limits.state_slots - 1)
    if len(plan.prefill) > most:
        raise PlanError(f"prefill: {len(plan.prefill)} chunks, more than a step can hold ({most})")
    tokens = sum(len(chunk.token_ids) for chunk in plan.prefill) // 4
    room = limits.pool_pages * limits.page_size
    if tokens > room:
        raise PlanError(f"prefill: {tokens} tokens, more than the KV pool holds ({room})")


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
    if limits.state_slots and not 1 <= chunk.state_slot < limits.state_slots:
        raise PlanError(
            f"{field}: state_slot {chunk.state_slot} is outside [1, {limits.state_slots}) "
            f"(the model has recurrent layers; slot 0 is the sink slot)"
        )
    if not limits.state_slots and chunk.state_slot:
        raise PlanError(f"{field}: state_slot {chunk.state_slot} for a model without recurrent layers")
    return PrefillWork(ids, chunk.start, pages)


def _check_state_copies(data: bytes, limits: PlanLimits) -> np.ndarray:
    """(source, destination) pairs of state slots in [1, state_slots), each destination written once."""
    flat = _ints(data, "state_copies")
    if not limits.state_slots:
        raise PlanError("state_copies: the model has no recurrent layers")
    if len(flat) % 2:
        raise PlanError(
            f"state_copies: {len(flat)} int32 is not a whole number of (source, destination) pairs"
        )
    pairs = flat.reshape(-1, 2)
    if ((pairs < 1) | (pairs >= limits.state_slots)).any():
        bad = int(pairs[(pairs < 1) | (pairs >= limits.state_slots)][0])
        raise PlanError(
            f"state_copies: state slot {bad} is outside [1, {limits.state_slots}) (0 is the sink)"
        )
    if len(np.unique(pairs[:, 1])) != len(pairs) or np.isin(pairs[:, 0], pairs[:, 1]).any():
        raise PlanError("state_copies: a destination slot is written twice, or is also a source")
    return pairs


_NO_INTS = np.zeros(0, dtype=np.int32)
NO_ROW_WRITES = RowWrites(_NO_INTS, [])
_NO_SAMPLER_F32 = np.zeros((0, SAMPLER_F32), dtype=np.float32)
_NO_SAMPLER_I32 = np.zeros((0, SAMPLER_I32), dtype=np.int32)
_STEADY_FIELDS = frozenset({"seq", "bucket", "steps"})  # all that a steady step's plan sets
_STEADY: dict[tuple[int, int], CheckedPlan] = {}  # (bucket, steps) -> its plan: nothing to write or build


def _steady(bucket: int, steps: int) -> CheckedPlan:
    """The plan of `steps` decode steps over the rows held, writing nothing."""
    plan = _STEADY.get((bucket, steps))
    if plan is None:
        plan = _STEADY[(bucket, steps)] = CheckedPlan(
            bucket,
            None,
            NO_ROW_WRITES,
            _NO_INTS,
            _NO_SAMPLER_F32,
            _NO_SAMPLER_I32,
            [],
            [],
            [],
            None,
            steps=steps,
        )
    return plan


def check_plan(plan: executor_pb2.StepPlan, limits: PlanLimits, decode_bucket: int) -> CheckedPlan:
    """Decode and check every field of `plan` before anything is written; PlanError says what is wrong.

    `decode_bucket` is the bucket whose slots the store holds (0 before the first decode step).
    """
    bucket = plan.bucket
    if bucket != 0 and bucket not in limits.buckets:
        raise PlanError(f"bucket {bucket} is not one of the buckets {list(limits.buckets)} (or 0)")
    steps = max(plan.steps, 1)
    if steps > MAX_DECODE_STEPS:
        raise PlanError(f"steps: {plan.steps}, more than {MAX_DECODE_STEPS}")
    # The steady step, most steps: no arrays to decode or check.
    steady = bucket == decode_bucket and all(field.name in _STEADY_FIELDS for field, _ in plan.ListFields())
    if steps > 1 and not (steady and bucket):
        raise PlanError(
            f"steps: {steps} for a plan that is not a steady decode step (more than one step takes the rows "
            f"held, {decode_bucket or 'none'}, with nothing but seq, bucket and steps set)"
        )
    if steady:
        return _steady(bucket, steps)
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
    rows = _check_runs(_ints(plan.row_runs, "row_runs"), limits)
    sampler_slots, sampler_f32, sampler_i32 = _check_sampler(plan, limits)
    try:
        controls = check_controls(plan, sampler_slots, limits.vocab_size)
    except ControlError as error:
        raise PlanError(str(error)) from None
    _check_prefill_size(plan, limits)
    prefill = [_check_prefill(chunk, index, limits) for index, chunk in enumerate(plan.prefill)]
    # The planner samples at most the widest bucket's prompts in a step (and the decode rows): the read-back
    # buffers are sized for that.
    sample_slots = [chunk.sample_slot for chunk in plan.prefill]
    sampling = sum(1 for slot in sample_slots if slot)
    if sampling > limits.layout.widest_bucket:
        raise PlanError(
            f"prefill: {sampling} chunks sample, more than the widest bucket ({limits.layout.widest_bucket})"
        )
    # One token a slot: two chunks sampling into one would leave the loop-back holding only one of them.
    _check_distinct(np.array([slot for slot in sample_slots if slot], dtype=np.int32), "prefill sample_slot")
    state_slots = [chunk.state_slot for chunk in plan.prefill]
    state_copies = _check_state_copies(plan.state_copies, limits) if plan.state_copies else None
    mirror = None
    if plan.mirror:
        columns = limits.layout.columns
        if len(plan.mirror) != 4 * bucket * columns:
            raise PlanError(
                f"mirror: {len(plan.mirror)} bytes, expected {4 * bucket * columns} "
                f"(bucket {bucket} x {columns} columns of int32)"
            )
        mirror = unpack_i32(plan.mirror).reshape(bucket, columns)
    return CheckedPlan(
        bucket,
        slots,
        rows,
        sampler_slots,
        sampler_f32,
        sampler_i32,
        prefill,
        sample_slots,
        state_slots,
        mirror,
        controls,
        state_copies,
    )
