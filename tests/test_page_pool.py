"""Exact expectations for the page pool, the chained keys and the per-request KV manager.

`check_integrity()` runs after every operation (the `pool` fixture wraps each mutation).
"""

from __future__ import annotations

import sys

import pytest

from pdserve.engine.request import Request
from pdserve.kvcache.hashing import cached_keys, chain_key, page_keys, root_key
from pdserve.kvcache.kv_manager import KVManager
from pdserve.kvcache.page_pool import OutOfPages, PagePool
from pdserve.sampling_params import SamplingParams


class CheckedPool(PagePool):
    """A PagePool that verifies its invariants after every mutation."""

    def _checked(name):
        def method(self, *args, **kwargs):
            out = getattr(PagePool, name)(self, *args, **kwargs)
            self.check_integrity()
            return out

        return method

    allocate = _checked("allocate")
    acquire = _checked("acquire")
    release = _checked("release")
    register = _checked("register")
    reset_prefix_cache = _checked("reset_prefix_cache")


def key(i: int) -> bytes:
    return chain_key(root_key("t"), [i])


def test_keys_are_deterministic_chained_and_not_builtin_hash():
    root = root_key("model-a")
    assert root == root_key("model-a") != root_key("model-b")
    k = page_keys(list(range(10)), 4, root)
    assert len(k) == 2  # the partial third page has no key
    assert k[0] == chain_key(root, [0, 1, 2, 3])
    assert k[1] == chain_key(k[0], [4, 5, 6, 7])
    # Same tokens after a different prefix -> different key.
    assert page_keys([9, 9, 9, 9, 4, 5, 6, 7], 4, root)[1] != k[1]
    # Extending a chain from a known key gives the same keys as hashing from the start.
    assert (
        page_keys(list(range(12)), 4, root, start_key=k[1], start_page=2)
        == page_keys(list(range(12)), 4, root)[2:]
    )
    # Fixed value: stable across processes and Python versions (blake2b, not builtin hash()).
    assert chain_key(root_key(""), [1, 2, 3]).hex() == "a287862963ed618b74f691eaafcf9772"
    assert len(k[0]) == 16
    # A per-request cache extended as the token list grows gives the same keys as hashing afresh.
    cache: list = []
    assert cached_keys(cache, list(range(10)), 4, root, 1) == k[:1] and len(cache) == 1
    assert cached_keys(cache, list(range(12)), 4, root, 3) == page_keys(list(range(12)), 4, root)
    assert len(cache) == 3 and cached_keys(cache, list(range(12)), 4, root, 2) == k


def test_allocate_lowest_ids_first_and_all_or_nothing():
    pool = CheckedPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    with pytest.raises(OutOfPages):
        pool.allocate(2)
    assert pool.num_free_pages == 1 and pool.num_used_pages == 5
    pool.release([3, 1])
    assert pool.allocate(3) == [1, 3, 5]


def test_ref_counts_and_sharing():
    pool = CheckedPool(4)
    a = pool.allocate(2)
    assert pool.register(a[0], key(0)) is True
    pool.acquire([a[0]])  # a second request shares page 0
    assert pool.ref_count(0) == 2 and pool.ref_count(1) == 1
    pool.release(a)
    assert pool.ref_count(0) == 1 and pool.num_free_pages == 3  # page 0 still held once
    pool.release([0])
    assert pool.evictable_page_ids() == [0]
    assert pool.lookup(key(0)) == 0
    with pytest.raises(ValueError):
        pool.release([0])  # released more than taken
    with pytest.raises(ValueError):
        pool.acquire([2])  # free, uncached


def test_lru_eviction_order():
    pool = CheckedPool(4)
    pages = pool.allocate(4)
    for i, p in enumerate(pages):
        pool.register(p, key(i))
    pool.release([2, 0, 3, 1])  # release order defines LRU: 2 oldest
    assert pool.evictable_page_ids() == [2, 0, 3, 1]
    pool.acquire([0])  # a hit takes page 0 out of the LRU ...
    pool.release([0])  # ... and puts it back as most recent
    assert pool.evictable_page_ids() == [2, 3, 1, 0]
    assert pool.allocate(2) == [2, 3]
    assert pool.lookup(key(2)) is None and pool.lookup(key(3)) is None
    assert pool.lookup(key(1)) == 1 and pool.num_evictions == 2
    assert pool.key_of(2) is None


def test_free_pages_preferred_over_cached():
    pool = CheckedPool(3)
    a = pool.allocate(2)
    pool.register(a[0], key(0))
    pool.release(a)  # page 0 cached, page 1 free, page 2 free
    assert pool.allocate(2) == [1, 2]
    assert pool.lookup(key(0)) == 0
    assert pool.allocate(1) == [0]  # only now is the cached page evicted
    assert pool.lookup(key(0)) is None


def test_register_duplicate_key_is_refused():
    pool = CheckedPool(3)
    a = pool.allocate(2)
    assert pool.register(a[0], key(5))
    assert not pool.register(a[1], key(5))  # computed twice concurrently: keep the first
    assert not pool.register(a[0], key(6))  # a page has one key
    pool.release(a)
    assert pool.evictable_page_ids() == [0] and pool.num_cached_pages == 1
    with pytest.raises(ValueError):
        pool.register(2, key(7))  # not in use


def test_reset_prefix_cache():
    pool = CheckedPool(3)
    a = pool.allocate(3)
    for i, p in enumerate(a):
        pool.register(p, key(i))
    pool.release(a[:2])
    assert pool.reset_prefix_cache() == 2
    assert pool.num_cached_pages == 1 and pool.lookup(key(2)) == 2


def test_integrity_catches_corruption():
    pool = PagePool(3)
    pool.allocate(1)
    pool._ref_counts[0] = 0  # a page that is neither free nor cached
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_integrity_catches_a_broken_free_heap():
    pool = PagePool(8)
    pool.allocate(2)
    pool.check_integrity()
    pool._free.reverse()  # allocate would no longer hand out the lowest id
    with pytest.raises(AssertionError, match="not a heap"):
        pool.check_integrity()
    pool._free.sort()
    pool._free.append(99)  # an id past the pool
    with pytest.raises(AssertionError, match="out of range"):
        pool.check_integrity()


def make_req(tokens, rid="r") -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), max_tokens=4)


def test_kv_manager_prefix_match_and_growth():
    kv = KVManager(num_pages=8, page_size=4, namespace="m")
    kv.pool = CheckedPool(8)
    a = make_req(range(10), "a")
    assert kv.match_prefix(a) == ([], [])
    assert kv.allocate(a, 10)
    assert a.page_ids == [0, 1, 2]
    a.num_computed_tokens = 10
    kv.cache_computed_pages(a)
    assert [kv.pool.lookup(k) for k in a.page_keys] == [0, 1]  # 2 full pages published
    # b shares a's first 8 tokens: pages 0 and 1 are hits.
    b = make_req(list(range(8)) + [50, 51, 52], "b")
    hits, keys = kv.match_prefix(b)
    assert hits == [0, 1] and keys == a.page_keys
    assert kv.allocate(b, 3, hits, keys)
    assert b.page_ids == [0, 1, 3] and b.num_computed_tokens == 8
    assert kv.pool.ref_count(0) == 2
    # A prompt that is entirely cached still leaves its last token to compute.
    c = make_req(range(8), "c")
    assert kv.match_prefix(c)[0] == [0]
    kv.free(a)
    assert a.page_ids == [] and kv.pool.ref_count(0) == 1
    assert kv.pool.evictable_page_ids() == []  # page 2 (a's partial page) is free, not cached
    kv.free(b)
    assert kv.pool.evictable_page_ids() == [1, 0]  # tail first: the prefix head survives longest
    kv.check_integrity()


def test_kv_manager_allocate_all_or_nothing_counts_hits_in_lru():
    kv = KVManager(num_pages=4, page_size=4)
    kv.pool = CheckedPool(4)
    a = make_req(range(8), "a")
    assert kv.allocate(a, 8)
    a.num_computed_tokens = 8
    kv.cache_computed_pages(a)
    kv.free(a)  # pages 0, 1 cached and evictable; 4 allocatable
    b = make_req(list(range(8)) + list(range(100, 109)), "b")  # 17 tokens -> 5 pages
    hits, keys = kv.match_prefix(b)
    assert hits == [0, 1]
    # Needs 3 fresh pages beyond the 2 hits, but acquiring the hits leaves only 2 allocatable.
    assert not kv.allocate(b, 9, hits, keys)
    assert b.page_ids == [] and kv.pool.evictable_page_ids() == [1, 0]
    assert kv.allocate(b, 8, hits, keys)
    assert b.page_ids == [0, 1, 2, 3]


def test_bookkeeping_does_not_import_torch():
    import subprocess

    code = (
        "import sys; import pdserve.kvcache.kv_manager, pdserve.engine.scheduler; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
