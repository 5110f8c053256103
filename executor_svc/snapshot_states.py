"""The recurrent states in a hybrid model's snapshot: which layers of a shard are KV layers and which are
recurrent ones, and the state bytes of a shard's recurrent layers (snapshots.py puts them after the shard's KV).

A shard of layers [begin, end) holds, after the K and V of its full-attention layers (snapshots.py's layout,
those layers only), the states of its recurrent layers for each parked checkpoint in position order: the conv
windows `[state_layers, states, channels, conv_width - 1]` in the pool's dtype, then the recurrent states
`[state_layers, states, heads, value_dim, key_dim]` in float32 (value-major); C order, little-endian
(HYBRID_LAYOUT)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from executor_svc.copy_stream import CopyStream
from executor_svc.models.qwen3_5_config import LINEAR
from executor_svc.state_pool import StatePool

# /2: the recurrent states value-major ([heads, value_dim, key_dim]); a restore refuses /1's key-major ones
HYBRID_LAYOUT = "kv-then-states-layer-major/2"


@dataclass(frozen=True, slots=True)
class LayerKinds:
    """Which of the model's layers are recurrent; the others hold KV. Pool indices count each kind from
    `first` (the executor's first layer)."""

    recurrent: frozenset[int]
    first: int = 0

    def kv_count(self, begin: int, end: int) -> int:
        """KV layers among the model's layers [begin, end)."""
        return sum(1 for layer in range(begin, end) if layer not in self.recurrent)

    def state_count(self, begin: int, end: int) -> int:
        """Recurrent layers among the model's layers [begin, end)."""
        return (end - begin) - self.kv_count(begin, end)

    def kv_range(self, begin: int, end: int) -> tuple[int, int]:
        """Layers [begin, end) of the model (this executor's) as a range of the KV pool's layers."""
        low = self.kv_count(self.first, begin)
        return low, low + self.kv_count(begin, end)

    def state_range(self, begin: int, end: int) -> tuple[int, int]:
        """Layers [begin, end) of the model (this executor's) as a range of the state pool's layers."""
        low = self.state_count(self.first, begin)
        return low, low + self.state_count(begin, end)

    def pattern(self, num_layers: int) -> str:
        """The layer pattern, 'R' recurrent and 'A' attention: what a snapshot's fingerprint covers."""
        return "".join("R" if layer in self.recurrent else "A" for layer in range(num_layers))


class StateShards:
    """The states of some slots of a state pool to and from a shard's bytes, through the card's copy stream and
    its staging (as shard_copies.py moves pages). Run on the page-copy thread."""

    def __init__(self, pool: StatePool, kinds: LayerKinds) -> None:
        self.pool = pool
        self.kinds = kinds
        # one layer, one slot (from the shapes: a stage of full-attention layers only has a pool of no layers)
        self._conv_bytes = math.prod(pool.conv.shape[2:]) * pool.conv.element_size()
        self._recurrent_bytes = math.prod(pool.recurrent.shape[2:]) * pool.recurrent.element_size()

    def describe(self) -> str:
        """The shape of one state, for the fingerprint: the conv window and the recurrent state."""
        conv, recurrent = self.pool.conv, self.pool.recurrent
        return f"conv {list(conv.shape[2:])} {conv.dtype}, recurrent {list(recurrent.shape[2:])}"

    def warm(self, stream: CopyStream) -> None:
        """The copy kernels for both state tensors, loaded at start-up (CopyStream.warm); none for a pool of no
        layers (a stage of full-attention layers only)."""
        if not self.pool.num_layers:
            return
        stream.warm((self.pool.conv,))
        stream.warm((self.pool.recurrent,))

    def nbytes(self, begin: int, end: int, states: int) -> int:
        return self.kinds.state_count(begin, end) * states * (self._conv_bytes + self._recurrent_bytes)

    def read(self, stream: CopyStream, begin: int, end: int, slots: np.ndarray) -> bytes:
        """The states at `slots` of the recurrent layers in [begin, end), in the shard's byte order."""
        low, high = self.kinds.state_range(begin, end)
        if low == high or not len(slots):
            return b""
        index = slots.astype(np.int64)
        parts = (
            stream.gather((tensor[low:high],), index) for tensor in (self.pool.conv, self.pool.recurrent)
        )
        return b"".join(part.tobytes() for part in parts)

    def write(
        self,
        stream: CopyStream,
        layers: tuple[int, int],
        begin: int,
        end: int,
        blob: np.ndarray,
        states: int,
        slots: np.ndarray,
        chosen: list[int],
    ) -> None:
        """The `chosen` (indices, in position order) of the `states` states in `blob` (u8, as `read` made it for
        layers [begin, end)) into `slots`, one each, for the shard's layers in `layers` (this pool's: a shard
        parked under another split may reach past them, and only its part in them is written)."""
        low_layer, high_layer = max(begin, layers[0]), min(end, layers[1])
        low, high = self.kinds.state_range(low_layer, high_layer)
        held = high - low
        if len(chosen) != len(slots):
            raise ValueError(f"{len(chosen)} states chosen for {len(slots)} slots")
        if held <= 0 or not chosen:
            return
        index = slots.astype(np.int64)
        shard_layers = self.kinds.state_count(begin, end)
        skip = self.kinds.state_count(begin, low_layer)  # the shard's recurrent layers before this pool's
        split = shard_layers * states * self._conv_bytes
        for tensor, data, entry_bytes in (
            (self.pool.conv, blob[:split], self._conv_bytes),
            (self.pool.recurrent, blob[split:], self._recurrent_bytes),
        ):
            # u8[shard layers, 1 (the tensor), states, entry bytes]: of this pool's layers, the chosen states
            src = data.reshape(shard_layers, 1, states, entry_bytes)[skip : skip + held, :, chosen]
            stream.scatter((tensor[low:high],), src, index)


def restored_states(pinned: list[bool], slots: int) -> list[int]:
    """Which of a snapshot's parked states (one per checkpoint, in position order; `pinned` their flags) a
    restore given `slots` state slots brings back: their indices, in position order. Short of slots, the pin's
    first (retention never evicts a pin), then the newest others (the next turn resumes from the newest)."""
    count = min(slots, len(pinned))
    order = [i for i, pin in enumerate(pinned) if pin] + [
        i for i in reversed(range(len(pinned))) if not pinned[i]
    ]
    return sorted(order[:count])


def layer_kinds(model: object, first: int) -> LayerKinds:
    """A model's layer kinds, from its `config.layer_types` where it has them (the hybrid); else all KV."""
    types = getattr(getattr(model, "config", None), "layer_types", ())
    return LayerKinds(frozenset(i for i, kind in enumerate(types) if kind == LINEAR), first)
