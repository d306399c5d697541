"""`pdserve bench store`: KV-store block reads into host memory vs a raw sequential read, warm and cold.

One run, same files, same bytes: `num_blocks` blocks of `block_mib` MiB (layout `[layers, tokens,
4 KiB]`, Qwen2.5-32B-shaped by default scaled down) are written with `KVBlockStore.put` into a temp
directory, then read back, per repeat and alternating the order of the paths:
- raw seq: one thread, per file `open` + one `os.readv` of header + payload into the host buffer, no
  verification -- the reference (ratio 1.00);
- raw Nt: the same reads spread over the store's I/O thread count (what parallel I/O alone gives);
- store <backend>: `KVBlockStore.read_blocks` (I/O pool, header + checksum verification, LRU touch)
  for each selected `io_backend` (preadv, nixl).
Warm = page cache holds the files (one untimed pass first). Cold = `posix_fadvise(DONTNEED)` on every
file right before each timed pass (files were fsynced after writing, so the pages can be dropped).
Best of `repeats` passes; the store's result is checked byte for byte against the raw read.

Case "joined" (`--readers` R): R requests of one prompt (the `n` choices of a rollout) each need its
`num_blocks` stored blocks at once, cold. "each its own": R concurrent `submit_read`s into R buffers,
what every request did before reads were joined; "joined": R `JoinedReads.read`s, the code the
engines run (store/joined_reads.py). Reported: time until every request has its blocks, bytes read
from the files (the store's count), and the ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from pdserve.argtypes import count, positive


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-mib", type=positive, default=4.0, help="bytes per block, MiB (Qwen2.5-32B: 16)")
    p.add_argument("--num-blocks", type=count, default=48, help="blocks written and read per pass")
    p.add_argument("--layers", type=count, default=64, help="layers per block (layer block = tokens x 4 KiB)")
    p.add_argument("--bytes-per-token-layer", type=count, default=4096, help="K+V bytes per token per layer")
    p.add_argument("--io-threads", type=count, default=4, help="store I/O threads")
    p.add_argument("--repeats", type=count, default=3, help="timed passes per path and case (best kept)")
    p.add_argument(
        "--backends",
        nargs="+",
        default=["preadv", "nixl"],
        choices=["preadv", "nixl"],
        help="store read paths",
    )
    p.add_argument(
        "--cases",
        nargs="+",
        default=["warm", "cold"],
        choices=["warm", "cold", "joined"],
        help="warm: files in the page cache; cold: dropped from it before each pass; joined: --readers "
        "requests of the same blocks, cold, each reading its own vs joining one read",
    )
    p.add_argument("--readers", type=count, default=8, help="requests of the same blocks (case joined)")
    p.add_argument("--dir", default=None, help="parent directory of the temp store (default: $TMPDIR)")


def _evict(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _raw_read(paths, out, header_scratch, num_threads: int) -> None:
    def one(i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            os.readv(fd, [header_scratch[i], out[i]])
        finally:
            os.close(fd)

    if num_threads == 1:
        for i in range(len(paths)):
            one(i)
    else:
        with ThreadPoolExecutor(num_threads) as ex:
            list(ex.map(one, range(len(paths))))


def _joined(args, stores: dict, keys: list[bytes], paths: list[str], ref, hdr, block_nbytes: int) -> int:
    """The "joined" case on each store backend; prints its rows. 1 if any bytes were wrong."""
    import numpy as np

    from pdserve.store.joined_reads import JoinedReads

    n, readers = len(keys), args.readers
    _raw_read(paths, ref, hdr, 1)  # (the reference bytes)

    def alloc(num_blocks: int):
        return np.empty((num_blocks, block_nbytes), dtype=np.uint8)  # (as the engines: torch.empty)

    def each_its_own(st) -> list:
        bufs = [alloc(n) for _ in range(readers)]
        futures = [st.submit_read(keys, buf) for buf in bufs]
        return [(buf, f.result()) for buf, f in zip(bufs, futures, strict=True)]

    def joined(st) -> list:
        reads = JoinedReads()
        pending = [reads.read(st, keys, alloc) for _ in range(readers)]
        return [(p.buffer, p.future.result()) for p in pending]

    print(f"joined: {readers} requests of the same {n} blocks, cold (page cache dropped before each pass)")
    print(f"{'backend':<8} {'path':<14} {'s':>8} {'MiB read':>9} {'GiB to requests/s':>18} {'speedup':>8}")
    for be, st in stores.items():
        best = {"each its own": (float("inf"), 0), "joined": (float("inf"), 0)}
        for rep in range(args.repeats):
            order = list(best) if rep % 2 == 0 else list(reversed(best))
            for name in order:
                _evict(paths)
                before = st.stats().read_ok_blocks
                t = time.perf_counter()
                answers = (each_its_own if name == "each its own" else joined)(st)
                dt = time.perf_counter() - t
                num_read = st.stats().read_ok_blocks - before
                for buf, result in answers:  # every request's blocks, byte for byte
                    if result.num_ok != n or not np.array_equal(buf[:n], ref):
                        print(f"{be} {name}: a request's blocks differ from the raw read")
                        return 1
                best[name] = min(best[name], (dt, num_read))
        base = best["each its own"][0]
        for name, (dt, num_read) in best.items():
            mib_read = num_read * block_nbytes / 2**20
            to_requests = readers * n * block_nbytes / 2**30 / dt
            print(f"{be:<8} {name:<14} {dt:8.3f} {mib_read:9.1f} {to_requests:18.2f} {base / dt:8.2f}")
    return 0


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from pdserve.store import BlockLayout, KVBlockStore
    from pdserve.store.fileformat import HEADER_NBYTES

    block_nbytes = int(args.block_mib * (1 << 20))
    per_token = args.layers * args.bytes_per_token_layer
    if block_nbytes % per_token:
        print(f"--block-mib must be a multiple of layers x bytes/token/layer = {per_token} bytes")
        return 2
    layout = BlockLayout(args.layers, block_nbytes // per_token, args.bytes_per_token_layer, "bench|store")
    n = args.num_blocks
    load_start = os.getloadavg()
    root = tempfile.mkdtemp(prefix="pdserve-bench-store-", dir=args.dir)
    try:
        stores = {}
        for be in args.backends:
            try:
                stores[be] = KVBlockStore(
                    root, layout, capacity_bytes=2 * n * (block_nbytes + HEADER_NBYTES),
                    num_io_threads=args.io_threads, io_backend=be,
                )  # fmt: skip
            except ImportError as e:
                print(f"skipping io_backend={be}: {e}")
        writer = next(iter(stores.values()))
        rng = np.random.default_rng(0)
        keys = [rng.bytes(16) for _ in range(n)]
        base = rng.integers(0, 256, block_nbytes, dtype=np.uint8)
        t0 = time.perf_counter()
        for i, key in enumerate(keys):
            base[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
            assert writer.put(key, base)
        write_s = time.perf_counter() - t0
        paths = [str(writer.path_for(k)) for k in keys]
        for p in paths:  # make the pages clean so DONTNEED can drop them
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        total_bytes = n * block_nbytes
        out = np.ones((n, block_nbytes), dtype=np.uint8)  # pre-faulted host buffer
        ref = np.zeros((n, block_nbytes), dtype=np.uint8)
        hdr = np.zeros((n, HEADER_NBYTES), dtype=np.uint8)
        paths_fns = {
            "raw seq (1 thread)": lambda: _raw_read(paths, ref, hdr, 1),
            f"raw {args.io_threads} threads": lambda: _raw_read(paths, ref, hdr, args.io_threads),
        }
        for be, st in stores.items():
            paths_fns[f"store {be}"] = lambda st=st: st.read_blocks(keys, out)
        print(
            f"bench store: {n} blocks x {block_nbytes / 2**20:g} MiB ({layout.num_layers} layers x "
            f"{layout.block_size} tokens x {layout.bytes_per_token_layer} B) = {total_bytes / 2**30:.2f} GiB, "
            f"{args.io_threads} I/O threads, {os.cpu_count()} CPUs, dir {root}; "
            f"write {total_bytes / write_s / 1e9:.2f} GB/s; load avg at start {load_start[0]:.2f}"
        )
        rows = []
        for case in args.cases:
            if case == "joined":
                continue
            if case == "warm":
                _raw_read(paths, ref, hdr, 1)
            best = {name: float("inf") for name in paths_fns}
            for rep in range(args.repeats):
                names = list(paths_fns) if rep % 2 == 0 else list(reversed(paths_fns))
                for name in names:
                    if case == "cold":
                        _evict(paths)
                    t = time.perf_counter()
                    res = paths_fns[name]()
                    best[name] = min(best[name], time.perf_counter() - t)
                    if res is not None and res.num_ok != n:
                        print(f"{name}: {n - res.num_ok} blocks not ok: {res.status}")
                        return 1
                    if res is not None:  # every store backend's bytes, checked after its own read
                        if not np.array_equal(out, ref):
                            print(f"{name}: bytes differ from the raw read")
                            return 1
                        out.fill(1)
            raw = best["raw seq (1 thread)"]
            for name, dt in best.items():
                rows.append((case, name, total_bytes / dt / 1e9, raw / dt))
        if rows:
            print(f"{'case':<6} {'path':<20} {'GB/s':>7} {'vs raw seq':>10}")
        for case, name, gbps, ratio in rows:
            print(f"{case:<6} {name:<20} {gbps:7.2f} {ratio:10.2f}")
        if "joined" in args.cases:
            failed = _joined(args, stores, keys, paths, ref, hdr, block_nbytes)
            if failed:
                return failed
        load_end = os.getloadavg()
        print(f"load avg (1 min) start {load_start[0]:.2f}, end {load_end[0]:.2f}; target: store >= 0.80")
        for st in stores.values():
            st.close()
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)
