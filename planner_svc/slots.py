"""The slot cache of DESIGN §2: which slot-store row each request holds, and who gets displaced."""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar, cast

SINK_SLOT = 0
_NO_HOLDER = object()  # request ids may be any hashable, None included
K = TypeVar("K", bound=Hashable)  # the request id type of one cache (the scheduler's: its Request objects)


@dataclass(slots=True)
class Assignment(Generic[K]):
    """One step's slots, row for row, and what changed to give them."""

    slots: list[int]
    fresh: list[K] = field(default_factory=list)  # took a slot this step: write their rows whole
    displaced: list[K] = field(default_factory=list)  # lost their slot: fresh when they next run


class SlotCache(Generic[K]):
    """Slots 1..2B, each free, cooling (released, a step that read it is uncommitted) or held.

    Slots are a cache, not a quota: a request without one takes a free one, or displaces the least
    recently run holder outside this step that no uncommitted step read. 2B is always enough while
    the caller plans `seq` only after `commit(seq - 2)`.
    """

    def __init__(self, widest_bucket: int) -> None:
        if widest_bucket < 1:
            raise ValueError(f"widest_bucket must be positive, got {widest_bucket}")
        self.widest_bucket = widest_bucket
        self.num_slots = 2 * widest_bucket + 1
        self._holder: list[object] = [_NO_HOLDER] * self.num_slots
        self._last_read = [-1] * self.num_slots  # seq of the last step that read the slot
        self._take_order = [0] * self.num_slots  # ties between equally stale holders: first taker first
        self._takes = 0
        self._slot_of: dict[K, int] = {}
        self._free = list(range(self.num_slots - 1, SINK_SLOT, -1))  # popped from the end: slot 1 first
        self._cooling: set[int] = set()
        self._committed = -1
        self._last_seq = -1

    @property
    def committed(self) -> int:
        return self._committed

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def cooling_count(self) -> int:
        return len(self._cooling)

    @property
    def held_count(self) -> int:
        return len(self._slot_of)

    def slot_of(self, request_id: K) -> int | None:
        return self._slot_of.get(request_id)

    def slots_of(self, request_ids: Sequence[K]) -> list[int | None]:
        """slot_of of each, in one pass."""
        return list(map(self._slot_of.get, request_ids))

    def held_slot(self, request_id: K) -> int:
        """The slot of a request that holds one (a KeyError names one that holds none)."""
        return self._slot_of[request_id]

    def assign(self, seq: int, request_ids: Sequence[K]) -> Assignment[K]:
        """The slots of step `seq`'s rows; holders keep theirs, the others take free or displaced ones."""
        if seq <= self._last_seq or seq <= self._committed:
            raise ValueError(f"plan {seq} is not after plan {self._last_seq} and commit {self._committed}")
        if len(request_ids) > self.widest_bucket:
            raise ValueError(f"{len(request_ids)} rows exceed the widest bucket {self.widest_bucket}")
        slot_of = self._slot_of
        slots: list = list(map(slot_of.get, request_ids))  # None for a row without a slot, until given one
        if len(set(request_ids)) != len(request_ids):
            raise ValueError(f"plan {seq} lists a request twice")
        self._last_seq = seq
        last_read = self._last_read
        if None not in slots:  # the steady step: every row kept its slot
            for slot in slots:
                last_read[slot] = seq
            return Assignment(slots)
        for slot in slots:
            if slot is not None:  # marked first, so no member of this step is taken as a victim
                last_read[slot] = seq
        assignment: Assignment[K] = Assignment(slots)
        missing = [row for row, slot in enumerate(slots) if slot is None]
        victims = self._victims(len(missing) - len(self._free))
        for row in missing:
            if self._free:
                slot = self._free.pop()
            else:
                slot = victims.pop()
                victim = cast(K, self._holder[slot])  # a victim's slot is held: its holder is a request id
                del slot_of[victim]
                assignment.displaced.append(victim)
            request_id = request_ids[row]
            self._holder[slot] = request_id
            slot_of[request_id] = slot
            last_read[slot] = seq
            self._takes += 1
            self._take_order[slot] = self._takes
            slots[row] = slot
            assignment.fresh.append(request_id)
        return assignment

    def _victims(self, count: int) -> list[int]:
        """The `count` least recently run holders whose last reader is committed, the least recent last."""
        if count <= 0:
            return []
        committed, last_read, take_order = self._committed, self._last_read, self._take_order
        eligible = [
            (last_read[slot], take_order[slot], slot)
            for slot in self._slot_of.values()
            if last_read[slot] <= committed
        ]
        if len(eligible) < count:
            raise RuntimeError(
                f"{count} slots needed, {len(eligible)} displaceable: a plan was made before the commit "
                f"of the step two before it (committed {committed}, planning {self._last_seq})"
            )
        return [slot for _, _, slot in reversed(heapq.nsmallest(count, eligible))]

    def commit(self, seq: int) -> None:
        """Step `seq` and all before it finished: cooling slots they were the last readers of are free."""
        if seq <= self._committed:
            return
        self._committed = seq
        cooled = [slot for slot in self._cooling if self._last_read[slot] <= seq]
        self._cooling.difference_update(cooled)
        self._free.extend(cooled)

    def release(self, request_id: K) -> None:
        """The request finished, aborted or parked: its slot cools until its last reader commits."""
        slot = self._slot_of.pop(request_id, None)
        if slot is None:
            return
        self._holder[slot] = _NO_HOLDER
        if self._last_read[slot] <= self._committed:
            self._free.append(slot)
        else:
            self._cooling.add(slot)

    def check(self) -> None:
        """Assert that free, cooling and held partition slots 1..S-1 exactly."""
        free, cooling, held = set(self._free), self._cooling, set(self._slot_of.values())
        assert len(free) == len(self._free), "a slot is twice on the free list"
        assert len(held) == len(self._slot_of), "two requests hold one slot"
        assert not (free & cooling or free & held or cooling & held), "a slot is in two states"
        assert free | cooling | held == set(range(1, self.num_slots)), "free, cooling and held miss a slot"
        for request_id, slot in self._slot_of.items():
            assert self._holder[slot] == request_id, f"slot {slot} is held by someone else"
        assert sum(holder is not _NO_HOLDER for holder in self._holder) == len(held), "a stale holder"
        assert all(self._last_read[slot] > self._committed for slot in cooling), "a committed slot cools"
