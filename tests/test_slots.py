"""SlotCache: the DESIGN §2 rules one by one, then a soak against a brute-force oracle."""

from __future__ import annotations

import random
import time

import pytest

from planner_svc.slots import SINK_SLOT, SlotCache


def run(cache: SlotCache, seq: int, request_ids: list):
    assignment = cache.assign(seq, request_ids)
    cache.check()
    return assignment


def full_cache() -> SlotCache:
    """B = 2, so slots 1..4, held by a b (step 0) and c d (step 1), both steps committed."""
    cache = SlotCache(2)
    run(cache, 0, ["a", "b"])
    cache.commit(0)
    run(cache, 1, ["c", "d"])
    cache.commit(1)
    cache.check()
    return cache


def test_size_is_two_buckets_and_the_sink():
    cache = SlotCache(4)
    assert cache.num_slots == 9 and cache.free_count == 8
    assert cache.held_count == cache.cooling_count == 0 and cache.committed == -1
    with pytest.raises(ValueError):
        SlotCache(0)


def test_new_requests_get_fresh_slots_and_holders_keep_theirs():
    cache = SlotCache(2)
    first = run(cache, 0, ["a", "b"])
    assert first.slots == [1, 2] and first.fresh == ["a", "b"] and first.displaced == []
    again = run(cache, 1, ["b", "a"])
    assert again.slots == [2, 1] and again.fresh == [] and again.displaced == []
    mixed = run(cache, 2, ["c", "a"])
    assert mixed.slots == [3, 1] and mixed.fresh == ["c"]
    assert cache.slot_of("a") == 1 and cache.slot_of("zz") is None and cache.held_count == 3


def test_the_sink_slot_is_never_handed_out():
    cache = SlotCache(3)
    seen = set()
    for seq in range(40):
        cache.commit(seq - 2)
        seen.update(run(cache, seq, [f"r{seq}-{i}" for i in range(3)]).slots)
    assert SINK_SLOT not in seen and seen == set(range(1, 7))


def test_displacement_takes_the_least_recently_run():
    cache = full_cache()
    step = run(cache, 2, ["e"])
    assert step.displaced == ["a"] and step.fresh == ["e"] and step.slots == [1]
    assert cache.slot_of("a") is None and cache.cooling_count == 0  # reused at once, no cooling
    cache.commit(2)
    run(cache, 3, ["b", "c"])  # b and c ran: d is now the least recent
    cache.commit(3)
    step = run(cache, 4, ["f"])
    assert step.displaced == ["d"] and step.slots == [4]


def test_ties_go_by_the_order_holders_took_their_slots():
    cache = SlotCache(2)
    run(cache, 0, ["b", "a"])  # same step: b took first
    cache.commit(0)
    run(cache, 1, ["c", "d"])
    cache.commit(1)
    step = run(cache, 2, ["e", "f"])
    assert step.displaced == ["b", "a"] and step.slots == [1, 2]


def test_a_member_of_this_step_is_never_displaced():
    cache = full_cache()
    step = run(cache, 2, ["a", "e"])  # a is the least recent, but it runs now
    assert step.displaced == ["b"] and step.slots == [1, 2] and cache.slot_of("a") == 1


def test_a_slot_read_by_an_uncommitted_step_is_never_displaced():
    cache = SlotCache(1)  # slots 1, 2
    run(cache, 0, ["a"])
    run(cache, 1, ["b"])
    with pytest.raises(RuntimeError):  # only possible when planning ahead of commit(seq - 2)
        cache.assign(2, ["c"])
    assert cache.slot_of("a") == 1 and cache.slot_of("b") == 2
    cache.commit(0)
    step = run(cache, 3, ["c"])
    assert step.displaced == ["a"] and step.slots == [1]


def test_a_displaced_request_gets_a_fresh_slot_when_it_runs_again():
    cache = full_cache()
    run(cache, 2, ["e"])
    cache.commit(2)
    step = run(cache, 3, ["a"])
    assert step.fresh == ["a"] and step.displaced == ["b"] and step.slots == [2]


def test_a_released_slot_cools_until_its_last_reader_commits():
    cache = SlotCache(1)
    run(cache, 0, ["a"])
    cache.release("a")
    cache.check()
    assert cache.cooling_count == 1 and cache.free_count == 1 and cache.slot_of("a") is None
    step = run(cache, 1, ["b"])
    assert step.slots == [2]  # not slot 1: step 0 still reads it
    cache.commit(0)
    cache.check()
    assert cache.cooling_count == 0 and cache.free_count == 1
    cache.release("b")  # read by step 1, not yet committed
    cache.commit(0)  # an old commit again changes nothing
    assert cache.cooling_count == 1
    cache.commit(1)
    cache.check()
    assert cache.cooling_count == 0 and cache.free_count == 2 and cache.committed == 1


def test_release_after_the_commit_frees_at_once_and_is_idempotent():
    cache = SlotCache(2)
    run(cache, 0, ["a", "b"])
    cache.commit(0)
    cache.release("a")
    cache.release("a")
    cache.release("never seen")
    cache.check()
    assert cache.free_count == 3 and cache.cooling_count == 0 and cache.held_count == 1
    assert run(cache, 1, ["a"]).fresh == ["a"]


def test_any_hashable_is_a_request_id():
    cache = SlotCache(2)
    assert run(cache, 0, [None, (1, "x")]).slots == [1, 2]
    assert run(cache, 1, [None]).fresh == []


@pytest.mark.parametrize(
    "seq, rows",
    [(5, ["a", "b", "c"]), (3, ["a"]), (2, ["a"]), (6, ["a", "a"]), (6, ["x", "x"])],
    ids=["too many rows", "seq repeated", "seq not after the commit", "held twice", "new twice"],
)
def test_bad_plans_raise_and_change_nothing(seq, rows):
    cache = SlotCache(2)
    run(cache, 2, ["a", "b"])
    cache.commit(2)
    run(cache, 3, ["a"])
    before = ({r: cache.slot_of(r) for r in "abx"}, cache.free_count, cache.held_count)
    with pytest.raises(ValueError):
        cache.assign(seq, rows)
    cache.check()
    assert ({r: cache.slot_of(r) for r in "abx"}, cache.free_count, cache.held_count) == before
    assert run(cache, 4, ["b", "x"]).fresh == ["x"]  # and the next good plan still goes through


def test_a_steady_step_is_cheap():
    cache = SlotCache(64)
    rows = [f"req-{i}" for i in range(64)]
    run(cache, 0, rows)
    steps = 20_000
    start = time.perf_counter()
    for seq in range(1, steps + 1):
        cache.assign(seq, rows)
    per_step = (time.perf_counter() - start) / steps
    assert per_step < 50e-6, f"{per_step * 1e6:.1f} us per 64-row steady step"  # ~4 us here; loose for CI


class Oracle:
    """The slot rules restated by brute force: per request its slot, last reading step and take number."""

    def __init__(self, widest_bucket: int):
        self.num_slots = 2 * widest_bucket + 1
        self.slot: dict[str, int] = {}
        self.last_read: dict[str, int] = {}
        self.took: dict[str, int] = {}
        self.takes = 0
        self.slot_reader: dict[int, int] = {}  # last step that read each slot
        self.cooling: set[int] = set()
        self.committed = -1

    def free_slots(self) -> set[int]:
        return set(range(1, self.num_slots)) - set(self.slot.values()) - self.cooling

    def expected_victims(self, seq: int, rows: list[str]) -> list[str]:
        missing = [r for r in rows if r not in self.slot]
        eligible = [r for r in self.slot if r not in rows and self.last_read[r] <= self.committed]
        eligible.sort(key=lambda r: (self.last_read[r], self.took[r]))
        return eligible[: max(0, len(missing) - len(self.free_slots()))]

    def apply(self, seq: int, rows: list[str], assignment) -> None:
        free = self.free_slots()
        victims = {self.slot[r]: r for r in assignment.displaced}
        assert assignment.fresh == [r for r in rows if r not in self.slot], "fresh: exactly the slotless"
        for r in assignment.displaced:
            del self.slot[r]
        for row, slot in zip(rows, assignment.slots):
            if row in assignment.fresh:
                assert slot in free or slot in victims, f"{row} took slot {slot}, neither free nor displaced"
                self.takes += 1
                self.took[row] = self.takes
                self.slot[row] = slot
            assert self.slot[row] == slot, f"{row} moved from slot {self.slot[row]} to {slot}"
            self.last_read[row] = seq
            self.slot_reader[slot] = seq
        assert len(set(assignment.slots)) == len(rows) and SINK_SLOT not in assignment.slots

    def release(self, request_id: str) -> None:
        slot = self.slot.pop(request_id, None)
        if slot is not None and self.slot_reader[slot] > self.committed:
            self.cooling.add(slot)

    def commit(self, seq: int) -> None:
        self.committed = max(self.committed, seq)
        self.cooling = {s for s in self.cooling if self.slot_reader[s] > self.committed}

    def compare(self, cache: SlotCache) -> None:
        cache.check()
        assert {r: cache.slot_of(r) for r in self.slot} == self.slot
        assert cache.held_count == len(self.slot) and cache.cooling_count == len(self.cooling)
        assert cache.free_count == len(self.free_slots()) and cache.committed == self.committed


@pytest.mark.parametrize("widest_bucket, seed", [(1, 0), (4, 1), (8, 2), (8, 3)])
def test_soak_against_the_oracle(widest_bucket, seed):
    """3x more live requests than slots take turns; finishes and aborts land at any point of a step."""
    rng = random.Random(seed)
    cache, oracle = SlotCache(widest_bucket), Oracle(widest_bucket)
    live_target = 3 * (cache.num_slots - 1)
    names = (f"r{i}" for i in range(10**9))
    turns = [next(names) for _ in range(live_target)]  # the run queue: front runs next
    was_displaced: set[str] = set()
    displaced_total = cooled_total = 0
    for seq in range(600):
        if seq >= 1 and rng.random() < 0.6:  # at most one uncommitted plan: commit(seq - 1) may lag a step
            cache.commit(seq - 1)
            oracle.commit(seq - 1)
        else:
            cache.commit(seq - 2)
            oracle.commit(seq - 2)
        oracle.compare(cache)
        width = rng.randint(1, widest_bucket)
        rows = turns[:width] if rng.random() < 0.7 else rng.sample(turns, width)
        expected = oracle.expected_victims(seq, rows)
        assignment = run(cache, seq, rows)
        assert assignment.displaced == expected, "victims must be the least recently run eligible holders"
        assert was_displaced & set(rows) <= set(assignment.fresh), "a displaced request runs on a fresh slot"
        was_displaced = (was_displaced - set(rows)) | set(assignment.displaced)
        displaced_total += len(assignment.displaced)
        oracle.apply(seq, rows, assignment)
        turns = [r for r in turns if r not in rows] + rows
        for _ in range(rng.choice([0, 0, 0, 1, 2])):  # finish or abort: maybe a row of this step
            gone = rng.choice(rows) if rng.random() < 0.5 else rng.choice(turns)
            cooled_total += cache.slot_of(gone) is not None and oracle.slot_reader[cache.slot_of(gone)] == seq
            cache.release(gone)
            cache.release(gone)
            oracle.release(gone)
            was_displaced.discard(gone)
            if gone in turns:  # else it went earlier in this loop: the releases above were no-ops
                turns.remove(gone)
        turns += [next(names) for _ in range(live_target - len(turns))]
        oracle.compare(cache)
    assert displaced_total > 100 and cooled_total > 20, (displaced_total, cooled_total)
