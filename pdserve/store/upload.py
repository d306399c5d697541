"""Stored KV blocks from host memory onto the pool's device: the copies DualPath's read paths end in.

A store read lands blocks in a host buffer [num_blocks, block_nbytes], block-major: each row holds K
then V of every layer in turn (store/layout.py). Its consumers want it layer by layer, so a layer's K
(or V) half is a strided slice: `num_blocks` rows of `layer_nbytes / 2` at a pitch of `block_nbytes`.
torch copies such a slice to a GPU by first making it contiguous in pageable memory, then copying
from pageable memory: 3.2 GB/s on an H200, against 55.5 GB/s for one contiguous copy from pinned
memory (scripts/bench_pe_copy.py, docs/benchmarks.md). This module keeps those copies near the PCIe
ceiling through small, reused pinned staging buffers; the read buffers themselves stay pageable
(pinning each read would pin GBs per request, on the engine thread, and torch's pinned cache never
gives them back):

* `scatter_chunks` (whole blocks into pool pages: the decode's DE-path hits, a colocated hit): runs of
  whole blocks go over in one copy each, through two pinned slots of `SCATTER_CHUNK_NBYTES` (the host
  fills one while the other is copied), and each layer's halves are cut out on the device;
* `LayerUpload` (layerwise prefill, PE path: one layer of every block at a time, in layer order): a
  helper thread gathers layer l's halves into one of two pinned staging slots (a CPU copy) and copies
  the slot to the device on a side stream, so layer l+1's gather overlaps layer l's copy and the
  compute; the consumer's stream waits for the copy's event. 35.8 GB/s on an H200.

On a CPU pool the same calls make one plain copy each (no pinning, no streams).
"""

from __future__ import annotations

import torch

from pdserve.store.layout import BlockLayout
from pdserve.transfer.staging import wide_rows

# Bytes of one `scatter_chunks` copy (whole blocks; at least one block): each of the two pinned
# staging slots, and the device scratch of one chunk.
SCATTER_CHUNK_NBYTES = 128 << 20


def _blocks_per_chunk(layout: BlockLayout) -> int:
    return max(1, SCATTER_CHUNK_NBYTES // layout.block_nbytes)


def scatter_staging(layout: BlockLayout, device: torch.device) -> torch.Tensor | None:
    """The pinned slots `scatter_chunks` copies through for a pool on `device`: [2, chunk bytes], made
    once per pool (256 MiB at the default); None for a CPU pool, which needs none."""
    if torch.device(device).type != "cuda":
        return None
    return torch.empty(
        (2, _blocks_per_chunk(layout) * layout.block_nbytes), dtype=torch.uint8, pin_memory=True
    )


def scatter_chunks(
    buf: torch.Tensor,
    num_blocks: int,
    layout: BlockLayout,
    page_ids: torch.Tensor,
    k_pools: list[torch.Tensor],
    v_pools: list[torch.Tensor],
    staging: torch.Tensor | None = None,
) -> None:
    """Blocks `buf[:num_blocks]` (host memory) -> pool pages `page_ids` (int64 on the pools' device,
    `block_size / page_size` per block, in token order). `k_pools[l]` / `v_pools[l]`: layer l's pool
    viewed as bytes [num_pages, page_nbytes]. `staging` (`scatter_staging`'s, for a GPU pool): each
    chunk goes to the device from one of its slots, asynchronously, on the current stream; the caller
    synchronizes before anyone reads the pages from elsewhere or `staging` is used again. Without it,
    chunks go directly."""
    device = k_pools[0].device
    page_nbytes = k_pools[0].shape[1]
    half = layout.layer_nbytes // 2
    pages_per_block = half // page_nbytes  # a block's K half = its pages' K rows (block_size / page_size)
    per_chunk = _blocks_per_chunk(layout) if staging is None else staging.shape[1] // layout.block_nbytes
    slot_free: list[torch.cuda.Event | None] = [None, None]
    for i, b0 in enumerate(range(0, num_blocks, per_chunk)):
        b1 = min(num_blocks, b0 + per_chunk)
        rows = buf[b0:b1]
        if staging is None:
            chunk = rows.to(device)  # a view on a CPU pool
        else:
            slot = i % 2
            if slot_free[slot] is not None:
                slot_free[slot].synchronize()  # chunk i - 2's copy out of this slot has finished
            src = staging[slot, : rows.numel()].view(rows.shape)
            src.copy_(rows)  # host memcpy into pinned memory; the device copies chunk i - 1 meanwhile
            chunk = torch.empty(rows.shape, dtype=torch.uint8, device=device)
            chunk.copy_(src, non_blocking=True)
            slot_free[slot] = torch.cuda.Event()
            slot_free[slot].record(torch.cuda.current_stream(device))
        ids = page_ids[b0 * pages_per_block : b1 * pages_per_block]
        for layer, (k, v) in enumerate(zip(k_pools, v_pools, strict=True)):
            off = layout.layer_range(layer)[0]
            # [blocks, half] -> [blocks * pages_per_block, page_nbytes]: a block's pages, in order
            for pool, start in ((k, off), (v, off + half)):
                dst, src = wide_rows(pool, chunk[:, start : start + half].reshape(-1, page_nbytes))
                dst.index_copy_(0, ids, src)  # (on wide rows: 8x faster than on bytes on a CPU)


class LayerUpload:
    """One layerwise run's copies of layer l's hit KV, from the read buffer to `device`.

    `copy(layer)` runs on the caller's helper thread (one at a time, in layer order); `ready(result)` on
    the thread that computes with the tensors. Returns K and V as [num_blocks * block_size, *kv_shape]
    of `dtype`, contiguous, on `device`.
    """

    def __init__(
        self,
        buffer: torch.Tensor,
        num_blocks: int,
        layout: BlockLayout,
        device: torch.device,
        dtype: torch.dtype,
        kv_shape: tuple[int, int],
    ) -> None:
        self.buffer, self.num_blocks, self.layout = buffer, num_blocks, layout
        self.device, self.dtype, self.kv_shape = torch.device(device), dtype, kv_shape
        self.half = layout.layer_nbytes // 2
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            # Two slots of [K, V] halves, used by even and odd layers (pinned on the helper thread at
            # the first copy: not on the engine thread); `_slot_free[s]`: the event of the last copy
            # out of slot s (gathering into it again waits for that copy).
            self._staging: torch.Tensor | None = None
            self._slot_free: list[torch.cuda.Event | None] = [None, None]
            self._stream = torch.cuda.Stream(self.device)  # (torch hands out streams from a pool)

    def _halves(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        off = self.layout.layer_range(layer)[0]
        rows = self.buffer[: self.num_blocks]
        return rows[:, off : off + self.half], rows[:, off + self.half : off + 2 * self.half]

    def _typed(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(-1).view(self.dtype).view(-1, *self.kv_shape)

    def copy(self, layer: int):
        """Layer `layer`'s K and V on their way to the device (helper thread)."""
        k_src, v_src = self._halves(layer)
        if not self.cuda:  # one contiguous copy each (the slices are strided unless num_blocks is 1)
            return (
                self._typed(k_src.clone(memory_format=torch.contiguous_format)),
                self._typed(v_src.clone(memory_format=torch.contiguous_format)),
                None,
            )
        if self._staging is None:
            self._staging = torch.empty(
                (2, 2, self.num_blocks, self.half), dtype=torch.uint8, pin_memory=True
            )
        slot = layer % 2
        if self._slot_free[slot] is not None:
            self._slot_free[slot].synchronize()  # layer - 2's copy out of this slot has finished
        staging = self._staging[slot]
        staging[0].copy_(k_src)  # CPU gather: strided rows -> contiguous pinned memory
        staging[1].copy_(v_src)
        with torch.cuda.stream(self._stream):
            k = torch.empty((self.num_blocks, self.half), dtype=torch.uint8, device=self.device)
            v = torch.empty_like(k)
            k.copy_(staging[0], non_blocking=True)
            v.copy_(staging[1], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        self._slot_free[slot] = done
        return self._typed(k), self._typed(v), done

    def ready(self, result) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a finished `copy`, usable on the current stream (the computing thread)."""
        k, v, done = result
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            # allocated on the side stream, used on this one: not reused before this stream is past it
            k.record_stream(current)
            v.record_stream(current)
        return k, v
