"""Model profiles and the prefill / decode cost model (torch-free).

Who uses it: the simulator (every prefill batch and decode step) and, later, a PE's batch builder
(``build_prefill_batch`` needs a predicted batch time). A profile is a frozen dataclass; the functions
below are pure. Past 400 lines because every constant stays beside its source (this docstring and the
profiles), and an HF config's profile is derived from the same constants.

Constants and their sources:

* Qwen2.5-32B dense constants are *fitted* to ``../shared/anchors/h200_2026-11-29.json`` (one H200,
  plain torch, bf16): least squares over its six prefill points gives 108.4 µs per new token (= 600
  TFLOP/s effective on 2 x 32.5 GFLOP/token) and 1.742 ns per (new token x context token) pair for
  attention (= 752 TFLOP/s on 4 x 40 heads x 128 x 64 layers FLOP/pair); its five decode points give
  a step of 19.1 ms + 46.8 µs per sequence + context bytes read at 4.55 TB/s effective.
* DeepSeek-V3.2 660B (FP8, MLA + DSA sparse attention, 37B activated): no anchor. Linear FLOPs are
  2 x 37e9 per token; the effective FP8 MoE throughput (420 TFLOP/s) is *calibrated* so that a token at
  ~32K context costs ~250 µs in total, i.e. ~4.0K uncached tokens/s per GPU, the figure implied by
  DeepSeek's published production prefill (73.7K input tok/s per H800 node incl. 56.3% cache hits,
  "DeepSeek-V3/R1 inference system overview", 2025-03; H800 ≈ H200 in dense FP8 FLOPs). DSA attention
  is sparse over the top 2,048 tokens (absorbed MLA: 128 heads x (576 + 512) x 2 FLOP per pair per
  layer) plus a lightning indexer over the whole context (64 heads x 128 x 2 FLOP, FP8). Decode: 15 ms
  fixed per step (weights share 21.6 GB / 4.55 TB/s ≈ 5 ms + ~10 ms of EP all-to-all latency over 61
  layers, [assumed]) + 0.35 ms per sequence (74 GFLOP at 420 TFLOP/s ≈ 0.18 ms + EP dispatch/combine,
  [assumed]; gives ~1.5K tok/s/GPU at batch 64, close to DeepSeek's published 1.85K tok/s/GPU decode).
* KV bytes per token per layer: DS-V3.2 FP8 MLA 656 B x 61 layers (paper, reproduces its Table 1);
  Qwen2.5-32B bf16 GQA 8 heads x 128 x 2 (K,V) x 2 B = 4 KiB x 64 layers.
* ``ds-27b``: the paper's internal "DS 27B" is unpublished; we assume a DeepSeek-V3-style MoE with 30
  layers, the same MLA FP8 KV layout (656 B/token/layer), 4.5B activated parameters and no DSA
  (dense MLA attention, 16 heads), with the same efficiencies as ``ds-660b``. [assumed]
* HBM free for KV per GPU (H200 141 GB): weights share + runtime buffers subtracted, see each profile.
* ``host_buffer_bytes`` (per node, paper §5): 80 GB for the DS models, 320 GB for Qwen2.5-32B; an HF
  config gets the DS size if it uses MLA, else the Qwen size. [paper; HF rule assumed]
* ``prefill_ep_gpus``: the prefill deployment's EP group (DP attention + EP MoE, whose ranks step in
  lockstep): EP16 over 2 nodes for ds-660b (the size its HBM budget assumes), EP8 for ds-27b
  [assumed, as its profile]; 1 (independent engines) for dense models; for an HF MoE config the
  group its experts need (``profile_from_hf_config``). ``decode_ep_gpus`` likewise for decode: EP32
  over 4 nodes for ds-660b (its decode HBM budget), EP8 for ds-27b, 1 for dense models.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class ModelProfile:
    """Everything the simulator needs to know about a model. Times in seconds, sizes in bytes."""

    name: str
    num_layers: int
    kv_bytes_per_token_layer: int
    # Prefill (per GPU = one DP-attention / TP engine): t = overhead + Σ new*linear + Σ attention.
    prefill_s_per_new_token: float
    attn_s_per_pair: float  # per (new token, attended context token), all layers
    attn_topk_tokens: int  # 0 = dense attention; >0 = sparse (DSA) over at most this many tokens
    indexer_s_per_pair: float  # DSA indexer per (new token, context token); 0 for dense models
    prefill_batch_overhead_s: float
    # Decode step (per engine): overhead + batch*per_seq + bytes read for attention / hbm bandwidth.
    decode_step_overhead_s: float
    decode_s_per_seq: float
    decode_attn_bytes_per_ctx_token: float  # bytes read per context token per step (dense part)
    decode_attn_bytes_per_topk_token: float  # bytes per selected token per step (sparse part)
    decode_hbm_bytes_per_s: float
    # Memory for KV (bytes per GPU) on prefill / decode engines.
    prefill_hbm_kv_bytes: int
    decode_hbm_kv_bytes: int
    # Model (high priority) traffic crossing each GPU's CNIC per token (EP all-to-all).
    model_cnic_bytes_per_prefill_token: float = 0.0
    model_cnic_bytes_per_decode_token: float = 0.0
    # PE ranks that run every forward in lockstep (DP attention + EP MoE); 1 = independent engines.
    prefill_ep_gpus: int = 1
    # DE ranks that run every decode step in lockstep (the decode instance's EP group).
    decode_ep_gpus: int = 1
    # Pinned host DRAM per node for KV in flight (pe_buffer / de_buffer): storage reads land there and
    # wait for the prefill; KV returned by the PE waits there for the decode H2D. Paper: 80 GB per node
    # for the DS models, 320 GB for Qwen2.5-32B.
    host_buffer_bytes: int = 80_000_000_000
    # Routed-expert weights of a MoE model (bytes, all of them) and the rest of its weights per GPU:
    # set for HF configs, so the KV budget can follow the EP group a run actually uses
    # (``hbm_kv_bytes``). 0 = the ``*_hbm_kv_bytes`` above hold whatever the group.
    routed_weight_bytes: float = 0.0
    other_weight_bytes: float = 0.0
    # A named MoE profile's smallest EP group whose GPUs hold its weights (its fixed KV budget is not
    # re-derived for a smaller one; the simulator says so: ``weights_fit``). HF configs: their weights.
    min_ep_gpus: int = 1
    # Whether the weights are fp8 (an HF config's quantization_config): a refusal then does not suggest it.
    fp8_weights: bool = False

    def weights_fit(self, ep_gpus: int) -> bool:
        """Whether each GPU of an EP group of ``ep_gpus`` holds its weights with HBM left for KV: from the
        weights themselves for an HF config (``hbm_kv_bytes`` refuses a group where they do not), from
        ``min_ep_gpus`` for a named profile."""
        if self.routed_weight_bytes:
            return _free_hbm_bytes(self.other_weight_bytes, self.routed_weight_bytes, ep_gpus) > 0
        return ep_gpus >= self.min_ep_gpus

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token_layer * self.num_layers


# ---- fitted / derived constants (see module docstring) ----
QWEN32B_PREFILL_S_PER_TOKEN = 1.08444e-4  # anchor fit
QWEN32B_ATTN_S_PER_PAIR = 1.74200e-9  # anchor fit
QWEN32B_DECODE_OVERHEAD_S = 0.019071  # anchor fit
QWEN32B_DECODE_S_PER_SEQ = 4.676e-5  # anchor fit
H200_DECODE_HBM_BYTES_PER_S = 4.551e12  # anchor fit (effective KV read bandwidth in decode)
H200_HBM_BYTES = 141e9
BF16_ATTN_FLOPS_PER_S = 752e12  # anchor fit (attention, bf16)
MOE_FP8_LINEAR_FLOPS_PER_S = 420e12  # calibrated to DeepSeek's published prefill throughput
FP8_INDEXER_FLOPS_PER_S = 1500e12  # 2 x bf16 GEMM anchor (773 TFLOP/s); [derived]

_DS_LAYERS = 61
_DS_SPARSE_FLOPS_PER_PAIR = _DS_LAYERS * 128 * (576 + 512) * 2
_DS_INDEXER_FLOPS_PER_PAIR = _DS_LAYERS * 64 * 128 * 2

DS_660B = ModelProfile(
    name="ds-660b",
    num_layers=_DS_LAYERS,
    kv_bytes_per_token_layer=656,
    prefill_s_per_new_token=2 * 37e9 / MOE_FP8_LINEAR_FLOPS_PER_S,
    attn_s_per_pair=_DS_SPARSE_FLOPS_PER_PAIR / BF16_ATTN_FLOPS_PER_S,
    attn_topk_tokens=2048,
    indexer_s_per_pair=_DS_INDEXER_FLOPS_PER_PAIR / FP8_INDEXER_FLOPS_PER_S,
    prefill_batch_overhead_s=0.010,  # 61 layers x 2 all-to-all x ~80 µs latency [assumed]
    decode_step_overhead_s=0.015,
    decode_s_per_seq=0.35e-3,
    decode_attn_bytes_per_ctx_token=_DS_LAYERS * 132,  # indexer keys: 128 FP8 + 4 B scale per layer
    decode_attn_bytes_per_topk_token=_DS_LAYERS * 656,
    decode_hbm_bytes_per_s=H200_DECODE_HBM_BYTES_PER_S,
    # PE: EP16 over 2 nodes, ~43 GB weights + ~30 GB activations/DeepEP buffers; DE: EP32 ~22 GB + ~19 GB.
    prefill_hbm_kv_bytes=int(H200_HBM_BYTES - 43e9 - 30e9),
    decode_hbm_kv_bytes=int(H200_HBM_BYTES - 22e9 - 19e9),
    # DeepEP: FP8 dispatch 7 KiB + bf16 combine 14 KiB per token per MoE layer (58), ~1 remote node.
    model_cnic_bytes_per_prefill_token=58 * 21 * 1024,
    model_cnic_bytes_per_decode_token=58 * 21 * 1024,
    prefill_ep_gpus=16,
    decode_ep_gpus=32,
    min_ep_gpus=8,  # ~86 GB of fp8 weights per GPU at EP8; ~172 GB at EP4, past an H200's 141 GB
)

DS_27B = ModelProfile(
    name="ds-27b",
    num_layers=30,
    kv_bytes_per_token_layer=656,
    prefill_s_per_new_token=2 * 4.5e9 / MOE_FP8_LINEAR_FLOPS_PER_S,
    attn_s_per_pair=30 * 16 * (576 + 512) * 2 / BF16_ATTN_FLOPS_PER_S,
    attn_topk_tokens=0,
    indexer_s_per_pair=0.0,
    prefill_batch_overhead_s=0.005,
    decode_step_overhead_s=0.008,
    decode_s_per_seq=0.06e-3,
    decode_attn_bytes_per_ctx_token=30 * 656,
    decode_attn_bytes_per_topk_token=0.0,
    decode_hbm_bytes_per_s=H200_DECODE_HBM_BYTES_PER_S,
    # 27B FP8 over 8 GPUs (EP8): ~3.4 GB weights + ~20 GB buffers.
    prefill_hbm_kv_bytes=int(H200_HBM_BYTES - 3.4e9 - 20e9),
    decode_hbm_kv_bytes=int(H200_HBM_BYTES - 3.4e9 - 20e9),
    model_cnic_bytes_per_prefill_token=26 * 21 * 1024 / 2,
    model_cnic_bytes_per_decode_token=26 * 21 * 1024 / 2,
    prefill_ep_gpus=8,
    decode_ep_gpus=8,
)

QWEN_32B = ModelProfile(
    name="qwen2.5-32b",
    num_layers=64,
    kv_bytes_per_token_layer=4096,
    prefill_s_per_new_token=QWEN32B_PREFILL_S_PER_TOKEN,
    attn_s_per_pair=QWEN32B_ATTN_S_PER_PAIR,
    attn_topk_tokens=0,
    indexer_s_per_pair=0.0,
    prefill_batch_overhead_s=0.0,  # the anchor fit has no significant intercept
    decode_step_overhead_s=QWEN32B_DECODE_OVERHEAD_S,
    decode_s_per_seq=QWEN32B_DECODE_S_PER_SEQ,
    decode_attn_bytes_per_ctx_token=64 * 4096,
    decode_attn_bytes_per_topk_token=0.0,
    decode_hbm_bytes_per_s=H200_DECODE_HBM_BYTES_PER_S,
    # One GPU per engine: 65.5 GB bf16 weights + ~10 GB activations.
    prefill_hbm_kv_bytes=int(H200_HBM_BYTES - 65.5e9 - 10e9),
    decode_hbm_kv_bytes=int(H200_HBM_BYTES - 65.5e9 - 10e9),
    host_buffer_bytes=320_000_000_000,  # 6.5x the DS models' KV per token
)

PROFILES: dict[str, ModelProfile] = {p.name: p for p in (DS_660B, DS_27B, QWEN_32B)}


def get_profile(name_or_path: str) -> ModelProfile:
    """A named profile, or one derived from a Hugging Face ``config.json`` path."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            cfg = json.loads(path.read_text())
            if not isinstance(cfg, dict):
                raise ValueError(f"its top level is a JSON {type(cfg).__name__}, not an object")
            return profile_from_hf_config(cfg, name=str(name_or_path))
        except json.JSONDecodeError as e:
            raise ValueError(f"model config {str(path)!r} is not JSON: {e}") from None
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(
                f"model config {str(path)!r} is not an HF config.json: missing or bad {e}"
            ) from None
        except (ValueError, OverflowError) as e:  # (a size out of range or infinite, or weights too big)
            raise ValueError(f"model config {str(path)!r}: {e}") from None
    if path.suffix == ".json" or "/" in name_or_path:
        raise ValueError(f"model config {name_or_path!r}: no such file (nor a directory holding config.json)")
    raise ValueError(f"unknown model {name_or_path!r}: use one of {sorted(PROFILES)} or a config.json path")


def _positive(cfg: dict, key: str, default: int | None = None) -> int:
    """cfg[key] (or `default` when absent or null) as an int >= 1, else a ValueError naming it."""
    raw = cfg.get(key)
    value = int(cfg[key] if default is None else (default if raw is None else raw))
    if value < 1:
        raise ValueError(f"{key} must be >= 1, got {value}")
    return value


def profile_from_hf_config(cfg: dict, name: str = "hf") -> ModelProfile:
    """Derive a profile from an HF config: KV layout, FLOPs per token, weights; Qwen-fitted efficiencies.

    KV bytes per token per layer: MLA (``kv_lora_rank``) stores kv_lora_rank + qk_rope_head_dim values;
    GQA stores 2 x num_key_value_heads x head_dim. Both in bf16 (2 B) unless ``torch_dtype`` says fp8.
    Activated parameters: attention projections + (dense or top-k experts') MLP per layer + lm head.
    Efficiencies are the Qwen2.5-32B anchor fits (dense bf16 on H200). Weights are fp8 when the config's
    ``quantization_config`` says so. A MoE model's routed experts are spread over an EP group (DP
    attention + EP MoE, as DeepSeek deploys it; prefill and decode alike): the smallest power of two
    that leaves at least half of an H200 for KV and activations [assumed]; a dense model runs on one GPU.
    """
    from pdserve.model.registry import ARCHITECTURES  # (pure Python: the traits are data)

    known = ARCHITECTURES.get((cfg.get("architectures") or [""])[0])
    if known is not None:  # keys left out mean what transformers defaults them to (as the engine reads)
        cfg = dict(known.config_defaults) | cfg
    hidden = _positive(cfg, "hidden_size")
    layers = _positive(cfg, "num_hidden_layers")
    heads = _positive(cfg, "num_attention_heads")
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    # (absent or null: MHA; 0 is not "absent", it was read as MHA silently: a review, 2026-12-04)
    kv_heads = heads if cfg.get("num_key_value_heads") is None else int(cfg["num_key_value_heads"])
    if head_dim < 1 or kv_heads < 1:  # (a zero or negative size divided by zero, or overflowed, later)
        raise ValueError(f"head_dim {head_dim} and num_key_value_heads {kv_heads} must be >= 1")
    # (newer transformers save "dtype", older "torch_dtype")
    dtype_bytes = 1 if "float8" in str(cfg.get("torch_dtype") or cfg.get("dtype") or "") else 2
    mla = bool(cfg.get("kv_lora_rank"))
    if mla:
        kv_elems = _positive(cfg, "kv_lora_rank") + _positive(cfg, "qk_rope_head_dim", 64)
    else:
        kv_elems = 2 * kv_heads * head_dim
    kv_bytes_layer = kv_elems * dtype_bytes
    inter = _positive(cfg, "intermediate_size", 4 * hidden)
    # DeepSeek: n_routed_experts; Qwen-MoE: num_experts; Mixtral: num_local_experts.
    n_experts = int(
        cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    )
    if n_experts < 0:  # (a negative count ran, with negative routed weights)
        raise ValueError(f"the number of experts must be >= 0, got {n_experts}")
    # MLP parameters per layer: on every GPU (dense MLP or shared experts), routed (spread over the EP
    # group), and activated per token.
    if n_experts:
        moe_inter = _positive(cfg, "moe_intermediate_size", inter)
        top_k = _positive(cfg, "num_experts_per_tok", 2)
        # Shared experts: DeepSeek counts them (n_shared_experts x moe size), Qwen-MoE sizes one.
        shared_inter = int(cfg.get("shared_expert_intermediate_size", 0) or 0)
        if not shared_inter:
            shared_inter = moe_inter * int(cfg.get("n_shared_experts", 0) or 0)
        mlp_fixed = 3 * hidden * shared_inter
        mlp_routed = 3 * hidden * moe_inter * n_experts
        mlp_active = 3 * hidden * moe_inter * top_k + mlp_fixed
        # EP all-to-all per token, as ds-660b's: FP8 dispatch (1 B) + bf16 combine (2 B) per hidden
        # element per MoE layer, to ~1 remote node (DeepSeek's first dense layers have none). Before,
        # an HF MoE config took the dense profile's 0: its CNICs carried no model traffic.
        moe_layers = max(layers - int(cfg.get("first_k_dense_replace", 0) or 0), 0)
        a2a_bytes_per_token = float(moe_layers * hidden * 3)
    else:
        mlp_fixed = mlp_active = 3 * hidden * inter
        mlp_routed = 0
        a2a_bytes_per_token = 0.0
    attn_params = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
    vocab = _positive(cfg, "vocab_size", 32000)
    active = layers * (attn_params + mlp_active) + vocab * hidden
    quant = cfg.get("quantization_config")
    quant_method = str(quant.get("quant_method", "")) if isinstance(quant, dict) else ""
    weight_bytes = 1 if "fp8" in quant_method.lower() else dtype_bytes
    routed_bytes = layers * mlp_routed * weight_bytes
    other_bytes = (layers * (attn_params + mlp_fixed) + 2 * vocab * hidden) * weight_bytes
    ep = 1  # at most one expert per rank: a larger group holds no fewer weights per GPU
    while (
        routed_bytes
        and ep * 2 <= n_experts
        and _gpu_weight_bytes(other_bytes, routed_bytes, ep) > H200_HBM_BYTES / 2
    ):
        ep *= 2
    weights_bytes = _gpu_weight_bytes(other_bytes, routed_bytes, ep)
    flops_per_pair = 4 * heads * head_dim * layers
    free = _free_hbm_bytes(other_bytes, routed_bytes, ep)
    if not routed_bytes and free <= 0:  # (a MoE model's EP group is checked per cluster: hbm_kv_bytes)
        raise ValueError(
            f"{name}: {weights_bytes / 1e9:.0f} GB of weights leave no HBM for KV on one H200 (a dense "
            f"model runs on one GPU here): use {'' if weight_bytes == 1 else 'fp8 weights or '}a smaller model"
        )
    free = max(free, 1e9)
    return replace(
        QWEN_32B,
        name=name,
        num_layers=layers,
        kv_bytes_per_token_layer=kv_bytes_layer,
        prefill_s_per_new_token=QWEN32B_PREFILL_S_PER_TOKEN * active / 32.5e9,
        attn_s_per_pair=flops_per_pair / BF16_ATTN_FLOPS_PER_S,
        decode_step_overhead_s=max(weights_bytes / H200_DECODE_HBM_BYTES_PER_S, 1e-3),
        decode_s_per_seq=QWEN32B_DECODE_S_PER_SEQ * active / 32.5e9,
        decode_attn_bytes_per_ctx_token=float(kv_bytes_layer * layers),
        prefill_hbm_kv_bytes=int(free),
        decode_hbm_kv_bytes=int(free),
        host_buffer_bytes=DS_660B.host_buffer_bytes if mla else QWEN_32B.host_buffer_bytes,
        prefill_ep_gpus=ep,
        decode_ep_gpus=ep,
        model_cnic_bytes_per_prefill_token=a2a_bytes_per_token,
        model_cnic_bytes_per_decode_token=a2a_bytes_per_token,
        routed_weight_bytes=float(routed_bytes),
        other_weight_bytes=float(other_bytes),
        fp8_weights=weight_bytes == 1,
    )


def _gpu_weight_bytes(other_weight_bytes: float, routed_weight_bytes: float, ep_gpus: int) -> float:
    """Weights on one GPU of an EP group: those every GPU holds, and its 1/ep of the routed experts."""
    return other_weight_bytes + routed_weight_bytes / ep_gpus


def _free_hbm_bytes(other_weight_bytes: float, routed_weight_bytes: float, ep_gpus: int) -> float:
    """An H200's HBM left for KV: minus the GPU's weights and 10 GB of runtime buffers [assumed]."""
    return H200_HBM_BYTES - _gpu_weight_bytes(other_weight_bytes, routed_weight_bytes, ep_gpus) - 10e9


def hbm_kv_bytes(p: ModelProfile, decode: bool, ep_gpus: int) -> int:
    """HBM per GPU for KV on a decode (else prefill) engine whose EP group has ``ep_gpus`` ranks, as
    run: for a profile that knows its weights (an HF config), H200 minus the rest of the weights, 1/ep of
    the routed experts and 10 GB of runtime buffers (a cluster too small for the model's EP group holds
    more experts per GPU, hence less KV); else the profile's fixed budget. Raises ``ValueError`` when the
    weights alone do not fit."""
    if not p.routed_weight_bytes:
        return p.decode_hbm_kv_bytes if decode else p.prefill_hbm_kv_bytes
    if not p.weights_fit(ep_gpus):
        weights = _gpu_weight_bytes(p.other_weight_bytes, p.routed_weight_bytes, ep_gpus)
        wanted = p.decode_ep_gpus if decode else p.prefill_ep_gpus
        raise ValueError(
            f"{p.name}: {weights / 1e9:.0f} GB of weights per GPU with EP{ep_gpus} leave no HBM for KV"
            f" (the model asks for EP{wanted}): add nodes{'' if p.fp8_weights else ' or use fp8 weights'}"
        )
    return int(_free_hbm_bytes(p.other_weight_bytes, p.routed_weight_bytes, ep_gpus))


# ---- cost functions ----


def prefill_request_s(p: ModelProfile, num_cached_tokens: int, num_new_tokens: int) -> float:
    """Compute time of one request's ``new`` tokens over ``cached`` context (no batch overhead)."""
    if num_new_tokens <= 0:
        return 0.0
    mean_ctx = num_cached_tokens + num_new_tokens / 2.0  # causal: token i attends cached + i
    attended = min(mean_ctx, p.attn_topk_tokens) if p.attn_topk_tokens else mean_ctx
    per_token = p.prefill_s_per_new_token + attended * p.attn_s_per_pair + mean_ctx * p.indexer_s_per_pair
    return num_new_tokens * per_token


def prefill_request_fn(p: ModelProfile) -> Callable[[int, int], float]:
    """``prefill_request_s`` bound to one profile (constants hoisted; same arithmetic, same floats)."""
    lin, attn, idx, topk = (
        p.prefill_s_per_new_token,
        p.attn_s_per_pair,
        p.indexer_s_per_pair,
        p.attn_topk_tokens,
    )

    def cost(num_cached_tokens: int, num_new_tokens: int) -> float:
        if num_new_tokens <= 0:
            return 0.0
        mean_ctx = num_cached_tokens + num_new_tokens / 2.0
        attended = (mean_ctx if mean_ctx < topk else topk) if topk else mean_ctx
        return num_new_tokens * (lin + attended * attn + mean_ctx * idx)

    return cost


def decode_attn_fn(p: ModelProfile) -> Callable[[int, float], float]:
    """The KV-reading (attention) part of ``decode_step_s``: what differs between the ranks of a
    lockstep decode group, whose overhead and per-sequence (MoE) work are shared."""
    topk_b, ctx_b, k, bw = (
        p.decode_attn_bytes_per_topk_token,
        p.decode_attn_bytes_per_ctx_token,
        p.attn_topk_tokens,
        p.decode_hbm_bytes_per_s,
    )

    def attn(num_seqs: int, sum_ctx_tokens: float) -> float:
        if num_seqs <= 0:
            return 0.0
        sparse = 0.0
        if topk_b:
            sparse = min(sum_ctx_tokens, num_seqs * k) * topk_b
        return (sum_ctx_tokens * ctx_b + sparse) / bw

    return attn


def prefill_batch_s(p: ModelProfile, pairs: Sequence[tuple[int, int]]) -> float:
    """Predicted seconds of one prefill forward over [(cached, new), ...] on one engine."""
    if not pairs:
        return 0.0
    return p.prefill_batch_overhead_s + sum(prefill_request_s(p, c, n) for c, n in pairs)


def decode_step_s(p: ModelProfile, num_seqs: int, sum_ctx_tokens: float) -> float:
    """One decode step for ``num_seqs`` sequences whose contexts sum to ``sum_ctx_tokens``.

    Sparse models read at most top-k tokens' KV per sequence; we approximate Σ min(ctx, k) by
    min(Σ ctx, n x k), exact when all contexts are ≥ k (agentic contexts are tens of thousands).
    """
    if num_seqs <= 0:
        return 0.0
    sparse = 0.0
    if p.decode_attn_bytes_per_topk_token:
        sparse = min(sum_ctx_tokens, num_seqs * p.attn_topk_tokens) * p.decode_attn_bytes_per_topk_token
    bytes_read = sum_ctx_tokens * p.decode_attn_bytes_per_ctx_token + sparse
    return p.decode_step_overhead_s + num_seqs * p.decode_s_per_seq + bytes_read / p.decode_hbm_bytes_per_s


def prefill_tokens_per_s(p: ModelProfile, num_cached_tokens: int, num_new_tokens: int = 512) -> float:
    """New tokens one engine computes per second at this context (for β = tokens in 5 s)."""
    t = prefill_request_s(p, num_cached_tokens, num_new_tokens)
    return num_new_tokens / t if t > 0 else math.inf
