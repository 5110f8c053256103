"""The sampler state written with a whole row: per-slot temperature, top-p, top-k, seed and last token."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from planner_svc.requests import Sampling
from protos.wire import F32, I32

_MASK32 = 0xFFFFFFFF


@dataclass(slots=True)
class SamplerWrites:
    slots: list[int] = field(default_factory=list)
    floats: list[tuple[float, float]] = field(default_factory=list)  # (temperature, top_p)
    ints: list[tuple[int, int, int, int]] = field(default_factory=list)  # (top_k, seed_lo, seed_hi, last)

    def add(self, slot: int, sampling: Sampling, last_token: int) -> None:
        """`last_token < 0` keeps the device's loop-back value (a prefill of this step, or one in flight)."""
        seed = sampling.seed
        # seed halves travel as int32 bit patterns
        lo, hi = (seed & _MASK32), (seed >> 32) & _MASK32
        self.slots.append(slot)
        self.floats.append((sampling.temperature, sampling.top_p))
        self.ints.append((sampling.top_k, _as_i32(lo), _as_i32(hi), last_token))

    def __bool__(self) -> bool:
        return bool(self.slots)

    def pack(self) -> tuple[bytes, bytes, bytes]:
        return (
            np.asarray(self.slots, dtype=I32).tobytes(),
            np.asarray(self.floats, dtype=F32).tobytes(),
            np.asarray(self.ints, dtype=I32).tobytes(),
        )


def _as_i32(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value
