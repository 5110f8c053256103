"""What a launched step holds until it is collected, and the pinned buffers its tokens come back into."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from executor_svc.plan import CheckedPlan
from executor_svc.sampler_controls import LOGPROB_COLUMNS


@dataclass(slots=True)
class LaunchedStep:
    """A step whose work is queued on the device; its sampled tokens reach `host_tokens` once `done` passes."""

    seq: int
    plan: CheckedPlan
    sampled_chunks: list[int]  # the prefill chunks that sampled, in the order of host_tokens
    host_tokens: torch.Tensor  # int64[n]: those chunks' tokens, then the decode rows'
    done: torch.cuda.Event | None  # None: the tokens are on the host already (the CPU path)
    mismatches: int
    # Graph path only, for RunnerTimes: perf_counter at began, applied, prefilled, planned, launched;
    # and the CUDA events around the replay.
    marks: tuple[float, ...] = ()
    replay: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    logprobs: tuple[torch.Tensor, np.ndarray] | None = None  # the rows' host table, which rows asked

    def wait(self) -> None:
        """Block until the tokens are on the host (`run`, and tests that step by hand)."""
        if self.done is not None:
            self.done.synchronize()


READ_BACK_RING = 4  # read-backs reused round-robin: more than the steps launched ahead of collection (2)


class ReadBack:
    """What one launched step reads back, reused round-robin so that the step path allocates nothing: pinned
    host tokens, the event that says they are back, and the timing events around the replay."""

    __slots__ = ("tokens", "tables", "done", "replay")

    def __init__(self, tokens: int, tables: int) -> None:
        self.tokens = torch.empty(tokens, dtype=torch.int64, pin_memory=True)  # tokens: [tokens]
        self.tables = torch.empty(tables, LOGPROB_COLUMNS, pin_memory=True)  # logprobs: [tables, L]
        self.done = torch.cuda.Event()
        self.replay = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
