"""Row runs, the wire form of a plan's row writes: `(slot, first_col, n_cells, cells...)...` packed int32,
parsed into the cells they write and the segments of the flattened rows they land in."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

RUN_HEADER = 3  # (slot, first_col, n_cells) before a run's cells


class Run(NamedTuple):
    slot: int
    first_col: int
    n_cells: int
    offset: int  # index of the run's first cell in the packed array


class Segment(NamedTuple):
    flat_start: int  # slot * C + first_col of its first run, in the flattened rows
    n_cells: int


class RunCells(NamedTuple):
    flat: np.ndarray  # int64[n]: each cell's place in the flattened rows (slot * C + col, runs continuing on)
    values: np.ndarray  # int32[n]: what it holds


class RowWrites(NamedTuple):
    """A plan's row runs, parsed: every cell's value in run order, and where they go as segments of the
    flattened rows (runs that continue one another joined), so each segment is one copy."""

    values: np.ndarray  # int32[n]
    segments: list[Segment]  # their lengths sum to n


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


def row_writes(runs: np.ndarray, columns: int) -> RowWrites:
    """Packed runs parsed into RowWrites, unchecked (check_plan checks a plan's; tests build their own)."""
    parsed = parse_runs(runs)
    return RowWrites(run_cells(runs, parsed, columns).values, join_runs(parsed, columns))
