"""`pdserve make-demo-model DIR`: a small Llama checkpoint that needs no download.

Random weights (fixed seed) and a byte-level BPE tokenizer trained here with `tokenizers` on text
generated from a fixed seed (`corpus_lines`), so every machine and interpreter builds the identical
checkpoint. It exists so that the demo, the tests and the benchmarks run offline; its text is noise,
its shapes and formats are real.
"""

from __future__ import annotations

import itertools
import json
import os
import random
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
DEMO_SHAPE = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=4096,
)


# The tokenizer's training text is generated here from a fixed seed, so that the tokenizer, and with it
# the vocabulary size and so the weights' shapes, is the same on every machine and interpreter. (It
# used to be the source of 15 standard-library modules, which differ between Python releases: 3.11.2
# and 3.11.7 trained different tokenizers, and tests tied to one tokenizer failed on the other.)
# `random.Random` with an int seed gives the same stream on every CPython 3 (its seeding, `random()`
# and `_randbelow` are fixed), and the text is made of ASCII pieces written here, nothing read.
CORPUS_SEED = 20261203
CORPUS_NUM_LINES = 20_000
CORPUS_NUM_WORDS = 6_000
_ONSETS = ("", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st",
           "tr", "pl", "ch", "sh", "th", "gr", "br", "cl", "sp", "qu")  # fmt: skip
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ai", "ea", "ou", "io", "y")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "x", "ck", "rt")
_FUNCTION_WORDS = ("the of and to in is that for it as with be on not this are by at from or an was "
                   "can if will one all which has more when each there use its we do how their other "
                   "into some than then only new may any such these two over most after first also "
                   "you what where who today hello thank please yes no good day capital city "
                   "weather country world time year people way make like just know take see come "
                   "think look want give find tell ask work seem feel try leave call keep let begin"
                   ).split()  # fmt: skip
# Identifiers of everyday code, ranked right after the common words: a code tokenizer learns them whole.
_CODE_WORDS = ("def class return import from self args kwargs request response context result process "
               "body user handler parser parse argv argument arguments argparse config options data "
               "value values key keys item items name names path file files line lines text string "
               "int float bool list dict set tuple get update append extend insert remove pop index "
               "count len range print format join split strip replace open read write close start "
               "stop run main init test error errors exception finally yield lambda async await "
               "object type types module package function method params param input output buffer "
               "size length offset end time timeout retry status state node page block token cache "
               "model layer batch step queue server client engine message event task worker thread "
               "lock loop total sum min max mean sort sorted filter map reduce fib fibonacci factorial "
               "compute calculate sample random seed weight matrix vector tensor shape dim axis os "
               "sys json re math np torch logging logger log debug info warning option help default "
               "source target node_id url host port base prefix suffix"
               ).split()  # fmt: skip
_KEYWORDS = ("def", "return", "if", "elif", "else", "for", "while", "in", "not", "and", "or", "is",
             "None", "True", "False", "import", "from", "class", "with", "as", "try", "except",
             "raise", "yield", "lambda", "pass", "break", "continue", "assert", "self")  # fmt: skip
_RULES = (" " + "-" * 40, " " + "=" * 32, " +" + "-" * 9 + "+" + "-" * 13 + "+", " ---- ")
_OPERATORS = ("=", "==", "!=", "+", "-", "*", "/", "//", "%", "<", ">", "<=", ">=", "+=", "-=", "->", ":")


def _corpus_words(rng: random.Random) -> list[str]:
    """The vocabulary of the generated text: common words, code identifiers, then pronounceable
    made-up ones (the long tail)."""
    words = list(dict.fromkeys(_FUNCTION_WORDS + _CODE_WORDS))
    seen = set(words)
    while len(words) < CORPUS_NUM_WORDS:
        w = "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(1, 3))
        )
        if len(w) > 1 and w not in seen:
            seen.add(w)
            words.append(w)
    return words


def corpus_lines() -> list[str]:
    """CORPUS_NUM_LINES lines of prose, Python-like code and JSON, deterministic (see CORPUS_SEED).
    Words follow a Zipf law (rank r drawn with weight 1/r), as in real text, so BPE learns frequent
    words whole and rare ones in pieces."""
    rng = random.Random(CORPUS_SEED)
    words = _corpus_words(rng)
    cum = list(itertools.accumulate(1.0 / (r + 1) for r in range(len(words))))

    def word() -> str:
        return rng.choices(words, cum_weights=cum)[0]

    def ident() -> str:
        return "_".join(word() for _ in range(rng.choice((1, 1, 2, 2, 3))))

    def number() -> str:
        r = rng.random()
        if r < 0.5:
            return str(rng.randint(0, 9 if r < 0.2 else 999))
        return f"{rng.uniform(0, 100):.{rng.randint(1, 3)}f}" if r < 0.7 else str(rng.randint(0, 10**6))

    def atom() -> str:
        r = rng.random()
        return ident() if r < 0.6 else number() if r < 0.8 else repr(" ".join(word() for _ in range(2)))

    def prose() -> str:
        text = " ".join(word() for _ in range(rng.randint(4, 16)))
        return text[0].upper() + text[1:] + rng.choice((".", ".", ",", "?", ":", "!"))

    def code() -> str:
        indent = " " * (4 * rng.choice((0, 1, 1, 2, 2, 3)))
        a, b = ident(), ident()
        kinds = (  # (only the drawn one is built: it alone draws from rng)
            lambda: f"def {a}({', '.join(ident() for _ in range(rng.randint(0, 3)))}):",
            lambda: f"{a} {rng.choice(_OPERATORS)} {b}({atom()}, {atom()})",
            lambda: f"return {a} {rng.choice(_OPERATORS)} {atom()}",
            lambda: f"{rng.choice(('if', 'while', 'elif'))} {a} {rng.choice(_OPERATORS)} {atom()}:",
            lambda: f"for {a} in {b}:",
            lambda: f"# {prose()}",
            lambda: f"self.{a} = {b}[{atom()}]",
            lambda: f"{rng.choice(_KEYWORDS)} {a}.{b}",
            lambda: f"{rng.choice(('import', 'from'))} {a}",
        )
        return indent + kinds[rng.randrange(len(kinds))]()

    def json_line() -> str:
        fields = []
        for _ in range(rng.randint(1, 4)):
            key = ident()
            values = (number(), f'"{word()}"', "true", "false", "null")
            fields.append(f'"{key}": {rng.choice(values)}')
        return "{" + ", ".join(fields) + "}"

    def rule() -> str:  # a separator comment, as code has them: BPE learns each as one long token
        return "#" + rng.choice(_RULES)

    makers = (prose, prose, code, code, code, json_line, rule)
    return [rng.choice(makers)() for _ in range(CORPUS_NUM_LINES)]


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
