"""The logprobs of a step's rows that asked for them, off the StepOutput's packed arrays: pure."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from protos.wire import unpack_f32, unpack_i32

TOP_LOGPROBS = 20  # alternatives the executor computes for each row that asks (executor.proto)


class LogprobRow(NamedTuple):
    logprob: float  # the sampled token's log_softmax of the model's logits
    top_logprobs: np.ndarray  # f32[TOP_LOGPROBS], most likely first
    top_ids: np.ndarray  # i32[TOP_LOGPROBS]


def logprob_rows(logprobs: bytes, ids: bytes) -> Iterator[LogprobRow]:
    """StepOutput.logprobs (f32[r, 1 + TOP_LOGPROBS]) and logprob_ids (i32[r, TOP_LOGPROBS]), row by row."""
    values = unpack_f32(logprobs).reshape(-1, 1 + TOP_LOGPROBS)
    top_ids = unpack_i32(ids).reshape(-1, TOP_LOGPROBS)
    if len(values) != len(top_ids):
        raise ValueError(f"{len(values)} rows of logprobs and {len(top_ids)} of their ids")
    for row, row_ids in zip(values, top_ids):
        yield LogprobRow(float(row[0]), row[1:], row_ids)
