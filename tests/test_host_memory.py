"""Host KV buffers: zeroed, right shape/dtype, 2 MiB aligned and advised for transparent huge pages."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from pdserve.kvcache.host_memory import HUGE_PAGE_NBYTES, host_zeros
from pdserve.kvcache.kv_cache import KVCache
from pdserve.transfer.staging import StagingPool


def _mapping(addr: int) -> tuple[str, set[str]]:
    """(smaps header line, VmFlags) of the mapping holding `addr` (Linux /proc/self/smaps)."""
    header, current = "", False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                current = lo <= addr < hi
                header = line.strip() if current else header
            elif head == "VmFlags:" and current:
                return header, set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


def _vm_flags(addr: int) -> set[str]:
    return _mapping(addr)[1]


def _thp_mode() -> str | None:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or _thp_mode() in (None, "never"),
    reason="needs Linux with transparent huge pages (always or madvise)",
)


def test_small_buffer_is_a_plain_zeros_tensor():
    t = host_zeros((3, 5), torch.float16)
    assert t.shape == (3, 5) and t.dtype == torch.float16 and t.is_contiguous()
    assert torch.count_nonzero(t) == 0


def test_large_buffer_shape_dtype_alignment_and_contents():
    t = host_zeros((4, HUGE_PAGE_NBYTES // 8), torch.float32)  # 4 MiB
    assert t.shape == (4, HUGE_PAGE_NBYTES // 8) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE_NBYTES == 0
    assert torch.count_nonzero(t) == 0
    t.fill_(1.5)  # writable over its whole length (the view ends inside the allocation)
    assert float(t.sum()) == 1.5 * t.numel()


@needs_thp
def test_large_buffer_is_advised_huge_pages():
    t = host_zeros(8 * HUGE_PAGE_NBYTES)
    assert "hg" in _vm_flags(t.data_ptr())  # VM_HUGEPAGE: MADV_HUGEPAGE was taken
    # (No negative check on a plain torch.zeros: glibc may hand it heap memory that an earlier, freed
    # advised buffer left flagged.)
    plain = host_zeros(8 * HUGE_PAGE_NBYTES, huge_pages=False)
    assert plain.shape == (8 * HUGE_PAGE_NBYTES,) and torch.count_nonzero(plain) == 0


@needs_thp
def test_kv_cache_and_staging_pool_use_huge_page_buffers():
    cfg = SimpleNamespace(num_layers=2, num_kv_heads=8, head_dim=128)  # the fields KVCache reads
    kv = KVCache(cfg, num_pages=256, page_size=16, dtype=torch.float16, device="cpu")  # 8 MiB per buffer
    assert len(kv.regions()) == 4
    for addr, nbytes in kv.regions():
        assert nbytes == 256 * 16 * 8 * 128 * 2
        assert addr % HUGE_PAGE_NBYTES == 0 and "hg" in _vm_flags(addr)
    assert all(torch.count_nonzero(t) == 0 for t in kv.k + kv.v)
    pool = StagingPool(num_regions=2, bytes_per_page=64 << 10, capacity_pages=64)  # 8 MiB
    addr, _ = pool.region()
    assert addr % HUGE_PAGE_NBYTES == 0 and "hg" in _vm_flags(addr)
    assert torch.count_nonzero(pool.buffer) == 0


@needs_thp
def test_buffer_is_its_own_mapping_even_after_malloc_raised_its_threshold():
    # Freeing a large malloc'ed chunk makes glibc serve later requests of up to 32 MiB from the heap,
    # whose pages may already be touched in 4 KiB pages: advice given there comes too late.
    for n in (30 << 20, 12 << 20):
        big = torch.ones(n, dtype=torch.uint8)
        del big
    t = host_zeros(8 << 20)
    header, flags = _mapping(t.data_ptr())
    assert "[heap]" not in header and header.split()[-1] == "0"  # anonymous, no path: our own mapping
    assert "hg" in flags
