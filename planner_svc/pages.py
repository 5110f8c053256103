"""The KV page pool of one executor group: free list, refcounts, and a prefix index of full pages."""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence

SINK_PAGE = 0


def page_hashes(token_ids: Sequence[int], page_size: int, seed: str = "") -> list[bytes]:
    """One hash per FULL page, each chained on the one before, so a hash names the whole prefix.

    blake2b(previous hash || the page's tokens as int32 little-endian), 16 bytes: stable across processes.
    The chain starts from b"" (no seed) or from blake2b(b"tenant\0" || seed): seeded by the tenant, two
    tenants' identical prompts hash apart, so no tenant can take, or time, another's cached pages.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be positive, got {page_size}")
    hashes: list[bytes] = []
    previous = hashlib.blake2b(b"tenant\0" + seed.encode(), digest_size=16).digest() if seed else b""
    page_format = f"<{page_size}i"
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        tokens = struct.pack(page_format, *token_ids[start : start + page_size])
        previous = hashlib.blake2b(previous + tokens, digest_size=16).digest()
        hashes.append(previous)
    return hashes


class PagePool:
    """Pages 1..num_pages-1, each exactly one of: free, cached (refcount 0, indexed), in use (refcount >= 1).

    A cached page keeps its content and index entry, so a later identical prefix can take it back,
    but it counts as free: `allocate` evicts cached pages, least recently freed first, once the plain
    free list is empty.
    """

    page_hashes = staticmethod(page_hashes)

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is the sink page), got {num_pages}")
        self.num_pages = num_pages
        self._refcount = [0] * num_pages
        self._free: deque[int] = deque(range(1, num_pages))
        self._cached: OrderedDict[int, None] = OrderedDict()  # oldest freed first
        self._page_of_hash: dict[bytes, int] = {}
        self._hash_of_page: dict[int, bytes] = {}

    def reset(self, keep: Sequence[int] = ()) -> None:
        """Every page free and unindexed (the KV went with its executor) but `keep`, one ref per listing (pages
        executor RPCs may still use: loans.py)."""
        kept = Counter(keep)
        for page in kept:
            self._check_page(page)
        self._refcount = [kept[page] for page in range(self.num_pages)]
        self._free = deque(page for page in range(1, self.num_pages) if page not in kept)
        self._cached.clear()
        self._page_of_hash.clear()
        self._hash_of_page.clear()

    @property
    def total(self) -> int:
        return self.num_pages - 1

    @property
    def free_count(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def cached_count(self) -> int:
        return len(self._cached)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def can_allocate(self, n: int) -> bool:
        return n <= self.free_count

    def allocate(self, n: int) -> list[int]:
        """n fresh pages at refcount 1; plain free pages first, then the oldest cached ones."""
        if n < 0 or n > self.free_count:
            raise ValueError(f"cannot allocate {n} pages: {self.free_count} free")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._cached.popitem(last=False)
                del self._page_of_hash[self._hash_of_page.pop(page)]
            self._refcount[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Drop one ref per listed page (checked whole first, so a bad list changes nothing)."""
        for page, drops in Counter(pages).items():
            self._check_page(page)
            if self._refcount[page] < drops:
                raise ValueError(f"page {page} freed {drops} times with refcount {self._refcount[page]}")
        for page in pages:
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                if page in self._hash_of_page:
                    self._cached[page] = None
                else:
                    self._free.append(page)

    def share(self, pages: Sequence[int]) -> None:
        """One more ref per listed page; a cached page comes back into use with its content."""
        for page in pages:
            self._check_page(page)
            if self._refcount[page] == 0 and page not in self._cached:
                raise ValueError(f"page {page} is free: its content is gone, it cannot be shared")
        for page in pages:
            if self._refcount[page] == 0:
                del self._cached[page]
            self._refcount[page] += 1

    def match_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """The pages of the longest indexed prefix of `hashes`, each with a ref taken for the caller."""
        pages = []
        for page_hash in hashes:
            page = self._page_of_hash.get(page_hash)
            if page is None:
                break
            pages.append(page)
        self.share(pages)
        return pages

    def held_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many pages of the longest indexed prefix of `hashes` are in use: a match shares those, where the
        others (cached, free) it takes off the free list as an allocation would."""
        held = 0
        for page_hash in hashes:
            page = self._page_of_hash.get(page_hash)
            if page is None:
                break
            held += self._refcount[page] > 0
        return held

    def register(self, hashes: Sequence[bytes], pages: Sequence[int]) -> list[int]:
        """Index the full pages of a sequence once written: hashes[i] names pages[i]. The pages newly indexed.

        A hash already indexed keeps its page (two sequences that wrote the same prefix at once:
        the later copy stays unindexed and goes back to the free list when freed).
        """
        if len(hashes) > len(pages):
            raise ValueError(f"{len(hashes)} hashes for {len(pages)} pages")
        for page_hash, page in zip(hashes, pages):
            self._check_page(page)
            if self._refcount[page] == 0:
                raise ValueError(f"page {page} is not in use: only written pages can be registered")
            known = self._hash_of_page.get(page)
            if known is not None and known != page_hash:
                raise ValueError(f"page {page} is already indexed under another hash")
        indexed = []
        for page_hash, page in zip(hashes, pages):
            if page_hash not in self._page_of_hash:
                self._page_of_hash[page_hash] = page
                self._hash_of_page[page] = page_hash
                indexed.append(page)
        return indexed

    def unindex(self, pages: Sequence[int]) -> None:
        """Out of the index (their KV was never written after all): a cached one is plainly free now."""
        for page in pages:
            page_hash = self._hash_of_page.pop(page, None)
            if page_hash is not None:
                del self._page_of_hash[page_hash]
                if page in self._cached:
                    del self._cached[page]
                    self._free.append(page)

    def check(self) -> None:
        """Assert that every page 1..N-1 is exactly one of free, cached, in use, and the index agrees."""
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free), "a page is twice on the free list"
        assert not free & cached, f"pages both free and cached: {free & cached}"
        assert self._refcount[SINK_PAGE] == 0, "the sink page has a refcount"
        assert SINK_PAGE not in free | cached, "the sink page is listed as free"
        assert SINK_PAGE not in self._hash_of_page, "the sink page is indexed"
        for page in range(1, self.num_pages):
            idle = page in free or page in cached
            assert idle == (self._refcount[page] == 0), f"page {page}: refcount {self._refcount[page]}"
        assert all(page in self._hash_of_page for page in cached), "a cached page is not indexed"
        assert not any(page in self._hash_of_page for page in free), "a free page is still indexed"
        assert len(self._page_of_hash) == len(self._hash_of_page), "the index and its reverse disagree"
        for page_hash, page in self._page_of_hash.items():
            assert self._hash_of_page.get(page) == page_hash, f"page {page} indexed under two hashes"

    def _check_page(self, page: int) -> None:
        if not 0 < page < self.num_pages:
            raise ValueError(f"page {page} is not a pool page (1..{self.num_pages - 1})")
