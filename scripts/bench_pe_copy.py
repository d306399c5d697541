"""DualPath's host -> GPU copies of stored KV beside a plain pinned copy of the same bytes, in one run.

    python scripts/bench_pe_copy.py [--device cuda] [--layers 16] [--hit-tokens 32768] [--json F]

A store read lands `num_blocks` blocks in a host buffer [num_blocks, block_nbytes], block-major (each
row: K then V of every layer in turn, store/layout.py). Two consumers copy it to the GPU:
1. layerwise prefill, PE path (`LayerwisePrefill.from_host_buffer`): layer l of every block, in layer
   order, on a helper thread. Layer l is a strided slice: `num_blocks` rows of `layer_nbytes` at a
   stride of `block_nbytes`.
2. `StoreConnector.scatter_blocks` (the decode's DE-path hits, a colocated store hit): every layer of
   every block into pool pages.
Each is timed as the engine runs it now (store/upload.py: from the pageable buffer the store reads
into, through pinned staging slots) and as it ran before (torch's copy of each strided slice, kept here
as the reference; from a pageable and from a pinned buffer), beside the ceiling: one contiguous pinned
H2D copy of the same bytes; and two references: for the layerwise path, one `cudaMemcpy2DAsync` per
layer through cuda-python (where importable), what a 2-D copy would give; for the scatter, runs of
blocks straight from a pinned buffer, what pinning every read buffer would give. The last layer's
bytes (layerwise) and the first 64 pages' (scatter) are compared across all paths.
Last, the other direction: write-back's per-chunk gather and copy to host (engine thread, pageable),
before and after it selected wide rows, beside one pinned device-to-host copy. Wall time with the device synchronized; best of
`--repeats`.
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
from pdserve.engine.store_connector import PERSIST_CHUNK_NBYTES, StoreConnector
from pdserve.store.layout import BlockLayout
from pdserve.store.upload import scatter_chunks


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
        print(f"  {name:<44} {seconds * 1e3:9.1f} ms {nbytes / seconds / 1e9:8.2f} GB/s")

    flat_dev = torch.empty(total, dtype=torch.uint8, device=dev)
    print("ceiling: one contiguous H2D copy of every byte")
    report("contiguous h2d (pinned)", total, best(lambda: flat_dev.copy_(pinned.view(-1), non_blocking=True)))

    # ---- 1. layerwise prefill, PE path -----------------------------------------------------------
    print("layerwise PE path: every layer of the hit, in layer order, a helper thread a layer ahead")
    lw = object.__new__(LayerwisePrefill)
    lw.runner = SimpleNamespace(device=dev)
    lw.dtype, lw.kv_shape = dtype, (args.kv_heads, args.head_dim)
    lw._copier = ThreadPoolExecutor(1)
    half = layout.layer_nbytes // 2
    last: dict[str, tuple] = {}

    def strided_load(buf):
        """The engine's copy before store/upload.py: torch's copy of each strided half."""

        def copy(layer: int):
            off = layout.layer_range(layer)[0]
            k = buf[:n, off : off + half].reshape(-1).clone().view(dtype).view(-1, *lw.kv_shape)
            v = buf[:n, off + half : off + 2 * half].reshape(-1).clone().view(dtype).view(-1, *lw.kv_shape)
            return k.to(dev), v.to(dev)

        futures = {}
        return (lambda layer: futures.__setitem__(layer, lw._copier.submit(copy, layer))), (
            lambda layer: futures.pop(layer).result()
        )

    def layerwise(load, key):
        start, finish = load
        start(0)
        for layer in range(args.layers):  # the engine's order: layer l+1 starts once layer l is ready
            out = finish(layer)
            if layer + 1 < args.layers:
                start(layer + 1)
        last[key] = out

    for name, buf in buffers.items():
        report(
            f"before: strided .to(device) ({name})",
            total,
            best(lambda b=buf, k=name: layerwise(strided_load(b), "old " + k)),
        )
    for name, buf in buffers.items():
        report(
            f"engine LayerUpload ({name})",
            total,
            best(lambda b=buf, k=name: layerwise(lw.from_host_buffer(b, n, layout), k)),
        )

    try:
        from cuda.bindings import runtime as cudart

        kind = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        scratch = torch.empty((n, layout.layer_nbytes), dtype=torch.uint8, device=dev)

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
                k = scratch[:, :half].reshape(-1).view(dtype).view(-1, *lw.kv_shape)
                v = scratch[:, half:].reshape(-1).view(dtype).view(-1, *lw.kv_shape)
                last[key] = (k, v)

        if cuda:
            report(
                "reference: memcpy2d, one per layer (pinned)",
                total,
                best(lambda: memcpy2d(pinned, "memcpy2d")),
            )
    except Exception as e:  # cuda-python missing, or its API not as expected: the other paths still run
        print(f"  memcpy2d: skipped ({type(e).__name__}: {e})")

    def raw(t):  # compared as bytes: random bits hold NaNs, which never equal themselves
        return t.cpu().view(torch.uint8)

    ref_k, ref_v = last["old pageable"]
    for key, (k, v) in last.items():
        assert torch.equal(raw(k), raw(ref_k)) and torch.equal(raw(v), raw(ref_v)), key
    print(f"  (last layer identical across {len(last)} paths)")

    # ---- 2. scatter_blocks ----------------------------------------------------------------------
    print("scatter_blocks: every layer of every block into pool pages")
    num_pages = 2 * n * ppb
    page_nbytes = args.page_size * per_token_layer // 2
    conn = object.__new__(StoreConnector)
    conn.layout, conn.page_size, conn.pages_per_block = layout, args.page_size, ppb
    conn._scatter_staging = None
    conn._k = [
        torch.zeros((num_pages, page_nbytes), dtype=torch.uint8, device=dev) for _ in range(args.layers)
    ]
    conn._v = [
        torch.zeros((num_pages, page_nbytes), dtype=torch.uint8, device=dev) for _ in range(args.layers)
    ]
    g = torch.Generator().manual_seed(0)
    page_ids = torch.randperm(num_pages, generator=g)[: n * ppb].tolist()

    def per_layer(buf):
        """The engine's scatter before store/upload.py: each layer's strided halves, one at a time."""
        idx = torch.tensor(page_ids, dtype=torch.long, device=dev)
        for layer, (k, v) in enumerate(zip(conn._k, conn._v, strict=True)):
            off = layout.layer_range(layer)[0]
            k.index_copy_(0, idx, buf[:n, off : off + half].reshape(n * ppb, -1).to(dev))
            v.index_copy_(0, idx, buf[:n, off + half : off + 2 * half].reshape(n * ppb, -1).to(dev))
        sync()

    pages = {}
    for name, buf in buffers.items():
        report(f"before: per-layer strided ({name})", total, best(lambda b=buf: per_layer(b)))
    pages["before"] = [t[page_ids[:64]].cpu() for t in (*conn._k, *conn._v)]
    for t in (*conn._k, *conn._v):
        t.zero_()
    # the store reads into pageable buffers; scatter_blocks copies them through its pinned slots
    report(
        "engine scatter_blocks (pageable)", total, best(lambda: conn.scatter_blocks(pageable, n, page_ids))
    )
    pages["engine"] = [t[page_ids[:64]].cpu() for t in (*conn._k, *conn._v)]
    if cuda:

        def direct(buf):  # what a pinned read buffer would allow: runs of blocks, no staging copy
            idx = torch.tensor(page_ids, dtype=torch.long, device=dev)
            scatter_chunks(buf, n, layout, idx, conn._k, conn._v, staging=None)
            sync()

        for t in (*conn._k, *conn._v):
            t.zero_()
        report("reference: runs of blocks from a pinned buffer", total, best(lambda: direct(pinned)))
        pages["direct"] = [t[page_ids[:64]].cpu() for t in (*conn._k, *conn._v)]
    for name, got in pages.items():
        assert all(torch.equal(a, b) for a, b in zip(pages["before"], got, strict=True)), name
    print(f"  (pages identical across {len(pages)} paths)")

    # ---- 3. write-back (the other direction, for reference: not changed yet) ---------------------
    print("write-back: StoreConnector.persist's gather + copy to host, per 64 MiB chunk (engine thread)")
    chunk_blocks = max(1, PERSIST_CHUNK_NBYTES // layout.block_nbytes)

    def old_gather(first: int, last: int) -> torch.Tensor:
        """gather_blocks before it selected wide rows: index_select on byte rows."""
        idx = torch.tensor(page_ids[first * ppb : last * ppb], dtype=torch.long, device=dev)
        parts = []
        for k, v in zip(conn._k, conn._v, strict=True):
            parts += [
                k.index_select(0, idx).view(last - first, -1),
                v.index_select(0, idx).view(last - first, -1),
            ]
        return torch.cat(parts, dim=1)

    def write_back(gather):
        for first in range(0, n, chunk_blocks):
            last = min(n, first + chunk_blocks)
            gather(first, last).cpu()

    report("before: gather on byte rows + .cpu()", total, best(lambda: write_back(old_gather)))
    report(
        "engine gather_blocks(...).cpu() (pageable)",
        total,
        best(lambda: write_back(lambda a, b: conn.gather_blocks(page_ids, a, b))),
    )
    assert torch.equal(old_gather(0, 4).cpu(), conn.gather_blocks(page_ids, 0, 4).cpu())
    if cuda:  # into the pinned buffer (nothing reads it any more), from the ceiling's device copy
        report(
            "ceiling: contiguous d2h (pinned)",
            total,
            best(lambda: pinned.view(-1).copy_(flat_dev, non_blocking=True)),
        )

    if args.json:
        with open(args.json, "w") as f:
            info = {"device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__}
            json.dump(vars(args) | info | {"GBps": results}, f, indent=1)


if __name__ == "__main__":
    main()
