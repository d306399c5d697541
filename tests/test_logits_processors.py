"""min_tokens, logit_bias and the presence / frequency / repetition penalties.

Exact values on hand-made logits, then greedy decoding of a real checkpoint against two references:
Hugging Face's own logits processors (repetition penalty, sequence bias, min new tokens) and a plain
per-step loop over the HF model that applies vLLM's formulas token by token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.llm_engine import InvalidRequest
from pdserve.model import logits_processors
from pdserve.model.sampler import Sampler
from tests.conftest import tiny_hf_model

INF = float("inf")


@dataclass
class History:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...] = ()
    prompt_unique_ids: np.ndarray | None = None


def row(*values: float) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = row(2.0, -1.0, 3.0, -4.0, 0.5)
    h = History([0, 1, 1], [3])  # seen: 0, 1 (prompt), 3 (output)
    out = logits_processors.apply(logits, [SamplingParams(repetition_penalty=2.0)], [h])
    assert out.tolist() == [[1.0, -2.0, 3.0, -8.0, 0.5]]
    assert out is logits  # in place (the sampler took its raw logprobs before)
    assert h.prompt_unique_ids.tolist() == [0, 1]  # cached once per request


def test_a_tiny_repetition_penalty_gives_the_largest_float_not_infinity():
    """5e-324 (found by the HTTP fuzzing): 2.0 / r overflows; +inf would make softmax NaN and the
    sampler pick token 0 whatever it was (under a grammar, a token the grammar forbids)."""
    logits = row(2.0, -1.0, -INF, 0.5)
    out = logits_processors.apply(
        logits, [SamplingParams(repetition_penalty=5e-324)], [History([0, 1, 2], [])]
    )
    tiny = torch.finfo(torch.float32).tiny  # (r is held at the smallest normal float)
    assert out.tolist() == [[torch.tensor(2.0 / tiny).item(), torch.tensor(-tiny).item(), -INF, 0.5]]
    assert torch.isfinite(out[0, :2]).all()
    probs = Sampler("cpu", 0)(out, [SamplingParams(temperature=1.0)], [None])
    assert probs.token_ids == [0]


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = row(1.0, 1.0, 1.0, 1.0)
    h = History([0, 0, 0], [1, 1, 1, 2])  # prompt token 0 is not penalised
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = logits_processors.apply(logits.clone(), [p], [h])
    assert out.tolist() == [[1.0, 1.0 - 1.5 - 0.25, 1.0 - 0.5 - 0.25, 1.0]]
    neg = logits_processors.apply(logits.clone(), [SamplingParams(frequency_penalty=-1.0)], [h])
    assert neg.tolist() == [[1.0, 4.0, 2.0, 1.0]]  # negative values encourage repetition


def test_min_tokens_bans_stop_tokens_until_reached_then_bias_adds():
    logits = row(0.0, 1.0, 2.0, 3.0, 4.0)
    p = SamplingParams(min_tokens=2, stop_token_ids=[4, 99], logit_bias={"1": 10, 0: -1.5})
    short = History([0], [2], eos_token_ids=(3,))
    out = logits_processors.apply(logits.clone(), [p], [short])
    assert out.tolist() == [[-1.5, 11.0, 2.0, -INF, -INF]]  # id 99 is outside the vocabulary: skipped
    done = History([0], [2, 2], eos_token_ids=(3,))
    assert logits_processors.apply(logits.clone(), [p], [done]).tolist() == [[-1.5, 11.0, 2.0, 3.0, 4.0]]
    ignore_eos = History([0], [], eos_token_ids=())  # LLMEngine gives no EOS ids under ignore_eos
    assert logits_processors.apply(logits.clone(), [p], [ignore_eos]).tolist() == [
        [-1.5, 11.0, 2.0, 3.0, -INF]
    ]


def test_order_is_min_tokens_then_bias_then_penalties():
    # Bias before the repetition penalty: (1 + 3) / 2, not 1 / 2 + 3; then the frequency penalty.
    logits = row(1.0, 0.0)
    p = SamplingParams(logit_bias={0: 3}, repetition_penalty=2.0, frequency_penalty=1.0)
    out = logits_processors.apply(logits.clone(), [p], [History([], [0])])
    assert out.tolist() == [[(1.0 + 3.0) / 2.0 - 1.0, 0.0]]


def test_rows_are_independent_and_plain_rows_untouched():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    params = [
        SamplingParams(),
        SamplingParams(repetition_penalty=1.5, presence_penalty=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(frequency_penalty=2.0, min_tokens=3, stop_token_ids=[7]),
    ]
    hist = [History([1, 2], [3]), History([4, 5], [6, 6]), History([8], []), History([9], [10, 10])]
    out = logits_processors.apply(logits.clone(), params, hist)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    for i in (1, 3):  # each processed row equals that row processed alone
        alone = logits_processors.apply(logits[i : i + 1].clone(), [params[i]], [hist[i]])
        assert torch.equal(out[i], alone[0])
    assert out[3, 7] == -INF and out[3, 10] == logits[3, 10] - 4.0


def test_repetition_penalty_equals_hf_processor():
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 64, generator=g)
    ids = torch.randint(0, 64, (3, 20), generator=g)
    hf = RepetitionPenaltyLogitsProcessor(1.7)(ids, logits.clone())
    hist = [History(r[:12].tolist(), r[12:].tolist()) for r in ids]
    ours = logits_processors.apply(logits.clone(), [SamplingParams(repetition_penalty=1.7)] * 3, hist)
    torch.testing.assert_close(ours, hf, rtol=0, atol=0)


def test_sampler_needs_histories_and_keeps_raw_logprobs():
    sampler = Sampler("cpu", 0)
    logits = row(5.0, 4.0, 0.0)
    p = SamplingParams(temperature=0, logit_bias={2: 10}, logprobs=1)
    with pytest.raises(ValueError, match="histories"):
        sampler(logits, [p], [None])
    raw = torch.log_softmax(logits, dim=-1)[0]
    res = sampler(logits.clone(), [p], [None], [History([0], [])])
    assert res.token_ids == [2]  # greedy over the processed logits
    chosen, top, rank = res.logprobs[0]
    assert chosen == pytest.approx(raw[2].item()) and top == [(0, pytest.approx(raw[0].item()))]
    assert rank == 3  # (of the raw logprobs: the least likely of the three)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-3),
        dict(frequency_penalty=math.nan),
        dict(repetition_penalty=0),
        dict(repetition_penalty=math.inf),
        dict(repetition_penalty=-1.0),
        dict(min_tokens=None),
        dict(min_tokens=1.5),
        dict(logit_bias={"\u00b2": 1}),  # a digit to str.isdigit, not to int()
        dict(min_tokens=-1),
        dict(min_tokens=5, max_tokens=4),
        dict(logit_bias={"a": 1}),
        dict(logit_bias={"-1": 1}),
        dict(logit_bias={1: 101}),
        dict(logit_bias={1: True}),
        dict(logit_bias=[1, 2]),
    ],
)
def test_invalid_values_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


# ---- greedy decoding of a real checkpoint against references ------------------------------------
MAX_NEW = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf = tiny_hf_model("llama", seed=3)
    hf.save_pretrained(path)
    llm = LLM(
        str(path), page_size=4, dtype="float32", num_pages=300, max_num_batched_tokens=32, max_model_len=256
    )
    return llm, hf.eval()


def ours(llm, prompts: list[list[int]], **kw) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, **kw))
    return [o.outputs[0].token_ids for o in outs]


def prompts(seed: int, lengths=(5, 17, 40)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def hf_generate(hf, prompt: list[int], **kw) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, **kw)
    return out[0, len(prompt) :].tolist()


def reference_loop(hf, prompt: list[int], p: SamplingParams, eos: tuple[int, ...] = ()) -> list[int]:
    """Greedy decoding with vLLM's formulas written out token by token (no tensors shared with ours)."""
    out: list[int] = []
    while len(out) < MAX_NEW:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].double().tolist()
        if len(out) < p.min_tokens:
            for t in (*eos, *p.stop_token_ids):
                logits[t] = -math.inf
        for t, b in p.logit_bias.items():
            logits[t] += b
        for t in set(prompt) | set(out):
            logits[t] = (
                logits[t] / p.repetition_penalty if logits[t] > 0 else logits[t] * p.repetition_penalty
            )
        for t in set(out):
            logits[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
        out.append(max(range(len(logits)), key=logits.__getitem__))
        if out[-1] in eos or out[-1] in p.stop_token_ids:
            break
    return out


def test_greedy_with_hf_repetition_penalty_and_sequence_bias(checkpoint):
    llm, hf = checkpoint
    ps = prompts(1)
    for p, got in zip(ps, ours(llm, ps, max_tokens=MAX_NEW, repetition_penalty=1.3), strict=True):
        assert got == hf_generate(hf, p, repetition_penalty=1.3, eos_token_id=None)
    plain = ours(llm, ps, max_tokens=MAX_NEW)
    tok = plain[0][2]  # a token greedy picks: pushed down it must disappear, pushed up it must win
    down = ours(llm, ps, max_tokens=MAX_NEW, logit_bias={tok: -100})
    up = ours(llm, ps, max_tokens=MAX_NEW, logit_bias={tok: 100})
    for p, d, u in zip(ps, down, up, strict=True):
        assert tok not in d and u == [tok] * MAX_NEW
        assert d == hf_generate(hf, p, sequence_bias={(tok,): -100.0}, eos_token_id=None)
    llm.engine.check_integrity()


def test_greedy_min_tokens_matches_hf_min_new_tokens(checkpoint):
    llm, hf = checkpoint
    ps = prompts(2)
    plain = ours(llm, ps, max_tokens=MAX_NEW)
    eos = plain[0][1]  # treat greedy's second token as EOS: without min_tokens it stops at once
    engine = llm.engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = (eos,)
    try:
        stopped = ours(llm, ps[:1], max_tokens=MAX_NEW)[0]
        assert stopped == plain[0][:2]
        for p, got in zip(ps, ours(llm, ps, max_tokens=MAX_NEW, min_tokens=6), strict=True):
            ref = hf_generate(hf, p, min_new_tokens=6, eos_token_id=eos, pad_token_id=0)
            if eos in ref:  # HF pads after EOS; we stop
                ref = ref[: ref.index(eos) + 1]
            assert got == ref
            assert len(got) >= 6 and eos not in got[:5]
            assert got == reference_loop(hf, p, SamplingParams(min_tokens=6, max_tokens=MAX_NEW), (eos,))
    finally:
        engine.eos_token_ids = saved


def test_greedy_penalties_match_reference_loop_with_chunking_and_prefix_hits(checkpoint):
    llm, hf = checkpoint
    first = prompts(3)
    second = [first[2] + [7, 8, 9], first[1] + first[0]]  # prefix-cache hits
    p = SamplingParams(
        temperature=0, max_tokens=MAX_NEW, frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.2
    )
    for batch in (first, second):
        outs = llm.generate([{"prompt_token_ids": x} for x in batch], p)
        for prompt, o in zip(batch, outs, strict=True):
            assert o.outputs[0].token_ids == reference_loop(hf, prompt, p)
    # The penalty changes what greedy picks (else this test would prove nothing).
    assert ours(llm, first, max_tokens=MAX_NEW) != [o for o in ours(llm, first, **_kw(p))]
    assert llm.engine.kv.pool.num_used_pages == 0


def _kw(p: SamplingParams) -> dict:
    return dict(
        max_tokens=p.max_tokens,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        repetition_penalty=p.repetition_penalty,
    )


@pytest.fixture(scope="module")
def demo_llm(demo_model_dir):
    return LLM(demo_model_dir, page_size=16, dtype="float32", num_pages=128, max_model_len=256)


@pytest.mark.parametrize("min_tokens", [0, 1, 2, 3, 12])
def test_stop_strings_do_not_match_inside_the_min_tokens_text(demo_llm, min_tokens):
    llm = demo_llm
    prompt = "def parse_args(argv):\n    parser = argparse.ArgumentParser("
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    text = greedy.text
    stop = text[1:3]  # a stop string that occurs at once
    got = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop], min_tokens=min_tokens)
    )
    o = got[0].outputs[0]
    assert len(o.token_ids) >= min_tokens
    # Cut at the first match that ends after the first min_tokens tokens' text, or not cut at all.
    min_chars = len(llm.engine.tokenizer.decode(greedy.token_ids[:min_tokens], True))
    at = text.find(stop, max(0, min_chars - len(stop) + 1))
    if min_tokens == 0:
        assert at == 1
    if at >= 0:
        assert o.finish_reason == "stop" and o.text == text[:at]
    else:
        assert o.finish_reason == "length" and o.text == text


def test_out_of_vocabulary_bias_is_refused_and_changes_no_state(checkpoint):
    llm, _ = checkpoint
    engine = llm.engine
    before = (engine.kv.pool.num_free_pages, len(engine.requests))
    vocab = engine.config.model_config.vocab_size
    with pytest.raises(InvalidRequest, match="logit_bias"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(logit_bias={vocab: 1.0}))
    assert (engine.kv.pool.num_free_pages, len(engine.requests)) == before
    assert not engine.has_unfinished()
