"""Stored KV blocks from host memory onto the pool's device: the copies DualPath's read paths end in.

A store read lands blocks in a host buffer [num_blocks, block_nbytes], block-major: each row holds K
then V of every layer in turn (store/layout.py). Its consumers want it layer by layer, so a layer's K
(or V) half is a strided slice: `num_blocks` rows of `layer_nbytes / 2` at a pitch of `block_nbytes`.
torch copies such a slice to a GPU by first making it contiguous in pageable memory, then copying
from pageable memory: 2.5-2.9 GB/s on an H200, against 55 GB/s for one contiguous copy from pinned
memory (scripts/bench_pe_copy.py, docs/benchmarks.md). This module keeps those copies near the PCIe
ceiling:

* `host_block_buffer`: the buffer a read lands in is pinned when the pool is on a GPU;
* `scatter_chunks` (whole blocks into pool pages: the decode's DE-path hits, a colocated hit): runs of
  whole blocks go over in one contiguous copy each, and each layer's halves are cut out on the device;
* `LayerUpload` (layerwise prefill, PE path: one layer of every block at a time, in layer order): a
  helper thread gathers layer l's halves into one of two pinned staging slots (a CPU copy) and copies
  the slot to the device on a side stream, so layer l+1's gather overlaps layer l's copy and the
  compute; the consumer's stream waits for the copy's event.

On a CPU pool the same calls make one plain copy each (no pinning, no streams).
"""

from __future__ import annotations

import torch

from pdserve.store.layout import BlockLayout

# Device scratch of one `scatter_chunks` copy (whole blocks; at least one block).
SCATTER_CHUNK_NBYTES = 128 << 20


def host_block_buffer(num_blocks: int, block_nbytes: int, device: torch.device) -> torch.Tensor:
    """[num_blocks, block_nbytes] uint8 host memory for a store read whose blocks go to `device`: pinned
    for a GPU (a copy from pageable memory runs at ~1/8 of the speed: 7.1 vs 55.5 GB/s on an H200,
    ../shared/anchors), plain otherwise. torch's pinned allocator caches freed buffers, so reads of
    similar sizes stop paying for the pinning after the first."""
    return torch.empty((num_blocks, block_nbytes), dtype=torch.uint8, pin_memory=device.type == "cuda")


def scatter_chunks(
    buf: torch.Tensor,
    num_blocks: int,
    layout: BlockLayout,
    page_ids: torch.Tensor,
    k_pools: list[torch.Tensor],
    v_pools: list[torch.Tensor],
) -> None:
    """Blocks `buf[:num_blocks]` -> pool pages `page_ids` (int64 on the pools' device, `pages_per_block`
    per block, in token order). `k_pools[l]` / `v_pools[l]`: layer l's pool viewed as bytes
    [num_pages, page_nbytes]. On a GPU each chunk of whole blocks is one copy (pinned `buf`: async);
    the caller synchronizes before anyone reads the pages from elsewhere."""
    device = k_pools[0].device
    page_nbytes = k_pools[0].shape[1]
    half = layout.layer_nbytes // 2
    pages_per_block = layout.block_size * layout.bytes_per_token_layer // 2 // page_nbytes
    per_chunk = max(1, SCATTER_CHUNK_NBYTES // layout.block_nbytes)
    for b0 in range(0, num_blocks, per_chunk):
        b1 = min(num_blocks, b0 + per_chunk)
        chunk = buf[b0:b1].to(device, non_blocking=True)  # contiguous rows; a view on a CPU pool
        ids = page_ids[b0 * pages_per_block : b1 * pages_per_block]
        for layer, (k, v) in enumerate(zip(k_pools, v_pools, strict=True)):
            off = layout.layer_range(layer)[0]
            # [blocks, half] -> [blocks * pages_per_block, page_nbytes]: a block's pages, in order
            k.index_copy_(0, ids, chunk[:, off : off + half].reshape(-1, page_nbytes))
            v.index_copy_(0, ids, chunk[:, off + half : off + 2 * half].reshape(-1, page_nbytes))


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
        stream=None,
    ) -> None:
        self.buffer, self.num_blocks, self.layout = buffer, num_blocks, layout
        self.device, self.dtype, self.kv_shape = torch.device(device), dtype, kv_shape
        self.half = layout.layer_nbytes // 2
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            # Two slots of [K, V] halves, used by even and odd layers; `_slot_free[s]`: the event of
            # the last copy out of slot s (gathering into it again waits for that copy).
            self._staging = torch.empty((2, 2, num_blocks, self.half), dtype=torch.uint8, pin_memory=True)
            self._slot_free: list[torch.cuda.Event | None] = [None, None]
            self._stream = stream if stream is not None else torch.cuda.Stream(self.device)

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
