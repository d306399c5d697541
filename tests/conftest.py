"""Shared fixtures: tiny random HF checkpoints of each supported architecture, built with
`transformers` itself (a test dependency) so equivalence tests compare against the real thing."""

from __future__ import annotations

import pytest

ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def tiny_hf_model(arch: str, *, tie: bool = False, seed: int = 0, **overrides):
    import torch
    import transformers as tf

    config_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }[arch]
    kwargs = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=1024,
        tie_word_embeddings=tie,
        # A wide init spreads the logits so greedy argmaxes of a random model are not near-ties.
        initializer_range=0.2,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    return model_cls(config_cls(**kwargs)).eval()


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """arch -> (directory, HF model in float32). Built once per session."""
    out = {}
    for arch in ARCHS:
        model = tiny_hf_model(arch)
        path = tmp_path_factory.mktemp(f"hf-{arch}")
        model.save_pretrained(path)
        out[arch] = (str(path), model)
    return out


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory):
    from pdserve.model.demo import make_demo_model

    return str(make_demo_model(tmp_path_factory.mktemp("demo")))
