"""The sampler state written with a whole row: per-slot temperature, top-p, top-k, seed and last token, and
for a request that has them, its sampling controls (executor.proto's control_* fields)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from planner_svc.requests import Request
from protos import executor_pb2
from protos.wire import F32, I32

_MASK32 = 0xFFFFFFFF


@dataclass(slots=True)
class SamplerWrites:
    slots: list[int] = field(default_factory=list)
    floats: list[tuple[float, float]] = field(default_factory=list)  # (temperature, top_p)
    ints: list[tuple[int, int, int, int]] = field(default_factory=list)  # (top_k, seed_lo, seed_hi, last)
    control_slots: list[int] = field(default_factory=list)
    control_floats: list[tuple[float, float, float, float]] = field(default_factory=list)
    control_ints: list[tuple[int, ...]] = field(default_factory=list)  # executor.proto's control_i32 row
    control_tokens: list[int] = field(default_factory=list)
    control_bias: list[float] = field(default_factory=list)
    control_grammars: list[executor_pb2.Grammar] = field(default_factory=list)

    def add(self, slot: int, request: Request, last_token: int) -> None:
        """`last_token < 0` keeps the device's loop-back value (a prefill of this step, or one in flight)."""
        sampling = request.sampling
        seed = sampling.seed
        # seed halves travel as int32 bit patterns
        lo, hi = (seed & _MASK32), (seed >> 32) & _MASK32
        self.slots.append(slot)
        self.floats.append((sampling.temperature, sampling.top_p))
        self.ints.append((sampling.top_k, _as_i32(lo), _as_i32(hi), last_token))
        self._add_controls(slot, request, last_token)

    def _add_controls(self, slot: int, request: Request, last_token: int) -> None:
        """The request's controls, when it has any. The device counts each decode step's input token (the
        last output) itself, so the output sent is what it has not counted: all of it when the last token
        stays on the device, all but the last token sent."""
        s = request.sampling
        grammar = request.grammar
        if not has_controls(request):
            return
        output = request.output_ids if last_token < 0 else request.output_ids[:-1]
        generated = len(output)
        prompt = request.prompt_ids if s.repetition_penalty != 1.0 else []
        counted = output if s.penalized or grammar is not None else []  # a grammar's matcher reads it too
        stops = sorted(request.stop_ids) if request.min_tokens > generated else []
        bias_ids = [token for token, _ in s.logit_bias]
        self.control_slots.append(slot)
        self.control_floats.append((s.min_p, s.repetition_penalty, s.frequency_penalty, s.presence_penalty))
        self.control_ints.append(
            (
                request.min_tokens,
                generated,
                s.top_logprobs,
                len(bias_ids),
                len(prompt),
                len(counted),
                len(stops),
            )
        )
        self.control_tokens += [*bias_ids, *prompt, *counted, *stops]
        self.control_bias += [bias for _, bias in s.logit_bias]
        self.control_grammars.append(grammar_message(grammar))

    def __bool__(self) -> bool:
        return bool(self.slots)

    def pack(self) -> dict[str, bytes | list[executor_pb2.Grammar]]:
        """The StepPlan fields, by name (control_grammar a list of messages, the others packed arrays)."""
        fields: dict[str, bytes | list[executor_pb2.Grammar]] = {
            "sampler_slots": np.asarray(self.slots, dtype=I32).tobytes(),
            "sampler_f32": np.asarray(self.floats, dtype=F32).tobytes(),
            "sampler_i32": np.asarray(self.ints, dtype=I32).tobytes(),
        }
        if self.control_slots:
            fields |= {
                "control_slots": np.asarray(self.control_slots, dtype=I32).tobytes(),
                "control_f32": np.asarray(self.control_floats, dtype=F32).tobytes(),
                "control_i32": np.asarray(self.control_ints, dtype=I32).tobytes(),
                "control_tokens": np.asarray(self.control_tokens, dtype=I32).tobytes(),
                "control_bias": np.asarray(self.control_bias, dtype=F32).tobytes(),
            }
            if any(g.WhichOneof("kind") for g in self.control_grammars):
                fields["control_grammar"] = self.control_grammars
        return fields


def has_controls(request: Request) -> bool:
    """The request's rows run the sampler's CONTROLLED variant: min_p, penalties, a logit bias, logprobs, a
    grammar or min_tokens."""
    s = request.sampling
    controlled = s.min_p > 0 or s.penalized or s.logit_bias or s.top_logprobs >= 0
    return bool(controlled or request.grammar is not None or request.min_tokens)


def grammar_message(grammar: str | None) -> executor_pb2.Grammar:
    """A request's grammar ("" any JSON object, else a JSON Schema's text, None none) as executor.proto's."""
    if grammar is None:
        return executor_pb2.Grammar()
    return executor_pb2.Grammar(json_schema=grammar) if grammar else executor_pb2.Grammar(json_object=True)


def _as_i32(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value
