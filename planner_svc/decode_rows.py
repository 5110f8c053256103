"""The rows of a decode step, chosen and put in slot order in numpy passes over the requests (pure): which
decoding requests still have a token to make, the least recently run first when they exceed the room, their
order by slot, and how many steps can repeat the step unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress

import numpy as np

from planner_svc.requests import Request
from planner_svc.sampler_state import has_controls
from protos.layout import RowLayout


def stored_lengths(requests: Sequence[Request], slots: Sequence[int | None], rows: np.ndarray) -> np.ndarray:
    """int64[n]: each request's stored length, the mirror's (`rows`, int32[S, C]) where it holds a slot
    (`slots`, row for row) and its row is not stale, else its own `kv_len`."""
    held = np.array([0 if r.stale or s is None else s for r, s in zip(requests, slots)], dtype=np.intp)
    lens = rows[held, RowLayout.KV_LEN].astype(np.int64)  # slot 0, the sink, is never held: their own
    for index in np.flatnonzero(held == 0).tolist():
        lens[index] = requests[index].kv_len
    return lens


def ready_rows(
    candidates: Sequence[Request], lens: np.ndarray, room: int
) -> tuple[list[Request], np.ndarray, bool]:
    """The candidates whose stored length (`lens`) is below their end, and those ends (int64); when more than
    `room`, the `room` least recently run (by last_seq, ties in candidate order). The bool: some were left."""
    ends = np.fromiter((r.end_len for r in candidates), dtype=np.int64, count=len(candidates))
    below = lens < ends
    ready = list(compress(candidates, below.tolist()))
    ends = ends[below]
    if len(ready) <= room:
        return ready, ends, False
    order = sorted(range(len(ready)), key=lambda i: ready[i].last_seq)[:room]
    return [ready[i] for i in order], ends[order], True


def in_slot_order(
    ready: Sequence[Request], slots: Sequence[int | None], ends: np.ndarray
) -> tuple[list[Request], np.ndarray, np.ndarray]:
    """The rows sorted by their slots (each holds one, distinct), with their slots (int32) and ends in the same
    order."""
    held = np.asarray(slots, dtype=np.int32)
    order = np.argsort(held, kind="stable")
    return [ready[i] for i in order.tolist()], held[order], ends[order]


def repeats_left(ends: np.ndarray, rows: np.ndarray, slots: np.ndarray) -> int:
    """How many next steps can repeat a decode step over `slots` (int32[bucket], its rows first, then padding;
    `ends` theirs): none may read a row past its end. `rows`: the mirror, int32[S, C], as that step left it."""
    lens = rows[slots[: len(ends)], RowLayout.KV_LEN].astype(np.int64)
    return int((ends - lens).min())


def steps_per_repeat(rows: Sequence[Request], steps: int) -> int:
    """Decode steps a repeat of a steady step over `rows` runs in one plan: `steps`, but one where a row has
    sampling controls (the executor runs those one a plan)."""
    if steps == 1 or any(has_controls(request) for request in rows):
        return 1
    return steps
