"""The engine's pre-allocated KV pool tensors (the only torch code under kvcache/).

Layout, per layer l:  K[l], V[l] each a contiguous buffer [num_pages, page_size, num_kv_heads, head_dim].
Page p of layer l's K starts at byte `K[l].data_ptr() + p * bytes_per_page`, so the transfer layer can
register the 2 * num_layers buffers as memory regions and address any page by its id.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.config import ModelConfig
from pdserve.kvcache.host_memory import host_zeros


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    element_bytes: int

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page of one layer's K (or V)."""
        return self.page_size * self.num_kv_heads * self.head_dim * self.element_bytes

    @property
    def bytes_per_page_all_layers(self) -> int:
        return 2 * self.num_layers * self.bytes_per_page

    def fingerprint(self) -> str:
        """Two engines can exchange pages only if their fingerprints are equal."""
        return f"L{self.num_layers}-ps{self.page_size}-h{self.num_kv_heads}-d{self.head_dim}-{self.dtype}"


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A zeroed K or V buffer; on the CPU backed by huge pages (faster cross-process page copies)."""
    if torch.device(device).type == "cpu":
        return host_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


class KVCache:
    def __init__(
        self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: str
    ) -> None:
        elem = torch.empty((), dtype=dtype).element_size()
        self.layout = KVLayout(
            cfg.num_layers,
            num_pages,
            page_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            str(dtype).removeprefix("torch."),
            elem,
        )
        self._alloc = ((num_pages, page_size, cfg.num_kv_heads, cfg.head_dim), dtype, device, cfg.num_layers)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.restore()

    @property
    def released(self) -> bool:
        return not self.k

    def release(self) -> None:
        """Free every K and V buffer (an engine put to sleep, `LLMEngine.release_memory`): the pages'
        contents are gone. The layout stays; `restore` allocates them again, zeroed."""
        self.k, self.v = [], []

    def restore(self) -> None:
        shape, dtype, device, num_layers = self._alloc
        self.k = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [_zeros(shape, dtype, device) for _ in range(num_layers)]

    def flat_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) as [num_pages * page_size, num_kv_heads, head_dim] views (slot-indexed)."""
        n = self.layout.num_pages * self.layout.page_size
        return [
            (k.view(n, *k.shape[2:]), v.view(n, *v.shape[2:])) for k, v in zip(self.k, self.v, strict=True)
        ]

    def regions(self) -> list[tuple[int, int]]:
        """(address, length in bytes) of every K and V buffer, layer by layer: K0, V0, K1, V1, ..."""
        out = []
        for k, v in zip(self.k, self.v, strict=True):
            out += [
                (k.data_ptr(), k.numel() * k.element_size()),
                (v.data_ptr(), v.numel() * v.element_size()),
            ]
        return out
