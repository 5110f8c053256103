"""The sampling controls of a StepPlan (min-p, penalties, logit bias, min_tokens, logprobs: the control_*
fields), parsed and checked once, before anything is written."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from protos import executor_pb2
from protos.wire import unpack_f32, unpack_i32

CONTROL_F32 = 4  # min_p, repetition_penalty, frequency_penalty, presence_penalty
CONTROL_I32 = 7  # min_tokens, generated, top_logprobs, n_bias, n_prompt, n_output, n_stop
TOP_LOGPROBS = 20  # alternatives computed for a row that asks for logprobs (the most a request may ask)


class ControlError(ValueError):
    """A malformed control write (the plan is refused with this message)."""


class ControlWrites(NamedTuple):
    slots: np.ndarray  # int32[m], each among the plan's sampler_slots
    f32: np.ndarray  # float32[m, CONTROL_F32]
    i32: np.ndarray  # int32[m, CONTROL_I32]
    tokens: np.ndarray  # int32: per slot, bias ids, prompt, output, stop ids
    bias: np.ndarray  # float32: per slot, the bias values
    grammars: list[str | None]  # per slot: "" (any JSON object), a JSON Schema's text, or None (no grammar)


def check_controls(
    plan: executor_pb2.StepPlan, sampler_slots: np.ndarray, vocab_size: int
) -> ControlWrites | None:
    """The plan's control writes, or None when it has none; ControlError says what is wrong."""
    if not plan.control_slots:
        if (
            plan.control_f32
            or plan.control_i32
            or plan.control_tokens
            or plan.control_bias
            or plan.control_grammar
        ):
            raise ControlError("control_*: values without control_slots")
        return None
    sizes = {name: len(getattr(plan, name)) for name in ("control_slots", "control_f32", "control_i32")}
    sizes |= {name: len(getattr(plan, name)) for name in ("control_tokens", "control_bias")}
    if any(size % 4 for size in sizes.values()):
        raise ControlError(f"control_*: not whole int32/float32 arrays ({sizes} bytes)")
    slots = unpack_i32(plan.control_slots)
    m = len(slots)
    if sizes["control_f32"] != 4 * CONTROL_F32 * m or sizes["control_i32"] != 4 * CONTROL_I32 * m:
        raise ControlError(
            f"control: {m} slots need {4 * CONTROL_F32 * m} bytes of control_f32 and {4 * CONTROL_I32 * m} of "
            f"control_i32, got {sizes['control_f32']} and {sizes['control_i32']}"
        )
    if not np.isin(slots, sampler_slots).all() or len(np.unique(slots)) != m:
        raise ControlError(f"control_slots {slots.tolist()} must be distinct slots among sampler_slots")
    f32 = unpack_f32(plan.control_f32).reshape(m, CONTROL_F32)
    i32 = unpack_i32(plan.control_i32).reshape(m, CONTROL_I32)
    tokens, bias = unpack_i32(plan.control_tokens), unpack_f32(plan.control_bias)
    if not np.isfinite(f32).all() or not np.isfinite(bias).all():
        raise ControlError("control_f32 / control_bias: values must be finite")
    if not ((f32[:, 0] >= 0) & (f32[:, 0] <= 1) & (f32[:, 1] > 0)).all():
        raise ControlError(
            f"control_f32: min_p must be in [0, 1] and repetition_penalty > 0, got {f32.tolist()}"
        )
    if (i32[:, :2] < 0).any() or (i32[:, 3:] < 0).any() or (i32[:, 2] > TOP_LOGPROBS).any():
        raise ControlError(
            f"control_i32: counts must be >= 0, top_logprobs in [-1, {TOP_LOGPROBS}]: {i32.tolist()}"
        )
    if int(i32[:, 3:].sum()) != len(tokens) or int(i32[:, 3].sum()) != len(bias):
        raise ControlError(
            f"control_tokens: {len(tokens)} ids and control_bias {len(bias)} values, the counts say "
            f"{int(i32[:, 3:].sum())} and {int(i32[:, 3].sum())}"
        )
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ControlError(f"control_tokens: a token id is outside the vocabulary ({vocab_size})")
    if len(plan.control_grammar) not in (0, m):
        raise ControlError(f"control_grammar: {len(plan.control_grammar)} grammars for {m} control slots")
    grammars: list[str | None] = [None] * m
    for index, grammar in enumerate(plan.control_grammar):
        grammars[index] = grammar_text(grammar)
    return ControlWrites(slots, f32, i32, tokens, bias, grammars)


def grammar_text(grammar: executor_pb2.Grammar) -> str | None:
    """A slot's grammar as the executor keeps it: "" any JSON object, a JSON Schema's text, or None."""
    kind = grammar.WhichOneof("kind")
    return None if kind is None else grammar.json_schema if kind == "json_schema" else ""
