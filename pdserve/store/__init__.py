"""Persistent KV store (issue 5, point 1): full blocks on disk, keyed by chained hashes.

`KVBlockStore` (block_store.py) is the entry point; `BlockLayout` (layout.py) says what a block's bytes
are; `block_keys` (keys.py) names blocks; `ReadResult`/`StoreStats` (results.py) report outcomes.
"""

from pdserve.store.block_store import KVBlockStore
from pdserve.store.keys import block_keys, store_root_key
from pdserve.store.layout import BlockLayout
from pdserve.store.results import BlockSizeError, ReadResult, StoreStats

__all__ = [
    "BlockLayout",
    "BlockSizeError",
    "KVBlockStore",
    "ReadResult",
    "StoreStats",
    "block_keys",
    "store_root_key",
]
