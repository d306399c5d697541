"""Hypothesis fuzzing of the store's block files: the header decoder (`store/fileformat.py`) and
`KVBlockStore.read_blocks` over damaged files on disk.

Header: arbitrary bytes, bit flips, truncations and crc-valid headers with arbitrary fields either
decode to exactly what was encoded or raise `BlockFormatError` -- nothing else.
Store: blocks are written, then some of their files are truncated, extended, bit-flipped, replaced by
random bytes, by another block's file, by a block of another layout (same size), by a header of another
format version, by a directory, or deleted -- optionally across a restart. Every damaged block reads
as bad (never "ok"), its file is removed and counted exactly once, the intact blocks read back their
exact bytes, and the index still matches the files.
Example counts are printed (pytest -s); PDSERVE_FUZZ_SCALE multiplies them.
"""

from __future__ import annotations

import shutil
import struct
import tempfile
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.store import BlockLayout, KVBlockStore, block_keys
from pdserve.store import fileformat as ff
from pdserve.store.fileformat import HEADER_NBYTES, BlockFormatError, decode_header, encode_header
from pdserve.store.results import BAD_STATUSES
from tests.fuzz_helpers import fuzz_settings

COUNTS: Counter[str] = Counter()

LAYOUT = BlockLayout(num_layers=2, block_size=4, bytes_per_token_layer=16, fingerprint="fuzz|fp")
# Same payload size, so their files have our size: only the header tells them apart.
OTHER_MODEL = BlockLayout(num_layers=2, block_size=4, bytes_per_token_layer=16, fingerprint="other|fp")
OTHER_SHAPE = BlockLayout(num_layers=4, block_size=2, bytes_per_token_layer=16, fingerprint="fuzz|fp")
FILE_NBYTES = HEADER_NBYTES + LAYOUT.block_nbytes
NUM_BLOCKS = 4
TOKENS = list(range(500, 500 + NUM_BLOCKS * LAYOUT.block_size))
KEYS = block_keys(TOKENS, LAYOUT.block_size, LAYOUT.fingerprint)


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(1000 + i).integers(0, 256, LAYOUT.block_nbytes, dtype=np.uint8)


# ---- header decoder ------------------------------------------------------------------------------
layouts = st.builds(
    BlockLayout,
    num_layers=st.integers(1, 2**16),
    block_size=st.integers(1, 2**16),
    bytes_per_token_layer=st.integers(1, 2**20).map(lambda n: 2 * n),
    fingerprint=st.text(min_size=1, max_size=200),
)
algos = st.sampled_from(sorted(ff.CHECKSUM_ALGOS))


def _decode(raw) -> ff.BlockHeader | None:
    try:
        return decode_header(raw)
    except BlockFormatError:
        return None


@fuzz_settings(150)
@given(
    layout=layouts,
    key=st.binary(max_size=ff.MAX_KEY_NBYTES),
    checksum=st.binary(min_size=16, max_size=16),
    algo=algos,
)
def test_header_round_trip(layout, key, checksum, algo):
    COUNTS["header: round trip"] += 1
    raw = encode_header(layout, key, checksum, algo)
    assert len(raw) == HEADER_NBYTES
    h = decode_header(raw)
    assert (h.checksum_algo, h.payload_nbytes, h.checksum, h.key, h.fingerprint) == (
        algo,
        layout.block_nbytes,
        checksum,
        key,
        layout.fingerprint,
    )
    assert (h.num_layers, h.block_size, h.bytes_per_token_layer) == (
        layout.num_layers,
        layout.block_size,
        layout.bytes_per_token_layer,
    )
    assert decode_header(bytearray(raw) + b"payload follows") == h  # only the first 4 KiB count
    assert decode_header(memoryview(raw)) == h


@fuzz_settings(300)
@given(data=st.data())
def test_damaged_header_is_refused(data):
    raw = bytearray(encode_header(LAYOUT, KEYS[0], b"\x01" * 16, "psum64"))
    how = data.draw(st.sampled_from(["flip", "truncate", "random", "zero-run"]))
    COUNTS[f"header: damaged ({how})"] += 1
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 4))):  # crc32 catches every 1-3 bit error
            i = data.draw(st.integers(0, HEADER_NBYTES * 8 - 1))
            raw[i // 8] ^= 1 << (i % 8)
        if data.draw(st.booleans()):
            raw[: data.draw(st.integers(0, 3))] = b""  # and/or shifted
    elif how == "truncate":
        raw = raw[: data.draw(st.integers(0, HEADER_NBYTES - 1))]
    elif how == "random":
        raw = bytearray(data.draw(st.binary(min_size=0, max_size=HEADER_NBYTES + 64)))
    else:
        start = data.draw(st.integers(0, HEADER_NBYTES - 1))
        length = data.draw(st.integers(1, 32))
        if raw[start : start + length] == bytes(len(raw[start : start + length])):
            return  # already zeros: nothing damaged
        raw[start : start + length] = bytes(len(raw[start : start + length]))
    if bytes(raw[:HEADER_NBYTES]) == encode_header(LAYOUT, KEYS[0], b"\x01" * 16, "psum64"):
        return  # the damage cancelled out
    with pytest.raises(BlockFormatError):
        decode_header(raw)


INVALID = {
    "magic": st.sampled_from([b"PDKVBLK\x01", b"\x00" * 8, b"pdkvblk\x00"]),
    "version": st.integers(0, 2**32 - 1).filter(lambda v: v != ff.VERSION),
    "header_nbytes": st.integers(0, 2**32 - 1).filter(lambda v: v != HEADER_NBYTES),
    "algo": st.integers(0, 2**32 - 1).filter(lambda v: v not in ff.CHECKSUM_ALGOS.values()),
    "klen": st.integers(ff.MAX_KEY_NBYTES + 1, 2**16 - 1),
    "flen": st.integers(ff.MAX_FINGERPRINT_NBYTES + 1, 2**16 - 1),
}


@fuzz_settings(300)
@given(
    algo=st.sampled_from(sorted(ff.CHECKSUM_ALGOS.values())),
    numbers=st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1)),
    more=st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)),
    checksum=st.binary(min_size=16, max_size=16),
    klen=st.integers(0, ff.MAX_KEY_NBYTES),
    flen=st.integers(0, 300),
    tail=st.binary(max_size=400) | st.text(max_size=200).map(str.encode),
    corrupt=st.sets(st.sampled_from(sorted(INVALID)), max_size=2),
    data=st.data(),
)
def test_crc_valid_header_with_any_fields(algo, numbers, more, checksum, klen, flen, tail, corrupt, data):
    """A header that passes its crc (as a foreign or buggy writer's would) with any field values:
    decoded exactly when every field is one this version writes, else BlockFormatError."""
    f = {"magic": ff.MAGIC, "version": ff.VERSION, "header_nbytes": HEADER_NBYTES, "algo": algo}
    f |= {"klen": klen, "flen": flen}
    for name in corrupt:
        f[name] = data.draw(INVALID[name])
    reserved, payload_nbytes, num_layers = numbers
    block_size, bptl = more
    fixed = ff._FIXED.pack(
        f["magic"], f["version"], f["header_nbytes"], f["algo"], reserved, payload_nbytes, checksum,
        num_layers, block_size, bptl, f["klen"], f["flen"],
    )  # fmt: skip
    body = (fixed + tail).ljust(HEADER_NBYTES - 4, b"\0")[: HEADER_NBYTES - 4]
    raw = body + struct.pack("<I", zlib.crc32(body))
    region = body[ff._FIXED.size :]
    fp = region[f["klen"] : f["klen"] + f["flen"]]
    try:
        fp.decode()
        utf8 = True
    except UnicodeDecodeError:
        utf8 = False
    h = _decode(raw)
    COUNTS[f"header: crc-valid fields -> {'decoded' if h else 'refused'}"] += 1
    if corrupt or not utf8:
        assert h is None
        return
    assert h is not None
    assert (h.key, h.fingerprint, h.payload_nbytes, h.checksum) == (
        region[:klen],
        fp.decode(),
        payload_nbytes,
        checksum,
    )
    assert (h.num_layers, h.block_size, h.bytes_per_token_layer) == (num_layers, block_size, bptl)


# ---- reads of damaged files ----------------------------------------------------------------------
DAMAGE = [
    "none",
    "truncate",
    "extend",
    "flip",
    "random",
    "swap-key",
    "other-model",
    "other-shape",
    "version",
    "dir",
    "delete",
    "empty",
]


def damage(path: Path, how: str, data, originals: dict[bytes, bytes]) -> None:
    raw = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(raw[: data.draw(st.integers(0, FILE_NBYTES - 1))])
    elif how == "extend":
        path.write_bytes(raw + data.draw(st.binary(min_size=1, max_size=64)))
    elif how == "flip":
        i = data.draw(st.integers(0, FILE_NBYTES * 8 - 1))
        raw[i // 8] ^= 1 << (i % 8)
        path.write_bytes(raw)
    elif how == "random":
        path.write_bytes(data.draw(st.binary(min_size=FILE_NBYTES, max_size=FILE_NBYTES)))
    elif how == "swap-key":  # another block's (valid) file under this name
        key = bytes.fromhex(path.name.removesuffix(".kvb"))
        path.write_bytes(originals[data.draw(st.sampled_from([k for k in KEYS if k != key]))])
    elif how in ("other-model", "other-shape", "version"):
        key = bytes.fromhex(path.name.removesuffix(".kvb"))
        layout = {"other-model": OTHER_MODEL, "other-shape": OTHER_SHAPE, "version": LAYOUT}[how]
        header = bytearray(encode_header(layout, key, ff.payload_checksum(raw[HEADER_NBYTES:]), "psum64"))
        if how == "version":  # a future format version, with a valid crc
            struct.pack_into("<I", header, 8, ff.VERSION + 1)
            struct.pack_into("<I", header, HEADER_NBYTES - 4, zlib.crc32(bytes(header[: HEADER_NBYTES - 4])))
        path.write_bytes(bytes(header) + raw[HEADER_NBYTES:])
    elif how == "dir":
        path.unlink()
        path.mkdir()
    elif how == "delete":
        path.unlink()
    elif how == "empty":
        path.write_bytes(b"")


@fuzz_settings(250)
@given(
    plan=st.lists(st.sampled_from(DAMAGE), min_size=NUM_BLOCKS, max_size=NUM_BLOCKS),
    restart=st.booleans(),
    data=st.data(),
)
def test_read_blocks_over_damaged_files(plan, restart, data):
    with tempfile.TemporaryDirectory() as tmp:
        store = KVBlockStore(tmp, LAYOUT, 100 * FILE_NBYTES, num_io_threads=2)
        try:
            for i, key in enumerate(KEYS):
                assert store.put(key, payload(i))
            originals = {k: store.path_for(k).read_bytes() for k in KEYS}
            for key, how in zip(KEYS, plan, strict=True):
                if how != "none":
                    damage(store.path_for(key), how, data, originals)
            damaged = [
                how != "none"
                and not (store.path_for(k).is_file() and store.path_for(k).read_bytes() == originals[k])
                for k, how in zip(KEYS, plan, strict=True)
            ]
            for how, bad in zip(plan, damaged, strict=True):
                COUNTS[f"store: {how}{'' if bad or how == 'none' else ' (no-op)'}"] += 1
            wrong_size = [
                store.path_for(k).exists() and store.path_for(k).stat().st_size != FILE_NBYTES for k in KEYS
            ]
            if restart:  # a restart rescans: wrong-size files are removed and counted there
                store.close()
                store = KVBlockStore(tmp, LAYOUT, 100 * FILE_NBYTES, num_io_threads=2)
                assert store.stats().num_corrupt == sum(wrong_size)
            before = store.stats()
            out = np.zeros((NUM_BLOCKS, LAYOUT.block_nbytes), dtype=np.uint8)
            res = store.read_blocks(KEYS, out)
            after = store.stats()
            for i, (key, how, bad) in enumerate(zip(KEYS, plan, damaged, strict=True)):
                status = res.status[i]
                if not bad:
                    assert status == "ok", (how, status)
                    assert np.array_equal(out[i], payload(i))
                    assert store.path_for(key).read_bytes() == originals[key]
                    continue
                assert status != "ok", (how, status)
                if how == "dir":  # opens and stats like a short file, but unlink cannot remove it
                    assert status in BAD_STATUSES or status == "ioerror", (how, status)
                elif how == "delete" or (restart and wrong_size[i]):
                    assert status == "missing", (how, status)
                else:
                    assert status in BAD_STATUSES, (how, status)
                    assert not store.path_for(key).exists(), (how, "bad file left on disk")
            n_bad = sum(s in BAD_STATUSES for s in res.status)
            n_missing = sum(s in ("missing", "ioerror") for s in res.status)
            assert after.num_corrupt - before.num_corrupt == n_bad
            assert after.num_missing - before.num_missing == n_missing
            assert after.read_ok_blocks - before.read_ok_blocks == res.num_ok
            # The index forgot every bad block; what is left on disk still matches it.
            assert store.lookup(TOKENS) == res.num_prefix_ok
            for d in store.dir.glob("*/*.kvb"):
                if d.is_dir():
                    shutil.rmtree(d)  # the one kind of damage a read cannot remove (see test)
            store.check_integrity()
        finally:
            store.close()


def test_zz_report_counts():
    print("\nfuzz examples run:", dict(sorted(COUNTS.items())))
    assert sum(COUNTS.values()) > 0
