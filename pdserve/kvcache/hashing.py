"""Deterministic chained page hashes (never builtin `hash()`, which is salted per process).

The key of page i commits to every token before it: key_i = H(key_{i-1} || tokens of page i), with
key_{-1} = H(namespace). Two engines (prefill and decode) loading the same model compute the same keys,
so a key can name a page across processes and, later, a block in the persistent store.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

PageKey = bytes  # 16-byte blake2b digest


def root_key(namespace: str = "") -> PageKey:
    """The parent of the first page; `namespace` separates incompatible caches (model, layout)."""
    return hashlib.blake2b(b"pdserve-root\0" + namespace.encode(), digest_size=16).digest()


def salted_root(root: PageKey, cache_salt: str | None) -> PageKey:
    """The root of a request's chain under its `cache_salt` (vLLM's field; None: `root` itself). Every
    key of a salted request commits to its salt, so requests of other salts (tenants) share none of its
    pages or store blocks: nobody can learn from a cache hit's timing that another tenant sent a prompt."""
    if not cache_salt:
        return root
    return hashlib.blake2b(
        root + b"\0cache-salt\0" + cache_salt.encode(errors="surrogatepass"), digest_size=16
    ).digest()


def chain_key(parent: PageKey, token_ids: Sequence[int]) -> PageKey:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def cached_keys(
    cache: list[PageKey], token_ids: Sequence[int], page_size: int, root: PageKey, num_pages: int
) -> list[PageKey]:
    """The keys of pages [0, num_pages) of `token_ids`, extending `cache` (the keys already computed
    for a prefix of the same, append-only, token list) instead of rehashing from the start."""
    have = len(cache)
    if num_pages > have:
        cache.extend(
            page_keys(
                token_ids[: num_pages * page_size],
                page_size,
                root,
                start_key=cache[-1] if have else None,
                start_page=have,
            )
        )
    return cache[:num_pages]


def page_keys(
    token_ids: Sequence[int],
    page_size: int,
    root: PageKey,
    start_key: PageKey | None = None,
    start_page: int = 0,
) -> list[PageKey]:
    """Keys of the full pages of `token_ids` from `start_page` on (partial last page excluded).

    `start_key` is the key of page `start_page - 1` (or `root` when start_page == 0), so callers can
    extend an existing chain without rehashing it.
    """
    keys: list[PageKey] = []
    parent = root if start_page == 0 else start_key
    assert parent is not None
    for i in range(start_page, len(token_ids) // page_size):
        parent = chain_key(parent, token_ids[i * page_size : (i + 1) * page_size])
        keys.append(parent)
    return keys
