"""The column layout of a slot-store row, shared by the planner's mirror and the executor's table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

MAX_DECODE_STEPS = 16  # decode steps one plan may run (StepPlan.steps); the executor's read-backs hold them


@dataclass(frozen=True, slots=True)
class RowLayout:
    """`rows: int32[slots, columns]`: narrow columns, then one block-table span (one KV pool).

    Row 0 is the sink row: all zero forever (page 0 is the sink page, length 0, state slot 0).
    """

    slots: int
    block_span: int

    KV_LEN: ClassVar[int] = 0  # tokens stored in the KV pool for this row
    POS_OFFSET: ClassVar[int] = 1  # position = KV_LEN + POS_OFFSET
    STATE_SLOT: ClassVar[int] = 2  # recurrent-state slot (0 = the sink slot)
    BLOCK_TABLE: ClassVar[int] = 3  # first block-table cell
    NARROW: ClassVar[int] = 3

    def __post_init__(self) -> None:
        if self.slots < 3 or self.slots % 2 == 0:
            raise ValueError(f"slots must be 2*B+1 with B >= 1, got {self.slots}")
        if self.block_span < 1:
            raise ValueError(f"block_span must be >= 1, got {self.block_span}")

    @property
    def columns(self) -> int:
        return self.NARROW + self.block_span

    @property
    def widest_bucket(self) -> int:
        return (self.slots - 1) // 2

    @classmethod
    def build(cls, buckets: list[int], max_seq_len: int, page_size: int, pool_pages: int) -> RowLayout:
        """S = 2*B + 1 for the widest bucket B; W = min(ceil(max_seq_len / page_size), pool_pages)."""
        span = min(-(-max_seq_len // page_size), pool_pages)
        return cls(slots=2 * max(buckets) + 1, block_span=span)
