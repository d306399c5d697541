"""Architectures by name (`config.json` "architectures"). Pure Python: the traits are data.

All four supported families share one decoder (`pdserve.model.decoder`); they differ only in the
traits below, which is how HF's own modeling files differ for them too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchTraits:
    qkv_bias: bool = False  # Qwen2: bias on q/k/v projections (never on o_proj)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_from_layer_types: bool = False  # Qwen: window only on "sliding_attention" layers
    sliding_on_all_layers: bool = False  # Mistral: `sliding_window` applies to every layer (Llama: none)
    # Which bias keys the HF modeling file reads (the others ignore them: a config that sets them still
    # loads there, without the tensors). Llama and Qwen3: `attention_bias` on q/k/v/o; Llama: `mlp_bias`.
    reads_attention_bias: bool = False
    reads_mlp_bias: bool = False
    # transformers' config class defaults for keys a config.json may leave out, where they differ
    # from the generic fallbacks (num_key_value_heads = num_attention_heads, head_dim = hidden //
    # heads, no window, 4,096 positions): an absent key means these there, and in vLLM (which reads
    # configs through transformers). An explicit null keeps its meaning.
    config_defaults: tuple[tuple[str, object], ...] = ()


_QWEN_DEFAULTS = (("num_key_value_heads", 32), ("sliding_window", 4096), ("max_position_embeddings", 32768))
_MISTRAL_DEFAULTS = (
    ("num_key_value_heads", 8),
    ("sliding_window", 4096),
    ("max_position_embeddings", 131072),
)
ARCHITECTURES: dict[str, ArchTraits] = {
    "LlamaForCausalLM": ArchTraits(
        reads_attention_bias=True, reads_mlp_bias=True, config_defaults=(("max_position_embeddings", 2048),)
    ),
    "MistralForCausalLM": ArchTraits(sliding_on_all_layers=True, config_defaults=_MISTRAL_DEFAULTS),
    "Qwen2ForCausalLM": ArchTraits(
        qkv_bias=True, sliding_from_layer_types=True, config_defaults=_QWEN_DEFAULTS
    ),
    "Qwen3ForCausalLM": ArchTraits(
        qk_norm=True,
        sliding_from_layer_types=True,
        reads_attention_bias=True,
        config_defaults=(*_QWEN_DEFAULTS, ("head_dim", 128)),
    ),
}


class UnsupportedArchitecture(ValueError):
    pass


def arch_traits(name: str) -> ArchTraits:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise UnsupportedArchitecture(
            f"architecture {name!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        ) from None
