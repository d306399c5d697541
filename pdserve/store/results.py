"""Typed results of the KV store: `ReadResult` (one read), `StoreStats` (counters), `BlockSizeError`.

Who: `KVBlockStore` fills them; read paths consume `ReadResult` to decide which tokens to recompute,
metrics/tests consume `StoreStats`. `block_views` turns the caller's host memory into per-block views.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.store.fileformat import _as_u8

BAD_STATUSES = ("corrupt", "truncated", "fingerprint")  # file removed, counted in num_corrupt


class BlockSizeError(ValueError):
    """`put` got a payload whose size is not the layout's `block_nbytes` (a caller bug, so it raises)."""


@dataclass
class ReadResult:
    """Outcome of one `read_blocks` call; `status[i]` is for `keys[i]` / the i-th output block.

    status: "ok" | "missing" (no file) | "truncated" | "corrupt" (header/checksum/key) | "fingerprint"
    (another layout's block) | "ioerror" (the read failed; file kept). Only "ok" blocks hold valid bytes.
    """

    keys: list[bytes]
    status: list[str]
    bytes_read: int = 0
    elapsed_s: float = 0.0

    @property
    def ok(self) -> list[bool]:
        return [s == "ok" for s in self.status]

    @property
    def num_ok(self) -> int:
        return self.status.count("ok")

    @property
    def num_prefix_ok(self) -> int:
        """Leading OK blocks: the tokens a read path may take from the store without a gap."""
        n = 0
        while n < len(self.status) and self.status[n] == "ok":
            n += 1
        return n

    @property
    def num_corrupt(self) -> int:
        return sum(s in BAD_STATUSES for s in self.status)

    @property
    def num_missing(self) -> int:
        return sum(s in ("missing", "ioerror") for s in self.status)

    @property
    def bad_indices(self) -> list[int]:
        return [i for i, s in enumerate(self.status) if s != "ok"]


@dataclass
class StoreStats:
    used_bytes: int
    capacity_bytes: int
    num_blocks: int
    lookup_hit_blocks: int = 0  # leading blocks found, summed over lookups
    lookup_miss_blocks: int = 0  # full blocks asked for but not stored, summed over lookups
    read_ok_blocks: int = 0
    num_corrupt: int = 0  # read (or startup scan) found a bad file; removed
    num_missing: int = 0  # read found no file (or an I/O error)
    num_evictions: int = 0
    num_puts: int = 0  # block files written
    num_put_dedup: int = 0  # put of a key already stored (nothing written)
    num_write_failures: int = 0
    num_put_orphans: int = 0  # put refused: the block before it in its chain is not stored


def block_views(out, num_blocks: int, block_nbytes: int) -> list[np.ndarray]:
    """Caller's host memory -> one writable uint8 view per block (no copies)."""
    if isinstance(out, list | tuple):
        views = [_as_u8(v) for v in out]
    else:
        flat = _as_u8(out)
        if flat.size < num_blocks * block_nbytes:
            raise ValueError(f"output buffer holds {flat.size} bytes, need {num_blocks * block_nbytes}")
        views = list(flat[: num_blocks * block_nbytes].reshape(num_blocks, block_nbytes))
    if len(views) < num_blocks or any(v.size != block_nbytes for v in views[:num_blocks]):
        raise ValueError(f"need {num_blocks} output views of {block_nbytes} bytes each")
    if any(not v.flags.writeable for v in views[:num_blocks]):
        raise ValueError("output views must be writable")
    return views[:num_blocks]
