"""Frozen configuration, passed explicitly (no globals).

`ModelConfig` is read from a Hugging Face `config.json`; `EngineConfig` holds the serving knobs. Both
are pure Python so that scheduler-side code can hold them without importing torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
DTYPE_NBYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # bytes per KV element


class ConfigError(ValueError):
    """A configuration value is missing, unsupported or inconsistent."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """The shape of one decoder-only transformer, as its HF `config.json` describes it."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    # Per-layer sliding window in tokens (None = full attention). Length num_layers.
    sliding_windows: tuple[int | None, ...]
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str | None
    # generation_config.json's sampling values ((SamplingParams field, value), ...): the defaults of a
    # request that does not set them, as vLLM applies them (its generation_config="auto")
    sampling_defaults: tuple[tuple[str, float | int], ...] = ()

    @staticmethod
    def from_dir(path: str | os.PathLike) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            hint = (
                ""
                if Path(path).is_dir()
                else " (--model is a local directory: download a hub model first, e.g. "
                "`huggingface-cli download ID --local-dir DIR`)"
            )
            raise ConfigError(f"no config.json in model directory {str(path)!r}{hint}")
        raw = _read_json(cfg_path)
        gen_path = Path(path) / "generation_config.json"
        gen = _read_json(gen_path) if gen_path.is_file() else {}
        from pdserve.model.registry import UnsupportedArchitecture  # torch-free

        try:
            return ModelConfig.from_dict(raw, gen)
        except ConfigError:
            raise
        except KeyError as e:  # (a required key; the others default as transformers defaults them)
            raise ConfigError(f"{cfg_path} lacks {e.args[0]!r}") from None
        except UnsupportedArchitecture as e:  # (a ValueError, but not a value of the wrong type)
            raise ConfigError(f"{cfg_path}: {e}") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"{cfg_path}: a value of the wrong type ({e})") from None

    @staticmethod
    def from_dict(raw: dict, generation: dict | None = None) -> ModelConfig:
        from pdserve.model.registry import arch_traits  # torch-free

        archs = raw.get("architectures") or []
        if not archs:
            raise ConfigError("config.json has no 'architectures' entry")
        arch = archs[0]
        if raw.get("quantization_config"):  # (its scale tensors would be refused one by one, later)
            method = (
                raw["quantization_config"].get("quant_method", "?")
                if isinstance(raw["quantization_config"], dict)
                else "?"
            )
            raise ConfigError(f"quantized checkpoints ({method}) are not supported: use unquantized weights")
        traits = arch_traits(arch)
        raw = dict(traits.config_defaults) | raw
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        head_dim = raw.get("head_dim") or hidden // num_heads
        num_layers = raw["num_hidden_layers"]
        windows = _sliding_windows(raw, num_layers, traits)
        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # the decoder's MLP is SwiGLU; anything else would be wrong
            raise ConfigError(f"unsupported hidden_act {act!r} (supported: silu)")
        attention_bias = traits.reads_attention_bias and bool(raw.get("attention_bias", False))
        eos: list[int] = []
        for src in (generation or {}, raw):
            val = src.get("eos_token_id")
            for tok in [val] if isinstance(val, int) else (val or []):
                if tok not in eos:
                    eos.append(tok)
        return ModelConfig(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rope=_rope(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=traits.qkv_bias or attention_bias,
            o_bias=attention_bias,
            mlp_bias=traits.reads_mlp_bias and bool(raw.get("mlp_bias", False)),
            qk_norm=traits.qk_norm,
            sliding_windows=windows,
            eos_token_ids=tuple(eos),
            bos_token_id=raw.get("bos_token_id"),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            sampling_defaults=_sampling_defaults(generation or {}),
        )

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """Bytes of K plus V for one token of one layer at 2 bytes/element (bf16/fp16)."""
        return 2 * self.num_kv_heads * self.head_dim * 2


# generation_config.json key -> SamplingParams field (vLLM's list: `get_diff_sampling_param`)
GENERATION_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def _sampling_defaults(generation: dict) -> tuple[tuple[str, float | int], ...]:
    """The sampling values a generation config gives (numbers only; a key set to null is absent)."""
    out = []
    for key, name in GENERATION_SAMPLING_KEYS.items():
        value = generation.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out.append((name, value))
    return tuple(out)


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return value


def _rope(raw: dict) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files write rope_theta and
    # rope_scaling at the top level. A `rope_scaling` block is the whole RoPE config, as transformers
    # reads it, also beside `rope_parameters` (what model cards tell users to add for a longer
    # context: merged key by key, the saved "rope_type": "default" won and the scaling was silently
    # dropped, a YaRN block included). Theta: the block's, else the top level's, else 10,000 -- with a
    # `rope_scaling` block, transformers drops the saved `rope_parameters` (its theta with it); reading
    # that theta here computed other logits than HF's (a review, 2026-12-04). So a block added to a
    # v5 config must carry its model's rope_theta.
    saved = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = dict(scaling) if scaling else saved
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise ConfigError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        # (absent: the model's positions, as transformers defaults it)
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
    )


QWEN_DEFAULT_MAX_WINDOW_LAYERS = 28  # transformers' Qwen2Config / Qwen3Config default


def _sliding_windows(raw: dict, num_layers: int, traits) -> tuple[int | None, ...]:
    """Per layer, the attention window in tokens (None: full), as transformers reads the config."""
    window = raw.get("sliding_window")
    if not window:
        return (None,) * num_layers
    if traits.sliding_from_layer_types:
        # Qwen2/Qwen3: only layers marked "sliding_attention" (and only if use_sliding_window).
        if not raw.get("use_sliding_window", False):
            return (None,) * num_layers
        types = raw.get("layer_types")
        if not types:  # saved before transformers 4.53: it derives them from max_window_layers
            first = raw.get("max_window_layers", QWEN_DEFAULT_MAX_WINDOW_LAYERS)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    if traits.sliding_on_all_layers:
        return (int(window),) * num_layers
    # Llama's attention has no window (transformers' modeling_llama.py never reads the key). Its generate
    # does truncate the cache to a `sliding_window` key while the prefill attends to everything: an
    # artifact of the cache, not the architecture.
    return (None,) * num_layers


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: `num_pages` pages of `page_size` tokens, all layers."""

    page_size: int = 16
    num_pages: int | None = None  # None: derived from kv_cache_memory_gib
    kv_cache_memory_gib: float = 0.5
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size must be a power of two >= 1, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ConfigError(f"num_pages must be >= 2, got {self.num_pages}")
        if not self.kv_cache_memory_gib > 0:  # (a pool of 2 pages started: the size was clamped)
            raise ConfigError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")

    def pool_pages(self, mc: ModelConfig, dtype: str) -> int:
        """Pages in the pool: `num_pages`, else as many as `kv_cache_memory_gib` holds (K and V of every
        layer, [page_size, kv_heads, head_dim] each, in `dtype`)."""
        if self.num_pages:
            return self.num_pages
        page_nbytes = 2 * mc.num_layers * self.page_size * mc.num_kv_heads * mc.head_dim * DTYPE_NBYTES[dtype]
        return max(2, int(self.kv_cache_memory_gib * (1 << 30)) // page_nbytes)


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits for one engine step."""

    max_num_seqs: int = 64  # running requests at once
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_model_len: int = 4096  # prompt + generated tokens of one request
    # A waiting request whose next prompt page a running prefill is computing waits for it to land
    # in the prefix cache instead of computing it again (n choices, an RL group of one prompt).
    share_in_flight_prefixes: bool = True
    # DualPath compute quota (None: off): a step's tokens are also capped so its predicted time,
    # overhead + Σ (µs_per_token · new + ns_per_token_pair · new · (cached + new / 2)), stays within
    # the quota (the PE's intra-engine batching of Algorithm 1; the last request is chunked to fit).
    prefill_quota_s: float | None = None
    prefill_overhead_s: float = 0.002
    prefill_us_per_token: float = 50.0
    prefill_ns_per_token_pair: float = 5.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ConfigError("max_num_seqs, max_num_batched_tokens >= 1 and max_model_len >= 2 required")
        if self.prefill_quota_s is not None and self.prefill_quota_s <= 0:
            raise ConfigError(f"prefill_quota_s must be > 0, got {self.prefill_quota_s}")

    def prefill_cost_s(self, num_cached_tokens: int, num_new_tokens: int) -> float:
        """Predicted compute seconds of `num_new_tokens` over `num_cached_tokens` of context (no overhead)."""
        attn_pairs = num_new_tokens * (num_cached_tokens + num_new_tokens / 2)
        return (
            num_new_tokens * self.prefill_us_per_token * 1e-6
            + attn_pairs * self.prefill_ns_per_token_pair * 1e-9
        )


@dataclass(frozen=True)
class EngineConfig:
    model: str
    model_config: ModelConfig
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    served_model_name: str | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ConfigError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @staticmethod
    def create(
        model: str,
        *,
        dtype: str = "auto",
        device: str = "auto",
        page_size: int = 16,
        num_pages: int | None = None,
        kv_cache_memory_gib: float = 0.5,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        seed: int = 0,
        served_model_name: str | None = None,
        prefill_quota_s: float | None = None,
        share_in_flight_prefixes: bool = True,
    ) -> EngineConfig:
        mc = ModelConfig.from_dir(model)
        if device == "auto":
            device = "cuda" if _cuda_available() else "cpu"
        if dtype == "auto":
            # On the resolved device: float32 on the CPU (its half-precision matmuls are slow); on a
            # GPU the checkpoint's own half type (an fp16 model stays fp16, as in vLLM and HF), else bf16.
            saved = mc.torch_dtype if mc.torch_dtype in ("float16", "bfloat16") else "bfloat16"
            if saved == "bfloat16" and device != "cpu" and not _cuda_bf16_supported(device):
                saved = "float16"  # a GPU older than Ampere has no bf16 arithmetic (vLLM's choice too)
            dtype = "float32" if device == "cpu" else saved
        # Positions the model was trained for (linear RoPE scaling stretches them; llama3-style
        # configs already state the extended length): beyond them outputs are garbage, so refuse.
        max_positions = int(
            mc.max_position_embeddings * (mc.rope.factor if mc.rope.rope_type == "linear" else 1)
        )
        if max_model_len is not None and max_model_len > max_positions:
            raise ConfigError(
                f"max_model_len {max_model_len} exceeds the model's {max_positions} positions "
                "(max_position_embeddings in its config.json)"
            )
        if dtype not in SUPPORTED_DTYPES:  # (before the pool is sized in it)
            raise ConfigError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype!r}")
        cache = CacheConfig(
            page_size=page_size,
            num_pages=num_pages,
            kv_cache_memory_gib=kv_cache_memory_gib,
            enable_prefix_caching=enable_prefix_caching,
        )
        # Unset: the model's positions (vLLM's default), capped at what the pool holds, so that any
        # request the context admits fits the pool (vLLM refuses to start there instead).
        max_len = (
            max_model_len
            if max_model_len is not None
            else min(max_positions, cache.pool_pages(mc, dtype) * page_size)
        )
        return EngineConfig(
            model=str(model),
            model_config=mc,
            dtype=dtype,
            device=device,
            seed=seed,
            served_model_name=served_model_name,
            cache=cache,
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_len,
                prefill_quota_s=prefill_quota_s,
                share_in_flight_prefixes=share_in_flight_prefixes,
            ),
        )


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _cuda_bf16_supported(device: str) -> bool:
    import torch

    try:
        major, _ = torch.cuda.get_device_capability(torch.device(device))
    except (RuntimeError, AssertionError, ValueError):  # no usable GPU: the engine will say so itself
        return True
    return major >= 8
