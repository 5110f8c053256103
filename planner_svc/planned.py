"""What the scheduler plans for one executor group: a step as the executor receives it (with who each row and
chunk belongs to), and the group's shape as its executor describes it."""

from __future__ import annotations

from dataclasses import dataclass, field

from planner_svc.config import SchedulingConfig
from planner_svc.requests import Request
from planner_svc.rows import RowDelta
from planner_svc.sampler_state import SamplerWrites


class CapacityError(Exception):
    """The request can never be served by this pool (RESOURCE_EXHAUSTED)."""


@dataclass(slots=True)
class PrefillChunk:
    request: Request
    start: int
    token_ids: bytes  # int32 packed
    pages: bytes  # int32 packed: the pages covering [0, start + n)
    sample_slot: int  # 0 unless this chunk ends the prompt
    state_slot: int = 0  # the request's recurrent-state slot (0 for a model without recurrent layers)


@dataclass(slots=True)
class PlannedStep:
    """One step as the executor receives it, plus who each row belongs to."""

    seq: int
    bucket: int = 0
    rows: list[Request] = field(default_factory=list)  # the real decode rows, in slot order of the bucket
    delta: RowDelta = field(default_factory=RowDelta)
    sampler: SamplerWrites | None = None
    prefill: list[PrefillChunk] = field(default_factory=list)
    mirror: bytes = b""  # row check: the rows read, as the planner holds them
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) state slots


@dataclass(slots=True)
class SchedulerConfig:
    """One executor group's shape, as its executor describes it, and the planner's settings."""

    page_size: int
    pool_pages: int  # page 0 included
    buckets: tuple[int, ...]
    max_seq_len: int
    vocab_size: int
    state_slots: int = 0  # the recurrent-state pool's slots, the sink included; 0: no recurrent layers
    settings: SchedulingConfig = field(default_factory=SchedulingConfig)

    def __post_init__(self) -> None:
        self.buckets = tuple(sorted(self.buckets))
