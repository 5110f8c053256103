"""PagePool: refcounts, the sink page, the prefix index and cached-page eviction, against a simple model."""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys

import numpy as np
import pytest

from planner_svc.pages import SINK_PAGE, PagePool, page_hashes

PAGE = 4


def snapshot(pool: PagePool) -> tuple:
    return (pool.free_count, pool.cached_count, [pool.refcount(p) for p in range(pool.num_pages)])


def test_sink_page_is_never_handed_out():
    pool = PagePool(8)
    assert pool.total == 7 and pool.free_count == 7
    pages = pool.allocate(7)
    pool.check()
    assert sorted(pages) == list(range(1, 8)) and SINK_PAGE not in pages
    assert pool.free_count == 0 and not pool.can_allocate(1) and pool.can_allocate(0)
    pool.free(pages)
    pool.check()
    assert pool.free_count == 7


def test_needs_a_sink_page_and_one_more():
    with pytest.raises(ValueError):
        PagePool(1)


def test_allocate_beyond_free_raises_and_changes_nothing():
    pool = PagePool(5)
    pool.allocate(3)
    before = snapshot(pool)
    assert not pool.can_allocate(2)
    with pytest.raises(ValueError):
        pool.allocate(2)
    with pytest.raises(ValueError):
        pool.allocate(-1)
    pool.check()
    assert snapshot(pool) == before


def test_refcounts_share_and_free():
    pool = PagePool(6)
    pages = pool.allocate(2)
    assert [pool.refcount(p) for p in pages] == [1, 1]
    pool.share(pages)
    pool.check()
    assert [pool.refcount(p) for p in pages] == [2, 2] and pool.free_count == 3
    pool.free(pages)
    pool.check()
    assert [pool.refcount(p) for p in pages] == [1, 1] and pool.free_count == 3
    pool.free(pages)
    pool.check()
    assert pool.free_count == 5


def test_a_page_listed_twice_drops_two_refs():
    pool = PagePool(4)
    (page,) = pool.allocate(1)
    pool.share([page])
    pool.free([page, page])
    pool.check()
    assert pool.refcount(page) == 0 and pool.free_count == 3


@pytest.mark.parametrize("bad", [[0], [99], [-1], "free page", "one too many"])
def test_bad_free_raises_and_changes_nothing(bad):
    pool = PagePool(6)
    used = pool.allocate(2)
    if bad == "free page":
        bad = [used[0], 5]  # page 5 was never handed out
    elif bad == "one too many":
        bad = [used[0], used[1], used[1]]
    before = snapshot(pool)
    with pytest.raises(ValueError):
        pool.free(bad)
    pool.check()
    assert snapshot(pool) == before


def test_sharing_a_free_page_or_the_sink_raises():
    pool = PagePool(4)
    with pytest.raises(ValueError):
        pool.share([1])
    with pytest.raises(ValueError):
        pool.share([SINK_PAGE])
    pool.check()
    assert pool.free_count == 3


def test_page_hashes_follow_the_documented_chain():
    tokens = list(range(100, 111))  # 2 full pages of 4, 3 tokens left over
    hashes = page_hashes(tokens, PAGE)
    assert len(hashes) == 2 and all(len(h) == 16 for h in hashes)
    first = hashlib.blake2b(np.array(tokens[:4], "<i4").tobytes(), digest_size=16).digest()
    second = hashlib.blake2b(first + np.array(tokens[4:8], "<i4").tobytes(), digest_size=16).digest()
    assert hashes == [first, second]
    assert PagePool.page_hashes(tokens, PAGE) == hashes
    assert page_hashes(tokens[:3], PAGE) == [] and page_hashes(tokens[:8], PAGE) == hashes


def test_page_hashes_name_the_whole_prefix():
    tokens = list(range(12))
    changed = [99] + tokens[1:]
    a, b = page_hashes(tokens, PAGE), page_hashes(changed, PAGE)
    assert all(x != y for x, y in zip(a, b))  # a change in page 0 changes every later hash
    assert page_hashes(tokens[:4] + [7, 7, 7, 7], PAGE)[0] == a[0]
    with pytest.raises(ValueError):
        page_hashes(tokens, 0)


def test_page_hashes_are_stable_across_processes():
    code = "from planner_svc.pages import page_hashes; print(page_hashes(list(range(64)), 16)[-1].hex())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": ".", "PYTHONHASHSEED": "123"},
    )
    assert out.stdout.strip() == page_hashes(list(range(64)), 16)[-1].hex()


def written(pool: PagePool, tokens: list[int]) -> tuple[list[bytes], list[int]]:
    """A sequence prefilled the way the scheduler does it: match, allocate the rest, register."""
    hashes = page_hashes(tokens, PAGE)
    pages = pool.match_prefix(hashes)
    pages += pool.allocate(-(-len(tokens) // PAGE) - len(pages))
    pool.register(hashes, pages)
    pool.check()
    return hashes, pages


def test_identical_prefixes_share_full_pages():
    pool = PagePool(16)
    prompt = list(range(10))  # 2 full pages + a partial one
    hashes, pages = written(pool, prompt)
    assert pool.free_count == 12
    matched = pool.match_prefix(hashes)
    pool.check()
    assert matched == pages[:2] and [pool.refcount(p) for p in pages] == [2, 2, 1]
    other = pool.match_prefix(page_hashes(prompt[:4] + [0, 0, 0, 0], PAGE))
    assert other == pages[:1] and pool.refcount(pages[0]) == 3
    assert pool.match_prefix(page_hashes([5, 5, 5, 5], PAGE)) == []
    pool.free(matched + other)
    pool.check()
    assert [pool.refcount(p) for p in pages] == [1, 1, 1]


def test_freed_indexed_pages_stay_cached_and_come_back():
    pool = PagePool(8)
    hashes, pages = written(pool, list(range(9)))
    pool.free(pages)
    pool.check()
    assert pool.free_count == 7 and pool.cached_count == 2  # the partial page was never indexed
    again = pool.match_prefix(hashes)
    pool.check()
    assert again == pages[:2] and pool.cached_count == 0 and pool.free_count == 5


def test_cached_pages_are_evicted_after_free_ones_least_recently_freed_first():
    pool = PagePool(7)
    ha, pa = written(pool, list(range(8)))
    hb, pb = written(pool, list(range(100, 108)))
    pool.free(pb)  # b freed first: evicted first
    pool.free(pa)
    pool.check()
    assert pool.cached_count == 4 and pool.free_count == 6
    fresh = pool.allocate(2)  # the two never-indexed pages go first
    pool.check()
    assert not set(fresh) & set(pa + pb) and pool.cached_count == 4
    evicted = pool.allocate(1)
    pool.check()
    assert evicted == [pb[0]] and pool.match_prefix(hb) == []  # b's chain is broken at its first page
    assert pool.match_prefix(ha) == pa
    pool.check()


def test_unindexed_pages_are_matched_no_more_and_a_cached_one_is_plain_free():
    pool = PagePool(8)
    hashes, pages = written(pool, list(range(8)))
    pool.free(pages[:1])  # cached (refcount 0, indexed); the second stays in use
    pool.unindex(pages)
    pool.check()
    assert pool.match_prefix(hashes) == [] and pool.cached_count == 0 and pool.free_count == 6
    pool.free(pages[1:])
    pool.check()
    assert pool.free_count == 7


def test_register_keeps_the_first_page_of_a_hash():
    pool = PagePool(8)
    prompt = list(range(8))
    hashes, first = written(pool, prompt)
    second = pool.allocate(2)  # written at the same time, before the first was registered
    pool.register(hashes, second)
    pool.check()
    assert pool.match_prefix(hashes) == first
    pool.free(second)
    pool.check()
    assert pool.cached_count == 0 and pool.free_count == 5


def test_register_rejects_bad_input():
    pool = PagePool(8)
    hashes = page_hashes(list(range(8)), PAGE)
    pages = pool.allocate(2)
    with pytest.raises(ValueError):
        pool.register(hashes, pages[:1])  # more hashes than pages
    with pytest.raises(ValueError):
        pool.register(hashes[:1], [5])  # not in use
    with pytest.raises(ValueError):
        pool.register(hashes[:1], [SINK_PAGE])
    pool.register(hashes, pages)
    pool.register(hashes, pages)  # again, same names: nothing changes
    with pytest.raises(ValueError):
        pool.register(hashes[1:], pages[:1])  # a page already indexed under another hash
    pool.check()


class Model:
    """The pool as plain facts per page: refcount, indexed hash, and when it was last freed."""

    def __init__(self, num_pages: int):
        self.refcount = {p: 0 for p in range(1, num_pages)}
        self.page_of_hash: dict[bytes, int] = {}
        self.freed_at: dict[int, int] = {}
        self.clock = 0

    def hash_of(self, page: int) -> bytes | None:
        return next((h for h, p in self.page_of_hash.items() if p == page), None)

    def plain_free(self) -> set[int]:
        return {p for p, r in self.refcount.items() if r == 0 and self.hash_of(p) is None}

    def cached_oldest_first(self) -> list[int]:
        cached = [p for p, r in self.refcount.items() if r == 0 and self.hash_of(p) is not None]
        return sorted(cached, key=self.freed_at.__getitem__)

    def allocated(self, pages: list[int]) -> int:
        """Check the pages `allocate` chose; return how many were evicted from the cache."""
        plain, cached = self.plain_free(), self.cached_oldest_first()
        evictions = max(0, len(pages) - len(plain))
        assert {p for p in pages if p not in plain} == set(cached[:evictions])
        for page in pages:
            if page in cached:
                del self.page_of_hash[self.hash_of(page)]
            self.refcount[page] = 1
        return evictions

    def freed(self, pages: list[int]) -> None:
        for page in pages:
            self.refcount[page] -= 1
            self.clock += 1
            self.freed_at[page] = self.clock

    def longest_match(self, hashes: list[bytes]) -> list[int]:
        pages = []
        for h in hashes:
            if h not in self.page_of_hash:
                break
            pages.append(self.page_of_hash[h])
        return pages

    def compare(self, pool: PagePool) -> None:
        pool.check()
        assert [pool.refcount(p) for p in self.refcount] == list(self.refcount.values())
        assert pool.free_count == sum(r == 0 for r in self.refcount.values())
        assert pool.cached_count == len(self.cached_oldest_first())


@pytest.mark.parametrize("seed", [0, 1])
def test_random_operations_match_the_model(seed):
    rng = random.Random(seed)
    pool, model = PagePool(24), Model(24)
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice([4, 8, 12]))] for _ in range(4)]
    held: list[list[int]] = []  # the pages of each live sequence
    shared_pages = evictions = refusals = 0  # so the test shows it reached each case
    for _ in range(2000):
        op = rng.random()
        if op < 0.35:  # a new sequence: shared prefix, own tail
            tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(0, 9))]
            hashes = page_hashes(tokens, PAGE)
            expected = model.longest_match(hashes)
            matched = pool.match_prefix(hashes)
            assert matched == expected
            shared_pages += len(matched)
            for page in matched:
                model.refcount[page] += 1
            need = -(-len(tokens) // PAGE) - len(matched)
            if not pool.can_allocate(need):
                assert need > pool.free_count
                refusals += 1
                with pytest.raises(ValueError):
                    pool.allocate(need)
                pool.free(matched)
                model.freed(matched)
            else:
                pages = pool.allocate(need)
                evictions += model.allocated(pages)
                pages = matched + pages
                pool.register(hashes, pages)
                for h, page in zip(hashes, pages):
                    model.page_of_hash.setdefault(h, page)
                held.append(pages)
        elif op < 0.65 and held:  # a sequence finishes
            pages = held.pop(rng.randrange(len(held)))
            pool.free(pages)
            model.freed(pages)
        elif op < 0.75 and held:  # a fork shares every page of a sequence
            pages = rng.choice(held)
            pool.share(pages)
            for page in pages:
                model.refcount[page] += 1
            held.append(list(pages))
        elif op < 0.85:  # a plain allocation, maybe too big
            n = rng.randrange(0, 6)
            if pool.can_allocate(n):
                pages = pool.allocate(n)
                evictions += model.allocated(pages)
                held.append(pages)
            else:
                with pytest.raises(ValueError):
                    pool.allocate(n)
        else:  # a bad free: a page nobody holds, or the sink
            idle = [p for p, r in model.refcount.items() if r == 0] + [SINK_PAGE]
            with pytest.raises(ValueError):
                pool.free([rng.choice(idle)])
        model.compare(pool)
    for pages in held:
        pool.free(pages)
        model.freed(pages)
    model.compare(pool)
    assert pool.free_count == pool.total
    assert shared_pages > 100 and evictions > 50 and refusals > 10, (shared_pages, evictions, refusals)


def test_page_hashes_are_seeded_by_the_tenant():
    tokens = list(range(16))
    a, b = page_hashes(tokens, PAGE, "a"), page_hashes(tokens, PAGE, "b")
    assert a == page_hashes(tokens, PAGE, "a") and len(a) == 4
    assert not set(a) & set(b) and not set(a) & set(page_hashes(tokens, PAGE))


def test_reset_frees_and_unindexes_everything_but_what_it_keeps():
    pool = PagePool(8)
    pages = pool.allocate(4)
    pool.register(page_hashes(list(range(8)), 4), pages[:2])
    pool.free(pages[:3])
    pool.reset(keep=[5, 6, 6])  # a page two loans hold: two refs
    pool.check()
    assert (pool.refcount(5), pool.refcount(6), pool.free_count, pool.cached_count) == (1, 2, 5, 0)
    assert pool.match_prefix(page_hashes(list(range(8)), 4)) == []
    with pytest.raises(ValueError, match="not a pool page"):
        pool.reset(keep=[8])
    assert pool.refcount(6) == 2  # refused: nothing changed
