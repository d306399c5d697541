"""`pdserve bench transfer`: NIXL page writes between two processes vs a torch in-process copy.

One run, same bytes for every path: for each page size (4 KiB .. 1 MiB per page per region) it moves
`total_mib` MiB spread over `num_regions` regions (K/V buffers), as
- contiguous: pages 0..n-1 -> 0..n-1 (one merged descriptor per region), NIXL direct;
- scattered: random distinct pages of a 2n-page pool -> random distinct pages of the peer's pool,
  (a) NIXL direct, one descriptor per page and region, (b) staged: gather into the staging slot ->
  one write per chunk -> scatter on the receiver (chunks pipeline gather / write / scatter).
Ceilings (torch, in-process, same page pattern): contiguous `copy_`; scattered: the faster of a
vectorized `index_select` + numpy row assignment and a per-page `copy_` loop. `memcpy` is one contiguous
copy of the same bytes, for reference.

A NIXL time runs from the first byte touched on the sender (gather included) to the moment the
receiver has seen the last notification (and scattered, when staged): it includes the notification's
latency, not the ack's way back (both processes read `time.perf_counter`, i.e. CLOCK_MONOTONIC, one
clock for the whole host). Bytes are verified exactly on the receiver once per case.
The receiver runs in a `spawn`ed process; the sender uses `TransferAgent` like an engine would.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

from pdserve.argtypes import count

PAGE_SIZES_KIB = (4, 16, 64, 256, 1024)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--page-kib", type=count, nargs="+", default=list(PAGE_SIZES_KIB), help="bytes per page, KiB"
    )
    p.add_argument("--total-mib", type=count, default=64, help="bytes moved per case, MiB")
    p.add_argument("--num-regions", type=count, default=2, help="regions (K/V buffers) the pages span")
    p.add_argument("--repeats", type=count, default=15, help="timed repetitions per case (median reported)")
    p.add_argument("--staging-chunks", type=count, default=4, help="pipelined chunks of a staged write")
    p.add_argument(
        "--rounds",
        type=count,
        default=1,
        help="sweep all cases this many times; the table gives medians over every repetition of every "
        "round and each round's ratio (drift on a shared machine shows up between rounds)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the scattered page ids")
    p.add_argument(
        "--torch-threads",
        type=count,
        default=1,
        help="torch intra-op threads in both processes (1: on 2 busy cores, 2 threads thrash: 1 MiB gathers 30x slower)",
    )


def _pool(num_regions: int, num_pages: int, page_nbytes: int, fill: bool):
    import torch

    from pdserve.kvcache.host_memory import host_zeros

    regions = [host_zeros((num_pages, page_nbytes)) for _ in range(num_regions)]
    if fill:
        g = torch.Generator().manual_seed(1)
        for t in regions:
            t.random_(0, 256, generator=g)
    return regions


def _digest(regions, page_ids) -> str:
    import torch

    h = hashlib.blake2b(digest_size=16)
    idx = torch.as_tensor(page_ids, dtype=torch.long)
    for r in regions:
        h.update(r.index_select(0, idx).numpy().tobytes())
    return h.hexdigest()


def _receiver_main(conn, num_regions: int, max_pages: int, page_nbytes: int, torch_threads: int) -> None:
    """Spawned receiver: a KV-like pool of 2 * max_pages pages of `page_nbytes` per region (reshaped
    for larger page sizes: same bytes) + a staging buffer; answers setup/zero/verify, acks notifs."""
    import torch

    from pdserve.kvcache.host_memory import host_zeros
    from pdserve.transfer.agent import TransferAgent
    from pdserve.transfer.staging import StagingPool, scatter_pages

    torch.set_num_threads(torch_threads)

    buf = _pool(num_regions, 2 * max_pages, page_nbytes, fill=False)
    staging_buf = host_zeros(num_regions * max_pages * page_nbytes)
    regions = [(t.data_ptr(), t.numel()) for t in buf] + [(staging_buf.data_ptr(), staging_buf.numel())]
    agent = TransferAgent("nixl", "bench-recv", regions, poll_interval_s=0.0002)
    conn.send((agent.metadata(), [t.data_ptr() for t in buf], staging_buf.data_ptr()))
    staging = views = dst_pages = None
    chunks, expected, seen = [], 0, 0
    while True:
        for _, notif in agent.wait_notifications(0.0005):
            if notif.startswith(b"s"):  # staged chunk c: scatter its slot into the pool
                off, start, n = chunks[int(notif[1:])]
                scatter_pages(staging.view(off, n), views, dst_pages[start : start + n])
            seen += 1
            if seen == expected:  # the receiver's clock reading: CLOCK_MONOTONIC is host-wide
                conn.send(("ack", time.perf_counter()))
                seen = 0
        try:
            if not conn.poll(0):
                continue
            msg = conn.recv()
        except (EOFError, OSError):  # the sender is gone: end quietly
            agent.close()
            return
        if msg[0] == "setup":  # (page size, pages per region, dst_pages, chunks, notifs per rep)
            _, case_page_nbytes, num_pages, dst_pages, chunks, expected = msg
            views = [t.view(2 * num_pages, case_page_nbytes) for t in buf]
            staging = StagingPool(num_regions, case_page_nbytes, num_pages, buffer=staging_buf)
            conn.send("ok")
        elif msg[0] == "zero":
            for t in buf:
                t.zero_()
            conn.send("ok")
        elif msg[0] == "verify":
            conn.send(_digest(views, dst_pages))
        elif msg[0] == "stop":
            agent.close()
            conn.send("bye")
            return


def _check_layout(total_nbytes: int, num_regions: int, page_sizes: list[int]) -> None:
    """Every page size must tile each region's share of the bytes exactly, at least once (else a
    view fails after both processes started); ValueError (an `error:` line) otherwise."""
    per_region, rest = divmod(total_nbytes, num_regions)
    bad = [p >> 10 for p in page_sizes if rest or per_region % p or per_region < p]
    if bad:
        raise ValueError(
            f"page size(s) {bad} KiB do not tile {total_nbytes >> 20} MiB over {num_regions} regions "
            f"({per_region} bytes each): each page size must divide it"
        )


def _stop_receiver(conn, proc, agent) -> None:
    """Tell the receiver to stop (it closes its agent), close ours, and reap it."""
    try:
        conn.send(("stop",))
        if conn.poll(10):
            conn.recv()
    except (EOFError, OSError, BrokenPipeError):
        pass
    if agent is not None:
        agent.close()
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _copy_contiguous(src, dst, num_pages: int) -> None:
    for s, d in zip(src, dst, strict=True):
        d[:num_pages].copy_(s[:num_pages])


def _copy_indexed(src, dst, src_idx, dst_idx, tmp) -> None:
    """The fastest vectorized torch/numpy way found here: index_select into a temporary, then a
    numpy row assignment (torch's index_copy_ on byte rows is ~1.5 GB/s)."""
    import torch

    for s, d in zip(src, dst, strict=True):
        torch.index_select(s, 0, src_idx, out=tmp)
        d.numpy()[dst_idx.numpy()] = tmp.numpy()


def _copy_loop(src, dst, pairs) -> None:
    for s, d in zip(src, dst, strict=True):
        for i, j in pairs:
            d[j].copy_(s[i])


def _time_ceiling(repeats: int, fn, *args) -> float:
    """Median seconds of `fn(*args)` over `repeats` runs after one warm-up (torch, in-process)."""
    fn(*args)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def run(args: argparse.Namespace) -> int:
    import multiprocessing as mp

    import numpy as np
    import torch

    from pdserve.kvcache.host_memory import host_zeros
    from pdserve.transfer.agent import TransferAgent
    from pdserve.transfer.nixl_backend import nixl_available
    from pdserve.transfer.pages import RegionTable, merge_runs, page_descriptors
    from pdserve.transfer.staging import StagingPool, gather_pages

    if not nixl_available():
        print("NIXL is not installed (pip install nixl-cu12); nothing to compare.")
        return 1
    R = args.num_regions
    total_nbytes = args.total_mib << 20
    page_sizes = [k << 10 for k in args.page_kib]
    _check_layout(total_nbytes, R, page_sizes)
    torch.set_num_threads(args.torch_threads)
    max_pages = total_nbytes // R // min(page_sizes)
    region_nbytes = 2 * max_pages * min(page_sizes)  # every page size uses the same bytes per region
    ctx = mp.get_context("spawn")  # never fork around NIXL agents
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_receiver_main, args=(child, R, max_pages, min(page_sizes), args.torch_threads), daemon=True
    )
    proc.start()
    agent = None
    try:
        src_flat = _pool(R, 1, region_nbytes, fill=True)
        ceil_dst_flat = _pool(R, 1, region_nbytes, fill=False)
        staging_buf = host_zeros(total_nbytes)
        regions = [(t.data_ptr(), t.numel()) for t in src_flat] + [
            (staging_buf.data_ptr(), staging_buf.numel())
        ]
        agent = TransferAgent("nixl", "bench-send", regions, poll_interval_s=0.0002)
        peer_md, peer_bases, peer_staging = parent.recv()
        agent.add_peer("bench-recv", peer_md)

        def call(*msg):
            parent.send(msg)
            return parent.recv()

        def nixl_rep(submit_all) -> float:
            t0 = time.perf_counter()
            ids = submit_all()
            kind, t_known = parent.recv()
            assert kind == "ack"
            dt = t_known - t0  # until the receiver knew (not the ack's way back)
            done: dict[int, object] = {}
            while len(done) < len(ids):
                done.update(agent.poll_completions())
                time.sleep(0.0001)
            if any(done[i] != 1 for i in ids):
                raise RuntimeError(f"transfer failed: {done}")
            return dt

        rng = np.random.default_rng(args.seed)
        # (page KiB, pattern, path) -> descriptors, and every repetition's times over all rounds.
        samples: dict[tuple[int, str, str], dict] = {}
        print(
            f"moving {args.total_mib} MiB per case over {R} regions; median of {args.repeats} x {args.rounds} "
            f"round(s); receiver pid {proc.pid}"
        )
        for page_nbytes in [p for _ in range(args.rounds) for p in page_sizes]:
            n = total_nbytes // R // page_nbytes  # pages per region
            src = [t.view(2 * n, page_nbytes) for t in src_flat]
            cdst = [t.view(2 * n, page_nbytes) for t in ceil_dst_flat]
            local_tab = RegionTable(tuple(t.data_ptr() for t in src), (page_nbytes,) * R)
            peer_tab = RegionTable(tuple(peer_bases), (page_nbytes,) * R)
            staging = StagingPool(R, page_nbytes, n, buffer=staging_buf)
            memcpy = (_copy_contiguous, (src, cdst, n))
            memcpy_s = _time_ceiling(args.repeats, memcpy[0], *memcpy[1])
            patterns = {
                "contiguous": (np.arange(n), np.arange(n)),
                "scattered": (rng.permutation(2 * n)[:n], rng.permutation(2 * n)[:n]),
            }
            for case, (src_pages, dst_pages) in patterns.items():
                if case == "contiguous":
                    ceiling = memcpy
                else:  # the faster of the two in-process ways, picked once, then timed next to nixl
                    sidx, didx = torch.as_tensor(src_pages), torch.as_tensor(dst_pages)
                    tmp = host_zeros((n, page_nbytes))
                    pairs = list(zip(src_pages.tolist(), dst_pages.tolist(), strict=True))
                    vec = (_copy_indexed, (src, cdst, sidx, didx, tmp))
                    loop = (_copy_loop, (src, cdst, pairs))
                    vec_s, loop_s = _time_ceiling(2, vec[0], *vec[1]), _time_ceiling(1, loop[0], *loop[1])
                    ceiling = vec if vec_s <= loop_s else loop
                runs = merge_runs(src_pages.tolist(), dst_pages.tolist())
                local, remote = page_descriptors(runs, local_tab, peer_tab)
                paths = {"direct": None}
                if case == "scattered":
                    paths["staged"] = None
                for path in paths:
                    if path == "direct":
                        chunks, expected = [], 1

                        def submit_all(local=local, remote=remote):
                            return [agent.submit("bench-recv", local, remote, b"d")]

                        num_descs = len(local)
                    else:
                        k = max(1, min(args.staging_chunks, n))
                        bounds = [n * c // k for c in range(k + 1)]
                        chunks = [(bounds[c], bounds[c], bounds[c + 1] - bounds[c]) for c in range(k)]
                        expected = k

                        def submit_all(chunks=chunks, src=src, src_pages=src_pages, staging=staging):
                            ids = []
                            for c, (off, start, cnt) in enumerate(chunks):
                                gather_pages(src, src_pages[start : start + cnt], staging.view(off, cnt))
                                addr, nbytes = staging.descriptor(off, cnt)
                                remote_addr = peer_staging + (addr - staging_buf.data_ptr())
                                ids.append(
                                    agent.submit(
                                        "bench-recv", [(addr, nbytes)], [(remote_addr, nbytes)], b"s%d" % c
                                    )
                                )
                            return ids

                        num_descs = k
                    assert call("setup", page_nbytes, n, dst_pages, chunks, expected) == "ok"
                    assert call("zero") == "ok"
                    nixl_rep(submit_all)  # warm-up, then verify the bytes
                    if call("verify") != _digest(src, src_pages):
                        raise RuntimeError(f"bytes differ on the receiver: {page_nbytes} B {case} {path}")
                    # Interleave: copy then nixl, rep by rep, so both see the same background load.
                    nixl_t, ceil_t = [], []
                    for _ in range(args.repeats):
                        ceil_t.append(_time_ceiling(1, ceiling[0], *ceiling[1]))
                        nixl_t.append(nixl_rep(submit_all))
                    ratios = [c / x for c, x in zip(ceil_t, nixl_t, strict=True)]
                    ratio = statistics.median(ratios)
                    acc = samples.setdefault(
                        (page_nbytes >> 10, case, path),
                        {
                            "descs": num_descs,
                            "nixl": [],
                            "ceil": [],
                            "ratios": [],
                            "round_ratios": [],
                            "memcpy": [],
                        },
                    )
                    acc["nixl"] += nixl_t
                    acc["ceil"] += ceil_t
                    acc["ratios"] += ratios
                    acc["round_ratios"].append(ratio)
                    acc["memcpy"].append(memcpy_s)
                    print(
                        f"  {page_nbytes >> 10:>5} KiB {case:<10} {path:<6} descs {num_descs:>6}  "
                        f"nixl {_gbps(total_nbytes, statistics.median(nixl_t)):6.2f}  "
                        f"copy {_gbps(total_nbytes, statistics.median(ceil_t)):6.2f}  ratio {ratio:5.0%}",
                        flush=True,
                    )
    finally:  # (an error on this side too: the receiver and both NIXL agents end cleanly)
        _stop_receiver(parent, proc, agent)
    rows = [
        (
            kib,
            case,
            path,
            acc["descs"],
            _gbps(total_nbytes, statistics.median(acc["nixl"])),
            _gbps(total_nbytes, statistics.median(acc["ceil"])),
            statistics.median(acc["ratios"]),
            _gbps(total_nbytes, statistics.median(acc["memcpy"])),
            acc["round_ratios"],
        )
        for (kib, case, path), acc in samples.items()
    ]
    _print_table(rows)
    return 0


def _print_table(rows) -> None:
    header = (
        "page KiB",
        "pattern",
        "nixl path",
        "descriptors",
        "nixl GB/s",
        "copy GB/s",
        "ratio",
        "memcpy GB/s",
    )
    multi = any(len(r[-1]) > 1 for r in rows)
    if multi:
        header = (*header, "ratio per round")
    lines = [header] + [
        (str(k), case, path, str(d), f"{g:.2f}", f"{c:.2f}", f"{ratio:.0%}", f"{m:.2f}")
        + ((" ".join(f"{x:.0%}" for x in per_round),) if multi else ())
        for k, case, path, d, g, c, ratio, m, per_round in rows
    ]
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    print()
    for i, row in enumerate(lines):
        print("| " + " | ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
