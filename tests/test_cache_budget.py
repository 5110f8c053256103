"""The budget's pure choice: a put evicts its own tenant's least recently used unpinned snapshots only."""

from __future__ import annotations

import pytest

from cache_svc.budget import Held, OverBudget, choose_victims


def held(*sizes, pinned=()):
    return [Held(f"k{i}", size, i in pinned) for i, size in enumerate(sizes)]


def test_nothing_is_evicted_while_it_fits():
    assert choose_victims(held(100, 100), 300, 100, budget=1000) == []


def test_the_tenants_least_recently_used_unpinned_go_first():
    own = held(100, 200, 300, pinned={0})
    victims = choose_victims(own, 0, 500, budget=1000, tenant_budget=800)
    assert [v.key for v in victims] == ["k1", "k2"]  # 600 - 500 + 500 <= 800; the pinned k0 stays


def test_the_global_ceiling_is_met_from_the_tenants_own_snapshots():
    own = held(200, 200)
    assert [v.key for v in choose_victims(own, 500, 200, budget=1000)] == ["k0"]
    with pytest.raises(OverBudget, match="held by other tenants"):
        choose_victims(own, 900, 200, budget=1000)


def test_refusals_say_which_limit_and_why():
    with pytest.raises(OverBudget, match="exceeds the tenant's budget of 300 bytes"):
        choose_victims([], 0, 301, budget=1000, tenant_budget=300)
    with pytest.raises(OverBudget, match="exceeds the cache budget of 1000 bytes"):
        choose_victims([], 0, 1001, budget=1000)
    with pytest.raises(OverBudget, match="pinned snapshots hold 250 bytes"):
        choose_victims(held(250, pinned={0}), 0, 100, budget=1000, tenant_budget=300)
