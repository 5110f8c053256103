"""The recurrent-state slots of one executor group's state pool (DESIGN §2's STATE_SLOT column): slot 0 is the
sink slot, never handed out; a request takes one at admission and gives it back after the commit of its last
step (the scheduler calls `give_back` only then, so a slot never changes hands under a step that reads it)."""

from __future__ import annotations

from collections.abc import Iterable

SINK_SLOT = 0


class StateSlots:
    """Slots 1..num_slots-1, each free or taken. `num_slots` 0: the model has no recurrent layers, and
    nothing is ever taken."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0 or num_slots == 1:
            raise ValueError(
                f"state slots must be 0 (none) or at least 2 (slot 0 is the sink), got {num_slots}"
            )
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, SINK_SLOT, -1))  # popped from the end: slot 1 first
        self._taken: set[int] = set()

    @property
    def enabled(self) -> bool:
        return self.num_slots > 0

    @property
    def total(self) -> int:
        """Slots a request can hold (the sink excluded)."""
        return max(self.num_slots - 1, 0)

    @property
    def free_count(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:
            raise RuntimeError(f"no free state slot (all {self.total} taken)")
        slot = self._free.pop()
        self._taken.add(slot)
        return slot

    def give_back(self, slot: int) -> None:
        if slot not in self._taken:
            raise ValueError(f"state slot {slot} is not taken")
        self._taken.remove(slot)
        self._free.append(slot)

    def reset(self, keep: Iterable[int] = ()) -> None:
        """Every slot free (the pool's states were lost with their executor) but `keep` (slots an executor RPC
        may still write: loans.py)."""
        kept = set(keep)
        if not kept <= set(range(1, self.num_slots)):
            raise ValueError(f"state slots {sorted(kept)} are not all pool slots (1..{self.num_slots - 1})")
        self._taken = kept
        self._free = [slot for slot in range(self.num_slots - 1, SINK_SLOT, -1) if slot not in kept]

    def check(self) -> None:
        """Free and taken partition slots 1..num_slots-1 (DESIGN §7 invariant 2, for state slots)."""
        free = set(self._free)
        if (
            len(free) != len(self._free)
            or free & self._taken
            or free | self._taken != set(range(1, self.num_slots))
        ):
            raise AssertionError(
                f"state slots: free {sorted(free)} and taken {sorted(self._taken)} do not partition"
            )
