"""Output semantics a review found apart from vLLM v1 / OpenAI / SGLang, now matched: completions'
top_logprobs hold the sampled token, the tokenizer's EOS stops a model whose config names another,
prompt-logprob ranks count ties as vLLM does, /generate streams never show a partial character, and
min_tokens bans EOS also under ignore_eos, and a stop string completed right after min_tokens counts."""

from __future__ import annotations

import json
import shutil

import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.model.sampler import SampleResult
from pdserve.sampling_params import SamplingParams
from tests.conftest import post_in_process


class ScriptedIds:
    """A sampler that emits `ids` in order (the last one repeated), whatever the logits."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def __call__(self, logits, params, generators, histories=None) -> SampleResult:
        picks = [self.ids[min(len(h.output_token_ids), len(self.ids) - 1)] for h in histories]
        return SampleResult(picks, [None] * len(picks))


def make_engine(model_dir: str) -> LLMEngine:
    return LLMEngine(EngineConfig.create(model_dir, num_pages=64, max_model_len=512))


def run(engine: LLMEngine, prompt, params: SamplingParams, rid: str = "r"):
    engine.add(engine.make_request(prompt, params, rid))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def test_completion_top_logprobs_always_hold_the_sampled_token(demo_engine):
    """OpenAI legacy completions (and vLLM's _create_completion_logprobs): "the API will always return
    the logprob of the sampled token, so there may be up to logprobs+1 elements". With logprobs=0
    vLLM returns {sampled token: its logprob} per position; pdserve returns {}."""
    body = {"prompt": "def f(x):", "max_tokens": 3, "temperature": 0, "logprobs": 0}
    (r,) = post_in_process(demo_engine, [("/v1/completions", body)])
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    for tok, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert top == {tok: chosen}, (tok, chosen, top)


def test_the_tokenizers_eos_stops_even_when_the_config_names_another(demo_model_dir, tmp_path):
    """vLLM: the primary EOS is the tokenizer's eos_token_id (InputPreprocessor.get_eos_token_id ->
    SamplingParams.update_from_generation_config(generation_config, eos_token_id)), and the
    generation config's eos ids are added as stop tokens. pdserve takes generation_config/config.json
    ids only, and the tokenizer's only when those are empty: a fine-tune that changed its tokenizer's
    eos_token (a chat end marker) never stops on it."""
    d = tmp_path / "m"
    shutil.copytree(demo_model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "<|end|>"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    engine = make_engine(str(d))
    end = engine.tokenizer.token_id("<|end|>")
    assert engine.tokenizer.eos_token_id == end
    params = SamplingParams(temperature=0, max_tokens=6, logit_bias={end: 100.0})
    (*_, final) = run(engine, "def f(x):", params)
    o = final.outputs[0]
    assert (o.finish_reason, list(o.token_ids)) == ("stop", [end]), (o.finish_reason, list(o.token_ids))


def test_prompt_logprob_rank_counts_ties_like_vllm(demo_model_dir, monkeypatch):
    """vLLM v1 (v1/sample/ops/logprobs.py batched_count_greater_than): rank = number of tokens whose
    logprob is >= the token's. pdserve: 1 + number strictly greater. Equal with no tie; with ties
    (common with bf16 logits) pdserve reports a better rank. Here every logit is equal."""
    engine = make_engine(demo_model_dir)
    vocab = engine.config.model_config.vocab_size
    model = engine.runner.model
    real = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda h: torch.zeros_like(real(h)))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    (*_, final) = run(engine, "def f(x):", params)
    ranks = [e.rank for e in final.prompt_logprobs[1:]]
    assert ranks == [vocab] * len(ranks), ranks


def test_generate_stream_never_shows_a_partial_character(demo_engine):
    """SGLang's DetokenizerManager holds back text ending in U+FFFD while a request runs (only
    printable text is sent); pdserve's /generate stream chunks carry the replacement character
    of a character still being completed (the OpenAI routes strip it)."""
    tok = demo_engine.tokenizer
    a = tok.encode("a", False)[0]
    c3, a9 = tok.token_id("\u00c3"), tok.token_id("\u00a9")
    body = {
        "text": "def f(x):",
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    (r,) = post_in_process(demo_engine, [("/generate", body)], sampler=ScriptedIds([a, c3, a9, a]))
    texts = [json.loads(line[6:])["text"] for line in r.text.splitlines() if line.startswith("data: {")]
    assert texts[-1] == "a\u00e9a"
    assert not any("\ufffd" in t for t in texts), texts


def test_min_tokens_bans_eos_also_under_ignore_eos(demo_model_dir):
    """vLLM bans the model's EOS below min_tokens whatever ignore_eos says (its
    update_from_generation_config adds EOS to the stop ids "to support min_tokens processing");
    ignore_eos only keeps EOS from stopping the request. Here EOS is biased to win every step: it is
    banned for the first 3 tokens, then sampled and, under ignore_eos, generation goes on."""
    engine = make_engine(demo_model_dir)
    eos = engine.eos_token_ids[0]
    params = SamplingParams(
        temperature=0, max_tokens=5, min_tokens=3, ignore_eos=True, logit_bias={eos: 100.0}
    )
    (*_, final) = run(engine, "def f(x):", params)
    ids = list(final.outputs[0].token_ids)
    assert eos not in ids[:3] and ids[3:] == [eos, eos] and final.outputs[0].finish_reason == "length", ids


def test_a_stop_string_completed_right_after_min_tokens_is_found(demo_model_dir):
    """Tokens 'a', 0xC3, 0xA9 ('é' over two tokens), then 'b'...; min_tokens 2, stop ['é']. Token 3 is
    past min_tokens and completes 'é': vLLM stops there (text 'a'). The partial character's U+FFFD was
    counted as min_tokens text, so a match had to end after it and the request ran to max_tokens."""
    engine = make_engine(demo_model_dir)
    tok = engine.tokenizer
    a, b = tok.encode("a", False)[0], tok.encode("b", False)[0]
    c3, a9 = tok.token_id("\u00c3"), tok.token_id("\u00a9")  # byte-level BPE symbols of 0xC3, 0xA9
    assert tok.decode([c3, a9]) == "\u00e9"
    real = engine.runner.sampler
    engine.runner.sampler = ScriptedIds([a, c3, a9, b, b, b, b, b])
    try:
        params = SamplingParams(temperature=0, max_tokens=8, min_tokens=2, stop=["\u00e9"], ignore_eos=True)
        (*_, final) = run(engine, "def f(x):", params)
    finally:
        engine.runner.sampler = real
    o = final.outputs[0]
    assert (o.finish_reason, o.stop_reason, o.text) == ("stop", "\u00e9", "a"), (o.finish_reason, o.text)
    engine.runner.sampler = ScriptedIds([a, b, c3, a9, b])  # (within min_tokens, 'é' still does not stop)
    try:
        params = SamplingParams(temperature=0, max_tokens=5, min_tokens=4, stop=["\u00e9"], ignore_eos=True)
        (*_, final) = run(engine, "def f(x):", params, rid="r2")
    finally:
        engine.runner.sampler = real
    assert (final.outputs[0].finish_reason, final.outputs[0].text) == ("length", "ab\u00e9b")
