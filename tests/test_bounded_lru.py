"""The executor's bounded LRU map (its compiled grammars)."""

from __future__ import annotations

import pytest

from executor_svc.bounded_lru import BoundedLru


def test_the_entry_used_longest_ago_goes_first():
    lru: BoundedLru[str, int] = BoundedLru(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1  # now b is the oldest
    lru.put("c", 3)
    assert "b" not in lru and (lru.get("a"), lru.get("c"), len(lru)) == (1, 3, 2)
    lru.put("a", 4)  # put again: replaced, and the newest
    lru.put("d", 5)
    assert "c" not in lru and lru.get("a") == 4 and lru.get("missing") is None


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="at least one entry, got capacity 0"):
        BoundedLru(0)
