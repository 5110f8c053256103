"""The restore guard: the predicate alone, and the card's copy stream before and after its first copy (a
refused restore over real gRPC is in test_snapshots.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor_svc.copy_stream import CopyStream
from executor_svc.restore_guard import (
    RESTORE_FIRST_USE_BYTES,
    CardSample,
    refusal,
    refused_cards,
    restore_fits,
)

NEED = RESTORE_FIRST_USE_BYTES


def test_a_card_with_its_stream_is_admitted_at_any_free_size():
    for free in (0, 1, NEED - 1, NEED, 80 << 30, None):
        assert restore_fits(free, stream_ready=True, need_bytes=NEED)


def test_a_card_without_a_stream_is_refused_only_under_the_need():
    assert not restore_fits(0, stream_ready=False, need_bytes=NEED)
    assert not restore_fits(NEED - 1, stream_ready=False, need_bytes=NEED)  # the edge at the need
    assert restore_fits(NEED, stream_ready=False, need_bytes=NEED)
    assert restore_fits(None, stream_ready=False, need_bytes=NEED)  # no sample: go ahead
    assert restore_fits(0, stream_ready=False, need_bytes=0)  # no need


def test_cards_each_checked_and_named_in_the_refusal():
    assert refusal([]) is None  # no cards
    full_ready = CardSample("cuda:0", 0, True)
    roomy = CardSample("cuda:1", 2 * NEED, False)
    unsampled = CardSample("cuda:2", None, False)
    assert refusal([full_ready, roomy, unsampled]) is None
    short = CardSample("cuda:3", 10 << 20, False)
    assert refused_cards([full_ready, short, roomy], NEED) == [short]
    why = refusal([full_ready, short])
    assert why is not None and "cuda:3 has 10 MiB free" in why and f"{NEED >> 20} MiB" in why
    assert "cuda:0" not in why


def test_the_copy_stream_is_ready_after_its_first_copy():
    stream = CopyStream(torch.device("cpu"))
    assert stream.cards() == []  # no card: nothing to guard
    sampled = CopyStream(torch.device("cpu"), free_memory=lambda: 5)
    assert sampled.cards() == [CardSample("cpu", 5, False)]
    pool = torch.zeros(2, 4, 16)  # [layers, pages, page]
    sampled.scatter((pool,), np.ones((2, 1, 1, 64), dtype=np.uint8), np.array([3]))
    assert sampled.cards() == [CardSample("cpu", 5, True)]
    assert pool[:, 3].view(torch.uint8).eq(1).all() and not pool[:, :3].any()

    def failing() -> int:
        raise RuntimeError("no memory query")

    assert CopyStream(torch.device("cpu"), free_memory=failing).cards() == [CardSample("cpu", None, False)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a card's copy stream needs CUDA")
def test_on_a_card_the_first_copy_makes_the_stream_and_later_restores_allocate_nothing():
    device = torch.device("cuda")
    stream = CopyStream(device)
    assert not stream.ready and stream.cards()[0].free_bytes is not None
    pool = torch.zeros(4, 1 << 12, 1 << 12, device=device)  # [layers, pages, page]: 256 MiB
    stream.warm((pool,))
    torch.cuda.synchronize()
    free = torch.cuda.mem_get_info(device)[0]
    pages = np.arange(1, 1 << 11)
    snapshot = np.ones((4, 1, len(pages), 1 << 14), dtype=np.uint8)  # 128 MiB, 16 times the staging
    stream.scatter((pool,), snapshot, pages)
    torch.cuda.synchronize()
    assert stream.ready
    assert free - torch.cuda.mem_get_info(device)[0] <= RESTORE_FIRST_USE_BYTES
    allocated = torch.cuda.memory_allocated(device)
    free = torch.cuda.mem_get_info(device)[0]
    for _ in range(3):
        stream.scatter((pool,), snapshot, pages[::-1].copy())
        assert (stream.gather((pool,), pages) == 1).all()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(device) == allocated
    assert torch.cuda.mem_get_info(device)[0] == free
