"""store/upload.py: read blocks from host memory into pool pages (whole blocks) and into per-layer
tensors (layerwise PE path), byte for byte against a per-token reference built from the layout alone.
The `cuda` cases (pinned staging slots, the side stream) run where a GPU is lent; there a kernel that
sleeps is queued first, so each copy is still pending when its slot comes round again and a missing
wait for the slot would show as wrong bytes."""

from __future__ import annotations

import pytest
import torch

from pdserve.store import upload
from pdserve.store.layout import BlockLayout
from pdserve.store.upload import LayerUpload, scatter_chunks, scatter_staging
from tests.conftest import requires_cuda

DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
# (layout, page_size, kv_shape): 2 pages per block with 2 heads x 4; 1 page per block with 1 head x 3
# (12 bytes per token and layer: not a power of two).
SHAPES = [
    (
        BlockLayout(num_layers=3, block_size=8, bytes_per_token_layer=2 * 2 * 4 * 2, fingerprint="t"),
        4,
        (2, 4),
    ),
    (
        BlockLayout(num_layers=2, block_size=4, bytes_per_token_layer=2 * 1 * 3 * 2, fingerprint="t"),
        4,
        (1, 3),
    ),
]


def blocks(layout: BlockLayout, num_blocks: int) -> torch.Tensor:
    """Random read blocks in a host buffer like the store's (pageable)."""
    g = torch.Generator().manual_seed(num_blocks)
    return torch.randint(0, 256, (num_blocks, layout.block_nbytes), generator=g, dtype=torch.uint8)


def token_bytes(layout: BlockLayout, buf: torch.Tensor, layer: int, half: int, token: int) -> torch.Tensor:
    """The bytes of `token`'s K (half 0) or V (half 1) in layer `layer`, read off the layout."""
    block, t = divmod(token, layout.block_size)
    off = layout.k_range(layer)[0] if half == 0 else layout.v_range(layer)[0]
    per_token = layout.bytes_per_token_layer // 2
    return buf[block, off + t * per_token : off + (t + 1) * per_token]


def stall(device: str) -> None:
    """On a GPU, queue ~0.1 s of sleep on the current stream: the copies queued next stay pending."""
    if device == "cuda":
        torch.cuda._sleep(200_000_000)


def test_scatter_staging_is_none_for_a_cpu_pool():
    assert scatter_staging(SHAPES[0][0], torch.device("cpu")) is None


@requires_cuda
def test_scatter_staging_is_two_pinned_slots_of_whole_blocks(monkeypatch):
    layout = SHAPES[0][0]
    monkeypatch.setattr(upload, "SCATTER_CHUNK_NBYTES", 3 * layout.block_nbytes + 1)
    staging = scatter_staging(layout, torch.device("cuda"))
    assert staging.is_pinned() and staging.shape == (2, 3 * layout.block_nbytes)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize("chunk_blocks", [1, 2, 5, 100])
def test_scatter_chunks_puts_every_token_of_every_layer_in_its_page(monkeypatch, chunk_blocks, shape, device):
    """Chunks of 1, 2 (the last one short: 5 blocks), 5 and more than all blocks: same pages."""
    layout, page_size, _ = SHAPES[shape]
    monkeypatch.setattr(upload, "SCATTER_CHUNK_NBYTES", chunk_blocks * layout.block_nbytes)
    num_blocks, num_pages = 5, 40
    ppb = layout.block_size // page_size
    page_nbytes = page_size * layout.bytes_per_token_layer // 2
    page_ids = torch.randperm(num_pages, generator=torch.Generator().manual_seed(1))[: num_blocks * ppb]
    n = layout.num_layers
    pools = [torch.zeros((num_pages, page_nbytes), dtype=torch.uint8, device=device) for _ in range(2 * n)]
    buf = blocks(layout, num_blocks + 2)  # rows past num_blocks are not copied
    stall(device)
    staging = scatter_staging(layout, torch.device(device))
    scatter_chunks(buf, num_blocks, layout, page_ids.to(device), pools[:n], pools[n:], staging)
    k_pools, v_pools = [p.cpu() for p in pools[:n]], [p.cpu() for p in pools[n:]]
    per_token = layout.bytes_per_token_layer // 2
    for layer in range(n):
        for half, got_pools in enumerate((k_pools, v_pools)):
            for token in range(num_blocks * layout.block_size):
                page, t = divmod(token, page_size)
                got = got_pools[layer][page_ids[page], t * per_token : (t + 1) * per_token]
                assert torch.equal(got, token_bytes(layout, buf, layer, half, token)), (layer, half, token)
    untouched = torch.ones(num_pages, dtype=torch.bool)
    untouched[page_ids] = False
    assert all(int(p[untouched].count_nonzero()) == 0 for p in (*k_pools, *v_pools))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize("num_blocks", [1, 3])
def test_layer_upload_gives_each_layers_kv_as_contiguous_copies(num_blocks, shape, device):
    """Layer l's K and V: [num_blocks * block_size, heads, dim], token t = the layout's bytes of t; a
    copy, not a view, even for one block (whose slices are contiguous): the read buffer may be reused.
    Copies are started in the engine's order (layer l+1 once layer l is ready)."""
    layout, _, kv_shape = SHAPES[shape]
    buf = blocks(layout, num_blocks + 1)
    up = LayerUpload(buf, num_blocks, layout, torch.device(device), torch.bfloat16, kv_shape)
    if device == "cuda":
        with torch.cuda.stream(up._stream):
            stall(device)  # every copy on the upload's stream waits behind it
    results = [up.ready(up.copy(layer)) for layer in range(layout.num_layers)]  # >2 layers: a slot reused
    expected = buf.clone()
    buf.zero_()
    for layer, (k, v) in enumerate(results):
        assert k.device.type == device
        k, v = k.cpu(), v.cpu()
        for half, t in enumerate((k, v)):
            assert t.shape == (num_blocks * layout.block_size, *kv_shape) and t.dtype == torch.bfloat16
            assert t.is_contiguous()
            raw = t.view(torch.uint8).view(num_blocks * layout.block_size, -1)
            for token in range(num_blocks * layout.block_size):
                assert torch.equal(raw[token], token_bytes(layout, expected, layer, half, token)), (
                    layer,
                    half,
                    token,
                )
