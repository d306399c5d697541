"""KV store I/O paths: preadv and NIXL POSIX give identical bytes and identical bad-block verdicts;
both checksum algorithms verify; the checksum catches what it claims to (one word, swapped pages)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pdserve.store import BlockLayout, KVBlockStore, block_keys
from pdserve.store.fileformat import HEADER_NBYTES, payload_checksum
from pdserve.transfer.nixl_backend import nixl_available

# 4 layers x 16 tokens x 256 B = 64 KiB payloads: several 4 KiB pages per block
LAYOUT = BlockLayout(num_layers=4, block_size=16, bytes_per_token_layer=256, fingerprint="io|fp")
FILE_NBYTES = HEADER_NBYTES + LAYOUT.block_nbytes
KEYS = block_keys(list(range(16 * 6)), 16, LAYOUT.fingerprint)


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(100 + i).integers(0, 256, LAYOUT.block_nbytes, dtype=np.uint8)


def fill(path, **kw) -> KVBlockStore:
    s = KVBlockStore(path, LAYOUT, 100 * FILE_NBYTES, num_io_threads=3, **kw)
    for i, k in enumerate(KEYS):
        assert s.put(k, payload(i))
    return s


def test_checksum_properties():
    a = payload(0)
    base = payload_checksum(a)
    b = a.copy()
    b[12345] ^= 0x80
    assert payload_checksum(b) != base
    pages = a.reshape(-1, 4096).copy()
    pages[[1, 2]] = pages[[2, 1]]  # two 4 KiB pages swapped: same words, other places
    assert payload_checksum(pages.reshape(-1)) != base
    assert payload_checksum(a[:1000]) != payload_checksum(a[:1001])  # short tails count
    assert payload_checksum(a, "crc32") != payload_checksum(b, "crc32")


def test_crc32_files_verify_in_a_psum64_store(tmp_path):
    s = fill(tmp_path, checksum="crc32")
    s.close()
    s2 = KVBlockStore(tmp_path, LAYOUT, 100 * FILE_NBYTES)  # default psum64; per-file algorithm wins
    out = np.zeros((len(KEYS), LAYOUT.block_nbytes), np.uint8)
    assert s2.read_blocks(KEYS, out).num_ok == len(KEYS)
    assert all(np.array_equal(out[i], payload(i)) for i in range(len(KEYS)))
    s2.check_integrity()
    s2.close()


@pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")
def test_nixl_and_preadv_identical(tmp_path):
    fill(tmp_path).close()
    stores = {
        be: KVBlockStore(tmp_path, LAYOUT, 100 * FILE_NBYTES, io_backend=be) for be in ("preadv", "nixl")
    }
    outs = {}
    for be, s in stores.items():
        outs[be] = np.zeros((len(KEYS), LAYOUT.block_nbytes), np.uint8)
        res = s.read_blocks(KEYS, outs[be])
        assert res.num_ok == len(KEYS), (be, res.status)
    assert np.array_equal(outs["preadv"], outs["nixl"])
    assert all(np.array_equal(outs["nixl"][i], payload(i)) for i in range(len(KEYS)))
    # bad blocks through NIXL: a flipped byte is caught by the checksum; a truncated file is caught
    # before the transfer; a missing one too
    nixl = stores["nixl"]
    path = nixl.path_for(KEYS[1])
    raw = bytearray(path.read_bytes())
    raw[HEADER_NBYTES + 5000] ^= 1
    path.write_bytes(bytes(raw))
    os.truncate(nixl.path_for(KEYS[3]), FILE_NBYTES - 4096)
    os.unlink(nixl.path_for(KEYS[4]))
    out = np.zeros((len(KEYS), LAYOUT.block_nbytes), np.uint8)
    res = nixl.submit_read(KEYS, out).result(timeout=30)
    assert res.status == ["ok", "corrupt", "ok", "truncated", "missing", "ok"]
    for i in (0, 2, 5):
        assert np.array_equal(out[i], payload(i))
    assert nixl.lookup_keys(KEYS) == 1
    nixl.check_integrity()
    for s in stores.values():
        s.close()


@pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (nixl-cu12)")
def test_nixl_read_whose_file_registration_fails_leaves_nothing_registered(tmp_path):
    """The buffers' registration was not undone when the files' failed, and the error was not the one
    the store falls back to preadv on. Now: NixlReadError, and the next read of the same buffer works."""
    from pdserve.store.nixl_io import NixlPosixReader, NixlReadError

    reader = NixlPosixReader()
    real = reader._agent
    registered = []

    class FailingFiles:  # the real agent, except that registering files fails
        def __getattr__(self, name):
            return getattr(real, name)

        def register_memory(self, descs, mem, backends):
            if mem == "FILE":
                raise RuntimeError("injected: FILE registration failed")
            registered.append(mem)
            return real.register_memory(descs, mem, backends)

        def deregister_memory(self, handle, backends):
            registered.append("undone")
            return real.deregister_memory(handle, backends)

    path = tmp_path / "blob"
    path.write_bytes(bytes(range(256)) * 32)
    buf = np.zeros(8192, np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        reads = [(fd, 0, buf.ctypes.data, 4096), (fd, 4096, buf[4096:].ctypes.data, 4096)]
        reader._agent = FailingFiles()
        with pytest.raises(NixlReadError, match="registering the files"):
            reader.read(reads)
        assert registered == ["DRAM", "undone"]
        reader._agent = real
        reader.read(reads)  # the same memory registers again: nothing was left behind
        assert buf.tobytes() == path.read_bytes()
    finally:
        os.close(fd)
        reader.close()
