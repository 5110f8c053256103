"""The byte budget, pure: which snapshots a put evicts, within its tenant only, or why it cannot fit.

Two limits hold after every put: the tenant's bytes stay within its budget (`tenant_budget`, the global
budget when not set) and all tenants' bytes within the global budget (the ceiling). A put evicts only its
own tenant's least recently used unpinned snapshots: one tenant's parks never evict another's snapshots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cache_svc.manifest import SnapshotError


class OverBudget(SnapshotError):
    """A snapshot that cannot fit the byte budget, even after evicting every unpinned one it may."""


@dataclass(frozen=True, slots=True)
class Held:
    """One stored snapshot of the tenant putting, as the budget sees it."""

    key: str
    size_bytes: int
    pinned: bool


def choose_victims(
    own: Sequence[Held],
    others_bytes: int,
    size_bytes: int,
    budget: int,
    tenant_budget: int | None = None,
) -> list[Held]:
    """The snapshots of `own` (the tenant's, least recently used first, the one replaced left out) to
    evict so that a put of `size_bytes` fits both limits; OverBudget saying why when it cannot.

    `others_bytes`: what every other tenant holds (never evicted here).
    """
    limit = budget if tenant_budget is None else min(tenant_budget, budget)
    scope = "the cache budget" if tenant_budget is None else "the tenant's budget"
    if size_bytes > limit:
        raise OverBudget(f"a snapshot of {size_bytes} bytes exceeds {scope} of {limit} bytes")
    used = sum(held.size_bytes for held in own)

    def fits(used: int) -> bool:
        return used + size_bytes <= limit and others_bytes + used + size_bytes <= budget

    victims: list[Held] = []
    for held in own:
        if fits(used):
            break
        if not held.pinned:
            victims.append(held)
            used -= held.size_bytes
    if fits(used):
        return victims
    pinned = sum(held.size_bytes for held in own if held.pinned)
    if used + size_bytes > limit:
        raise OverBudget(
            f"a snapshot of {size_bytes} bytes does not fit {scope} of {limit} bytes: pinned snapshots "
            f"hold {pinned} bytes and are never evicted"
        )
    raise OverBudget(
        f"a snapshot of {size_bytes} bytes does not fit: the cache's budget of {budget} bytes is held by "
        "other tenants' snapshots, which this put may not evict"
    )
