"""Sampling, stop conditions, logprobs and request validation through the offline API."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.llm_engine import InvalidRequest
from pdserve.model.sampler import _truncated_probs


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM(demo_model_dir, page_size=16, dtype="float32", num_pages=256, max_model_len=512)


PROMPT = "def parse_args(argv):\n    parser = argparse.ArgumentParser("


def gen(llm, prompt=PROMPT, **kw):
    return llm.generate(prompt, SamplingParams(**kw))[0].outputs[0]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    alone = gen(llm, temperature=1.0, seed=7, max_tokens=24).token_ids
    assert gen(llm, temperature=1.0, seed=7, max_tokens=24).token_ids == alone
    batch = llm.generate(
        ["other prompt", PROMPT, "x = 1"],
        [
            SamplingParams(temperature=1.0, max_tokens=24),
            SamplingParams(temperature=1.0, seed=7, max_tokens=24),
            SamplingParams(temperature=0.7, seed=1, max_tokens=5),
        ],
    )
    assert batch[1].outputs[0].token_ids == alone
    assert gen(llm, temperature=1.0, seed=8, max_tokens=24).token_ids != alone


def test_truncation_that_keeps_one_token_equals_greedy(llm):
    greedy = gen(llm, temperature=0, max_tokens=16).token_ids
    assert gen(llm, temperature=1.0, top_k=1, seed=3, max_tokens=16).token_ids == greedy
    assert gen(llm, temperature=1.0, top_p=1e-6, seed=3, max_tokens=16).token_ids == greedy
    assert gen(llm, temperature=1.0, min_p=1.0, seed=3, max_tokens=16).token_ids == greedy


def test_truncated_probs_exact():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]] * 4)
    params = [
        SamplingParams(top_k=2),
        SamplingParams(top_p=0.8),
        SamplingParams(min_p=0.5),
        SamplingParams(temperature=0.5),
    ]
    probs = _truncated_probs(logits, params)
    full = logits[0].softmax(-1)
    assert (probs[0] > 0).tolist() == [True, True, False, False, False]
    torch.testing.assert_close(probs[0, :2], full[:2] / full[:2].sum())
    # top_p 0.8: cumulative mass before token i: 0, .55, .75, .89 -> keep the first three.
    assert (probs[1] > 0).tolist() == [True, True, True, False, False]
    # min_p 0.5: keep tokens with p >= 0.5 * p_max: only exp(-1) = .37 < .5 fails for token 1.
    assert (probs[2] > 0).tolist() == [True, False, False, False, False]
    torch.testing.assert_close(probs[3], (logits[0] / 0.5).softmax(-1))
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))


def test_truncation_follows_vllm_order_ties_and_leaves_other_rows_alone():
    """vLLM v1: min-p before top-k/top-p, top-k keeps ties with the k-th logit; and a row that asks
    for no truncation is bit-identical whatever its neighbours ask for (seeded sampling)."""
    # p = [0.40, 0.30, 30 x 0.01]: min_p 0.1 first leaves tokens 0 and 1, then top_p 0.5 only token 0.
    # (top-p first kept 0 and 1, then min-p kept both: 0.57 / 0.43.)
    logits = torch.tensor([[0.40, 0.30] + [0.01] * 30]).log()
    probs = _truncated_probs(logits, [SamplingParams(top_p=0.5, min_p=0.1)])
    assert probs[0, 0] == 1.0 and probs[0, 1:].sum() == 0
    # Ties: logits [3, 2, 2, 2, 1, 0], top_k 2 keeps 3 and every 2.
    probs = _truncated_probs(torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]]), [SamplingParams(top_k=2)])
    assert (probs[0] > 0).tolist() == [True, True, True, True, False, False]
    torch.testing.assert_close(probs[0, 1], probs[0, 3])
    # A full-vocabulary row of sharp logits (float32 sums pass 1.0) next to truncating rows.
    gen = torch.Generator().manual_seed(0)
    row = torch.randn(1, 151_936, generator=gen) * 4
    alone = _truncated_probs(row, [SamplingParams()])
    mixed = _truncated_probs(
        torch.cat([row, row, row]), [SamplingParams(top_k=5), SamplingParams(), SamplingParams(top_p=0.9)]
    )
    assert torch.equal(mixed[1], alone[0]) and bool((alone[0] > 0).all())


def test_stop_token_ids_and_max_tokens(llm):
    greedy = gen(llm, temperature=0, max_tokens=16)
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 16
    stop_tok = greedy.token_ids[5]
    first = greedy.token_ids.index(stop_tok)
    out = gen(llm, temperature=0, max_tokens=16, stop_token_ids=[stop_tok])
    assert out.token_ids == greedy.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok


def test_a_stop_tokens_text_is_left_out_unless_asked_for(llm):
    greedy = gen(llm, temperature=0, max_tokens=16)
    stop_tok = greedy.token_ids[4]
    first = greedy.token_ids.index(stop_tok)
    tok = llm.get_tokenizer()
    out = gen(llm, temperature=0, max_tokens=16, stop_token_ids=[stop_tok])
    assert out.token_ids[-1] == stop_tok and out.text == tok.decode(greedy.token_ids[:first])
    kept = gen(llm, temperature=0, max_tokens=16, stop_token_ids=[stop_tok], include_stop_str_in_output=True)
    assert kept.text == tok.decode(greedy.token_ids[: first + 1])
    assert kept.text != out.text


def test_stop_strings_truncate_text(llm):
    greedy = gen(llm, temperature=0, max_tokens=24)
    text = greedy.text
    stop = text[10:14]
    assert stop and text.find(stop) >= 0
    out = gen(llm, temperature=0, max_tokens=24, stop=[stop])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.find(stop)]
    kept = gen(llm, temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == text[: text.find(stop) + len(stop)]
    assert len(out.token_ids) < 24


def test_a_stop_string_early_in_a_long_token_is_found(llm):
    """One token can add many characters (runs of dashes, newline + indentation). The stop check used
    to look only at the last len(stop) + 16 characters, so a stop string starting early in a long token
    was never found and the request ran to max_tokens."""
    engine = llm.engine
    tok = engine.tokenizer

    def unique_head(text: str) -> str:  # the shortest prefix found nowhere else in the text
        return next(text[:k] for k in range(1, len(text) + 1) if text.find(text[:k], 1) < 0)

    # A token whose text is long and starts with a short string it never repeats.
    texts = {t: s for t in range(engine.config.model_config.vocab_size) if (s := tok.decode([t]))}
    long_id = max(texts, key=lambda t: len(texts[t]) - len(unique_head(texts[t])))
    stop = unique_head(texts[long_id])
    assert len(texts[long_id]) - len(stop) > 16 + len(stop), texts[long_id]  # beyond the old window
    req = engine.make_request({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=50, stop=[stop]))
    req.append_output(long_id)  # the stop string starts at the token's first character, only there
    assert engine.check_stop(req) is not None and req.stop_reason == stop


def test_logprobs_beyond_the_vocabulary_and_stop_strings_without_a_tokenizer_are_refused(tmp_path):
    """Both used to be accepted: the first crashed the engine step (topk past the vocabulary), the
    second ran to max_tokens with its stop strings silently ignored."""
    from tests.conftest import tiny_hf_model

    tiny_hf_model("llama", vocab_size=16).save_pretrained(tmp_path)  # no tokenizer, 16 tokens
    engine = LLM(str(tmp_path), dtype="float32", num_pages=16, max_model_len=64).engine
    with pytest.raises(InvalidRequest, match="vocabulary of 16"):
        engine.make_request([5, 6], SamplingParams(logprobs=17))
    assert engine.make_request([5, 6], SamplingParams(logprobs=16)).sampling_params.logprobs == 16
    with pytest.raises(InvalidRequest, match="prompt_logprobs=17 exceeds the vocabulary of 16"):
        engine.make_request([5, 6], SamplingParams(prompt_logprobs=17))  # (it crashed the step too)
    with pytest.raises(InvalidRequest, match="tokenizer"):
        engine.make_request([5, 6], SamplingParams(stop=["\n"]))
    assert engine.make_request([5, 6], SamplingParams(stop_token_ids=[3])).sampling_params.stop_token_ids == [
        3
    ]
    assert not engine.requests  # nothing was queued


def test_eos_and_ignore_eos(llm):
    greedy = gen(llm, temperature=0, max_tokens=16)
    eos = greedy.token_ids[3]
    engine = llm.engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = (eos,)
    try:
        stopped = gen(llm, temperature=0, max_tokens=16)
        assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == eos
        assert len(stopped.token_ids) == greedy.token_ids.index(eos) + 1
        assert gen(llm, temperature=0, max_tokens=16, ignore_eos=True).token_ids == greedy.token_ids
    finally:
        engine.eos_token_ids = saved


def test_logprobs_chosen_and_top_n(llm):
    out = gen(llm, temperature=0, max_tokens=4, logprobs=20)
    assert len(out.logprobs) == 4
    for lp, tok in zip(out.logprobs, out.token_ids, strict=True):
        assert lp.token_id == tok and len(lp.top) == 20
        assert lp.top[0][0] == tok and lp.logprob == pytest.approx(lp.top[0][1])
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    sampled = gen(llm, temperature=1.0, seed=0, max_tokens=8, logprobs=0)
    assert all(lp.top == [] and lp.logprob <= 0 for lp in sampled.logprobs)
    assert gen(llm, temperature=0, max_tokens=2).logprobs is None


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_k=-2),
        dict(min_p=2),
        dict(max_tokens=0),
        dict(logprobs=21),
        dict(stop=[""]),
        dict(stop_token_ids=[-1]),
        dict(stop=["a"] * 1025),
        dict(stop_token_ids=[1] * 1025),
    ],
)
def test_invalid_sampling_params_raise(kwargs):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert len(str(e.value)) < 300  # (a huge value is not repeated in full in the message)


def test_the_stop_lists_bounds_are_inclusive_and_a_long_bad_list_is_cut_in_the_message():
    SamplingParams(stop=["a"] * 1024, stop_token_ids=list(range(1024)))
    with pytest.raises(ValueError, match=r"bad stop_token_ids, got \[-1, -1, .*\.\.\. \(4000 chars\)"):
        SamplingParams(stop_token_ids=[-1] * 1000)


def test_bad_requests_change_no_state(llm):
    engine = llm.engine
    before = (engine.kv.pool.num_free_pages, engine.kv.pool.num_cached_pages, len(engine.requests))
    with pytest.raises(InvalidRequest, match="maximum context length"):
        llm.generate({"prompt_token_ids": [1] * 600})
    with pytest.raises(InvalidRequest, match="too large: 100"):  # (a max_tokens alone is capped offline)
        llm.generate({"prompt_token_ids": [1] * 500}, SamplingParams(max_tokens=100, min_tokens=50))
    with pytest.raises(InvalidRequest, match="empty"):
        llm.generate("")
    with pytest.raises(InvalidRequest, match="token ids"):
        llm.generate({"prompt_token_ids": [1, 10**9]})
    # One bad prompt in a batch: nothing of the batch is queued.
    with pytest.raises(InvalidRequest):
        llm.generate(["fine", {"prompt_token_ids": [1] * 600}])
    assert (engine.kv.pool.num_free_pages, engine.kv.pool.num_cached_pages, len(engine.requests)) == before
    assert not engine.has_unfinished()
    engine.check_integrity()


@pytest.mark.parametrize("num_prompt, max_tokens", [(7, 2), (8, 1)])
def test_a_request_whose_kv_fills_the_pool_exactly_runs(demo_model_dir, num_prompt, max_tokens):
    """The last token sampled is never computed, so a request holds prompt + max_tokens - 1 KV slots:
    7 + 2 (or 8 + 1) tokens fit 2 pages of 4. It was refused ("needs more KV pages than this engine
    has in total", found by a review of the KV managers) with max_model_len above the pool; now it
    runs, to the same greedy tokens as an engine with pages to spare; one token more is refused."""
    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    def greedy(num_pages: int, n: int) -> list[int]:
        config = EngineConfig.create(demo_model_dir, page_size=4, num_pages=num_pages, max_model_len=64)
        engine = LLMEngine(config)
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        engine.add(engine.make_request({"prompt_token_ids": list(range(5, 5 + num_prompt))}, params, "r"))
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        engine.check_integrity()
        assert engine.kv.pool.num_free_pages == num_pages
        return list(outs[-1].outputs[0].token_ids)

    assert greedy(2, max_tokens) == greedy(64, max_tokens)
    with pytest.raises(InvalidRequest, match="more KV pages"):
        greedy(2, max_tokens + 1)


def test_an_unset_max_tokens_is_the_context_left_or_the_apis_default_within_it(demo_model_dir):
    """max_tokens None: up to max_model_len; with `default_max_tokens` (an API's default, /generate's
    128): that, lowered to the room the prompt leaves, and the pool check uses the lowered value."""
    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    unset = SamplingParams(max_tokens=None)
    roomy = LLMEngine(EngineConfig.create(demo_model_dir, num_pages=64, page_size=16, max_model_len=512))
    assert roomy.make_request({"prompt_token_ids": [1] * 500}, unset).max_tokens == 12
    assert roomy.make_request({"prompt_token_ids": [1] * 10}, unset).max_tokens == 502
    assert roomy.make_request({"prompt_token_ids": [1] * 500}, unset, default_max_tokens=100).max_tokens == 12
    # 8 pages of 16 tokens: 128 tokens of KV, a quarter of the 512-token context.
    engine = LLMEngine(EngineConfig.create(demo_model_dir, num_pages=8, page_size=16, max_model_len=512))
    with pytest.raises(InvalidRequest, match="more KV pages"):
        engine.make_request({"prompt_token_ids": [1] * 10}, unset)  # (502 tokens would not fit)
    assert (
        engine.make_request({"prompt_token_ids": [1] * 10}, unset, default_max_tokens=100).max_tokens == 100
    )
    with pytest.raises(InvalidRequest, match="more KV pages"):
        engine.make_request({"prompt_token_ids": [1] * 10}, unset, default_max_tokens=200)
    # min_tokens past the room left is refused; past the default, it raises the default
    with pytest.raises(InvalidRequest, match=r"min_tokens \(13\) exceeds the 12 tokens"):
        roomy.make_request({"prompt_token_ids": [1] * 500}, SamplingParams(max_tokens=None, min_tokens=13))
    at_least = SamplingParams(max_tokens=None, min_tokens=150)
    assert (
        roomy.make_request({"prompt_token_ids": [1] * 10}, at_least, default_max_tokens=100).max_tokens == 150
    )
    given = SamplingParams(max_tokens=5)  # (a value the client set wins over the default)
    assert engine.make_request({"prompt_token_ids": [1] * 10}, given, default_max_tokens=100).max_tokens == 5


def test_outputs_in_input_order_with_per_prompt_params(llm):
    prompts = ["a" * n for n in (50, 3, 20)]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m) for m in (3, 9, 5)])
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 9, 5]


def _history(prompt_ids, output_ids=()):
    from types import SimpleNamespace

    return SimpleNamespace(
        prompt_token_ids=list(prompt_ids),
        output_token_ids=list(output_ids),
        eos_token_ids=(1,),
        prompt_unique_ids=None,
        grammar=None,
    )


def test_a_huge_temperature_is_a_uniform_draw_that_keeps_banned_tokens_out():
    """1e39 is finite for SamplingParams and inf in float32: -inf (a banned token: min_tokens' EOS, a
    grammar's mask) / inf was NaN, the whole row NaN, and the draw always token 0 (a review,
    2026-12-04). Now a near-uniform draw over the allowed tokens."""
    from pdserve.model.sampler import Sampler

    sampler = Sampler("cpu", 0)
    logits = torch.tensor([[1.0, 5.0, 2.0, 0.5, 0.0, 0.0]])
    params = SamplingParams(temperature=1e39, min_tokens=1)  # bans EOS, id 1
    picks = {sampler(logits.clone(), [params], [None], [_history([2])]).token_ids[0] for _ in range(60)}
    assert 1 not in picks and len(picks) >= 3


def test_a_huge_repetition_penalty_keeps_the_argmax():
    """A seen token whose logit is exactly 0, times a penalty of 1e39 (inf in float32), was NaN, and
    greedy picked it."""
    from pdserve.model.sampler import Sampler

    sampler = Sampler("cpu", 0)
    logits = torch.tensor([[1.0, 5.0, 2.0, 0.0, -1.0, 0.5]])  # token 3, seen in the prompt, has logit 0
    params = SamplingParams(temperature=0, repetition_penalty=1e39)
    assert sampler(logits.clone(), [params], [None], [_history([3, 4])]).token_ids == [1]
