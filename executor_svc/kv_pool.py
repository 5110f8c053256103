"""The paged KV pool: K and V of every layer in fixed-size pages; page 0 is the sink page."""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog
import torch

if TYPE_CHECKING:
    from executor_svc.slot_store import SlotStore

log = structlog.get_logger("deltaserve.executor.kv_pool")

SINK_PAGE = 0


class KVPool:
    """`k`, `v`: [layers, pages, page_size, kv_heads, head_dim].

    Padding rows write their K/V into the sink page; no row ever attends over it past length 1,
    so what lies there does not matter (it only has to stay finite, hence zeros at birth).

    No layers is a stage of a hybrid's layer split holding gated delta nets only: its pages are numbers the
    planner hands out to every stage alike, with no bytes here.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_layers < 0 or num_kv_heads < 1 or head_dim < 1:
            raise ValueError(
                f"num_layers must not be negative, num_kv_heads and head_dim must be positive, "
                f"got {num_layers}, {num_kv_heads}, {head_dim}"
            )
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is the sink page), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        # k, v: [layers, pages, page_size, kv_heads, head_dim]
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(
        self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store k[n, kv_heads, head_dim], v[n, ...] at (pages[n], offsets[n]) of `layer`; no host sync."""
        index = (pages, offsets)
        self.k[layer].index_put_(index, k)
        self.v[layer].index_put_(index, v)


def log_tables(kv_pool: KVPool, store: SlotStore) -> None:
    """The start-up log line of the device memory beside the weights: the KV pool, and the sampling controls'
    per-slot token tables (allocated whole at start, since the captured CONTROLLED graphs read them)."""
    controls = store.controls
    log.info(
        f"KV pool: {kv_pool.num_pages} pages of {kv_pool.page_size} tokens, {kv_pool.nbytes / 2**20:.1f} MiB; "
        f"sampler controls: {len(controls.on)} slots x {controls.vocab_size} tokens, "
        f"{controls.nbytes / 2**20:.1f} MiB"
    )
