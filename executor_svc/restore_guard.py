"""The restore guard (the reference's restore_fits and kRestoreFirstUseMib), pure: which cards a restore may
not touch now.

A restore writes into pool pages that exist already; the one thing it can allocate on a card is, the first
time, that card's copy stream, its events and its staging, of a fixed size (copy_stream.py). So a card is
refused only while it has no copy stream yet and less free memory than that first use needs; a card with its
stream is never refused however full, and a card whose free memory could not be sampled goes ahead (a failed
query must not stop restores that would work).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MIB = 1 << 20
# The copy stream's staging on a card (copy_stream.py): park and restore go through it in chunks, so it is the
# same whatever the snapshot; 8 MiB moves a chunk of megabytes per copy, where per-copy costs are small.
STAGING_BYTES = 8 * MIB
# The stream, its events and what its first copies load: the reference measured under 16 MiB for them; ours took
# 82 MiB beyond the staging on an H200 (bench/first_copy.py at 40f7514: 70 MiB of it outside torch's allocator,
# CUDA's lazy loading of the copy kernels suspected), so the guard asks for that with a margin.
COPY_STREAM_BYTES = 96 * MIB
# What a card's first park or restore allocates on it, the one allocation the guard checks for: the stream
# and its events, and the staging.
RESTORE_FIRST_USE_BYTES = STAGING_BYTES + COPY_STREAM_BYTES


@dataclass(frozen=True, slots=True)
class CardSample:
    """What the guard knows of one card just before a restore."""

    card: str  # "cuda:0"
    free_bytes: int | None  # None: no sample (the memory query failed)
    stream_ready: bool  # the card's copy stream and event exist already


def restore_fits(free_bytes: int | None, stream_ready: bool, need_bytes: int) -> bool:
    """One card: refused only with no copy stream yet and less free memory than the first use needs."""
    return stream_ready or free_bytes is None or free_bytes >= need_bytes


def refused_cards(cards: Iterable[CardSample], need_bytes: int) -> list[CardSample]:
    """The cards that refuse a restore now (none for no cards)."""
    return [c for c in cards if not restore_fits(c.free_bytes, c.stream_ready, need_bytes)]


def refusal(cards: Iterable[CardSample], need_bytes: int = RESTORE_FIRST_USE_BYTES) -> str | None:
    """Why a restore is refused, naming each card and its free memory; None when it may go ahead."""
    refused = refused_cards(cards, need_bytes)
    if not refused:
        return None
    named = ", ".join(f"{c.card} has {(c.free_bytes or 0) // MIB} MiB free" for c in refused)
    return (
        f"restore refused: {named} and no copy stream yet, under the {need_bytes // MIB} MiB "
        f"its first one needs"
    )
