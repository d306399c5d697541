"""Byte layout of one persistent-store block (who: the store, the read paths, the write-back).

A full block is `block_size` tokens x all layers, stored as `[num_layers, block_size,
bytes_per_token_layer]` bytes so that layer l of a block is ONE contiguous range (a "layer block";
concatenating the layer blocks gives the full block, no conversion). Inside layer l's range the K of
the block's tokens comes first, then their V (each `block_size * bytes_per_token_layer / 2` bytes):
an engine page of K (`[page_size, kv_heads, head_dim]`, contiguous in the pool) then maps to one
contiguous slice of the K half, and the same for V, so moving a layer between a block and engine
pages is `2 * block_size / page_size` contiguous copies.

The fingerprint names everything that makes two blocks' bytes incompatible (model, layer count, head
shape, dtype, block size); it is the root namespace of the block keys and is recorded in every block
file, so blocks of another layout are never mistaken for ours.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_BLOCK_SIZE = 64  # tokens per block (DESIGN.md §2)


@dataclass(frozen=True)
class BlockLayout:
    num_layers: int
    block_size: int  # tokens per block
    bytes_per_token_layer: int  # K and V of one token of one layer
    fingerprint: str

    def __post_init__(self) -> None:
        if self.num_layers <= 0 or self.block_size <= 0 or self.bytes_per_token_layer <= 0:
            raise ValueError(f"block layout sizes must be positive: {self}")
        if self.bytes_per_token_layer % 2:
            raise ValueError("bytes_per_token_layer holds K and V halves, so it must be even")
        if not self.fingerprint:
            raise ValueError("a block layout needs a non-empty fingerprint")

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer block (K then V of `block_size` tokens)."""
        return self.block_size * self.bytes_per_token_layer

    @property
    def block_nbytes(self) -> int:
        """Bytes of one full block (all layers); the payload of one block file."""
        return self.num_layers * self.layer_nbytes

    def layer_range(self, layer: int) -> tuple[int, int]:
        """(offset, nbytes) of layer `layer` inside a full block: one contiguous range."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} outside 0..{self.num_layers - 1}")
        return layer * self.layer_nbytes, self.layer_nbytes

    def k_range(self, layer: int) -> tuple[int, int]:
        """(offset, nbytes) of the K half of layer `layer`: tokens 0..block_size-1, token-major."""
        off, n = self.layer_range(layer)
        return off, n // 2

    def v_range(self, layer: int) -> tuple[int, int]:
        """(offset, nbytes) of the V half of layer `layer`, right after its K half."""
        off, n = self.layer_range(layer)
        return off + n // 2, n // 2

    @classmethod
    def from_kv_layout(cls, kv_layout, block_size: int = DEFAULT_BLOCK_SIZE, model: str = "") -> BlockLayout:
        """The block layout matching an engine pool (`pdserve.kvcache.kv_cache.KVLayout`).

        `block_size` must be a multiple of the engine's `page_size` (a block is whole pages). The page
        size itself is not part of the fingerprint: engines with different page sizes share blocks.
        `model` (e.g. the checkpoint name or its hash) separates models with equal shapes.
        """
        if block_size <= 0 or block_size % kv_layout.page_size:
            raise ValueError(f"block_size {block_size} must be a multiple of page_size {kv_layout.page_size}")
        per_token_layer = 2 * kv_layout.num_kv_heads * kv_layout.head_dim * kv_layout.element_bytes
        fingerprint = (
            f"{model}|L{kv_layout.num_layers}-h{kv_layout.num_kv_heads}-d{kv_layout.head_dim}"
            f"-{kv_layout.dtype}-bs{block_size}-kvsplit"
        )
        return cls(kv_layout.num_layers, block_size, per_token_layer, fingerprint)
