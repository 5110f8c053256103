"""The prefill chunks of one step packed into one token batch: ids, positions, write locations, page tables."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class PrefillBatch:
    """N chunks of T tokens in all, chunk i holding positions [starts[i], starts[i] + lengths[i]) of its
    sequence. Device tensors are int64; the host arrays serve the loops that need them (the CPU attention,
    the Triton kernel's block map) without a read back."""

    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    write_pages: torch.Tensor  # [T]: the page each token's K/V goes to
    write_offsets: torch.Tensor  # [T]: its offset in that page
    seq_starts: torch.Tensor  # [N + 1]: chunk i's tokens are [seq_starts[i], seq_starts[i + 1]) of T
    kv_lens: torch.Tensor  # [N]: positions each chunk's last query sees, starts + lengths
    block_tables: torch.Tensor  # [N, W]: each chunk's pages in order, zero-padded (the sink page)
    last_index: torch.Tensor  # [N]: the index in T of each chunk's last token
    starts: np.ndarray  # int64[N]
    lengths: np.ndarray  # int64[N]
    page_counts: np.ndarray  # int64[N]
    seq_starts_host: np.ndarray  # int64[N + 1]

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @classmethod
    def build(
        cls,
        chunks: Sequence[tuple[np.ndarray, int, np.ndarray]],
        page_size: int,
        max_seq_len: int,
        device: torch.device,
    ) -> PrefillBatch:
        """chunks: (token_ids int[n], start, pages int[p] covering positions [0, start + n)). One host-to-device
        copy for the lot."""
        if not chunks:
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
            raise ValueError(f"chunk {i}: {page_counts[i]} pages of {page_size} cannot hold {ends[i]} positions")
        total, n, width = int(lengths.sum()), len(chunks), int(page_counts.max())
        seq_starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=seq_starts[1:])
        positions = np.concatenate([np.arange(s, e, dtype=np.int64) for s, e in zip(starts, ends)])
        tables = np.zeros((n, width), dtype=np.int64)
        for i, (_, _, pages) in enumerate(chunks):
            tables[i, : len(pages)] = pages
        chunk_of = np.repeat(np.arange(n), lengths)
        # packed: ids, positions, write pages, write offsets [T each]; seq starts [N+1]; kv lens [N];
        # block tables [N * W]; last index [N]
        packed = np.concatenate([
            np.concatenate([ids for ids, _, _ in chunks]).astype(np.int64),
            positions,
            tables[chunk_of, positions // page_size],
            positions % page_size,
            seq_starts,
            ends,
            tables.reshape(-1),
            seq_starts[1:] - 1,
        ])
        on_device = torch.from_numpy(packed).to(device)
        views = on_device.split([total] * 4 + [n + 1, n, n * width, n])
        return cls(
            token_ids=views[0],
            positions=views[1],
            write_pages=views[2],
            write_offsets=views[3],
            seq_starts=views[4],
            kv_lens=views[5],
            block_tables=views[6].view(n, width),
            last_index=views[7],
            starts=starts,
            lengths=lengths,
            page_counts=page_counts,
            seq_starts_host=seq_starts,
        )
