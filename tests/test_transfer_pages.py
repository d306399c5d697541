"""Exact expectations for page-run merging, descriptors, fragmentation, the staging pool, and the
gather -> scatter round trip (pure CPU; no backend)."""

from __future__ import annotations

import pytest
import torch

from pdserve.transfer.pages import RegionTable, is_fragmented, merge_runs, page_descriptors
from pdserve.transfer.staging import StagingPool, gather_pages, kv_regions, scatter_pages


@pytest.mark.parametrize(
    "src, dst, runs",
    [
        ([], [], []),
        ([7], [3], [(7, 3, 1)]),
        ([4, 5, 6, 7], [10, 11, 12, 13], [(4, 10, 4)]),
        ([4, 5, 6, 7], [10, 11, 20, 21], [(4, 10, 2), (6, 20, 2)]),  # contiguous on the source only
        ([1, 5, 6, 9], [2, 3, 4, 5], [(1, 2, 1), (5, 3, 2), (9, 5, 1)]),  # contiguous on the dest only
        ([3, 2, 1], [3, 2, 1], [(3, 3, 1), (2, 2, 1), (1, 1, 1)]),  # reversed: no merge
        ([0, 1, 5, 2, 3], [8, 9, 0, 10, 11], [(0, 8, 2), (5, 0, 1), (2, 10, 2)]),  # interleaved, order kept
        ([0, 1, 2], [5, 6, 6], [(0, 5, 2), (2, 6, 1)]),
    ],
)
def test_merge_runs_exact(src, dst, runs):
    assert merge_runs(src, dst) == runs
    assert sum(n for _, _, n in runs) == len(src)


def test_merge_runs_length_mismatch():
    with pytest.raises(ValueError, match="2 source pages but 3 destination pages"):
        merge_runs([1, 2], [1, 2, 3])


def test_page_descriptors_exact_addresses():
    src = RegionTable(base_addrs=(1000, 5000), bytes_per_page=(10, 10))
    dst = RegionTable(base_addrs=(90000, 70000), bytes_per_page=(10, 10))
    local, remote = page_descriptors([(2, 0, 3), (9, 7, 1)], src, dst)
    # Region-major: region 0's runs, then region 1's.
    assert local == [(1020, 30), (1090, 10), (5020, 30), (5090, 10)]
    assert remote == [(90000, 30), (90070, 10), (70000, 30), (70070, 10)]


def test_page_descriptors_per_region_page_sizes_and_mismatch():
    src = RegionTable((0, 100), (4, 8))
    local, remote = page_descriptors([(1, 2, 2)], src, RegionTable((1000, 2000), (4, 8)))
    assert local == [(4, 8), (108, 16)] and remote == [(1008, 8), (2016, 16)]
    with pytest.raises(ValueError, match="bytes_per_page differ"):
        page_descriptors([(0, 0, 1)], src, RegionTable((0, 100), (4, 4)))
    with pytest.raises(ValueError, match="2 local regions vs 1 remote"):
        page_descriptors([(0, 0, 1)], src, RegionTable((0,), (4,)))
    with pytest.raises(ValueError):
        RegionTable((0, 1), (4,))


def test_region_table_from_kv_regions():
    t = RegionTable.from_regions([(100, 4096), (9000, 4096)], 512)
    assert t == RegionTable((100, 9000), (512, 512)) and t.num_regions == 2


def test_is_fragmented():
    assert not is_fragmented([], [], 0.5)
    assert not is_fragmented([0, 1, 2, 3], [4, 5, 6, 7], 0.5)  # 1 run / 4 pages
    assert not is_fragmented([0, 1, 5, 6], [0, 1, 8, 9], 0.5)  # 2 / 4 = 0.5, not above
    assert is_fragmented([0, 1, 5, 9], [0, 1, 8, 2], 0.5)  # 3 / 4
    assert is_fragmented([3, 1], [0, 1])  # default threshold 0.5: 2 / 2
    assert not is_fragmented([3, 1], [0, 1], threshold=1.0)


def test_staging_pool_offsets_free_coalesce():
    pool = StagingPool(num_regions=2, bytes_per_page=16, capacity_pages=10)
    assert pool.region() == (pool.buffer.data_ptr(), 2 * 16 * 10)
    a, b, c = pool.alloc(3), pool.alloc(4), pool.alloc(3)
    assert (a, b, c) == (0, 3, 7)
    assert pool.alloc(1) is None
    pool.check_integrity()
    pool.free(b)
    assert pool.alloc(5) is None  # only 4 free, and contiguous
    assert pool.alloc(2) == 3  # first fit
    pool.check_integrity()
    pool.free(a)
    pool.free(3)  # coalesces with [0, 3) -> [0, 5)
    assert pool.num_free_pages == 7 and pool.num_used_pages == 3
    assert pool.alloc(5) == 0
    pool.free(0)
    pool.free(c)  # everything coalesces back into one range
    pool.check_integrity()
    assert pool.alloc(10) == 0
    pool.free(0)
    with pytest.raises(KeyError):
        pool.free(0)  # double free
    with pytest.raises(ValueError):
        pool.alloc(0)
    pool.check_integrity()


def test_staging_pool_views_and_descriptors():
    pool = StagingPool(num_regions=3, bytes_per_page=8, capacity_pages=6)
    off = pool.alloc(2)
    off2 = pool.alloc(4)
    assert pool.descriptor(off2, 4) == (pool.buffer.data_ptr() + 2 * 3 * 8, 4 * 3 * 8)
    v = pool.view(off2, 4)
    assert v.shape == (3, 4, 8) and v.is_contiguous() and v.data_ptr() == pool.descriptor(off2, 4)[0]
    v.fill_(7)
    assert int(pool.view(off, 2).sum()) == 0  # slots do not overlap
    pool.check_integrity()


def test_staging_pool_integrity_detects_corruption():
    pool = StagingPool(1, 4, 8)
    pool.alloc(3)
    pool._used[5] = 2  # overlaps free space
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_gather_scatter_round_trip_equals_direct_page_copy():
    torch.manual_seed(0)
    num_layers, num_pages, shape = 2, 16, (4, 2, 8)  # page_size 4, 2 kv heads, head_dim 8
    src_k = [torch.randn(num_pages, *shape, dtype=torch.bfloat16) for _ in range(num_layers)]
    src_v = [torch.randn(num_pages, *shape, dtype=torch.bfloat16) for _ in range(num_layers)]
    dst_k = [torch.randn(num_pages, *shape, dtype=torch.bfloat16) for _ in range(num_layers)]
    dst_v = [torch.randn(num_pages, *shape, dtype=torch.bfloat16) for _ in range(num_layers)]
    expect = [t.clone() for t in kv_regions(dst_k, dst_v)]
    src_pages, dst_pages = [5, 1, 9, 10, 3], [0, 15, 7, 2, 8]
    for e, s in zip(expect, kv_regions(src_k, src_v), strict=True):
        for i, j in zip(src_pages, dst_pages, strict=True):
            e[j] = s[i]
    page_nbytes = 4 * 2 * 8 * 2
    sender, receiver = StagingPool(4, page_nbytes, 8), StagingPool(4, page_nbytes, 8)
    off_s, off_r = sender.alloc(5), receiver.alloc(2) and receiver.alloc(5)
    gather_pages(kv_regions(src_k, src_v), src_pages, sender.view(off_s, 5))
    # "The write": one contiguous descriptor from the sender's slot to the receiver's slot.
    receiver.view(off_r, 5).copy_(sender.view(off_s, 5))
    scatter_pages(receiver.view(off_r, 5), kv_regions(dst_k, dst_v), dst_pages)
    for got, want in zip(kv_regions(dst_k, dst_v), expect, strict=True):
        assert torch.equal(got, want)
    with pytest.raises(ValueError):
        gather_pages(kv_regions(src_k, src_v), src_pages[:2], sender.view(off_s, 5))


def test_worth_staging_needs_two_runs_unless_forced():
    """One page, or one contiguous run, is one descriptor per region either way: gathering it through
    a staging slot only adds a copy (the prefill used to, for every one-page send)."""
    from pdserve.transfer.pages import worth_staging

    assert not worth_staging([7], 0.5) and not worth_staging([3, 4, 5], 0.5) and not worth_staging([], -1)
    assert worth_staging([1, 5], 0.5) and worth_staging([1, 3, 5, 9], 0.5)
    assert not worth_staging([1, 2, 3, 9], 0.5)  # 2 runs over 4 pages: not fragmented enough
    assert worth_staging([7], -1.0)  # a negative threshold stages always
