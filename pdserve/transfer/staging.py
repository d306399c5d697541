"""Staging path for fragmented page lists: gather -> one contiguous write -> scatter.

Who calls what, when:
- Each engine creates one `StagingPool` at startup, next to its KV pool, and registers
  `pool.region()` with its TransferAgent together with the KV regions.
- Sender (prefill), for a fragmented send: `off = pool.alloc(n)`; `gather_pages(kv_regions, src_pages,
  pool.view(off, n))`; submit ONE descriptor `pool.descriptor(off, n)` -> the receiver's slot
  descriptor; `pool.free(off)` once the transfer is reported DONE/FAILED.
- Receiver (decode): reserves its slot with its own `alloc(n)` before sending the request; when the
  notification arrives: `scatter_pages(pool.view(off, n), kv_regions, dst_pages)`, then `free(off)`.

Slot layout: an allocation of n pages at page offset `off` is the byte range
[off * R * P, (off + n) * R * P) of the flat buffer (R regions, P bytes per page), viewed as [R, n, P]:
region r's pages are contiguous inside the slot, so the whole slot is ONE descriptor and gathering a
region is one `index_select` into a contiguous output.
"""

from __future__ import annotations

import threading
from bisect import insort
from collections.abc import Sequence

import torch

from pdserve.kvcache.host_memory import host_zeros


def kv_regions(k_layers: Sequence[torch.Tensor], v_layers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per-layer K and V pools -> regions in transfer order K0, V0, K1, V1, ... (as `KVCache.regions()`)."""
    out: list[torch.Tensor] = []
    for k, v in zip(k_layers, v_layers, strict=True):
        out += [k, v]
    return out


def _page_bytes_view(region: torch.Tensor) -> torch.Tensor:
    """[num_pages, ...] contiguous tensor of any dtype -> uint8 view [num_pages, bytes_per_page]."""
    if not region.is_contiguous():
        raise ValueError("KV regions must be contiguous")
    return region.view(-1).view(torch.uint8).view(region.shape[0], -1)


def wide_rows(*rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """uint8 [n, P] tensors (equal P) -> the same bytes as [n, P / w] of the widest plain dtype that
    divides P and every one's address, so that they can be copied into each other (index_copy_ on
    uint8 rows runs ~1.3 GB/s on CPU, on int64 or complex128 rows ~10 GB/s; index_select ~1.7x)."""
    for dtype, width in ((torch.complex128, 16), (torch.int64, 8), (torch.int32, 4)):
        if all(r.shape[1] % width == 0 and r.data_ptr() % width == 0 for r in rows):
            return tuple(r.view(dtype) for r in rows)
    return rows


def _index(page_ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(page_ids, dtype=torch.long).to(device)


def gather_pages(
    regions: Sequence[torch.Tensor], page_ids: Sequence[int] | torch.Tensor, out: torch.Tensor
) -> None:
    """Copy page `page_ids[i]` of region r into `out[r, i]` for every region r.

    `out` is a contiguous uint8 [num_regions, len(page_ids), bytes_per_page] view (a staging slot).
    """
    if out.dim() != 3 or out.shape[0] != len(regions) or out.shape[1] != len(page_ids):
        raise ValueError(
            f"gather_pages: out shape {tuple(out.shape)} does not fit {len(regions)} regions "
            f"x {len(page_ids)} pages"
        )
    idx = _index(page_ids, out.device)
    for r, region in enumerate(regions):
        torch.index_select(_page_bytes_view(region), 0, idx, out=out[r])


def scatter_pages(
    staging: torch.Tensor, regions: Sequence[torch.Tensor], page_ids: Sequence[int] | torch.Tensor
) -> None:
    """Inverse of `gather_pages`: `staging[r, i]` -> page `page_ids[i]` of region r (ids distinct)."""
    if staging.dim() != 3 or staging.shape[0] != len(regions) or staging.shape[1] != len(page_ids):
        raise ValueError(
            f"scatter_pages: staging shape {tuple(staging.shape)} does not fit {len(regions)} "
            f"regions x {len(page_ids)} pages"
        )
    if staging.device.type == "cpu":
        # numpy row assignment is a memcpy per row (11-13 GB/s here); shares memory with the tensors.
        idx_np = torch.as_tensor(page_ids, dtype=torch.long).numpy()
        for r, region in enumerate(regions):
            _page_bytes_view(region).numpy()[idx_np] = staging[r].numpy()
        return
    idx = _index(page_ids, staging.device)
    for r, region in enumerate(regions):
        dst, src = wide_rows(_page_bytes_view(region), staging[r])
        dst.index_copy_(0, idx, src)


class StagingPool:
    """Pre-allocated staging buffer handing out contiguous slot ranges (first fit, coalescing free).

    Thread-safe (a lock): the scheduler allocates, completion handlers may free. Offsets and sizes
    are in pages; one page of the slot holds one page of EVERY region (R * bytes_per_page bytes).
    """

    def __init__(
        self,
        num_regions: int,
        bytes_per_page: int,
        capacity_pages: int,
        device: str | torch.device = "cpu",
        pin_memory: bool = False,
        buffer: torch.Tensor | None = None,
    ) -> None:
        """`buffer`: an existing contiguous uint8 tensor to carve slots from (already registered, e.g.
        shared by pools of different page sizes); otherwise a zeroed one is allocated."""
        if num_regions <= 0 or bytes_per_page <= 0 or capacity_pages <= 0:
            raise ValueError("StagingPool: num_regions, bytes_per_page and capacity_pages must be positive")
        self.num_regions = num_regions
        self.bytes_per_page = bytes_per_page
        self.capacity_pages = capacity_pages
        self.slot_page_nbytes = num_regions * bytes_per_page
        nbytes = capacity_pages * self.slot_page_nbytes
        if buffer is None and torch.device(device).type == "cpu" and not pin_memory:
            buffer = host_zeros(nbytes)  # huge pages: faster cross-process copies (kvcache/host_memory.py)
        elif buffer is None:
            buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device, pin_memory=pin_memory)
        elif buffer.dtype != torch.uint8 or not buffer.is_contiguous() or buffer.numel() < nbytes:
            raise ValueError(f"StagingPool: buffer must be a contiguous uint8 tensor of >= {nbytes} bytes")
        self.buffer = buffer.view(-1)[:nbytes]
        self._lock = threading.Lock()
        # Invariant: _free is sorted by offset, ranges are disjoint, non-empty and never adjacent
        # (adjacent ones are coalesced); _used maps offset -> num_pages; together they tile the buffer.
        self._free: list[tuple[int, int]] = [(0, capacity_pages)]
        self._used: dict[int, int] = {}

    def region(self) -> tuple[int, int]:
        """(addr, nbytes) of the whole buffer: register it with the TransferAgent once."""
        return self.buffer.data_ptr(), self.buffer.numel()

    def alloc(self, num_pages: int) -> int | None:
        """Offset (in pages) of a free contiguous range of `num_pages`, or None if none is big enough."""
        if num_pages <= 0:
            raise ValueError(f"alloc: num_pages must be positive, got {num_pages}")
        with self._lock:
            for i, (off, n) in enumerate(self._free):
                if n >= num_pages:
                    if n == num_pages:
                        del self._free[i]
                    else:
                        self._free[i] = (off + num_pages, n - num_pages)
                    self._used[off] = num_pages
                    return off
        return None

    def free(self, offset: int) -> None:
        """Return the range allocated at `offset`. Raises KeyError on a double or unknown free."""
        with self._lock:
            num_pages = self._used.pop(offset)
            insort(self._free, (offset, num_pages))
            i = self._free.index((offset, num_pages))
            # Coalesce with the right then the left neighbour.
            if i + 1 < len(self._free) and offset + num_pages == self._free[i + 1][0]:
                self._free[i] = (offset, num_pages + self._free[i + 1][1])
                del self._free[i + 1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
                self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
                del self._free[i]

    def view(self, offset: int, num_pages: int) -> torch.Tensor:
        """The slot as a uint8 [num_regions, num_pages, bytes_per_page] tensor (shares the buffer)."""
        return self.view_regions(offset, self.num_regions, num_pages)

    def pages_for(self, num_regions: int, num_pages: int) -> int:
        """Slot pages that hold `num_pages` pages of only `num_regions` regions, packed (the layerwise
        lane moves one layer, K and V: 2 regions of the R a slot page has room for)."""
        return -(-num_regions * num_pages // self.num_regions)

    def view_regions(self, offset: int, num_regions: int, num_pages: int) -> torch.Tensor:
        """The start of a slot of `pages_for(num_regions, num_pages)` pages as a uint8
        [num_regions, num_pages, bytes_per_page] tensor (region r's page p at (r * num_pages + p))."""
        start = offset * self.slot_page_nbytes
        flat = self.buffer[start : start + num_regions * num_pages * self.bytes_per_page]
        return flat.view(num_regions, num_pages, self.bytes_per_page)

    def descriptor(self, offset: int, num_pages: int) -> tuple[int, int]:
        """(addr, nbytes) of the slot: the single descriptor of a staged write."""
        return self.buffer.data_ptr() + offset * self.slot_page_nbytes, num_pages * self.slot_page_nbytes

    @property
    def num_free_pages(self) -> int:
        with self._lock:
            return sum(n for _, n in self._free)

    @property
    def num_used_pages(self) -> int:
        with self._lock:
            return sum(self._used.values())

    def check_integrity(self) -> None:
        """Raise AssertionError unless free and used ranges exactly tile [0, capacity_pages)."""
        with self._lock:
            ranges = sorted(
                [(o, n, "free") for o, n in self._free] + [(o, n, "used") for o, n in self._used.items()]
            )
            pos = 0
            prev_kind = None
            for off, n, kind in ranges:
                assert n > 0, f"empty {kind} range at {off}"
                assert off == pos, f"{kind} range at {off} but expected {pos} (gap or overlap)"
                assert not (kind == prev_kind == "free"), f"adjacent free ranges not coalesced at {off}"
                pos, prev_kind = off + n, kind
            assert pos == self.capacity_pages, f"ranges end at {pos}, capacity {self.capacity_pages}"
            assert self._free == sorted(self._free), "free list not sorted"
