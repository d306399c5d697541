"""Attention over the paged KV pool, with plain torch ops (SDPA).

Shapes (T = tokens in the step, flattened over requests; S = num_pages * page_size slots):
    q            [T, num_heads, head_dim]
    k, v (new)   [T, num_kv_heads, head_dim]     written to the pool at `slot_mapping`
    k_cache      [S, num_kv_heads, head_dim]     a flat view of one layer's [num_pages, page_size, ...]

A step mixes two kinds of work, handled separately because their shapes differ:
  * prefill chunks: one SDPA per request over [ctx_len] keys (queries [q_len]); when the chunk starts
    at position 0 the new K/V are used directly (no gather) with a causal mask;
  * decodes (q_len 1): one batched SDPA over keys gathered to [B, max_pages * page_size] with a
    padding mask.
Context is gathered a whole page at a time (`index_select` over the pool viewed as
[num_pages, page_size * heads * dim]): rows of a few KiB copy ~10x faster than one row per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    token_start: int  # row of the chunk's first token in the flat batch
    num_tokens: int  # q_len
    pos_start: int  # position of the first query token (= tokens already in the cache)
    kv_pages: torch.Tensor | None  # [ceil(ctx_len / page_size)] page ids of the context; None if pos_start 0
    mask: torch.Tensor | None  # [num_tokens, ctx_len] bool (True = attend) or None for plain causal


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes in the flat pool
    prefills: list[PrefillChunk]
    decode_rows: torch.Tensor | None  # [B] rows of decode tokens in the flat batch
    decode_pages: torch.Tensor | None  # [B, max_pages] int64 page table (padding points at page 0)
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_pages * page_size] bool
    page_size: int = 16


def gather_pages(cache: torch.Tensor, page_ids: torch.Tensor, page_size: int) -> torch.Tensor:
    """cache [S, Hkv, D] (flat slots), page_ids [n] -> [n * page_size, Hkv, D] (a copy)."""
    heads, dim = cache.shape[1:]
    return cache.view(-1, page_size * heads * dim).index_select(0, page_ids).view(-1, heads, dim)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window_masks: tuple[list[torch.Tensor | None], torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Write k/v into the pool, then attend. Returns [T, num_heads, head_dim].

    `window_masks` (sliding-window layers only) replaces the per-prefill masks and the decode mask.
    """
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    for i, chunk in enumerate(meta.prefills):
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        qi = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        mask = chunk.mask if window_masks is None else window_masks[0][i]
        if chunk.kv_pages is None:
            ki, vi = k[rows], v[rows]
        else:
            ctx = chunk.pos_start + chunk.num_tokens
            ki = gather_pages(k_cache, chunk.kv_pages, meta.page_size)[:ctx]
            vi = gather_pages(v_cache, chunk.kv_pages, meta.page_size)[:ctx]
        ki = ki.transpose(0, 1).unsqueeze(0)
        vi = vi.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
        )
        out[rows] = o[0].transpose(0, 1)
    if meta.decode_rows is not None:
        qd = q[meta.decode_rows].unsqueeze(2)  # [B, H, 1, D]
        bsz = meta.decode_pages.shape[0]
        kd = gather_pages(k_cache, meta.decode_pages.view(-1), meta.page_size).view(bsz, -1, *k.shape[1:])
        vd = gather_pages(v_cache, meta.decode_pages.view(-1), meta.page_size).view(bsz, -1, *k.shape[1:])
        kd, vd = kd.transpose(1, 2), vd.transpose(1, 2)  # [B, Hkv, L, D]
        mask = meta.decode_mask if window_masks is None else window_masks[1]
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[meta.decode_rows] = o.squeeze(2)
    return out
