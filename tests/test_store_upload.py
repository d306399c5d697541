"""store/upload.py: read blocks from host memory into pool pages (whole blocks) and into per-layer
tensors (layerwise PE path), byte for byte against a per-token reference built from the layout alone.
The `cuda` cases (pinned buffers, the side stream) run where a GPU is lent."""

from __future__ import annotations

import pytest
import torch

from pdserve.store import upload
from pdserve.store.layout import BlockLayout
from pdserve.store.upload import LayerUpload, host_block_buffer, scatter_chunks
from tests.conftest import requires_cuda

DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]

KV_SHAPE = (2, 4)  # kv heads, head dim (bf16): 16 B per token per half
PAGE_SIZE = 4
LAYOUT = BlockLayout(num_layers=3, block_size=8, bytes_per_token_layer=2 * 2 * 4 * 2, fingerprint="t")
PAGE_NBYTES = PAGE_SIZE * LAYOUT.bytes_per_token_layer // 2  # one page of one half (K or V)


def blocks(num_blocks: int, device: str = "cpu") -> torch.Tensor:
    """Random read blocks in the host buffer a read for a pool on `device` lands in."""
    g = torch.Generator().manual_seed(num_blocks)
    buf = host_block_buffer(num_blocks, LAYOUT.block_nbytes, torch.device(device))
    return buf.copy_(torch.randint(0, 256, buf.shape, generator=g, dtype=torch.uint8))


def token_bytes(buf: torch.Tensor, layer: int, half: int, token: int) -> torch.Tensor:
    """The bytes of `token`'s K (half 0) or V (half 1) in layer `layer`, read off the layout."""
    block, t = divmod(token, LAYOUT.block_size)
    off = LAYOUT.k_range(layer)[0] if half == 0 else LAYOUT.v_range(layer)[0]
    per_token = LAYOUT.bytes_per_token_layer // 2
    return buf[block, off + t * per_token : off + (t + 1) * per_token]


def test_host_block_buffer_is_plain_memory_for_a_cpu_pool():
    buf = host_block_buffer(3, LAYOUT.block_nbytes, torch.device("cpu"))
    assert buf.shape == (3, LAYOUT.block_nbytes) and buf.dtype == torch.uint8 and not buf.is_pinned()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk_blocks", [1, 2, 5, 100])
def test_scatter_chunks_puts_every_token_of_every_layer_in_its_page(monkeypatch, chunk_blocks, device):
    """Chunks of 1, 2 (the last one short: 5 blocks), 5 and more than all blocks: same pages."""
    monkeypatch.setattr(upload, "SCATTER_CHUNK_NBYTES", chunk_blocks * LAYOUT.block_nbytes)
    num_blocks, num_pages = 5, 40
    ppb = LAYOUT.block_size // PAGE_SIZE
    page_ids = torch.randperm(num_pages, generator=torch.Generator().manual_seed(1))[: num_blocks * ppb]
    pools = [torch.zeros((num_pages, PAGE_NBYTES), dtype=torch.uint8, device=device) for _ in range(6)]
    buf = blocks(num_blocks + 2, device)  # rows past num_blocks are not copied
    scatter_chunks(buf, num_blocks, LAYOUT, page_ids.to(device), pools[:3], pools[3:])
    k_pools, v_pools = [p.cpu() for p in pools[:3]], [p.cpu() for p in pools[3:]]
    per_token = LAYOUT.bytes_per_token_layer // 2
    for layer in range(LAYOUT.num_layers):
        for half, pools in enumerate((k_pools, v_pools)):
            for token in range(num_blocks * LAYOUT.block_size):
                page, t = divmod(token, PAGE_SIZE)
                got = pools[layer][page_ids[page], t * per_token : (t + 1) * per_token]
                assert torch.equal(got, token_bytes(buf, layer, half, token)), (layer, half, token)
    untouched = torch.ones(num_pages, dtype=torch.bool)
    untouched[page_ids] = False
    assert all(int(p[untouched].count_nonzero()) == 0 for p in (*k_pools, *v_pools))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_blocks", [1, 3])
def test_layer_upload_gives_each_layers_kv_as_contiguous_copies(num_blocks, device):
    """Layer l's K and V: [num_blocks * block_size, heads, dim], token t = the layout's bytes of t; a
    copy, not a view, even for one block (whose slices are contiguous): the read buffer may be reused."""
    buf = blocks(num_blocks + 1, device)
    up = LayerUpload(buf, num_blocks, LAYOUT, torch.device(device), torch.bfloat16, KV_SHAPE)
    results = [up.ready(up.copy(layer)) for layer in range(LAYOUT.num_layers)]  # 3 layers: a slot reused
    expected = buf.clone()
    buf.zero_()
    for layer, (k, v) in enumerate(results):
        assert k.device.type == device
        k, v = k.cpu(), v.cpu()
        for half, t in enumerate((k, v)):
            assert t.shape == (num_blocks * LAYOUT.block_size, *KV_SHAPE) and t.dtype == torch.bfloat16
            assert t.is_contiguous()
            raw = t.view(torch.uint8).view(num_blocks * LAYOUT.block_size, -1)
            for token in range(num_blocks * LAYOUT.block_size):
                assert torch.equal(raw[token], token_bytes(expected, layer, half, token)), (
                    layer,
                    half,
                    token,
                )
