"""Which rows of a step return logprobs, and their tables gathered for the read-back and packed for the
StepOutput (the rows that asked only)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from executor_svc.control_writes import TOP_LOGPROBS
from executor_svc.decode_graphs import Sampled
from executor_svc.grammars import step_slots
from executor_svc.plan import CheckedPlan
from executor_svc.sampler_controls import LOGPROB_COLUMNS
from executor_svc.slot_store import SlotStore
from protos.wire import pack_f32, pack_i32


def asking_rows(store: SlotStore, plan: CheckedPlan, sampled: Sequence[Sampled]) -> np.ndarray | None:
    """bool[n]: which of the step's sampled rows (its prefill chunks that sampled, then its decode rows,
    padding included) return logprobs, by the sampler state as this step reads it; None where no part of the
    step ran the CONTROLLED variant (none returns logprobs)."""
    if not any(part[1] is not None for part in sampled):
        return None
    return store.controls.logprob_rows(step_slots(plan, store, None))


def gathered_table(tables: Sequence[tuple[int, torch.Tensor | None]], device: torch.device) -> torch.Tensor:
    """The logprob tables of the step's parts, (rows, table or None: no row of the part asked), as one
    f32[n, LOGPROB_COLUMNS]."""
    parts = [
        table if table is not None else torch.zeros(rows, LOGPROB_COLUMNS, device=device)
        for rows, table in tables
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def packed(table: np.ndarray, asking: np.ndarray) -> tuple[bytes, bytes]:
    """StepOutput.logprobs (f32[r, 1 + TOP_LOGPROBS]) and logprob_ids (i32[r, TOP_LOGPROBS]) of the rows
    that asked."""
    rows = table[asking]
    return pack_f32(rows[:, : 1 + TOP_LOGPROBS]), pack_i32(rows[:, 1 + TOP_LOGPROBS :].astype(np.int32))
