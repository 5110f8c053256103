"""The host mirror of every slot-store row, and the encoder that turns a step's changes into row deltas."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protos.layout import RowLayout
from protos.wire import I32


@dataclass(slots=True)
class RowDelta:
    """What one decode step writes into the device rows, packed for the wire (DESIGN §3)."""

    slots: bytes = b""  # int32[bucket]; empty = same rows as the previous decode step
    row_runs: bytes = b""  # int32 (slot, first_col, n_cells, cells...) runs


class RowMirror:
    """`rows: int32[S, C]` as the device holds it, kept by applying the same writes in the same order."""

    def __init__(self, layout: RowLayout):
        self.layout = layout
        self.rows = np.zeros((layout.slots, layout.columns), dtype=I32)  # rows: [slots, columns]
        self._last_slots: np.ndarray | None = None  # the previous decode step's slots
        self._last_real: np.ndarray = np.zeros(0, dtype=np.intp)  # its non-padding slots

    def reset(self) -> None:
        """The device lost its tables: forget the last rows so the next step sends its slots again."""
        self.rows[:] = 0
        self._last_slots = None

    def whole_row(
        self, kv_len: int, pages: list[int], pos_offset: int = 0, state_slot: int = 0
    ) -> np.ndarray:
        """The cells of a row written whole: narrow columns then the block table up to the pages it has."""
        if len(pages) > self.layout.block_span:
            raise ValueError(f"{len(pages)} pages exceed the block span of {self.layout.block_span}")
        row = np.empty(RowLayout.NARROW + len(pages), dtype=I32)
        row[RowLayout.KV_LEN] = kv_len
        row[RowLayout.POS_OFFSET] = pos_offset
        row[RowLayout.STATE_SLOT] = state_slot
        row[RowLayout.BLOCK_TABLE :] = pages
        return row

    def encode(self, slots: np.ndarray, whole: list[tuple[int, np.ndarray]]) -> RowDelta:
        """Apply a decode step's writes to the mirror and pack them.

        `slots`: int32[bucket], 0 for padding. `whole`: (slot, cells from column 0) rows written whole,
        each one run; a run that starts where the previous one ended in the flattened table joins it.
        """
        delta = RowDelta()
        last = self._last_slots
        if slots is not last and (last is None or not np.array_equal(slots, last)):
            delta.slots = slots.tobytes()
            self._last_slots = slots
            self._last_real = slots[slots != 0].astype(np.intp)
        if whole:
            delta.row_runs = self._pack_runs(whole)
        return delta

    def _pack_runs(self, whole: list[tuple[int, np.ndarray]]) -> bytes:
        columns = self.layout.columns
        parts: list[np.ndarray] = []
        run_start = run_end = -1  # flattened [start, end) of the run being built
        run_cells: list[np.ndarray] = []
        for slot, row in sorted(whole, key=lambda item: item[0]):
            self.rows[slot, : len(row)] = row
            start = slot * columns
            if start == run_end:  # joins the previous run
                run_cells.append(row)
                run_end = start + len(row)
                continue
            if run_cells:
                parts.append(self._run(run_start, run_cells))
            run_start, run_end, run_cells = start, start + len(row), [row]
        parts.append(self._run(run_start, run_cells))
        return np.concatenate(parts).tobytes()

    def _run(self, flat_start: int, rows: list[np.ndarray]) -> np.ndarray:
        slot, col = divmod(flat_start, self.layout.columns)
        n = sum(len(r) for r in rows)
        return np.concatenate([np.array([slot, col, n], dtype=I32), *rows])

    @property
    def last_slots(self) -> np.ndarray:
        """The slots of the last decode step encoded (padding included)."""
        assert self._last_slots is not None, "no decode step encoded yet"
        return self._last_slots

    def advance(self, steps: int = 1) -> None:
        """After the step's `steps` decode steps: the device added a token a step to every real row it read."""
        self.rows[self._last_real, RowLayout.KV_LEN] += steps

    def read(self, slots: np.ndarray) -> np.ndarray:
        """The rows a step reads, as the device must hold them (row check)."""
        return self.rows[slots]

    def kv_len(self, slot: int) -> int:
        return int(self.rows[slot, RowLayout.KV_LEN])
