"""Page lists -> transfer descriptors (pure Python/numpy; no torch, no backend).

Who calls what, when:
- The prefill engine, once per send (a chunk's full pages, or the final pages + handoff), calls
  `merge_runs(src_pages, dst_pages)`, then `is_fragmented(...)` to choose between a direct write and the
  staging path, then `page_descriptors(runs, local_table, peer_table)` to get the (addr, nbytes) pairs
  it hands to `TransferAgent.submit`.
- `RegionTable` for the local pool is built from `KVCache.regions()` and `KVLayout.bytes_per_page`; the
  peer's arrives in its one-time registration message.

Page p of region r lives at `base_addrs[r] + p * bytes_per_page[r]`, so pages that are consecutive on
both sides form one byte range on both sides: one descriptor per (region, run) instead of per page.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Default for `is_fragmented`: more than one run per two pages (average run shorter than 2 pages)
# means per-descriptor overhead dominates and gather -> one write -> scatter is cheaper.
DEFAULT_FRAGMENTATION_THRESHOLD = 0.5


@dataclass(frozen=True)
class RegionTable:
    """One engine's KV pool as seen by the transfer layer.

    Invariant: regions are ordered K0, V0, K1, V1, ... (2 * num_layers of them) on every engine, so
    region r of the sender corresponds to region r of the receiver.
    """

    base_addrs: tuple[int, ...]  # per region: address of page 0
    bytes_per_page: tuple[int, ...]  # per region: bytes of one page

    def __post_init__(self) -> None:
        if len(self.base_addrs) != len(self.bytes_per_page):
            raise ValueError(
                f"RegionTable: {len(self.base_addrs)} base addresses but "
                f"{len(self.bytes_per_page)} bytes_per_page entries"
            )

    @property
    def num_regions(self) -> int:
        return len(self.base_addrs)

    @classmethod
    def from_regions(cls, regions: Sequence[tuple[int, int]], bytes_per_page: int) -> RegionTable:
        """Build from `KVCache.regions()` ((addr, nbytes) per buffer) and a uniform page size in bytes."""
        return cls(tuple(int(a) for a, _ in regions), tuple(bytes_per_page for _ in regions))


def merge_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """Group page pairs into maximal runs contiguous on BOTH sides, in the given order.

    Returns [(src_start, dst_start, num_pages)]. A new run starts whenever either side does not continue
    at +1 (so a reversed list gives one run per page). Raises ValueError if the lengths differ.
    """
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"merge_runs: {len(src_pages)} source pages but {len(dst_pages)} destination pages")
    runs: list[tuple[int, int, int]] = []
    if not src_pages:
        return runs
    run_src, run_dst, run_len = int(src_pages[0]), int(dst_pages[0]), 1
    for s, d in zip(src_pages[1:], dst_pages[1:], strict=True):
        s, d = int(s), int(d)
        if s == run_src + run_len and d == run_dst + run_len:
            run_len += 1
        else:
            runs.append((run_src, run_dst, run_len))
            run_src, run_dst, run_len = s, d, 1
    runs.append((run_src, run_dst, run_len))
    return runs


def page_descriptors(
    runs: Sequence[tuple[int, int, int]], src: RegionTable, dst: RegionTable
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(addr, nbytes) descriptor lists for `runs` over every region, region-major.

    For region r and run (s, d, n): local (src.base[r] + s*bpp, n*bpp), remote (dst.base[r] + d*bpp,
    n*bpp). Raises ValueError if the two tables differ in region count or any bytes_per_page (engines
    with different layouts must be refused at registration; this is the last line of defence).
    """
    if src.num_regions != dst.num_regions:
        raise ValueError(f"page_descriptors: {src.num_regions} local regions vs {dst.num_regions} remote")
    if src.bytes_per_page != dst.bytes_per_page:
        raise ValueError(
            f"page_descriptors: bytes_per_page differ: local {src.bytes_per_page} vs remote {dst.bytes_per_page}"
        )
    local: list[tuple[int, int]] = []
    remote: list[tuple[int, int]] = []
    for src_base, dst_base, bpp in zip(src.base_addrs, dst.base_addrs, src.bytes_per_page, strict=True):
        for s, d, n in runs:
            nbytes = n * bpp
            local.append((src_base + s * bpp, nbytes))
            remote.append((dst_base + d * bpp, nbytes))
    return local, remote


def worth_staging(pages: Sequence[int], threshold: float = DEFAULT_FRAGMENTATION_THRESHOLD) -> bool:
    """Whether gathering `pages` through a staging slot saves descriptors: they are fragmented
    (`is_fragmented`) and form at least two runs; one run is one descriptor per region either way. A
    negative threshold stages always (tests and benchmarks force the staged path with it)."""
    if not pages:
        return False
    if threshold < 0:
        return True
    num_runs = len(merge_runs(pages, pages))  # once: the runs of every send are merged here
    return num_runs >= 2 and num_runs / len(pages) > threshold


def is_fragmented(
    src_pages: Sequence[int], dst_pages: Sequence[int], threshold: float = DEFAULT_FRAGMENTATION_THRESHOLD
) -> bool:
    """True when num_runs / num_pages > threshold (empty lists are never fragmented).

    The default 0.5 sends a request through staging when its runs average fewer than 2 pages.
    """
    if not src_pages:
        return False
    return len(merge_runs(src_pages, dst_pages)) / len(src_pages) > threshold
