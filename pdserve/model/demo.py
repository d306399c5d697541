"""`pdserve make-demo-model DIR`: a small Llama checkpoint that needs no download.

Random weights (fixed seed) and a byte-level BPE tokenizer trained here with `tokenizers` on Python
standard-library sources, so every machine builds the identical checkpoint. It exists so that the demo,
the tests and the benchmarks run offline; its text is noise, its shapes and formats are real.
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SPECIAL = [BOS, EOS, "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
# Tools (a `tools` list) go into a system turn and an assistant's calls are written back in the
# hermes form (<tool_call>{json}</tool_call>), as Qwen2.5's template does; plain chats render as before.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\nTools:\n{% for t in tools %}{{ t['function'] | tojson }}\n{% endfor %}"
    'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|end|>\n{% endif %}'
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</tool_call>"
    "{% endfor %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Stdlib modules whose source is the tokenizer's training text (present in every CPython 3.11+).
CORPUS_MODULES = (
    "this.py",
    "textwrap.py",
    "argparse.py",
    "json/decoder.py",
    "json/encoder.py",
    "string.py",
    "difflib.py",
    "pathlib.py",
    "typing.py",
    "dataclasses.py",
    "enum.py",
    "functools.py",
    "collections/__init__.py",
    "email/message.py",
    "calendar.py",
)

DEMO_SHAPE = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=4096,
)


def corpus_lines() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines: list[str] = []
    for name in CORPUS_MODULES:
        path = stdlib / name
        if path.is_file():
            lines += path.read_text(encoding="utf-8", errors="replace").splitlines()
    return lines


def train_tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def make_demo_model(out_dir: str | Path, seed: int = 0, **shape) -> Path:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer to `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {**DEMO_SHAPE, **shape}
    tok = train_tokenizer(cfg["vocab_size"])
    vocab = tok.get_vocab_size()
    cfg["vocab_size"] = vocab  # the trainer may stop short of the target on a small corpus
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        **cfg,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
        "attention_bias": False,
    }
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": BOS,
                "eos_token": EOS,
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": cfg["max_position_embeddings"],
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            indent=2,
        )
    )
    save_file(_random_weights(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    # config.json last, atomically: its presence means a whole checkpoint (`pdserve demo` builds one
    # unless it is there; an interrupted build, without it, is built again over its files).
    tmp = out / ".config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2))
    os.replace(tmp, out / "config.json")
    return out


def _random_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d

    def rand(*shape):
        # std 0.05 (> HF's 0.02) spreads the logits so greedy argmaxes are rarely near-ties.
        return torch.randn(*shape, generator=g) * 0.05

    w = {
        "model.embed_tokens.weight": rand(v, h),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": rand(v, h),
    }
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w |= {
            p + "self_attn.q_proj.weight": rand(h, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, h),
            p + "mlp.gate_proj.weight": rand(i, h),
            p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        }
    return {k: t.contiguous() for k, t in w.items()}
