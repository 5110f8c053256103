"""How park and restore cut a copy into chunks that fit the copy stream's staging (pure: copy_stream.py does
the copies).

A copy moves, for each of `layers` layers, the same `entries` entries (pages, or state slots) of one or more
tensors (K and V): `layer_entry_bytes` bytes per entry and layer, over the tensors. A chunk is a block of it,
layers [l0, l1) x entries [e0, e1), staged as its entries' int64 indices, then its bytes: whole layers at a
time when every entry of a layer fits, else a run of entries of one layer. So the staging never grows with
the snapshot: a larger one is more chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

INDEX_BYTES = 8  # an entry's int64 index, staged with the chunk's bytes


@dataclass(frozen=True, slots=True)
class Chunk:
    """Layers [l0, l1) x entries [e0, e1) of a copy."""

    l0: int
    l1: int
    e0: int
    e1: int

    @property
    def layers(self) -> int:
        return self.l1 - self.l0

    @property
    def entries(self) -> int:
        return self.e1 - self.e0

    def nbytes(self, layer_entry_bytes: int) -> int:
        """What the chunk takes in the staging: its indices, then its bytes."""
        return self.entries * (INDEX_BYTES + self.layers * layer_entry_bytes)


def plan_chunks(layers: int, entries: int, layer_entry_bytes: int, capacity: int) -> list[Chunk]:
    """The chunks of a copy, in layer-major order, each at most `capacity` bytes staged; none for an empty
    copy. ValueError when not even one entry of one layer fits."""
    if layers < 0 or entries < 0 or layer_entry_bytes < 1:
        raise ValueError(f"bad copy: {layers} layers x {entries} entries of {layer_entry_bytes} bytes")
    if INDEX_BYTES + layer_entry_bytes > capacity:
        raise ValueError(
            f"one entry of one layer ({layer_entry_bytes} bytes and its index) does not fit the "
            f"{capacity}-byte staging"
        )
    if not layers or not entries:
        return []
    per_entry = capacity // entries  # what each entry may take when a chunk holds all of them
    layers_per_chunk = (per_entry - INDEX_BYTES) // layer_entry_bytes if per_entry > INDEX_BYTES else 0
    if layers_per_chunk >= 1:
        return [
            Chunk(l0, min(l0 + layers_per_chunk, layers), 0, entries)
            for l0 in range(0, layers, layers_per_chunk)
        ]
    run = capacity // (INDEX_BYTES + layer_entry_bytes)  # entries of one layer a chunk holds
    return [
        Chunk(layer, layer + 1, e0, min(e0 + run, entries))
        for layer in range(layers)
        for e0 in range(0, entries, run)
    ]
