"""GGUF quantized tensors -> PackedWeight without de-quantizing: each ggml block type's integers, scales and
minimums rewritten into the one packed layout the CPU kernel reads (see packed_kernel.c).

Every type maps exactly: a packed weight de-quantizes to gguf's own float32 value bit for bit (scale and
minimum are the float16 values the blocks hold, or for the K-quants the float32 products gguf computes). Types with groups of 16 (Q2_K, Q3_K, Q6_K) and the i-quants
have no mapping here; the loader de-quantizes those.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from executor_svc.models.packed import GROUP, PackedWeight

_QK_K = 256  # a K-quant super-block: 8 groups of 32


def _f16(half: np.ndarray) -> np.ndarray:
    """Two bytes per element (ggml's float16) -> float16, shape without the byte axis."""
    return np.ascontiguousarray(half).view(np.float16)[..., 0]


def _f32(half: np.ndarray) -> np.ndarray:
    return _f16(half).astype(np.float32)


def _nibbles_to_bytes(q: np.ndarray) -> np.ndarray:
    """q[..., 32] values 0..15 per group -> [..., 16] bytes, element j in the low nibble of byte j, j + 16
    in its high nibble."""
    return (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)


def _low_high(qs: np.ndarray) -> np.ndarray:
    """ggml's 16 bytes a group -> [..., 32] nibbles: the low nibbles are elements 0..15, the high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bit_planes(qh: np.ndarray, count: int) -> np.ndarray:
    """Little-endian bit i of the uint32 in qh[..., 4 bytes] for i < count -> [..., count] of 0/1."""
    bits = np.ascontiguousarray(qh).view(np.uint32)  # [..., 1]
    return ((bits >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)


def _q4_0(b: np.ndarray) -> tuple:
    return 4, 8, b[..., 2:], _f16(b[..., :2]), None


def _q4_1(b: np.ndarray) -> tuple:
    return 4, 0, b[..., 4:], _f16(b[..., :2]), _f16(b[..., 2:4])


def _q8_0(b: np.ndarray) -> tuple:
    return 8, 0, b[..., 2:], _f16(b[..., :2]), None


def _q5_0(b: np.ndarray) -> tuple:
    q = _low_high(b[..., 6:]) | (_bit_planes(b[..., 2:6], 32) << 4)
    return 8, 16, q, _f16(b[..., :2]), None


def _q5_1(b: np.ndarray) -> tuple:
    q = _low_high(b[..., 8:]) | (_bit_planes(b[..., 4:8], 32) << 4)
    return 8, 0, q, _f16(b[..., :2]), _f16(b[..., 2:4])


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_K / Q5_K super-block's float32 scale and minimum per group: [..., 8] each, as gguf computes them."""
    import gguf

    lead = b.shape[:-1]
    sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12))
    d, dmin = _f32(b[..., :2])[..., None], _f32(b[..., 2:4])[..., None]
    scale = d * sc.reshape(*lead, 8).astype(np.float32)
    minv = -(dmin * m.reshape(*lead, 8).astype(np.float32))
    return scale, minv


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes a super-block -> [..., 8, 32]: group 2c is the low nibbles of bytes 32c..32c+31, 2c + 1
    their high nibbles."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 1, 32) >> np.array([0, 4], dtype=np.uint8)[:, None]
    return (chunks & 0x0F).reshape(*qs.shape[:-1], 8, 32)


def _q4_k(b: np.ndarray) -> tuple:
    scale, minv = _k_scales(b)
    return 4, 0, _nibbles_to_bytes(_k_nibbles(b[..., 16:])), scale, minv


def _q5_k(b: np.ndarray) -> tuple:
    scale, minv = _k_scales(b)
    high = (b[..., 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1  # [..., 32 elements, 8 groups]
    q = _k_nibbles(b[..., 48:]) | (np.swapaxes(high, -1, -2) << 4)
    return 8, 0, q, scale, minv


# ggml type name -> (bytes a block, elements a block, the block reader)
_BLOCKS: dict[str, tuple[int, int, Callable[[np.ndarray], tuple]]] = {
    "Q4_0": (18, 32, _q4_0),
    "Q4_1": (20, 32, _q4_1),
    "Q8_0": (34, 32, _q8_0),
    "Q5_0": (22, 32, _q5_0),
    "Q5_1": (24, 32, _q5_1),
    "Q4_K": (144, _QK_K, _q4_k),
    "Q5_K": (176, _QK_K, _q5_k),
}
PACKABLE = frozenset(_BLOCKS)


def pack_gguf(data: np.ndarray, type_name: str, rows: int, cols: int) -> PackedWeight:
    """A GGUF tensor's raw blocks (uint8 [rows, bytes a row], as GGUFReader gives them) of a [rows, cols]
    matrix -> PackedWeight. type_name must be in PACKABLE."""
    block_bytes, block_size, read = _BLOCKS[type_name]
    blocks = np.asarray(data, dtype=np.uint8).reshape(rows, cols // block_size, block_bytes)
    bits, offset, q, scale, minv = read(blocks)
    groups = cols // GROUP
    q = np.ascontiguousarray(q, dtype=np.uint8).reshape(rows, cols * bits // 8)
    return PackedWeight(
        bits,
        offset,
        torch.from_numpy(q),
        torch.from_numpy(np.ascontiguousarray(scale.reshape(rows, groups))),
        None if minv is None else torch.from_numpy(np.ascontiguousarray(minv.reshape(rows, groups))),
    )
