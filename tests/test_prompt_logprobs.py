"""prompt_logprobs (vLLM's extra parameter) and `echo` on completions: the log-probability of every
prompt token given the ones before it, as RL trainers (a reference policy's logprobs of a rollout) and
evaluation harnesses (lm-eval's loglikelihood through echo + logprobs) ask for them.

Checked against Hugging Face's own forward on a tiny checkpoint: values, ranks and top-k, through
chunked prefill, a prefix-cache hit that must not be taken, and preemption by recompute."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from pdserve import LLM, SamplingParams
from tests.conftest import post_in_process


def prompts_for(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """[T - 1, V]: row i is the distribution of token i + 1 given tokens 0..i."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)


def check_against_hf(entries, ref: torch.Tensor, prompt: list[int], k: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        e, row = entries[i], ref[i - 1]
        assert e.token_id == prompt[i]
        assert e.logprob == pytest.approx(row[prompt[i]].item(), abs=1e-4)
        assert e.rank == int((row > row[prompt[i]]).sum()) + 1
        top_ids = [t for t, _ in e.top]
        assert len(top_ids) == k
        if k:
            assert top_ids == row.topk(k).indices.tolist()
            torch.testing.assert_close(
                torch.tensor([v for _, v in e.top]), row[top_ids], rtol=1e-4, atol=1e-4
            )


@pytest.fixture(scope="module")
def llama(hf_checkpoints):
    return hf_checkpoints["llama"]


def test_prompt_logprobs_equal_hf_through_chunks_and_without_prefix_hits(llama):
    """A 16-token step budget cuts the 90-token prompt into chunks; the second request repeats the
    first prompt, whose pages are cached: it must compute them anyway (cached tokens have no logits)."""
    path, hf = llama
    llm = LLM(path, page_size=4, dtype="float32", num_pages=400, max_num_batched_tokens=16, max_model_len=512)
    prompts = prompts_for(0, (90, 7, 2))
    p = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=4)
    outs = llm.generate([{"prompt_token_ids": x} for x in prompts], p)
    for prompt, out in zip(prompts, outs, strict=True):
        check_against_hf(out.prompt_logprobs, hf_prompt_logprobs(hf, prompt), prompt, 4)
    again = llm.generate([{"prompt_token_ids": prompts[0]}], p)[0]
    assert again.num_cached_tokens == 0
    check_against_hf(again.prompt_logprobs, hf_prompt_logprobs(hf, prompts[0]), prompts[0], 4)
    plain = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=3))[0]
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None  # others still hit
    assert plain.outputs[0].token_ids == outs[0].outputs[0].token_ids
    zero = llm.generate([{"prompt_token_ids": prompts[1]}], SamplingParams(max_tokens=1, prompt_logprobs=0))[
        0
    ]
    check_against_hf(zero.prompt_logprobs, hf_prompt_logprobs(hf, prompts[1]), prompts[1], 0)


@pytest.mark.parametrize(("length", "budget"), [(300, 512), (64, 32), (1, 16)])
def test_slices_chunks_and_edges(llama, length, budget):
    """300 tokens in one step: two logits slices of 256 positions; 64 tokens in two chunks of 32, the
    second ending exactly at the prompt's end; a one-token prompt has nothing to score ([None])."""
    path, hf = llama
    llm = LLM(
        path, page_size=4, dtype="float32", num_pages=400, max_num_batched_tokens=budget, max_model_len=512
    )
    (prompt,) = prompts_for(length, (length,))
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2, prompt_logprobs=2))[0]
    if length == 1:
        assert out.prompt_logprobs == [None]
    else:
        check_against_hf(out.prompt_logprobs, hf_prompt_logprobs(hf, prompt), prompt, 2)


def test_preemption_recomputes_without_repeating_entries(llama):
    path, hf = llama
    llm = LLM(path, page_size=4, dtype="float32", num_pages=40, max_num_batched_tokens=64, max_model_len=256)
    prompts = prompts_for(5, (30, 41, 52, 35, 44))
    outs = llm.generate(
        [{"prompt_token_ids": x} for x in prompts],
        SamplingParams(temperature=0, max_tokens=30, prompt_logprobs=1),
    )
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        check_against_hf(out.prompt_logprobs, hf_prompt_logprobs(hf, prompt), prompt, 1)
    llm.engine.check_integrity()


def test_only_pages_whose_entries_exist_are_taken_from_the_cache(llama):
    """A first admission computes the whole prompt; re-admitted after a preemption, the request takes
    the cached pages whose tokens it already scored (page_size 4: 9 entries cover 2 pages)."""
    path, _ = llama
    llm = LLM(path, page_size=4, dtype="float32", num_pages=64, max_model_len=256)
    (prompt,) = prompts_for(9, (30,))
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1))  # caches its 7 full pages
    req = llm.engine.make_request(
        {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0)
    )
    sched = llm.engine.scheduler
    assert sched._prefix_hits(req) == ([], [])
    req.prompt_logprobs += [None] * 8  # (as if tokens 1..8 were scored before a preemption)
    assert len(sched._prefix_hits(req)[0]) == 2
    req.prompt_logprobs += [None] * 21  # all 30
    assert len(sched._prefix_hits(req)[0]) == 7 == len(llm.engine.kv.match_prefix(req)[0])


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_bad_prompt_logprobs_are_value_errors(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


# ---- HTTP ----------------------------------------------------------------------------------------
def post_all(engine, requests: list[tuple[str, dict]]) -> list[httpx.Response]:
    return post_in_process(engine, requests)


def test_completions_prompt_logprobs_and_echo_over_http(demo_engine):
    """vLLM's shapes: `prompt_logprobs` per choice, [None, {token id: {logprob, rank, decoded_token}},
    ...] holding the prompt's token and the top-k; `echo` puts the prompt before the completion, and
    with `logprobs` the prompt's tokens lead the logprobs (the first one None), as lm-eval reads them."""
    tok = demo_engine.tokenizer
    prompt = "def handler(request):\n    return request"
    ids = tok.encode(prompt)
    base = {"prompt": prompt, "max_tokens": 3, "temperature": 0}
    plain, with_plp, echo, echo_lp, streamed, chat = post_all(
        demo_engine,
        [
            ("/v1/completions", base | {"logprobs": 1}),
            ("/v1/completions", base | {"prompt_logprobs": 2}),
            ("/v1/completions", base | {"echo": True}),
            ("/v1/completions", base | {"echo": True, "logprobs": 2}),
            ("/v1/completions", base | {"echo": True, "logprobs": 2, "stream": True}),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 1},
            ),
        ],
    )
    for r in (plain, with_plp, echo, echo_lp, streamed, chat):
        assert r.status_code == 200, r.text
    token_texts = [tok.decode([t], skip_special_tokens=False) for t in ids]
    completion = plain.json()["choices"][0]["text"]
    plp = with_plp.json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        entry = plp[i]
        assert str(ids[i]) in entry and 2 <= len(entry) <= 3
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
        assert entry[str(ids[i])]["decoded_token"] == tok.decode([ids[i]])
    assert (
        "prompt_logprobs" not in plain.json()["choices"][0]
        or plain.json()["choices"][0]["prompt_logprobs"] is None
    )

    assert echo.json()["choices"][0]["text"] == prompt + completion
    lp = echo_lp.json()["choices"][0]["logprobs"]
    assert echo_lp.json()["choices"][0]["text"] == prompt + completion
    assert (
        len(lp["tokens"]) == len(ids) + 3
        and lp["token_logprobs"][0] is None
        and lp["top_logprobs"][0] is None
    )
    assert lp["token_logprobs"][1:] and all(isinstance(v, float) for v in lp["token_logprobs"][1:])
    # (approx: the plain request found the prompt cached, so it ran another kernel path)
    assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(
        [plp[i][str(ids[i])]["logprob"] for i in range(1, len(ids))], abs=1e-4
    )
    assert lp["token_logprobs"][len(ids) :] == pytest.approx(
        plain.json()["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4
    )
    # (offsets run over the tokens' own texts, the prompt's first, as vLLM counts them)
    assert lp["text_offset"][: len(ids) + 1] == [sum(map(len, token_texts[:i])) for i in range(len(ids) + 1)]
    assert lp["tokens"][: len(ids)] == token_texts
    chunks = [
        json.loads(line[6:])["choices"][0] for line in streamed.text.split("\n") if line.startswith("data: {")
    ]
    assert "".join(c["text"] for c in chunks) == prompt + completion
    streamed_lp = {k: sum((c["logprobs"][k] for c in chunks if c["logprobs"]), []) for k in lp}
    assert streamed_lp == lp
    n_chat = chat.json()["usage"]["prompt_tokens"]
    assert len(chat.json()["prompt_logprobs"]) == n_chat and chat.json()["prompt_logprobs"][0] is None


def test_echo_prompt_positions_carry_as_many_top_logprobs_as_the_completion(demo_engine):
    """`echo` with `logprobs` 1 and `prompt_logprobs` 4: the prompt's positions listed the top 4 (+ the
    token itself), the completion's the top 1. vLLM lists `logprobs` on both (a review, 2026-12-04)."""
    body = {"prompt": "hello world there", "max_tokens": 2, "temperature": 0, "echo": True}
    (r,) = post_all(demo_engine, [("/v1/completions", body | {"logprobs": 1, "prompt_logprobs": 4})])
    assert r.status_code == 200, r.text
    tops = r.json()["choices"][0]["logprobs"]["top_logprobs"]
    assert tops[0] is None and all(1 <= len(t) <= 2 for t in tops[1:]), tops  # (top 1 + the token)
    assert len(r.json()["choices"][0]["prompt_logprobs"][1]) >= 4  # (prompt_logprobs keeps its 4)


def test_echo_with_max_tokens_0_scores_the_prompt_alone(demo_engine):
    """OpenAI's and vLLM's scoring form (lm-eval's loglikelihood): echo + max_tokens 0 answers the
    prompt and its logprobs, nothing generated (the one token run to finish the prompt is dropped, and
    not counted); streamed, the same. max_tokens 0 without echo stays a 400."""
    tok = demo_engine.tokenizer
    prompt = "def handler(request):\n    return request"
    ids = tok.encode(prompt)
    base = {"prompt": prompt, "max_tokens": 0, "echo": True, "temperature": 0}
    before = demo_engine.kv.pool.num_free_pages
    scored, streamed, with_ids, plp, refused = post_all(
        demo_engine,
        [
            ("/v1/completions", base | {"logprobs": 2}),
            (
                "/v1/completions",
                base | {"logprobs": 2, "stream": True, "stream_options": {"include_usage": True}},
            ),
            ("/v1/completions", base | {"return_token_ids": True}),
            ("/v1/completions", {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2}),
            ("/v1/completions", {"prompt": prompt, "max_tokens": 0}),
        ],
    )
    for r in (scored, streamed, with_ids, plp):
        assert r.status_code == 200, r.text
    assert refused.status_code == 400 and "max_tokens" in refused.text
    choice = scored.json()["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids)
    expected = plp.json()["choices"][0]["prompt_logprobs"]
    assert lp["token_logprobs"][1:] == pytest.approx(
        [expected[i][str(ids[i])]["logprob"] for i in range(1, len(ids))], abs=1e-4
    )
    assert all(len(top) <= 3 for top in lp["top_logprobs"][1:])  # (top 2 and the prompt's token)
    assert scored.json()["usage"] == scored.json()["usage"] | {
        "prompt_tokens": len(ids),
        "completion_tokens": 0,
        "total_tokens": len(ids),
    }
    events = [json.loads(line[6:]) for line in streamed.text.split("\n") if line.startswith("data: {")]
    chunks = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(c["text"] for c in chunks) == prompt
    assert {k: sum((c["logprobs"][k] for c in chunks if c["logprobs"]), []) for k in lp} == lp
    assert events[-1]["usage"]["completion_tokens"] == 0
    ids_choice = with_ids.json()["choices"][0]
    assert ids_choice["text"] == prompt and ids_choice["logprobs"] is None
    assert ids_choice["prompt_token_ids"] == ids and ids_choice["token_ids"] == []
    assert not demo_engine.requests and demo_engine.kv.pool.num_free_pages == before


def test_echo_null_is_echo_false(demo_engine):
    (r,) = post_all(demo_engine, [("/v1/completions", {"prompt": "hello", "max_tokens": 2, "echo": None})])
    assert r.status_code == 200 and not r.json()["choices"][0]["text"].startswith("hello")


@pytest.mark.parametrize("extra", [{"prompt_logprobs": 21}, {"prompt_logprobs": -1}, {"echo": "yes"}])
def test_bad_prompt_logprobs_requests_are_400s(demo_engine, extra):
    before = demo_engine.kv.pool.num_free_pages
    (r,) = post_all(demo_engine, [("/v1/completions", {"prompt": "x", "max_tokens": 2} | extra)])
    assert r.status_code == 400, r.text
    assert not demo_engine.requests and demo_engine.kv.pool.num_free_pages == before


def test_other_forms_n_generate_and_token_ids(demo_engine):
    """n > 1: each choice carries the prompt's logprobs; /generate returns them SGLang's way
    (input_token_logprobs: [logprob, id, text or null], the first logprob null); return_token_ids adds the prompt's
    ids beside the completion's (vLLM)."""
    tok = demo_engine.tokenizer
    prompt = "x = compute(y)"
    ids = tok.encode(prompt)
    n2, gen, with_ids = post_all(
        demo_engine,
        [
            ("/v1/completions", {"prompt": prompt, "max_tokens": 2, "n": 2, "seed": 1, "prompt_logprobs": 0}),
            ("/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 2, "prompt_logprobs": 1}}),
            ("/v1/completions", {"prompt": prompt, "max_tokens": 2, "echo": True, "return_token_ids": True}),
        ],
    )
    plps = [c["prompt_logprobs"] for c in n2.json()["choices"]]
    assert len(plps) == 2 and plps[0] == plps[1] and len(plps[0]) == len(ids)
    meta = gen.json()["meta_info"]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == ids and meta["input_token_logprobs"][0][
        0
    ] is None
    assert {text for _, _, text in meta["input_token_logprobs"]} == {None}  # (no return_text_in_logprobs)
    # (a batch of two and a lone request may differ in the last float bits)
    assert [v for v, _, _ in meta["input_token_logprobs"][1:]] == pytest.approx(
        [plps[0][i][str(ids[i])]["logprob"] for i in range(1, len(ids))], abs=1e-4
    )
    assert meta["input_top_logprobs"][0] is None and all(len(t) == 1 for t in meta["input_top_logprobs"][1:])
    choice = with_ids.json()["choices"][0]
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 2


def test_generate_takes_sglangs_logprob_fields(demo_engine):
    """SGLang's top-level return_logprob / top_logprobs_num / logprob_start_len /
    return_text_in_logprobs: the same numbers as our sampling_params.logprobs and prompt_logprobs,
    the prompt's from logprob_start_len on, entries [logprob, id, text]; streamed, the last chunk
    carries the same meta_info; bad values are 400s."""
    tok = demo_engine.tokenizer
    prompt = "def area(r):\n    return"
    ids = tok.encode(prompt)
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    sglang = {"text": prompt, "sampling_params": sp, "return_logprob": True, "top_logprobs_num": 2}
    sglang |= {"logprob_start_len": 3, "return_text_in_logprobs": True}
    ours = {"text": prompt, "sampling_params": sp | {"logprobs": 2, "prompt_logprobs": 2}}
    a, b, streamed, *bad = post_all(
        demo_engine,
        [
            ("/generate", sglang),
            ("/generate", ours),
            ("/generate", sglang | {"stream": True}),
            ("/generate", sglang | {"logprob_start_len": len(ids)}),
            ("/generate", sglang | {"top_logprobs_num": -1}),
            ("/generate", sglang | {"sampling_params": sp | {"logprobs": 1}}),
            ("/generate", sglang | {"top_logprobs_num": 21}),
            ("/generate", sglang | {"logprob_start_len": -1}),
            ("/generate", sglang | {"logprob_start_len": -1, "stream": True}),
        ],
    )
    *bad, default_start, default_streamed = bad
    last_default = [json.loads(x[6:]) for x in default_streamed.text.splitlines() if x.startswith("data: {")][
        -1
    ]
    assert last_default["meta_info"] | {"id": None} == default_start.json()["meta_info"] | {"id": None}
    no_input = default_start.json()["meta_info"]  # (SGLang's default: the keys, empty here)
    assert no_input["input_token_logprobs"] == [] and no_input["input_top_logprobs"] == []
    assert len(no_input["output_token_logprobs"]) == 4
    ma, mb = a.json()["meta_info"], b.json()["meta_info"]
    assert a.json()["output_ids"] == b.json()["output_ids"]
    out = a.json()["output_ids"]
    assert [(lp, t) for lp, t, _ in ma["output_token_logprobs"]] == [
        (lp, t) for lp, t, _ in mb["output_token_logprobs"]
    ]
    assert [text for _, _, text in ma["output_token_logprobs"]] == [tok.decode([t]) for t in out]
    assert [t for _, t, _ in ma["input_token_logprobs"]] == ids[3:]  # from logprob_start_len
    assert ma["input_token_logprobs"][0][0] == mb["input_token_logprobs"][3][0] is not None
    assert len(mb["input_token_logprobs"]) == len(ids) and mb["input_top_logprobs"][0] is None
    for tops in ma["output_top_logprobs"] + ma["input_top_logprobs"]:
        assert len(tops) == 2 and tops[0][0] >= tops[1][0] and all(isinstance(e[2], str) for e in tops)
    last = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")][-1]
    assert last["meta_info"] | {"id": None} == ma | {"id": None}  # (everything but the request id)
    assert [r.status_code for r in bad] == [400] * 4
    assert "logprob_start_len" in bad[0].json()["error"]["message"]
    assert "not both" in bad[2].json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "extra", "word"),
    [
        ("/v1/chat/completions", {"echo": True}, "echo"),  # (vLLM's chat echo means another thing)
        ("/v1/chat/completions", {"prompt_logprobs": 1, "stream": True}, "stream"),
    ],
)
def test_chat_refuses_echo_and_streamed_prompt_logprobs(demo_engine, path, extra, word):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | extra
    (r,) = post_all(demo_engine, [(path, body)])
    assert r.status_code == 400 and word in r.json()["error"]["message"], r.text


def test_an_explicit_prompt_logprobs_is_kept_under_echo_with_more_logprobs(demo_engine):
    """`echo` with `logprobs` 5 raises the engine's prompt logprobs to 5 (the echoed logprobs need them);
    an explicit `prompt_logprobs` 1 then listed 5 top entries (+ the token), where vLLM keeps the
    client's 1 (a review, 2026-12-05)."""
    body = {"prompt": "hello world there", "max_tokens": 1, "temperature": 0}
    echoed, plain = post_all(
        demo_engine,
        [
            ("/v1/completions", body | {"echo": True, "logprobs": 5, "prompt_logprobs": 1}),
            ("/v1/completions", body | {"prompt_logprobs": 1}),
        ],
    )
    assert echoed.status_code == plain.status_code == 200, (echoed.text, plain.text)
    lengths = [None if p is None else len(p) for p in echoed.json()["choices"][0]["prompt_logprobs"]]
    assert lengths == [None if p is None else len(p) for p in plain.json()["choices"][0]["prompt_logprobs"]]
    assert all(n is None or n <= 2 for n in lengths), lengths
    tops = echoed.json()["choices"][0]["logprobs"]["top_logprobs"]
    assert max(len(t) for t in tops[1:]) >= 5  # (the echoed logprobs keep their 5)
