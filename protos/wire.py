"""Arrays on the wire: little-endian packed int32/float32 bytes, decoded without copying."""

from __future__ import annotations

import numpy as np

I32 = np.dtype("<i4")
F32 = np.dtype("<f4")


def pack_i32(values) -> bytes:
    return np.asarray(values, dtype=I32).tobytes()


def pack_f32(values) -> bytes:
    return np.asarray(values, dtype=F32).tobytes()


def unpack_i32(data: bytes) -> np.ndarray:
    """A read-only int32 view of `data` (no copy)."""
    return np.frombuffer(data, dtype=I32)


def unpack_f32(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=F32)
