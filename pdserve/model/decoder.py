"""One decoder-only transformer for every registered architecture (Llama, Mistral, Qwen2, Qwen3).

The families differ only in `ModelConfig` traits (qkv bias, q/k norm, sliding windows, tied
embeddings). The forward takes a flat token batch [T] and the step's `AttentionMetadata`; it never
sees requests or page ids, only slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.config import ModelConfig
from pdserve.model.attention import AttentionMetadata, paged_attention
from pdserve.model.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rope


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.window = cfg.sliding_windows[layer_idx]
        self.scale = self.head_dim**-0.5

    def project(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, H, D], k and v [T, Hkv, D] (q/k normed if the model does, RoPE applied)."""
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata, window_masks) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        masks = window_masks.get(self.window) if self.window is not None else None
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, masks)
        return self.o_proj(o.reshape(x.shape[0], self.q_size))

    def forward_dense(self, x, cos, sin, k_prefix, v_prefix, emit) -> torch.Tensor:
        """One request's new tokens over a dense prefix (layerwise prefill). k_prefix, v_prefix:
        [P, Hkv, D], the prefix's KV of this layer (e.g. loaded from the store); `emit(k, v)` receives the
        new tokens' KV [T, Hkv, D] before attention."""
        q, k, v = self.project(x, cos, sin)
        emit(k, v)
        num_prefix, num_tokens = k_prefix.shape[0], x.shape[0]
        keys = torch.cat((k_prefix, k)).transpose(0, 1).unsqueeze(0)  # [1, Hkv, P+T, D]
        values = torch.cat((v_prefix, v)).transpose(0, 1).unsqueeze(0)
        q_pos = torch.arange(num_prefix, num_prefix + num_tokens, device=x.device)[:, None]
        k_pos = torch.arange(num_prefix + num_tokens, device=x.device)[None, :]
        mask = k_pos <= q_pos
        if self.window is not None:
            mask &= q_pos - k_pos < self.window
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys,
            values,
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return self.o_proj(o[0].transpose(0, 1).reshape(num_tokens, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x, cos, sin, k_cache, v_cache, meta, window_masks) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta, window_masks)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_dense(self, x, cos, sin, k_prefix, v_prefix, emit) -> torch.Tensor:
        x = x + self.self_attn.forward_dense(self.input_layernorm(x), cos, sin, k_prefix, v_prefix, emit)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope)
        self.lm_head = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k [S, Hkv, D], v [S, Hkv, D])
        meta: AttentionMetadata,
        window_masks: dict[int, tuple] | None = None,
    ) -> torch.Tensor:
        """Returns the final hidden states [T, hidden] (normed)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, k_cache, v_cache, meta, window_masks or {})
        return self.norm(x)

    def forward_layerwise(
        self,
        input_ids: torch.Tensor,  # [T] the request's new (miss) tokens
        positions: torch.Tensor,  # [T] their positions: prefix_len .. prefix_len + T - 1
        load_layer,  # l -> (k [P, Hkv, D], v [P, Hkv, D]): the prefix's KV of layer l; may block
        emit_layer,  # (l, k [T, Hkv, D], v [T, Hkv, D]): the new tokens' KV of layer l
    ) -> torch.Tensor:
        """Prefill one request layer by layer (DualPath): only layer l's prefix KV needs to be resident
        while layer l runs, so the caller can load layer l+1 meanwhile and drop layer l after. Returns
        the final hidden states [T, hidden] (normed)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            k_prefix, v_prefix = load_layer(i)
            x = layer.forward_dense(x, cos, sin, k_prefix, v_prefix, lambda k, v, i=i: emit_layer(i, k, v))
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return hidden @ weight.t()
