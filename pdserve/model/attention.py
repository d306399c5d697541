"""Attention over the paged KV pool, with plain torch ops (SDPA).

Shapes (T = tokens in the step, flattened over requests; S = num_pages * page_size slots):
    q            [T, num_heads, head_dim]
    k, v (new)   [T, num_kv_heads, head_dim]     written to the pool at `slot_mapping`
    k_cache      [S, num_kv_heads, head_dim]     a flat view of one layer's [num_pages, page_size, ...]

A step mixes two kinds of work, handled separately because their shapes differ:
  * prefill chunks: one SDPA per request over [ctx_len] keys (queries [q_len]); when the chunk starts
    at position 0 the new K/V are used directly (no gather) with a causal mask;
  * decodes (q_len 1): batched SDPA over keys gathered to [B, max_pages * page_size] with a padding
    mask; decodes are sorted by context length and split into a few groups so that short contexts
    are not padded to the longest one.
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
    decodes: list[DecodeGroup]
    page_size: int = 16


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [B] rows of the group's decode tokens in the flat batch
    pages: torch.Tensor  # [B, max_pages] int64 page table (padding points at page 0)
    mask: torch.Tensor  # [B, 1, 1, max_pages * page_size] bool (True = attend)


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
    window_masks: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Write k/v into the pool, then attend. Returns [T, num_heads, head_dim].

    `window_masks` (sliding-window layers only) replaces the per-prefill and per-decode-group masks.
    """
    # The pool holds only finite values (it starts zeroed; store loads and PD transfers copy pool
    # bytes). Why: batched decode reads whole pages, padding and the unwritten tail of a reused page
    # included, and hides them by the mask alone, but SDPA's 0 weight times an inf or NaN left there
    # is NaN, so one request whose activations overflowed (fp16) would turn other requests' tokens to
    # garbage. Only that request's own cached numbers change (they are inf/NaN in HF too).
    k_cache.index_copy_(0, meta.slot_mapping, torch.nan_to_num(k, nan=0.0, posinf=0.0, neginf=0.0))
    v_cache.index_copy_(0, meta.slot_mapping, torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0))
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
    for i, group in enumerate(meta.decodes):
        qd = q[group.rows].unsqueeze(2)  # [B, H, 1, D]
        bsz = group.pages.shape[0]
        kd = gather_pages(k_cache, group.pages.view(-1), meta.page_size).view(bsz, -1, *k.shape[1:])
        vd = gather_pages(v_cache, group.pages.view(-1), meta.page_size).view(bsz, -1, *k.shape[1:])
        kd, vd = kd.transpose(1, 2), vd.transpose(1, 2)  # [B, Hkv, L, D]
        mask = group.mask if window_masks is None else window_masks[1][i]
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[group.rows] = o.squeeze(2)
    return out
