"""What the scheduler plans for one executor group: a step as the executor receives it (with who each row and
chunk belongs to), and the group's shape as its executor describes it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from planner_svc.config import SchedulingConfig
from planner_svc.requests import Request
from planner_svc.rows import RowDelta
from planner_svc.sampler_state import SamplerWrites
from planner_svc.state_slots import StateSlots


class CapacityError(Exception):
    """RESOURCE_EXHAUSTED: the request can never be served by this pool, or (retryable) not now."""

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


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
    steps: int = 1  # decode steps over the same rows (more than one: a repeat of a steady step)
    indexed: list[int] = field(default_factory=list)  # pages its prompt chunks put in the prefix index


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


def check_request(request: Request, config: SchedulerConfig, pages: int, states: StateSlots) -> None:
    """Refuse what could never run on a group of this shape with `pages` KV pages and `states` (ValueError: bad
    input, CapacityError: too big), and clamp max_tokens to the context. Changes nothing but the request."""
    limit = config.max_seq_len
    if request.prompt_len >= limit:
        raise ValueError(f"the prompt has {request.prompt_len} tokens; the model's context is {limit}")
    ids = np.asarray(request.prompt_ids)
    bad = ids[(ids < 0) | (ids >= config.vocab_size)]
    if bad.size:
        raise ValueError(f"token id {int(bad[0])} is outside the vocabulary [0, {config.vocab_size})")
    request.max_tokens = min(request.max_tokens, limit - request.prompt_len + 1)
    need = request.pages_needed(config.page_size)
    if need > pages:
        raise CapacityError(f"the request needs {need} KV pages and the pool has {pages}")
    # Its n choices stream as one answer, side by side: more choices than state slots would wait on each
    # other's ends, so they are refused as a request larger than the KV pool is. One always fits.
    if states.enabled and request.n > states.total:
        raise CapacityError(
            f"the request's {request.n} choices need {request.n} recurrent-state slots at once and the "
            f"pool has {states.total} (--state-slots {states.num_slots}, slot 0 the sink)"
        )
