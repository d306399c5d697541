"""Page ids of one engine's KV pool: reference counts, a prefix-cache index and LRU eviction.

Pure Python bookkeeping; it never sees a tensor. Every page is in exactly one of three states:

    in use      ref_count > 0 (held by one or more requests; shared prefix pages have ref > 1)
    cached      ref_count == 0, has a key, sits in `_evictable` (LRU order, oldest first)
    free        ref_count == 0, no key, sits in `_free`

`allocate` takes free pages first (lowest id first, so tests can name exact ids) and only then evicts
cached pages, least recently released first. Releasing a request's pages in reverse order (done by the
caller) makes the tail of a prompt evicted before its head, which keeps shared prefixes alive longest.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable

from pdserve.kvcache.hashing import PageKey


class OutOfPages(RuntimeError):
    """Not enough free or evictable pages; nothing was allocated."""


class PagePool:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        self.num_pages = num_pages
        self._ref_counts = [0] * num_pages
        self._keys: list[PageKey | None] = [None] * num_pages
        self._key_to_page: dict[PageKey, int] = {}
        self._free: list[int] = list(range(num_pages))  # min-heap of page ids
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Counters for metrics; only `match` queries count.
        self.num_evictions = 0

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages an `allocate` can hand out now (free + evictable cached)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        return len(self._key_to_page)

    def ref_count(self, page_id: int) -> int:
        return self._ref_counts[page_id]

    def key_of(self, page_id: int) -> PageKey | None:
        return self._keys[page_id]

    def lookup(self, key: PageKey) -> int | None:
        return self._key_to_page.get(key)

    def evictable_page_ids(self) -> list[int]:
        """Cached, unreferenced pages in eviction order (first = evicted first)."""
        return list(self._evictable)

    # ---- mutations -----------------------------------------------------------------------------
    def allocate(self, num_pages: int) -> list[int]:
        """Take `num_pages` fresh pages (ref 1, no key). All or nothing: raises OutOfPages."""
        if num_pages > self.num_free_pages:
            raise OutOfPages(f"need {num_pages} pages, {self.num_free_pages} free")
        out: list[int] = []
        for _ in range(num_pages):
            if self._free:
                page = heapq.heappop(self._free)
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._key_to_page[self._keys[page]]  # type: ignore[index]
                self._keys[page] = None
                self.num_evictions += 1
            self._ref_counts[page] = 1
            out.append(page)
        return out

    def acquire(self, page_ids: Iterable[int]) -> None:
        """Add a reference to each page (a prefix-cache hit); a cached page leaves the LRU."""
        for page in page_ids:
            if self._ref_counts[page] == 0:
                if page not in self._evictable:
                    raise ValueError(f"page {page} is free and holds no cached KV; cannot acquire it")
                del self._evictable[page]
            self._ref_counts[page] += 1

    def release(self, page_ids: Iterable[int]) -> None:
        """Drop one reference from each page, in the order given (later = evicted later)."""
        for page in page_ids:
            if self._ref_counts[page] <= 0:
                raise ValueError(f"page {page} released more times than it was taken")
            self._ref_counts[page] -= 1
            if self._ref_counts[page] == 0:
                if self._keys[page] is not None:
                    self._evictable[page] = None
                else:
                    heapq.heappush(self._free, page)

    def register(self, page_id: int, key: PageKey) -> bool:
        """Publish a full, computed page under `key` so later requests can share it.

        Returns False (and changes nothing) when another page already holds `key` (two requests
        computed the same prefix concurrently) or this page already has a key.
        """
        if self._ref_counts[page_id] <= 0:
            raise ValueError(f"page {page_id} is not in use; only computed pages can be registered")
        if key in self._key_to_page or self._keys[page_id] is not None:
            return False
        self._keys[page_id] = key
        self._key_to_page[key] = page_id
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached, unreferenced page (they become free). Returns how many."""
        n = len(self._evictable)
        for page in self._evictable:
            del self._key_to_page[self._keys[page]]  # type: ignore[index]
            self._keys[page] = None
            heapq.heappush(self._free, page)
        self._evictable.clear()
        return n

    # ---- invariants ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError if any bookkeeping invariant is broken. O(num_pages)."""
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate page in free heap"
        assert all(0 <= p < self.num_pages for p in free), "page id out of range in free heap"
        heap = self._free  # allocate pops the lowest id: the list must be a valid min-heap
        assert all(heap[(i - 1) // 2] <= heap[i] for i in range(1, len(heap))), "free list not a heap"
        evictable = set(self._evictable)
        assert all(0 <= p < self.num_pages for p in evictable), "page id out of range in LRU"
        assert not (free & evictable), "page both free and cached"
        for page in range(self.num_pages):
            ref, key = self._ref_counts[page], self._keys[page]
            assert ref >= 0, f"page {page} has negative ref count"
            if ref > 0:
                assert page not in free and page not in evictable, f"page {page} in use but listed free"
            elif key is None:
                assert page in free, f"page {page} unreferenced, no key, but not free"
            else:
                assert page in evictable, f"page {page} cached but not evictable"
            if key is not None:
                assert self._key_to_page.get(key) == page, f"key index disagrees for page {page}"
        assert len(self._key_to_page) == sum(k is not None for k in self._keys), "stale key index"
        assert self.num_used_pages == sum(r > 0 for r in self._ref_counts), "used pages != referenced pages"

    def ref_counts(self) -> list[int]:
        """A copy of every page's reference count (integrity checks of the pool's users)."""
        return list(self._ref_counts)
