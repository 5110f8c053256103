"""Checkpoint retention per conversation (DESIGN §4): which prefix checkpoints stay under the cap."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal, get_args

Policy = Literal["lru", "spread"]  # the names of the eviction policies, here only
POLICIES: tuple[Policy, ...] = get_args(Policy)


@dataclass(slots=True)
class RetentionConfig:
    cap: int = 6  # checkpoints kept per conversation; only a pin can hold it above this
    policy: Policy = "spread"

    def __post_init__(self) -> None:
        if self.cap < 1:
            raise ValueError(f"cap must be positive, got {self.cap}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")


class Retention:
    """The retained checkpoints of one conversation: positions (tokens covered) on one branch of history.

    They always form a prefix chain, so a checkpoint is just its position. Eviction, in this order:
    never the newest (the greatest position, the one the next turn resumes from); never the pin (a
    shared read-only prefix; one at a time); the root (end of the system prompt) only when the cap
    is 1 or nothing else can go; among the rest, the policy's victim:

    - lru: the least recently used, where an add or a mount is a use.
    - spread: removing checkpoint c merges its gaps into one, from prev (its older neighbour, 0 for
      the oldest) to next; a resume that lands there re-reads up to next - prev tokens. The victim
      minimises (next - prev) / (newest - prev): that gap relative to how far it reaches back from
      the newest, so kept points are dense near the newest and thin out geometrically behind it
      (200 turns of 1K tokens, cap 6: 0, 1K, 3K, 8K, 43K back and the root). Ties: lru.

    With no candidate beyond the newest and the pin, the cap is exceeded by the pin alone (cap 1).
    """

    def __init__(self, config: RetentionConfig) -> None:
        self.config = config
        self._positions: list[int] = []  # sorted, unique
        self._last_used: dict[int, int] = {}  # position -> clock of its last add or mount
        self._clock = 0
        self._root: int | None = None
        self._pinned: int | None = None

    @property
    def positions(self) -> list[int]:
        return list(self._positions)

    @property
    def root(self) -> int | None:
        return self._root

    @property
    def pinned(self) -> int | None:
        return self._pinned

    def add(self, position: int, *, root: bool = False, pinned: bool = False) -> list[int]:
        """Retain a checkpoint (re-date it if already kept); return the positions evicted for the cap.

        A position below the newest is allowed (a pin marked inside retained history); unless root
        or pinned it competes like any other, and may be the one evicted.
        """
        if position < 1:
            raise ValueError(f"a checkpoint covers at least one token, got position {position}")
        if position not in self._last_used:
            bisect.insort(self._positions, position)
        self._touch(position)
        if root:
            self._root = position  # one root: an older one becomes an ordinary checkpoint
        if pinned:
            self._pinned = position
        return self._evict_over_cap()

    def pin(self, position: int) -> list[int]:
        """Pin a retained checkpoint; the previous pin (one at a time) becomes ordinary and may go."""
        self._require(position)
        self._pinned = position
        return self._evict_over_cap()

    def mount(self, position: int) -> None:
        """A request resumed from this checkpoint: re-date it, and only it."""
        self._require(position)
        self._touch(position)

    def best_prefix(self, common: int) -> int | None:
        """The longest retained checkpoint within `common` tokens (the prompt's common prefix), if any."""
        index = bisect.bisect_right(self._positions, common)
        return self._positions[index - 1] if index else None

    def drop_after(self, position: int) -> list[int]:
        """History diverged at `position`: drop the checkpoints past it (not a prefix any more)."""
        index = bisect.bisect_right(self._positions, position)
        dropped = self._positions[index:]
        for gone in dropped:
            self._remove(gone)
        return dropped

    def evict_one(self) -> int | None:
        """Evict the policy's victim now (never the newest or the pin; pressure on what checkpoints hold)."""
        victim = self._victim()
        if victim is not None:
            self._remove(victim)
        return victim

    def remove(self, position: int) -> None:
        """Forget one checkpoint (what it held is gone), whatever the policy says."""
        self._require(position)
        self._remove(position)

    def _evict_over_cap(self) -> list[int]:
        evicted = []
        while len(self._positions) > self.config.cap and (victim := self._victim()) is not None:
            self._remove(victim)
            evicted.append(victim)
        return evicted

    def _victim(self) -> int | None:
        unpinned = [p for p in self._positions[:-1] if p != self._pinned]  # never the newest or the pin
        keep_root = self.config.cap >= 2  # room for root and leaf apart
        candidates = [p for p in unpinned if not (keep_root and p == self._root)]
        pool = candidates or unpinned  # no candidate: the plain policy, the root included
        return min(pool, key=self._eviction_order) if pool else None

    def _eviction_order(self, position: int) -> tuple:
        """Sort key of a victim candidate (never the newest): smallest first."""
        if self.config.policy == "lru":
            return (self._last_used[position],)
        index = bisect.bisect_left(self._positions, position)
        prev = self._positions[index - 1] if index else 0
        next_ = self._positions[index + 1]
        newest = self._positions[-1]
        # Exact ratio: equal gaps on a uniform turn grid must tie, then fall to lru.
        return (Fraction(next_ - prev, newest - prev), self._last_used[position])

    def _touch(self, position: int) -> None:
        self._clock += 1
        self._last_used[position] = self._clock

    def _remove(self, position: int) -> None:
        self._positions.remove(position)
        del self._last_used[position]
        if position == self._root:
            self._root = None
        if position == self._pinned:
            self._pinned = None

    def _require(self, position: int) -> None:
        if position not in self._last_used:
            raise KeyError(f"no retained checkpoint at position {position}")
