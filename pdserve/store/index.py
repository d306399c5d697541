"""The store's index: which blocks exist, their LRU order, and the longest stored prefix.

Who: `KVBlockStore` owns one `BlockIndex` and calls it under its lock (this class is not thread-safe).
Because block keys are chained (key_i commits to every token before block i's end), a trie of blocks is
equivalent to a flat key set: the longest stored prefix of a token sequence is the number of leading
keys of its key chain that are present -- `longest_prefix(keys)`.

Persistence: the block files are the source of truth and there is no separate index file to keep in
sync. At startup `scan_block_files` lists the directory (one `os.scandir` + `stat` per file, ~0.2 s per
100k files) and rebuilds the index; the LRU order is the files' mtimes, which the store bumps
(`os.utime`) whenever a block is read, so recency survives restarts, and it is shared between running
processes through the same mtimes: each process evicts by its own index's order, but before it evicts
a block it compares the file's mtime with the one it last gave or saw (`note_mtime`); a newer one means
another process used the block since, which makes it most recently used here instead (a review,
2026-12-05: a block one engine kept reading was another's LRU victim). Files are `<root>/<key[0:1] hex>/<key hex>.kvb`; temporary files of
in-flight writes are `.tmp-<host>-<pid>-<random>` beside them and are never indexed.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

BLOCK_SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"


def block_path(root: Path, key: bytes) -> Path:
    """Where block `key` lives under `root` (256 fan-out subdirectories keep directories small)."""
    h = key.hex()
    return root / h[:2] / (h + BLOCK_SUFFIX)


def tmp_path(final: Path) -> Path:
    """A unique temp file name beside `final`; encodes host and pid so restarts can tell stale ones."""
    return final.parent / f"{TMP_PREFIX}{socket.gethostname()}-{os.getpid()}-{os.urandom(6).hex()}"


# When this process's store code was loaded: a temp file named with our pid but older than that is a
# dead writer's whose pid we reuse (a container restarted: the same pid again), not one of our puts.
_LOADED_S = time.time()


def _tmp_is_stale(name: str, mtime: float, stale_tmp_s: float) -> bool:
    """A temp file is stale if its writer (same host) is dead, or it is older than `stale_tmp_s`."""
    if time.time() - mtime >= stale_tmp_s:
        return True
    parts = name[len(TMP_PREFIX) :].rsplit("-", 2)
    if len(parts) != 3 or parts[0] != socket.gethostname():
        return False
    if parts[1] == str(os.getpid()):
        return mtime < _LOADED_S
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except (ValueError, PermissionError):
        return False
    return False


def _entries(path) -> list[os.DirEntry]:
    """A directory's entries; none when it is gone (another engine's `remove_files` after a weight
    update may remove the directory while this one scans it: that raised, and killed the engine at
    start-up or left it without a store)."""
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except PermissionError:  # (made by another user's engine with umask 077: skipped, not a crash)
        log.warning("kv store: cannot list %s (permission denied): its blocks are not used", path)
        return []


def scan_block_files(
    root: Path, expected_file_nbytes: int, stale_tmp_s: float = 300.0
) -> tuple[list[tuple[bytes, int, int]], list[Path], list[Path]]:
    """List `root`: ([(key, file_nbytes, mtime_ns)] oldest first, stale temp files, wrong-size block files).
    In ns: a float of seconds rounds them to ~0.2 us, and a chain's blocks are stamped 1 ns apart.

    Called by the store at startup and by `rescan`. Reads no file contents: a damaged file of the right
    size is caught by the checksum on its first read.
    """
    blocks: list[tuple[bytes, int, int]] = []
    stale: list[Path] = []
    wrong_size: list[Path] = []
    for sub in _entries(root):
        if not sub.is_dir(follow_symlinks=False) or len(sub.name) != 2:
            continue
        for entry in _entries(sub.path):
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # removed by a concurrent writer/evicter
                continue
            if entry.name.startswith(TMP_PREFIX):
                if _tmp_is_stale(entry.name, st.st_mtime, stale_tmp_s):
                    stale.append(Path(entry.path))
                continue
            if not entry.name.endswith(BLOCK_SUFFIX):
                continue
            try:
                key = bytes.fromhex(entry.name[: -len(BLOCK_SUFFIX)])
            except ValueError:
                continue
            if st.st_size != expected_file_nbytes:
                wrong_size.append(Path(entry.path))
                continue
            blocks.append((key, st.st_size, st.st_mtime_ns))
    blocks.sort(key=lambda b: (b[2], b[0]))
    return blocks, stale, wrong_size


class BlockIndex:
    """Key -> file bytes, in LRU order (least recently used first). Invariant: used_bytes == sum."""

    def __init__(self) -> None:
        self._entries: OrderedDict[bytes, int] = OrderedDict()
        self.used_bytes = 0
        # The file mtime (ns) this process last gave or saw each block: a newer one on disk means
        # another process sharing the directory used the block since (`KVBlockStore._make_room_locked`).
        self._mtime_ns: dict[bytes, int] = {}

    def note_mtime(self, key: bytes, mtime_ns: int) -> None:
        """Record the mtime this process set or saw on `key`'s file (ignored for keys not indexed)."""
        if key in self._entries:
            self._mtime_ns[key] = mtime_ns

    def known_mtime(self, key: bytes) -> int | None:
        return self._mtime_ns.get(key)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def keys_lru_first(self) -> list[bytes]:
        return list(self._entries)

    def add(self, key: bytes, file_nbytes: int) -> bool:
        """Insert as most recently used; False (and just touch) if already present."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return False
        self._entries[key] = file_nbytes
        self.used_bytes += file_nbytes
        return True

    def touch(self, key: bytes) -> None:
        """Mark `key` most recently used (a read or a re-put); no-op if absent."""
        if key in self._entries:
            self._entries.move_to_end(key)

    def remove(self, key: bytes) -> int:
        """Drop `key`; returns the bytes it accounted (0 if absent)."""
        nbytes = self._entries.pop(key, 0)
        self._mtime_ns.pop(key, None)
        self.used_bytes -= nbytes
        return nbytes

    def longest_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading `keys` present (a chained key set is a trie)."""
        n = 0
        for key in keys:
            if key not in self._entries:
                break
            n += 1
        return n

    def victims(self, need_bytes: int, protect: Iterable[bytes] = ()) -> list[bytes]:
        """LRU-first keys whose removal frees at least `need_bytes` (fewer if the index runs out)."""
        protected = set(protect)
        out, freed = [], 0
        for key, nbytes in self._entries.items():
            if freed >= need_bytes:
                break
            if key in protected:
                continue
            out.append(key)
            freed += nbytes
        return out
