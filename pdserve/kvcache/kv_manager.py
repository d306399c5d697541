"""Per-request page tables on top of `PagePool`: prefix matching, growth, publishing, release.

Pure Python; called only by the scheduler (admission, growth, preemption, finish) and, after each
model step, by the engine (`cache_computed_pages`). A request's KV index ranges:

    tokens   0 ........ cached ........ computed ............ num_tokens
    pages    [ shared (ref>1) ][ own, full, registered ][ own, partial ][ reserved for this step ]
             └ prefix-cache hit ┘
"""

from __future__ import annotations

from pdserve.engine.request import Request
from pdserve.kvcache.hashing import PageKey, cached_keys, root_key, salted_root
from pdserve.kvcache.page_pool import PagePool


class KVManager:
    def __init__(
        self, num_pages: int, page_size: int, enable_prefix_caching: bool = True, namespace: str = ""
    ) -> None:
        self.pool = PagePool(num_pages)
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.root = root_key(namespace)
        # Metrics: prompt tokens looked up / found in the prefix cache (first admission only).
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    def root_for(self, req: Request) -> PageKey:
        """The parent of the request's first page: the engine's root under the request's salt."""
        return salted_root(self.root, req.cache_salt)

    def num_pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def match_prefix(self, req: Request) -> tuple[list[int], list[PageKey]]:
        """Longest run of cached full pages that prefixes the request's tokens (no state change).

        At least one token is always left to compute: the step that computes the last token is the
        one that produces logits to sample from.
        """
        if not self.enable_prefix_caching:
            return [], []
        max_pages = (req.num_tokens - 1) // self.page_size
        keys = cached_keys(
            req.page_key_cache, req.all_token_ids, self.page_size, self.root_for(req), max_pages
        )
        hits: list[int] = []
        for key in keys:
            page = self.pool.lookup(key)
            if page is None:
                break
            hits.append(page)
        return hits, keys[: len(hits)]

    def can_allocate(
        self, req: Request, num_new_tokens: int, hit_page_ids: list[int] = (), num_reserved_pages: int = 0
    ) -> bool:
        """Whether `allocate` with these arguments would succeed now (it changes nothing)."""
        return self._num_fresh(req, num_new_tokens, hit_page_ids) <= self._num_allocatable(
            hit_page_ids, num_reserved_pages
        )

    def _num_fresh(self, req: Request, num_new_tokens: int, hit_page_ids) -> int:
        num_hit_tokens = len(hit_page_ids) * self.page_size
        needed = self.num_pages_for(req.num_computed_tokens + num_hit_tokens + num_new_tokens)
        return needed - len(req.page_ids) - len(hit_page_ids)

    def _num_allocatable(self, hit_page_ids, num_reserved_pages: int) -> int:
        # Hit pages that sit in the LRU stop being allocatable once acquired.
        num_hits_evictable = sum(1 for p in hit_page_ids if self.pool.ref_count(p) == 0)
        return self.pool.num_free_pages - num_hits_evictable - num_reserved_pages

    def allocate(
        self,
        req: Request,
        num_new_tokens: int,
        hit_page_ids: list[int] = (),
        hit_keys: list[PageKey] = (),
        num_reserved_pages: int = 0,
    ) -> bool:
        """Make room for `num_new_tokens` more computed tokens. All or nothing; False if short.

        `hit_page_ids` (from `match_prefix`, only on admission) are shared into the request first.
        `num_reserved_pages`: free pages to leave untouched (kept for requests ahead of this one).
        """
        num_hit_tokens = len(hit_page_ids) * self.page_size
        num_fresh = self._num_fresh(req, num_new_tokens, hit_page_ids)
        if num_fresh > self._num_allocatable(hit_page_ids, num_reserved_pages):
            return False
        if hit_page_ids:
            self.pool.acquire(hit_page_ids)
            req.page_ids.extend(hit_page_ids)
            req.page_keys.extend(hit_keys)
            req.num_computed_tokens += num_hit_tokens
        if num_fresh > 0:
            req.page_ids.extend(self.pool.allocate(num_fresh))
        return True

    def record_admission(self, req: Request, num_hit_tokens: int) -> None:
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit_tokens
            self.num_query_tokens += req.num_prompt_tokens
            self.num_hit_tokens += num_hit_tokens

    def cache_computed_pages(self, req: Request) -> None:
        """Publish the request's newly completed full pages in the prefix cache."""
        num_full = req.num_computed_tokens // self.page_size
        start = len(req.page_keys)
        if num_full <= start:
            return
        keys = cached_keys(
            req.page_key_cache, req.all_token_ids, self.page_size, self.root_for(req), num_full
        )
        for i, key in enumerate(keys[start:], start=start):
            if self.enable_prefix_caching and req.publish_pages:
                self.pool.register(req.page_ids[i], key)
            req.page_keys.append(key)

    def free(self, req: Request) -> None:
        """Release all of the request's pages (tail first, so its tail is evicted first)."""
        self.pool.release(reversed(req.page_ids))
        req.page_ids = []
        req.page_keys = []
        req.num_computed_tokens = 0

    def check_integrity(self) -> None:
        self.pool.check_integrity()
