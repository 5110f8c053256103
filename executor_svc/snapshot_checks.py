"""The pure half of park and restore: shard ranges, the snapshot fingerprint and the checks
of a request, with the refusal they raise (no I/O, no device: snapshots.py does those)."""

from __future__ import annotations

import hashlib

import grpc
import numpy as np

from executor_svc.kv_pool import SINK_PAGE
from protos import executor_pb2
from protos.wire import unpack_i32

SHARD_LAYOUT = "kv-layer-major/1"  # the byte order in snapshots.py's docstring; a restore refuses any other


def shard_ranges(layer_begin: int, layer_end: int, shard_layers: int) -> list[tuple[int, int]]:
    """Layers [layer_begin, layer_end) cut at the multiples of shard_layers."""
    if not 0 <= layer_begin < layer_end or shard_layers < 1:
        raise ValueError(f"bad layer range [{layer_begin}, {layer_end}) or shard_layers {shard_layers}")
    cuts = range((layer_begin // shard_layers + 1) * shard_layers, layer_end, shard_layers)
    bounds = [layer_begin, *cuts, layer_end]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def snapshot_fingerprint(
    model_fingerprint: str,
    dtype: str,
    page_size: int,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    layer_pattern: str = "",
) -> str:
    """What a snapshot can be restored into: the weights, and the pool's dtype, page size and shape; for a
    hybrid model, its layer pattern and the shape of a recurrent state (`layer_pattern`; "" for the others).

    Not Describe's model_fingerprint (weights only): the cache refuses a snapshot whose fingerprint
    differs, and KV bytes of another dtype or page size are no more usable than another model's."""
    text = f"deltaserve.kv\0{model_fingerprint}\0{dtype}\0{page_size}\0{num_layers}\0{kv_heads}\0{head_dim}"
    if layer_pattern:
        text += f"\0{layer_pattern}"
    return hashlib.sha256(text.encode()).hexdigest()


class SnapshotRefused(Exception):
    """A Park or Restore refused; `code` is the gRPC status to answer with, the message says why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def invalid(message: str) -> SnapshotRefused:
    return SnapshotRefused(grpc.StatusCode.INVALID_ARGUMENT, message)


def check_pages(data: bytes, pool_pages: int) -> np.ndarray:
    """The int32 packed pages of a request: at least one, none the sink page, all in the pool, distinct."""
    if len(data) % 4:
        raise invalid(f"pages must be int32 packed; {len(data)} bytes is not a multiple of 4")
    pages = unpack_i32(data)
    if not len(pages):
        raise invalid("no pages given")
    if (pages == SINK_PAGE).any():
        raise invalid(f"page {SINK_PAGE} is the sink page; it holds no conversation")
    outside = pages[(pages < 0) | (pages >= pool_pages)]
    if len(outside):
        raise invalid(f"page {int(outside[0])} is outside the pool [1, {pool_pages})")
    if len(np.unique(pages)) != len(pages):
        raise invalid("a page is listed twice")
    return pages


def check_park(
    request: executor_pb2.ParkPagesRequest, page_size: int, pool_pages: int, vocab_size: int, max_seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, pages) of a well-formed ParkPagesRequest; SnapshotRefused(INVALID_ARGUMENT) otherwise.
    The ids are what a resume reads again: one the model or its context cannot take would be refused then,
    every turn after, so it is refused here."""
    if not request.conversation_id:
        raise invalid("conversation_id is empty")
    if len(request.token_ids) % 4:
        raise invalid(
            f"token_ids must be int32 packed; {len(request.token_ids)} bytes is not a multiple of 4"
        )
    tokens = unpack_i32(request.token_ids)
    if not len(tokens):
        raise invalid("token_ids is empty: there is nothing to park")
    if len(tokens) > max_seq_len:
        raise invalid(f"{len(tokens)} tokens, more than the context holds ({max_seq_len})")
    outside = tokens[(tokens < 0) | (tokens >= vocab_size)]
    if len(outside):
        raise invalid(f"token id {int(outside[0])} is outside the vocabulary ({vocab_size})")
    pages = check_pages(request.pages, pool_pages)
    needed = -(-len(tokens) // page_size)
    if len(pages) != needed:
        raise invalid(f"{len(tokens)} tokens fill {needed} pages of {page_size}; {len(pages)} pages given")
    positions = [c.position for c in request.checkpoints]
    increasing = all(a < b for a, b in zip([0, *positions], positions))
    if not increasing or (positions and positions[-1] > len(tokens)):
        raise invalid(
            f"checkpoint positions must be strictly increasing in [1, {len(tokens)}], got {positions}"
        )
    return tokens, pages


def check_state_slots(data: bytes, num_slots: int, expected: int | None) -> np.ndarray:
    """The int32 packed state slots of a park or restore: none for a model without recurrent layers; else
    distinct slots in [1, num_slots), `expected` of them where given (one per parked checkpoint)."""
    if len(data) % 4:
        raise invalid(f"state_slots must be int32 packed; {len(data)} bytes is not a multiple of 4")
    slots = unpack_i32(data)
    if not num_slots and len(slots):
        raise invalid("state_slots given for a model without recurrent layers")
    if num_slots and expected is not None and len(slots) != expected:
        raise invalid(f"{expected} checkpoints need one state slot each; {len(slots)} state slots given")
    outside = slots[(slots < 1) | (slots >= max(num_slots, 1))]
    if len(outside):
        raise invalid(f"state slot {int(outside[0])} is outside [1, {num_slots}) (0 is the sink slot)")
    if len(np.unique(slots)) != len(slots):
        raise invalid("a state slot is listed twice")
    return slots


def cache_refusal(err: grpc.aio.AioRpcError, addr: str) -> SnapshotRefused:
    """The cache's status as is (NOT_FOUND, DATA_LOSS, FAILED_PRECONDITION, ...), said to come from it."""
    code = err.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return SnapshotRefused(
            grpc.StatusCode.UNAVAILABLE, f"cache service at {addr} unreachable: {err.details()}"
        )
    return SnapshotRefused(code, f"cache service: {err.details()}")
