"""DualPath's host -> GPU copies of stored KV beside a plain pinned copy of the same bytes, in one run.

    python scripts/bench_pe_copy.py [--device cuda] [--layers 16] [--hit-tokens 32768] [--json F]

A store read lands `num_blocks` blocks in a host buffer [num_blocks, block_nbytes], block-major (each
row: K then V of every layer in turn, store/layout.py). Two consumers copy it to the GPU:
1. layerwise prefill, PE path (`LayerwisePrefill.from_host_buffer`): layer l of every block, in layer
   order, on a helper thread. Layer l is a strided slice: `num_blocks` rows of `layer_nbytes` at a
   stride of `block_nbytes`.
2. `StoreConnector.scatter_blocks` (the decode's DE-path hits, a colocated store hit): every layer of
   every block into pool pages.
Each is timed as the engine runs it, from a pageable buffer (what `start_read` allocates) and from a
pinned one, beside candidates and the ceiling: one contiguous pinned H2D copy of the same bytes.
Layerwise candidates: `rows` (one pinned copy per block row), `memcpy2d` (one cudaMemcpy2DAsync per
layer through cuda-python, where importable), `host gather` (a strided CPU copy into a pinned
staging buffer, then one H2D). Scatter candidate: `chunked` (contiguous runs of blocks, all layers,
one pinned H2D each, then the per-layer index_copy on the device). Every candidate's bytes are
checked against the engine's. Wall time with the device synchronized; best of `--repeats`.
Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import torch

from pdserve.engine.pd_layerwise import LayerwisePrefill
from pdserve.engine.store_connector import StoreConnector
from pdserve.store.layout import BlockLayout

CHUNK_NBYTES = 256 << 20  # scratch of the chunked scatter on the device


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hit-tokens", type=int, default=32768)
    p.add_argument("--block-size", type=int, default=64, help="tokens per store block")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16
    per_token_layer = 2 * args.kv_heads * args.head_dim * dtype.itemsize
    layout = BlockLayout(args.layers, args.block_size, per_token_layer, "bench")
    n = args.hit_tokens // args.block_size
    ppb = args.block_size // args.page_size
    total = n * layout.block_nbytes
    print(
        f"{args.hit_tokens} hit tokens = {n} blocks of {layout.block_nbytes >> 20} MiB "
        f"({total / 2**30:.2f} GiB, {layout.layer_nbytes * n >> 20} MiB per layer), device {dev}"
    )

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def best(fn) -> float:
        fn()
        sync()
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t)
        return min(times)

    pageable = torch.empty((n, layout.block_nbytes), dtype=torch.uint8)
    pageable.view(torch.int32).random_()
    buffers = {"pageable": pageable}
    if cuda:
        buffers["pinned"] = torch.empty_like(pageable, pin_memory=True).copy_(pageable)
    pinned = buffers.get("pinned", pageable)
    results: dict[str, float] = {}

    def report(name: str, nbytes: int, seconds: float) -> None:
        results[name] = round(nbytes / seconds / 1e9, 2)
        print(f"  {name:<34} {seconds * 1e3:9.1f} ms {nbytes / seconds / 1e9:8.2f} GB/s")

    flat_dev = torch.empty(total, dtype=torch.uint8, device=dev)
    print("ceiling: one contiguous H2D copy of every byte")
    report("contiguous h2d (pinned)", total, best(lambda: flat_dev.copy_(pinned.view(-1), non_blocking=True)))

    # ---- 1. layerwise prefill, PE path -----------------------------------------------------------
    print("layerwise PE path: every layer of the hit, in layer order")
    lw = object.__new__(LayerwisePrefill)
    lw.runner = SimpleNamespace(device=dev)
    lw.dtype, lw.kv_shape = dtype, (args.kv_heads, args.head_dim)
    lw._copier = ThreadPoolExecutor(1)
    last: dict[str, tuple] = {}

    def engine_layerwise(buf, key):
        start, finish = lw.from_host_buffer(buf, n, layout)
        start(0)
        for layer in range(args.layers):
            if layer + 1 < args.layers:
                start(layer + 1)
            out = finish(layer)
        last[key] = out

    for name, buf in buffers.items():
        report(f"engine from_host_buffer ({name})", total, best(lambda b=buf, k=name: engine_layerwise(b, k)))

    half = layout.layer_nbytes // 2
    scratch = torch.empty((n, layout.layer_nbytes), dtype=torch.uint8, device=dev)

    def split(d):
        k = d[:, :half].reshape(-1).view(dtype).view(-1, *lw.kv_shape)
        v = d[:, half:].reshape(-1).view(dtype).view(-1, *lw.kv_shape)
        return k, v

    def rows(buf, key):
        for layer in range(args.layers):
            off = layout.layer_range(layer)[0]
            for i in range(n):
                scratch[i].copy_(buf[i, off : off + layout.layer_nbytes], non_blocking=True)
            last[key] = split(scratch)

    report("rows (pinned)", total, best(lambda: rows(pinned, "rows")))

    staging = torch.empty((n, layout.layer_nbytes), dtype=torch.uint8, pin_memory=cuda)

    def host_gather(buf, key):
        for layer in range(args.layers):
            off = layout.layer_range(layer)[0]
            sync()  # the staging buffer is reused: the last H2D out of it must be done
            staging.copy_(buf[:, off : off + layout.layer_nbytes])
            scratch.copy_(staging, non_blocking=True)
            last[key] = split(scratch)

    report("host gather + h2d (pinned)", total, best(lambda: host_gather(pageable, "gather")))

    try:
        from cuda.bindings import runtime as cudart

        kind = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice

        def memcpy2d(buf, key):
            stream = torch.cuda.current_stream(dev).cuda_stream
            for layer in range(args.layers):
                off = layout.layer_range(layer)[0]
                (err,) = cudart.cudaMemcpy2DAsync(
                    scratch.data_ptr(),
                    layout.layer_nbytes,
                    buf.data_ptr() + off,
                    layout.block_nbytes,
                    layout.layer_nbytes,
                    n,
                    kind,
                    stream,
                )
                if err != cudart.cudaError_t.cudaSuccess:
                    raise RuntimeError(f"cudaMemcpy2DAsync: {err}")
                last[key] = split(scratch)

        if cuda:
            report("memcpy2d (pinned)", total, best(lambda: memcpy2d(pinned, "memcpy2d")))
            report("memcpy2d (pageable)", total, best(lambda: memcpy2d(pageable, "memcpy2d_pageable")))
    except Exception as e:  # cuda-python missing, or its API not as expected: the other paths still run
        print(f"  memcpy2d: skipped ({type(e).__name__}: {e})")

    # every candidate's last layer equals the engine's
    def raw(t):  # compared as bytes: random bits hold NaNs, which never equal themselves
        return t.cpu().view(torch.uint8)

    ref_k, ref_v = last["pageable"]
    for key, (k, v) in last.items():
        assert torch.equal(raw(k), raw(ref_k)) and torch.equal(raw(v), raw(ref_v)), key
    print(f"  (last layer identical across {len(last)} paths)")

    # ---- 2. scatter_blocks ----------------------------------------------------------------------
    print("scatter_blocks: every layer of every block into pool pages")
    num_pages = 2 * n * ppb
    page_nbytes = args.page_size * per_token_layer // 2
    conn = object.__new__(StoreConnector)
    conn.layout, conn.page_size, conn.pages_per_block = layout, args.page_size, ppb
    conn._k = [
        torch.zeros((num_pages, page_nbytes), dtype=torch.uint8, device=dev) for _ in range(args.layers)
    ]
    conn._v = [
        torch.zeros((num_pages, page_nbytes), dtype=torch.uint8, device=dev) for _ in range(args.layers)
    ]
    g = torch.Generator().manual_seed(0)
    page_ids = torch.randperm(num_pages, generator=g)[: n * ppb].tolist()
    for name, buf in buffers.items():
        report(
            f"engine scatter_blocks ({name})", total, best(lambda b=buf: conn.scatter_blocks(b, n, page_ids))
        )
    ref = [t[page_ids[:64]].cpu() for t in (*conn._k, *conn._v)]

    def chunked(buf):
        idx = torch.tensor(page_ids, dtype=torch.long, device=dev)
        per_chunk = max(1, CHUNK_NBYTES // layout.block_nbytes)
        for b0 in range(0, n, per_chunk):
            b1 = min(n, b0 + per_chunk)
            d = buf[b0:b1].to(dev, non_blocking=True)  # contiguous rows: one copy
            ids = idx[b0 * ppb : b1 * ppb]
            for layer in range(args.layers):
                off = layout.layer_range(layer)[0]
                conn._k[layer].index_copy_(0, ids, d[:, off : off + half].reshape(-1, page_nbytes))
                conn._v[layer].index_copy_(0, ids, d[:, off + half : off + 2 * half].reshape(-1, page_nbytes))

    for t in (*conn._k, *conn._v):
        t.zero_()
    report("chunked (pinned)", total, best(lambda: chunked(pinned)))
    got = [t[page_ids[:64]].cpu() for t in (*conn._k, *conn._v)]
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True)), "chunked scatter differs"
    print("  (pages identical to the engine's)")

    if args.json:
        with open(args.json, "w") as f:
            info = {"device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__}
            json.dump(info | vars(args) | {"GBps": results}, f, indent=1)


if __name__ == "__main__":
    main()
