"""The prefill chunks of one step packed into one token batch: ids, positions, write locations, page tables,
the attention's query blocks and the chunks that sample; exact, or padded to a captured graph's shape."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from executor_svc.attention import StepInputs
from executor_svc.staging import upload_once

QUERY_BLOCK = 64  # queries of one chunk per program of the prefill attention kernel: the block map's unit


@dataclass(frozen=True, slots=True)
class PrefillShape:
    """The sizes a batch is laid out in: its own (`exact`), or a graph's, which padding fills.

    Chunk arrays hold one chunk more than `chunks`: an empty chunk that the padding query blocks point at."""

    tokens: int
    chunks: int
    samples: int
    table_width: int  # pages per chunk row of the block tables

    @property
    def blocks(self) -> int:
        # each chunk's ceil(length / QUERY_BLOCK) blocks sum to at most this
        return -(-self.tokens // QUERY_BLOCK) + self.chunks

    @property
    def sizes(self) -> list[int]:
        """Words of each array in the packed layout, in the order of PrefillBatch's device fields."""
        t, c, s, b = self.tokens, self.chunks, self.samples, self.blocks
        return [t, t, t, t, c + 2, c + 1, (c + 1) * self.table_width, c, b, b, s, s, s]

    @property
    def words(self) -> int:
        return sum(self.sizes)

    def holds(self, other: PrefillShape) -> bool:
        return (
            other.tokens <= self.tokens
            and other.chunks <= self.chunks
            and other.samples <= self.samples
            and other.table_width <= self.table_width
        )


@dataclass(slots=True)
class PrefillBatch:
    """N chunks of T tokens in all, chunk i holding positions [starts[i], starts[i] + lengths[i]) of its
    sequence; S of them end their prompt and sample. Device tensors are int64 views of one packed buffer (the
    padding of a graph's shape included); the host arrays serve the loops that need them (the CPU attention)
    without a read back.

    Padding tokens read token 0 at position 0 and write the sink page; padding query blocks point at the empty
    chunk after the real ones; padding samples read token 0 into the sink slot. None of them changes a real
    page or slot."""

    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    write_pages: torch.Tensor  # [T]: the page each token's K/V goes to
    write_offsets: torch.Tensor  # [T]: its offset in that page
    seq_starts: torch.Tensor  # [N + 2]: chunk i's tokens are [seq_starts[i], seq_starts[i + 1]) of T
    kv_lens: (
        torch.Tensor
    )  # [N + 1]: positions each chunk's last query sees, starts + lengths (0: empty chunk)
    block_tables: torch.Tensor  # [N + 1, W]: each chunk's pages in order, zero-padded (the sink page)
    last_index: torch.Tensor  # [N]: the index in T of each chunk's last token
    block_chunk: torch.Tensor  # [blocks]: the chunk of each query block of the attention
    block_first: torch.Tensor  # [blocks]: the index in T of its first query
    sample_index: torch.Tensor  # [S]: the index in T of each sampling chunk's last token
    sample_slots: torch.Tensor  # [S]: the slot its token loops back into
    sample_counters: torch.Tensor  # [S]: the sampler's counter, the position of the token sampled
    starts: np.ndarray  # int64[N]
    lengths: np.ndarray  # int64[N]
    page_counts: np.ndarray  # int64[N]
    seq_starts_host: np.ndarray  # int64[N + 1]
    sampled_chunks: np.ndarray  # int64[S]: which chunks sample, in order

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def inputs(self) -> StepInputs:
        """The tokens as the model's rows: a prefill token is a row whose stored length before it is its
        position."""
        return StepInputs(
            self.token_ids, self.positions, self.positions, self.write_pages, self.write_offsets
        )

    @staticmethod
    def exact_shape(chunks: Sequence[tuple[np.ndarray, int, np.ndarray]], samples: int) -> PrefillShape:
        return PrefillShape(
            tokens=sum(len(ids) for ids, _, _ in chunks),
            chunks=len(chunks),
            samples=samples,
            table_width=max((len(pages) for _, _, pages in chunks), default=0),
        )

    @classmethod
    def build(
        cls,
        chunks: Sequence[tuple[np.ndarray, int, np.ndarray]],
        page_size: int,
        max_seq_len: int,
        device: torch.device,
        *,
        sample_slots: Sequence[int] = (),
        shape: PrefillShape | None = None,
        upload: Callable[[np.ndarray], torch.Tensor] | None = None,
    ) -> PrefillBatch:
        """chunks: (token_ids int[n], start, pages int[p] covering positions [0, start + n)); sample_slots: the
        slot each chunk samples into, 0 where it does not (default: none samples). `shape` pads to a graph's
        sizes (default the batch's own). `upload` puts the batch's int64 words on the device and returns them
        there (a graph's staging, whose device buffer the graph reads); default: a buffer of their own. One
        host-to-device copy for the lot, from pinned memory on CUDA: no wait for the device."""
        if not chunks and shape is None:
            raise ValueError("a prefill batch needs at least one chunk")
        starts = np.array([start for _, start, _ in chunks], dtype=np.int64)
        lengths = np.array([len(ids) for ids, _, _ in chunks], dtype=np.int64)
        page_counts = np.array([len(pages) for _, _, pages in chunks], dtype=np.int64)
        ends = starts + lengths
        if (lengths < 1).any() or (starts < 0).any() or (ends > max_seq_len).any():
            i = int(np.flatnonzero((lengths < 1) | (starts < 0) | (ends > max_seq_len))[0])
            raise ValueError(
                f"chunk {i}: positions [{starts[i]}, {ends[i]}) are empty or exceed the context of {max_seq_len}"
            )
        short = page_counts * page_size < ends
        if short.any():
            i = int(np.flatnonzero(short)[0])
            raise ValueError(
                f"chunk {i}: {page_counts[i]} pages of {page_size} cannot hold {ends[i]} positions"
            )
        slots = (
            np.asarray(sample_slots, dtype=np.int64) if len(sample_slots) else np.zeros(len(chunks), np.int64)
        )
        if len(slots) != len(chunks):
            raise ValueError(f"{len(slots)} sample slots for {len(chunks)} chunks")
        sampled = np.flatnonzero(slots)
        own = cls.exact_shape(chunks, len(sampled))
        shape = own if shape is None else shape
        if not shape.holds(own):
            raise ValueError(f"a batch of {own} does not fit the shape {shape}")

        total, n = int(lengths.sum()), len(chunks)
        seq_starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=seq_starts[1:])
        parts = [np.zeros(size, dtype=np.int64) for size in shape.sizes]
        token_ids, positions, write_pages, write_offsets, starts_out, kv_lens, tables, last = parts[:8]
        block_chunk, block_first = parts[8:10]
        sample_index, slots_out, counters = parts[10:]
        if n:
            token_ids[:total] = np.concatenate([ids for ids, _, _ in chunks])
            positions[:total] = np.concatenate(
                [np.arange(s, e, dtype=np.int64) for s, e in zip(starts, ends)]
            )
            table_rows = tables.reshape(shape.chunks + 1, shape.table_width)
            for i, (_, _, pages) in enumerate(chunks):
                table_rows[i, : len(pages)] = pages
            chunk_of = np.repeat(np.arange(n), lengths)
            write_pages[:total] = table_rows[chunk_of, positions[:total] // page_size]
            write_offsets[:total] = positions[:total] % page_size
        starts_out[: n + 1] = seq_starts
        starts_out[n + 1 :] = total  # the empty chunk, and the unused ones after it
        kv_lens[:n] = ends
        last[:n] = seq_starts[1:] - 1
        # Query blocks: each chunk's tokens in blocks of QUERY_BLOCK; the padding blocks hold the empty chunk.
        per_chunk = -(-lengths // QUERY_BLOCK)
        owner = np.repeat(np.arange(n), per_chunk)
        within = np.arange(len(owner)) - np.repeat(np.cumsum(per_chunk) - per_chunk, per_chunk)
        block_chunk[: len(owner)], block_chunk[len(owner) :] = owner, n
        block_first[: len(owner)], block_first[len(owner) :] = seq_starts[owner] + within * QUERY_BLOCK, total
        sample_index[: len(sampled)] = last[sampled]
        slots_out[: len(sampled)] = slots[sampled]
        counters[: len(sampled)] = ends[sampled]

        packed = np.concatenate(parts)
        words = upload_once(packed, device) if upload is None else upload(packed)
        views = words.split(shape.sizes)
        return cls(
            token_ids=views[0],
            positions=views[1],
            write_pages=views[2],
            write_offsets=views[3],
            seq_starts=views[4],
            kv_lens=views[5],
            block_tables=views[6].view(shape.chunks + 1, shape.table_width),
            last_index=views[7],
            block_chunk=views[8],
            block_first=views[9],
            sample_index=views[10],
            sample_slots=views[11],
            sample_counters=views[12],
            starts=starts,
            lengths=lengths,
            page_counts=page_counts,
            seq_starts_host=seq_starts,
            sampled_chunks=sampled,
        )
