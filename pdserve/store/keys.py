"""Block keys of the persistent store: chained hashes over full blocks of tokens.

key_i = chain_key(key_{i-1}, tokens of block i), key_{-1} = root_key("pdserve-store|" + fingerprint):
the same chained blake2b as the engine's page keys (`pdserve.kvcache.hashing`), with the block layout
fingerprint as the namespace, so a key commits to the model/layout and to every token before the
block's end. Any process (prefill, decode, router) computes the same keys for the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.kvcache.hashing import PageKey, chain_key, page_keys, root_key

BlockKey = PageKey  # 16-byte blake2b digest

__all__ = ["BlockKey", "block_keys", "store_root_key", "chain_key"]


def store_root_key(fingerprint: str) -> BlockKey:
    """Parent key of a sequence's first block for blocks of layout `fingerprint`."""
    return root_key("pdserve-store|" + fingerprint)


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    fingerprint: str,
    start_key: BlockKey | None = None,
    start_block: int = 0,
) -> list[BlockKey]:
    """Keys of the full blocks of `token_ids` (a partial last block has no key).

    `start_key`/`start_block` extend a known chain without rehashing: `start_key` is the key of block
    `start_block - 1`, and the result starts at block `start_block`.
    """
    root = store_root_key(fingerprint)
    return page_keys(token_ids, block_size, root, start_key=start_key, start_page=start_block)
