"""Text of SentencePiece (Llama-2 / Mistral-style) models as vLLM gives it (found by a review of the
detokenization against vLLM v1, 2026-12-02; each test failed before its fix): the first output
token's leading space, stop strings inside runs of byte-fallback tokens, and vLLM request fields
that change the prompt are refused rather than ignored.

A Llama-2-style tokenizer is built here (tokenizers' BPE with byte_fallback, the normalizer
Prepend("▁") + Replace(" ", "▁"), the decoder Replace/ByteFallback/Fuse/Strip(" ", 1, 0): exactly the
layout of meta-llama/Llama-2-7b-hf's and mistralai/Mistral-7B-v0.1's tokenizer.json) and put beside
the demo model's weights; a scripted sampler emits chosen token ids.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.model.sampler import SampleResult
from pdserve.sampling_params import SamplingParams
from tests.conftest import post_in_process


class ScriptedIds:
    """A sampler that emits `ids` in order (the last one repeated), whatever the logits; with real
    log-softmax logprobs for rows that asked for them."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def __call__(self, logits, params, generators, histories=None) -> SampleResult:
        picks = [self.ids[min(len(h.output_token_ids), len(self.ids) - 1)] for h in histories]
        lp = torch.log_softmax(logits.float(), -1)
        out = []
        for i, p in enumerate(params):
            if p.logprobs is None:
                out.append(None)
                continue
            v, t = lp[i].topk(max(p.logprobs, 1))
            out.append(
                (
                    lp[i, picks[i]].item(),
                    list(zip(t[: p.logprobs].tolist(), v[: p.logprobs].tolist(), strict=True)),
                )
            )
        return SampleResult(picks, out)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> str:
    from pdserve.model.demo import make_demo_model

    return str(make_demo_model(tmp_path_factory.mktemp("demo")))


@pytest.fixture(scope="module")
def llama2_dir(demo_dir, tmp_path_factory) -> str:
    """The demo weights with a Llama-2-style SentencePiece (byte-fallback, Metaspace-like) tokenizer."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    from pdserve.model.demo import corpus_lines

    d = tmp_path_factory.mktemp("llama2tok")
    shutil.copytree(demo_dir, d, dirs_exist_ok=True)
    tok = HFTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    # (trained on words that begin with '▁', as SentencePiece's pieces do: '▁world'; Llama 2's
    # tokenizer.json has no pre-tokenizer, so none is kept)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("▁"), behavior="merged_with_next")
    tok.train_from_iterator(
        corpus_lines()[:2000] + ["The capital of France is Paris."],
        trainers.BpeTrainer(vocab_size=1200, special_tokens=special),
    )
    tok.pre_tokenizer = None
    tok.save(str(d / "tokenizer.json"))
    # As in Llama 2: <0x00>..<0xFF> are ordinary vocabulary entries, not added (special) tokens.
    j = json.loads((d / "tokenizer.json").read_text())
    j["added_tokens"] = [a for a in j["added_tokens"] if not a["content"].startswith("<0x")]
    (d / "tokenizer.json").write_text(json.dumps(j))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg |= {"bos_token": "<s>", "eos_token": "</s>"}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(d)


def make_engine(model_dir: str) -> LLMEngine:
    return LLMEngine(EngineConfig.create(model_dir, num_pages=64, max_model_len=512))


def run(engine: LLMEngine, prompt, params: SamplingParams, ids: list[int]):
    real = engine.runner.sampler
    engine.runner.sampler = ScriptedIds(ids)
    try:
        engine.add(engine.make_request(prompt, params, "r"))
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        return outs
    finally:
        engine.runner.sampler = real


def sse(r) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


EMOJI = "😀😁😂🤣😃😄😅🚀😆😉🙂🙃"  # no emoji is in the vocabulary: 4 byte-fallback tokens each


def byte_tokens(tok, text: str) -> list[int]:
    """`text` as byte-fallback tokens <0xNN>, one per UTF-8 byte (how such a model writes emoji)."""
    return [tok.token_id(f"<0x{b:02X}>") for b in text.encode()]


def test_stop_string_inside_a_long_byte_fallback_run_stops_the_request(llama2_dir):
    """vLLM v1: the detokenizer emits each character once complete and checks the new characters for
    stop strings at every step, so the request stops on the token that completes '🚀' (text: the 7
    emoji before it). pdserve: while a byte-fallback run is open the ByteFallback decoder renders the
    whole run as one U+FFFD per byte (4x the characters), `num_stop_checked_chars` records that
    inflated length, and once the run is valid again the next search starts (len - len(stop) - 16)
    chars in -- past the new character. A stop string in a run of >= 6 four-byte characters is never
    searched while the run lasts: here the request runs to max_tokens and returns the stop string."""
    engine = make_engine(llama2_dir)
    tok = engine.tokenizer
    ids = byte_tokens(tok, EMOJI)
    assert tok.encode(EMOJI, add_special_tokens=False)[1:] == ids and tok.decode(ids) == EMOJI
    stop_at = 4 * 7  # (the 4 tokens of the 8th emoji, '🚀', start here)
    params = SamplingParams(temperature=0, max_tokens=len(ids), stop=["🚀"], ignore_eos=True)
    *_, final = run(engine, "def f", params, ids)
    o = final.outputs[0]
    assert (o.finish_reason, o.stop_reason, o.text) == ("stop", "🚀", EMOJI[:7]), (o.finish_reason, o.text)
    assert len(o.token_ids) == stop_at + 4  # stopped on the token that completed '🚀'


def test_stream_never_shows_the_stop_string_of_a_byte_fallback_run(llama2_dir):
    """Same cause, through the API: the stream shows '🚀' and the emoji after it (the hold-back is
    max(len(stop)) - 1 = 0 chars: a stop found at once needs none), then the final non-streamed text
    is cut before '🚀'; stream and non-stream disagree. vLLM streams exactly the final text."""
    engine = make_engine(llama2_dir)
    tok = engine.tokenizer
    ids = byte_tokens(tok, EMOJI) + tok.encode("x", add_special_tokens=False)
    body = {"prompt": "def f", "max_tokens": len(ids), "temperature": 0, "ignore_eos": True, "stop": ["🚀"]}
    r1, r2 = post_in_process(
        engine,
        [("/v1/completions", body), ("/v1/completions", body | {"stream": True})],
        sampler=ScriptedIds(ids),
    )
    final = r1.json()["choices"][0]["text"]
    streamed = "".join(c["choices"][0]["text"] for c in sse(r2) if c.get("choices"))
    assert "🚀" not in streamed and streamed == final, (streamed, final)


def test_completion_text_keeps_the_leading_space_of_its_first_token(llama2_dir):
    """Llama 2 / Mistral tokenizers (Strip(" ", 1, 0) decoder, or Metaspace prepend_scheme 'first'):
    the leading space of a sequence's first piece is dropped by decode. vLLM v1 primes its
    DecodeStream with the prompt's ids (FastIncrementalDetokenizer; the slow path starts from the
    prompt's last tokens), so '▁Paris' after a prompt reads ' Paris', as HF's
    decode(prompt + output) minus decode(prompt) does. pdserve decodes the output ids alone
    (IncrementalDetokenizer / LLMEngine._text), so every completion of such a model loses its first
    space: prompt + text = 'The capital of France isParis.' (echo shows exactly that)."""
    from transformers import PreTrainedTokenizerFast

    engine = make_engine(llama2_dir)
    tok = engine.tokenizer
    prompt = "The capital of France is"
    out = tok.encode("Paris. It is", add_special_tokens=False)  # '▁', 'Par', ... (as a model writes)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(Path(llama2_dir) / "tokenizer.json"))
    pids = tok.encode(prompt)
    expected = hf.decode(pids + out, skip_special_tokens=True)[
        len(hf.decode(pids, skip_special_tokens=True)) :
    ]
    assert expected == " Paris. It is"
    body = {"prompt": prompt, "max_tokens": len(out), "temperature": 0, "ignore_eos": True}
    r1, r2, r3 = post_in_process(
        engine,
        [
            ("/v1/completions", body),
            ("/v1/completions", body | {"stream": True}),
            ("/v1/completions", body | {"echo": True}),
        ],
        sampler=ScriptedIds(out),
    )
    streamed = "".join(c["choices"][0]["text"] for c in sse(r2) if c.get("choices"))
    got = (r1.json()["choices"][0]["text"], streamed, r3.json()["choices"][0]["text"])
    assert got == (expected, expected, prompt + expected), got


def test_logprob_token_strings_keep_their_pieces_leading_spaces(llama2_dir, demo_dir):
    """Each logprob token is decoded alone, and a SentencePiece decoder drops a sequence's first
    space: '▁is' read 'is', so the tokens of ' Paris. It is' joined to 'Paris.Itis'. vLLM puts the
    spaces of the piece back (its convert_ids_list_to_tokens); so do we, in completions' tokens and
    top_logprobs, chat's content and prompt_logprobs' decoded_token. A byte-level BPE vocabulary
    (the demo's) has no such marker and is decoded as before."""
    engine = make_engine(llama2_dir)
    tok = engine.tokenizer
    out = tok.encode("Paris. It is", add_special_tokens=False)
    assert tok.decode([out[-1]]) == "is" and tok.token_text(out[-1]) == " is"
    body = {
        "prompt": "The capital of France is",
        "max_tokens": len(out),
        "temperature": 0,
        "ignore_eos": True,
    }
    (r,) = post_in_process(
        engine,
        [("/v1/completions", body | {"logprobs": 1, "prompt_logprobs": 1})],
        sampler=ScriptedIds(out),
    )
    choice = r.json()["choices"][0]
    text = choice["text"]
    assert text == " Paris. It is"
    lps = choice["logprobs"]
    assert "".join(lps["tokens"]) == text
    assert all(t in top for t, top in zip(lps["tokens"], lps["top_logprobs"], strict=True))
    assert lps["text_offset"] == [sum(map(len, lps["tokens"][:i])) for i in range(len(out))]
    prompt_ids = tok.encode(body["prompt"])
    decoded = [
        e[str(t)]["decoded_token"] for t, e in zip(prompt_ids[1:], choice["prompt_logprobs"][1:], strict=True)
    ]
    assert "".join(decoded) == " capital of France is"
    byte_level = make_engine(demo_dir).tokenizer
    ids = byte_level.encode("def f(x): return x", add_special_tokens=False)
    assert [byte_level.token_text(t) for t in ids] == [byte_level.decode([t]) for t in ids]


@pytest.mark.parametrize(
    "route, field",
    [
        ("/v1/completions", {"add_special_tokens": False}),
        ("/v1/chat/completions", {"add_special_tokens": True}),
        ("/v1/chat/completions", {"continue_final_message": True, "add_generation_prompt": False}),
        ("/v1/completions", {"return_tokens_as_token_ids": True}),
    ],
)
def test_vllm_fields_that_change_the_prompt_or_tokens_are_refused_not_ignored(demo_dir, route, field):
    """Ignored, they gave a doubled BOS, a closed final message the model was to continue, or token
    text where ids were asked for; refused like every field this server does not implement."""
    engine = make_engine(demo_dir)
    if route == "/v1/completions":
        body = {"prompt": "hello there", "max_tokens": 1}
    else:
        body = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The"}]}
    (r,) = post_in_process(engine, [(route, body | field)])
    assert r.status_code == 400, r.text
    assert f"{next(iter(field))}=" in r.json()["error"]["message"]
