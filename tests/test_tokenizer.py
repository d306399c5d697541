"""Incremental detokenization: the text of a growing output, a few tokens per step, is the full
decode's at every step (a trailing incomplete character's U+FFFD included), for the decoder families
LLM tokenizers use -- byte-level BPE; Metaspace with byte fallback and a leading-space Strip, as Llama
2 and Mistral -- on text a model writes and on random ids (special tokens, stray and split UTF-8
bytes, invalid byte runs), stepped 1-5 at a time."""

from __future__ import annotations

import random

import pytest

from pdserve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def byte_level(demo_model_dir) -> Tokenizer:
    return Tokenizer(demo_model_dir)


@pytest.fixture(scope="module")
def metaspace(tmp_path_factory) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, trainers

    from pdserve.model.demo import corpus_lines

    tok = HFTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    lines = corpus_lines() + ["héllo wörld ünïcode ✓ 中文 テスト", "  two  spaces  "]
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=1200, special_tokens=special))
    d = tmp_path_factory.mktemp("metaspace")
    tok.save(str(d / "tokenizer.json"))
    return Tokenizer(d)


def _check(tok: Tokenizer, ids: list[int], skip: bool, rng: random.Random) -> None:
    inc = tok.incremental(skip)
    n = 0
    while n < len(ids):
        n = min(len(ids), n + rng.randint(1, 5))
        assert inc.update(ids[:n]) == tok.decode(ids[:n], skip), ids[:n]


@pytest.mark.parametrize("which", ["byte_level", "metaspace"])
def test_incremental_text_equals_the_full_decode(which, request):
    tok = request.getfixturevalue(which)
    rng = random.Random(which)
    vocab = tok.vocab_size
    texts = [
        "def handler(request):\n    return request.body\n",
        " leading space",
        "héllo ✓ 中文 テスト  x",
        "Ω≈ç√∫ 😀🚀 ok",  # characters the tokenizers never saw: byte tokens, split over steps
    ]
    for text in texts:  # what a model writes
        for skip in (True, False):
            _check(tok, tok.encode(text, add_special_tokens=False), skip, rng)
    for _ in range(300):  # and anything a sampler can draw
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 80))]
        _check(tok, ids, rng.random() < 0.5, rng)
    byte_runs = sorted(tok.byte_token_ids)  # (none in byte-level BPE)
    for _ in range(100 if byte_runs else 0):  # runs of byte tokens, valid and not, among words
        ids = [rng.choice(byte_runs) if rng.random() < 0.6 else rng.randrange(vocab) for _ in range(30)]
        _check(tok, ids, rng.random() < 0.5, rng)


def test_incremental_text_starts_over_when_the_ids_do_not_grow(byte_level):
    ids = byte_level.encode("def f(x):\n    return x\n", add_special_tokens=False)
    inc = byte_level.incremental()
    assert inc.update(ids) == byte_level.decode(ids)
    assert inc.update(ids[:3]) == byte_level.decode(ids[:3])


def test_the_engines_text_at_every_step_is_the_decode_of_its_tokens(demo_model_dir):
    """The engine's streamed text (incremental) against a full decode of the same tokens, step by step,
    sampled outputs included; the finished output is the full decode itself."""
    from pdserve import SamplingParams
    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig.create(demo_model_dir, num_pages=128, max_model_len=512))
    tok = engine.tokenizer
    skip = {"r0": True, "r1": False}
    for rid, skip_special in skip.items():
        params = SamplingParams(
            temperature=1.0,
            seed=3 + int(rid[1:]),
            max_tokens=120,
            ignore_eos=True,
            skip_special_tokens=skip_special,
        )
        engine.add(engine.make_request("def handler(request):", params, rid))
    seen = 0
    while engine.has_unfinished():
        for out in engine.step():
            o = out.outputs[0]
            full = tok.decode(o.token_ids, skip[out.request_id])
            assert full.startswith(o.text) and set(full[len(o.text) :]) <= {"\ufffd"}
            if out.finished:
                assert o.text == full
            seen += 1
    assert seen == 240


def test_the_chat_template_is_compiled_once(byte_level, monkeypatch):
    """Compiling Qwen2.5's template took ~6.5 ms per chat request (GIL held); it is compiled once."""
    import jinja2.sandbox

    compiled = []
    from_string = jinja2.sandbox.ImmutableSandboxedEnvironment.from_string
    monkeypatch.setattr(
        jinja2.sandbox.ImmutableSandboxedEnvironment,
        "from_string",
        lambda env, source: compiled.append(source) or from_string(env, source),
    )
    byte_level._template = None
    messages = [{"role": "user", "content": "hi"}]
    first = byte_level.apply_chat_template(messages)
    assert byte_level.apply_chat_template(messages) == first and "hi" in first
    assert len(compiled) == 1


# ---- chat templates as transformers renders them (a review, 2026-12-04) ----------------------------------
def _template_dir(tmp_path, **config):
    """A small byte-level BPE tokenizer with `config` in its tokenizer_config.json."""
    import json

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>", "<|pad|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello world the quick brown fox"] * 50, trainer=trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    base = {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(base | config))
    return tmp_path


def _ours_and_hf(path, tools=None) -> tuple[str, str]:
    import transformers

    messages = [{"role": "user", "content": "hello"}]
    hf = transformers.AutoTokenizer.from_pretrained(str(path))
    ref = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return Tokenizer(path).apply_chat_template(messages, tools=tools), ref


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(
    ("config", "jinja_file", "tools"),
    [
        # Llama 3.2's templates write today's date with strftime_now (a fixed 26 Jul 2024 without it)
        (
            {
                "chat_template": '{%- if strftime_now is defined %}{%- set d = strftime_now("%d %b %Y") %}'
                '{%- else %}{%- set d = "26 Jul 2024" %}{%- endif %}Today Date: {{ d }}'
            },
            None,
            None,
        ),
        ({"chat_template": "OLD"}, "NEW", None),  # chat_template.jinja wins (it lost to the config's)
        # training templates' {% generation %} tag (it did not compile: every chat request a 400)
        ({"chat_template": "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"}, None, None),
        # named templates: "tool_use" with tools (Hermes-2-Pro's), "default" without
        ({"chat_template": [{"name": "default", "template": "DEFAULT"}, {"name": "tool_use", "template": "TOOLS"}]}, None, [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ({"chat_template": [{"name": "default", "template": "DEFAULT"}, {"name": "tool_use", "template": "TOOLS"}]}, None, None),
        # tojson's json.dumps options, and the other special tokens (pad_token, ...)
        ({"chat_template": "{{ messages | tojson(sort_keys=True, separators=(',', ':')) }}[{{ pad_token }}]", "pad_token": "<|pad|>"}, None, None),
    ],
    ids=["strftime_now", "jinja_file_wins", "generation_tag", "tool_use", "default_without_tools", "tojson_and_pad"],
)  # fmt: skip
def test_chat_templates_render_as_transformers_renders_them(tmp_path, config, jinja_file, tools):
    path = _template_dir(tmp_path, **config)
    if jinja_file is not None:
        (path / "chat_template.jinja").write_text(jinja_file)
    ours, ref = _ours_and_hf(path, tools)
    assert ours == ref
