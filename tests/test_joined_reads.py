"""`store/joined_reads.py` on a real store (temp directory): a read of blocks a read in flight covers
joins it; one that needs more reads its own; an ended read is forgotten; bad blocks and failed reads
are counted once. Reads are held in flight by a gate in front of the store's real read."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pdserve.store import BlockLayout, KVBlockStore, block_keys
from pdserve.store.joined_reads import JoinedReads

LAYOUT = BlockLayout(num_layers=2, block_size=4, bytes_per_token_layer=64, fingerprint="test|joined")
NUM_BLOCKS = 5


def alloc(n: int) -> np.ndarray:
    return np.zeros((n, LAYOUT.block_nbytes), dtype=np.uint8)


@pytest.fixture
def store(tmp_path):
    """A store holding one chain of NUM_BLOCKS blocks (block i filled with i + 1), its reads gated:
    `store.gate` must be set for any read to finish."""
    s = KVBlockStore(tmp_path, LAYOUT, capacity_bytes=1 << 24)
    s.chain = list(block_keys(list(range(NUM_BLOCKS * 4)), 4, LAYOUT.fingerprint))
    for i, key in enumerate(s.chain):
        assert s.put(key, np.full(LAYOUT.block_nbytes, i + 1, dtype=np.uint8), ancestors=s.chain[:i])
    s.gate = threading.Event()
    read_blocks = s.read_blocks

    def gated(*args):
        assert s.gate.wait(10)
        return read_blocks(*args)

    s.read_blocks = gated
    yield s
    s.gate.set()
    s.close()


def test_reads_of_a_prefix_in_flight_join_it_and_longer_ones_read_their_own(store):
    reads = JoinedReads()
    chain = store.chain
    owner = reads.read(store, chain[:3], alloc)
    same = reads.read(store, chain[:3], alloc)
    prefix = reads.read(store, chain[:2], alloc)
    longer = reads.read(store, chain, alloc)  # (its last blocks are not in flight: a read of its own)
    assert (same.shared, prefix.shared, longer.shared) == (True, True, False)
    assert same.buffer is owner.buffer and prefix.future is owner.future
    assert reads.num_blocks_joined == 3 + 2 and reads.num_in_flight == 2
    reads.check_integrity()
    store.gate.set()
    longer.future.result(10)
    result = prefix.future.result(10)
    assert (owner.num_prefix_ok(result), prefix.num_prefix_ok(result)) == (3, 2)
    assert [int(row[0]) for row in prefix.buffer[:2]] == [1, 2]  # (its blocks: the owner's first rows)
    assert store.stats().read_ok_blocks == 3 + NUM_BLOCKS  # (the joined ones read nothing)
    _until(lambda: reads.num_in_flight == 0)
    del owner  # (its request is done with it: the ended read is no longer joined)
    again = reads.read(store, chain[:3], alloc)  # (nothing in flight: a read of its own)
    assert not again.shared and again.future.result(10).num_ok == 3
    assert reads.num_blocks_bad == 0


def test_a_read_in_flight_longer_than_the_join_age_is_not_joined_and_a_new_one_takes_its_keys(store):
    """A read still in flight past `max_join_age_s` is stuck as far as its callers are concerned (they
    leave it behind): a request of that prefix reads anew, and the next ones join the new read."""
    reads = JoinedReads()
    chain = store.chain
    stuck = reads.read(store, chain[:3], alloc, now_s=0.0, max_join_age_s=5.0)
    assert reads.read(store, chain[:3], alloc, now_s=5.0, max_join_age_s=5.0).shared  # (at the age: joins)
    fresh = reads.read(store, chain[:3], alloc, now_s=5.5, max_join_age_s=5.0)
    assert not fresh.shared and fresh.started_s == 5.5 and fresh.buffer is not stuck.buffer
    joined = reads.read(store, chain[:2], alloc, now_s=6.0, max_join_age_s=5.0)
    assert joined.shared and joined.future is fresh.future and joined.started_s == 5.5
    reads.check_integrity()
    store.gate.set()
    for r in (stuck, fresh):
        assert r.num_prefix_ok(r.future.result(10)) == 3
    deadline = time.monotonic() + 5  # (a read leaves the index in its future's callback, just after)
    while reads.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.001)
    assert reads.num_in_flight == 0
    reads.check_integrity()


def test_an_ended_read_is_joined_while_its_owner_holds_it_then_forgotten_and_freed_at_once(store):
    """The `n` choices of one prompt reach the engine thread between its steps; during a long step the
    first choice's read can end before the others ask (the engine thread takes requests before it
    looks at ended reads): they read the blocks again, although the first still held them. An ended
    read is joined while its owner's request holds it. Once the owner drops it, it is forgotten, and
    it and its buffer are freed at once: its future's callback referred to it, a cycle that kept
    every ended read's buffer until the cyclic GC's next pass (host memory the size of the hits)."""
    import gc
    import weakref

    reads = JoinedReads()
    chain = store.chain
    store.gate.set()
    owner = reads.read(store, chain[:3], alloc)
    assert owner.future.result(10).num_ok == 3
    _until(lambda: reads.num_in_flight == 0)
    late = reads.read(store, chain[:3], alloc)
    prefix = reads.read(store, chain[:2], alloc)
    assert (late.shared, prefix.shared) and late.buffer is owner.buffer and prefix.future is owner.future
    assert store.stats().read_ok_blocks == 3 and reads.num_blocks_joined == 3 + 2
    was_enabled = gc.isenabled()
    gc.disable()  # (freed by reference counts alone, not by a collection)
    try:
        dropped, buffer = weakref.ref(owner), weakref.ref(owner.buffer)
        del owner, late, prefix
        assert dropped() is None and buffer() is None
    finally:
        if was_enabled:
            gc.enable()
    again = reads.read(store, chain[:3], alloc)
    assert not again.shared and again.future.result(10).num_ok == 3
    assert store.stats().read_ok_blocks == 6
    reads.check_integrity()


def test_an_ended_read_that_found_a_bad_block_is_joined_only_before_it(store):
    """A read that found a block corrupt (or missing) is joined, once it ended, only by a request whose
    blocks all come before the first bad one; one that needs that block reads anew (in flight it is
    joined, as in the test below: its readers recompute from there). The good leading blocks used to
    be read again too."""
    with open(store.path_for(store.chain[1]), "r+b") as f:
        f.truncate(100)
    reads = JoinedReads()
    store.gate.set()
    owner = reads.read(store, store.chain[:3], alloc)
    assert owner.future.result(10).status == ["ok", "truncated", "ok"]
    _until(lambda: reads.num_in_flight == 0)
    reads.check_integrity()
    before = store.stats().read_ok_blocks
    good = reads.read(store, store.chain[:1], alloc)
    assert good.shared and good.buffer is owner.buffer and good.num_prefix_ok(good.future.result(10)) == 1
    assert store.stats().read_ok_blocks == before  # (no I/O)
    late = reads.read(store, store.chain[:3], alloc)
    assert not late.shared and late.buffer is not owner.buffer
    late.future.result(10)
    _until(lambda: reads.num_in_flight == 0)
    reads.check_integrity()


def test_a_bad_block_is_counted_once_and_a_failed_read_not_at_all(store):
    reads = JoinedReads()
    with open(store.path_for(store.chain[3]), "r+b") as f:
        f.truncate(100)
    owner = reads.read(store, store.chain, alloc)
    joined = [reads.read(store, store.chain, alloc) for _ in range(3)]
    store.gate.set()
    result = owner.future.result(10)
    assert [j.num_prefix_ok(result) for j in joined] == [3, 3, 3]
    _until(lambda: reads.num_in_flight == 0)
    assert reads.num_blocks_bad == 1

    def broken(*args):
        raise OSError("disk gone")

    store.read_blocks = broken
    failed = reads.read(store, store.chain[:4], alloc)  # (past the owner's good blocks: its own read)
    with pytest.raises(OSError):
        failed.future.result(10)
    _until(lambda: reads.num_in_flight == 0)
    assert reads.num_blocks_bad == 1  # (a failed read: its users recompute; nothing counted)


def _until(condition, timeout_s: float = 5.0) -> None:
    """(a read's entries go in its future's callback, just after the future is done)"""
    event = threading.Event()
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        event.wait(0.01)
    raise AssertionError("condition not reached")


def test_bench_store_joined_case_reads_the_blocks_once_for_all_readers():
    """`pdserve bench store --cases joined`: each request's blocks checked byte for byte against a raw
    read (else exit 1); the files' bytes read are R times the blocks each its own, once joined."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    cmd = [str(Path(sys.executable).parent / "pdserve"), "bench", "store", "--cases", "joined"]
    cmd += [
        "--num-blocks",
        "4",
        "--block-mib",
        "1",
        "--readers",
        "4",
        "--repeats",
        "1",
        "--backends",
        "preadv",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = dict(re.findall(r"^preadv\s+(each its own|joined)\s+[\d.]+\s+([\d.]+)", out.stdout, re.M))
    assert (float(rows["each its own"]), float(rows["joined"])) == (4 * 4.0, 4.0), out.stdout  # MiB
