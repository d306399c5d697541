"""End-to-end tests of the HTTP server: a real `pdserve serve` subprocess on 127.0.0.1 (one per module)
on the demo checkpoint, driven by the official `openai` client and raw `httpx`.

Reference outputs come from the offline `LLM` in the test process (same checkpoint, separate process),
so "the server returns what the engine computes" is checked across the process boundary.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time

import httpx
import openai
import pytest

from tests.conftest import serve_subprocess

pytestmark = pytest.mark.timeout(240)

MAX_MODEL_LEN = 512
NUM_PAGES = 256
PAGE_SIZE = 16
MSGS_X = [{"role": "user", "content": "x"}]
PROMPT = "def fibonacci(n):"


# ---- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from pdserve.model.demo import make_demo_model

    d = tmp_path_factory.mktemp("demo-model")
    make_demo_model(str(d))
    return str(d)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """(base_url, model_name). The server's log is printed if it fails to come up."""
    flags = ["--role", "colocated", "--max-model-len", str(MAX_MODEL_LEN), "--num-pages", str(NUM_PAGES)]
    flags += ["--page-size", str(PAGE_SIZE)]
    with serve_subprocess(model_dir, tmp_path_factory.mktemp("server-log"), *flags) as (url, _, _):
        yield url, httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def url(server) -> str:
    return server[0]


@pytest.fixture(scope="module")
def model_name(server) -> str:
    return server[1]


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    # max_retries=0: a 5xx must surface as such, not be retried behind the test's back.
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm(model_dir):
    from pdserve import LLM

    return LLM(model=model_dir, max_model_len=MAX_MODEL_LEN, num_pages=NUM_PAGES, page_size=PAGE_SIZE)


def offline(llm, prompt, max_tokens: int):
    from pdserve import SamplingParams

    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))[0]


# ---- helpers -------------------------------------------------------------------------------------
_METRIC_RE = re.compile(r"^(pdserve_[A-Za-z0-9_]+(?:\{[^}]*\})?) ([-+0-9.eE]+|NaN|[-+]Inf)$", re.M)


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {k: float(v) for k, v in _METRIC_RE.findall(text)}


def wait_idle(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """Poll /metrics until nothing runs, waits or holds KV pages (the engine updates gauges on idle)."""
    deadline = time.monotonic() + timeout_s
    m = metrics(url)
    while time.monotonic() < deadline:
        if (
            m["pdserve_num_requests_running"] == 0
            and m["pdserve_num_requests_waiting"] == 0
            and m["pdserve_kv_pages_used"] == 0
        ):
            return m
        time.sleep(0.05)
        m = metrics(url)
    raise AssertionError(f"server not idle after {timeout_s}s: {m}")


def assert_openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["code"] == status
    return err


# ---- 1. openai client, non-streaming completion vs offline LLM -----------------------------------
def test_models_list(client, model_name, model_dir):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [model_name]
    assert model_name == model_dir  # no --served-model-name: the model path


def test_completion_matches_offline_llm(client, model_name, llm):
    ref = offline(llm, PROMPT, 16)
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=16, temperature=0)
    assert r.object == "text_completion"
    assert r.model == model_name
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.text == ref.outputs[0].text
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids) == 16
    assert c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(llm.get_tokenizer().encode(PROMPT)) == len(ref.prompt_token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


# ---- 2. streaming completion ---------------------------------------------------------------------
def test_streaming_completion_matches_non_streamed(client, model_name):
    prompt = "import argparse\n\nparser ="
    kw = dict(model=model_name, prompt=prompt, max_tokens=16, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text_chunks = [ch for ch in chunks if ch.choices]
    assert "".join(ch.choices[0].text for ch in text_chunks) == full.choices[0].text
    assert all(ch.choices[0].finish_reason is None for ch in text_chunks[:-1])
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert len({ch.id for ch in chunks}) == 1
    usage_chunks = [ch for ch in chunks if ch.usage is not None]
    assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0]
    assert usage_chunks[0].choices == []
    u = usage_chunks[0].usage
    assert (u.prompt_tokens, u.completion_tokens) == (full.usage.prompt_tokens, 16)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_streaming_without_include_usage_has_no_usage_chunk(client, model_name):
    chunks = list(
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0, stream=True)
    )
    assert chunks and all(ch.choices and ch.usage is None for ch in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client, model_name):
    """vLLM's stream_options.continuous_usage_stats: with include_usage, each chunk carries the counts
    so far (completion tokens growing to max_tokens; chat's role chunk: 0); without include_usage,
    none; the last chunk is still the whole usage."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    kw = dict(model=model_name, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(**kw, prompt=PROMPT, stream=True, stream_options=options))
    text_chunks = [ch for ch in chunks if ch.choices]
    counts = [ch.usage.completion_tokens for ch in text_chunks]
    assert all(ch.usage is not None for ch in chunks) and counts == sorted(counts) and counts[-1] == 12
    assert {ch.usage.prompt_tokens for ch in chunks} == {chunks[-1].usage.prompt_tokens}
    assert all(ch.usage.total_tokens == ch.usage.prompt_tokens + ch.usage.completion_tokens for ch in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details is not None
    msgs = [{"role": "user", "content": "hi"}]
    chat = list(client.chat.completions.create(**kw, messages=msgs, stream=True, stream_options=options))
    assert chat[0].choices[0].delta.role == "assistant" and chat[0].usage.completion_tokens == 0
    assert [ch.usage.completion_tokens for ch in chat if ch.choices][-1] == 12
    off = {"include_usage": False, "continuous_usage_stats": True}  # (vLLM: only with include_usage)
    plain = list(client.completions.create(**kw, prompt=PROMPT, stream=True, stream_options=off))
    assert all(ch.usage is None for ch in plain)


def test_raw_sse_framing(url, model_name):
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        json.loads(e.removeprefix("data: "))


# ---- 3. chat -------------------------------------------------------------------------------------
def test_chat_streaming_and_not_agree(client, model_name):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
    kw = dict(model=model_name, messages=msgs, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kw)
    assert full.object == "chat.completion"
    choice = full.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert full.usage.completion_tokens == 12

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [ch for ch in chunks if ch.choices]
    streamed = "".join(ch.choices[0].delta.content or "" for ch in with_choices)
    assert streamed == choice.message.content
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert all(ch.choices[0].finish_reason is None for ch in with_choices[:-1])
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_uses_template(client, model_name, llm):
    """The chat prompt is the template's rendering, tokenized without a second BOS."""
    msgs = [{"role": "user", "content": "Hi"}]
    tok = llm.get_tokenizer()
    ids = tok.encode(tok.apply_chat_template(msgs, True), add_special_tokens=False)
    ref = offline(llm, {"prompt_token_ids": ids}, 6)
    r = client.chat.completions.create(model=model_name, messages=msgs, max_tokens=6, temperature=0)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == ref.outputs[0].text


# ---- 4. prefix cache -----------------------------------------------------------------------------
def test_prefix_cache_hit_on_repeat(client, model_name, url, llm):
    prompt = (
        "Prefix-cache probe 42. The quick brown fox jumps over the lazy dog while the parser reads "
        "arguments, decodes JSON, wraps text and formats calendars; dataclasses and enums follow. "
        "Then functools caches results, pathlib joins paths and difflib compares sequences of lines. "
        "Finally the string module formats templates and typing checks annotations."
    )
    n = len(llm.get_tokenizer().encode(prompt))
    assert 80 <= n <= 160, n  # (several pages, far below max_model_len)
    kw = dict(model=model_name, prompt=prompt, max_tokens=8, temperature=0)
    first = client.completions.create(**kw)
    second = client.completions.create(**kw)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == n
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    assert cached % PAGE_SIZE == 0
    assert cached < n  # the last prompt token is always recomputed
    assert cached == (n - 1) // PAGE_SIZE * PAGE_SIZE  # every full prompt page is reused
    assert second.choices[0].text == first.choices[0].text
    m = wait_idle(url)
    assert m["pdserve_prefix_cache_hit_rate"] > 0
    assert m["pdserve_kv_pages_cached"] >= cached // PAGE_SIZE


# ---- 5. logprobs ---------------------------------------------------------------------------------
def test_completion_logprobs(client, model_name, llm):
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=5)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(8)]  # where each token starts
    streamed = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=5, stream=True
    )
    offsets = [o for ch in streamed for o in ch.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset  # chunks continue the offsets where the previous chunk ended
    # The top 5 keyed by their text (OpenAI's legacy format): tokens that spell the same text, such as
    # lone bytes of a UTF-8 character ("\ufffd"), share one key.
    from pdserve import SamplingParams

    ref = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, logprobs=5))[0].outputs[0]
    text_of = llm.engine.tokenizer.token_text
    for step, top in zip(ref.logprobs, lp.top_logprobs, strict=True):
        assert set(top) == {text_of(t) for t, _ in step.top}
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert all(v <= 0 for v in top.values())
        best_tok, best = max(top.items(), key=lambda kv: kv[1])
        assert chosen == pytest.approx(best, abs=1e-5)
        assert tok == best_tok
        assert sum(2.718281828459045**v for v in top.values()) <= 1 + 1e-4


def test_chat_logprobs(client, model_name):
    r = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 3
        assert c.logprob == pytest.approx(max(t.logprob for t in c.top_logprobs), abs=1e-5)


# ---- 6. seeded sampling --------------------------------------------------------------------------
def test_seeded_sampling_reproducible(client, model_name):
    kw = dict(
        model=model_name, prompt=PROMPT, max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True}
    )
    a = client.completions.create(**kw, seed=7).choices[0].text
    b = client.completions.create(**kw, seed=7).choices[0].text
    c = client.completions.create(**kw, seed=8).choices[0].text
    assert a == b
    assert a != c


def test_seeded_sampling_independent_of_batching(client, model_name):
    """A seeded request samples the same tokens whether it runs alone or batched with others."""
    kw = dict(
        model=model_name, prompt=PROMPT, max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True}
    )
    alone = client.completions.create(**kw, seed=7).choices[0].text

    async def together():
        ac = openai.AsyncOpenAI(base_url=client.base_url, api_key="unused", max_retries=0, timeout=60)
        try:
            rs = await asyncio.gather(*(ac.completions.create(**kw, seed=s) for s in (7, 7, 3, 7)))
        finally:
            await ac.close()
        return [r.choices[0].text for r in rs]

    texts = asyncio.run(together())
    assert texts[0] == texts[1] == texts[3] == alone
    assert texts[2] != alone


def test_n_choices_equal_their_seeded_children(client, model_name):
    """n = 3 with seed s: choice i is what a request with seed s + i samples (vLLM's rule); the prompt
    counts once in usage, the completions of all choices add up."""
    kw = dict(
        model=model_name, prompt=PROMPT, max_tokens=10, temperature=1.0, extra_body={"ignore_eos": True}
    )
    r = client.completions.create(**kw, n=3, seed=11)
    assert [c.index for c in r.choices] == [0, 1, 2]
    alone = [client.completions.create(**kw, seed=11 + i) for i in range(3)]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert len({c.text for c in r.choices}) > 1
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert r.usage.completion_tokens == 30 and r.usage.total_tokens == r.usage.prompt_tokens + 30
    msgs = [{"role": "user", "content": "hi"}]
    chat_kw = dict(
        model=model_name, messages=msgs, max_tokens=5, temperature=1.0, extra_body={"ignore_eos": True}
    )
    chat = client.chat.completions.create(**chat_kw, n=2, seed=1)
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 10
    second = client.chat.completions.create(**chat_kw, seed=2).choices[0].message.content
    assert chat.choices[1].message.content == second


def test_n_choices_of_a_long_prompt_compute_it_once(url, model_name):
    """The n children of one prompt arrive together; the prompt is computed once: the others find
    every full page in the prefix cache, whether they waited for its pages in flight
    (pdserve_prefix_waits_total; the scheduler's tests pin that exactly) or, on a slow or busy machine,
    arrived after the first child's prefill had finished."""
    before = wait_idle(url)
    prompt = "def handler(request, context):\n    return process(request.body)\n" * 8  # ~10 pages
    body = {"model": model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0, "n": 4}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert len({c["text"] for c in r.json()["choices"]}) == 1  # greedy: all the same
    after = wait_idle(url)
    hits = after["pdserve_prefix_cache_hit_tokens_total"] - before["pdserve_prefix_cache_hit_tokens_total"]
    n_prompt = r.json()["usage"]["prompt_tokens"]
    assert hits >= 3 * ((n_prompt - 1) // PAGE_SIZE) * PAGE_SIZE  # three children hit every full page


def test_n_choices_stream_interleaved_with_one_usage_chunk(url, model_name):
    body = {
        "model": model_name,
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 5,
        "n": 3,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    texts, finishes = ["", "", ""], [None, None, None]
    for ch in chunks[:-1]:
        (choice,) = ch["choices"]
        texts[choice["index"]] += choice["text"]
        finishes[choice["index"]] = choice["finish_reason"] or finishes[choice["index"]]
    assert len({ch["id"] for ch in chunks}) == 1
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 36
    assert finishes == ["length"] * 3
    plain = httpx.post(
        url + "/v1/completions", json=body | {"stream": False, "stream_options": None}, timeout=60
    )
    assert [c["text"] for c in plain.json()["choices"]] == texts
    assert wait_idle(url)["pdserve_kv_pages_used"] == 0


def test_n_choices_stream_disconnect_aborts_every_child(url, model_name):
    before = wait_idle(url)
    body = {
        "model": model_name,
        "prompt": PROMPT,
        "max_tokens": 400,
        "temperature": 0,
        "n": 4,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for i, _ in enumerate(r.iter_lines()):
                if i >= 8:
                    break
    after = wait_idle(url, timeout_s=5)
    assert after["pdserve_num_requests_running"] == 0 and after["pdserve_kv_pages_used"] == 0
    generated = after["pdserve_generation_tokens_total"] - before["pdserve_generation_tokens_total"]
    assert generated < 4 * 400 / 2, generated  # aborted, not run to completion


# ---- 7. bad input --------------------------------------------------------------------------------
def test_bad_requests_get_openai_errors_and_leave_engine_clean(client, model_name, url):
    before = wait_idle(url)
    total = before["pdserve_kv_pages_total"]
    assert total == NUM_PAGES
    finished_before = sum(v for k, v in before.items() if k.startswith("pdserve_requests_finished_total"))

    too_long = "hello " * (MAX_MODEL_LEN + 50)
    cases = [
        dict(prompt=too_long, max_tokens=4),
        dict(prompt="", max_tokens=4),
        dict(prompt=PROMPT, temperature=-1),
        dict(prompt=PROMPT, top_p=0),
        dict(prompt=PROMPT, logprobs=50),
        dict(prompt=PROMPT, max_tokens=0),
        dict(prompt=PROMPT, max_tokens=MAX_MODEL_LEN),  # prompt + max_tokens > max_model_len
        dict(prompt=[], max_tokens=4),
        dict(prompt=[10**6], max_tokens=4),  # token id out of the vocabulary
        dict(prompt=PROMPT, stop=[""]),
    ]
    for kw in cases:
        with pytest.raises(openai.BadRequestError) as ei:
            client.completions.create(model=model_name, **kw)
        e = ei.value
        assert e.status_code == 400
        assert isinstance(e.body, dict) and e.body["message"] and e.body["type"], e.body
        assert e.body["code"] == 400

    for n in (0, 65, "2", True, 1.5):
        with pytest.raises(openai.BadRequestError, match="n must be|n\\b"):
            client.completions.create(model=model_name, prompt=PROMPT, extra_body={"n": n})
    # OpenAI fields we do not implement are refused, not silently ignored; their "off" values pass.
    # (echo, prompt_logprobs: test_prompt_logprobs; json_object / json_schema: test_structured_outputs)
    for extra in (
        {"suffix": "x"},
        {"best_of": 2},
        {"use_beam_search": True},
        {"response_format": {"type": "structural_tag"}},
        {"structural_tag": '{"structures": []}'},  # vLLM's extra parameters we do not implement
        {"stream_options": {"include_usage": True}},  # without stream
    ):
        with pytest.raises(openai.BadRequestError) as ei:
            client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2, extra_body=extra)
        assert next(iter(extra)) in ei.value.body["message"]
    tool = {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "x"}], max_tokens=2, tools=[tool]
        )
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "x"}], max_tokens=2, top_logprobs=2
        )
    raw = b'{"prompt": "x", "max_tokens": 2, "temperature": Infinity}'  # Python's json reads it
    r = httpx.post(url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert "temperature" in assert_openai_error(r, 400)["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_name, messages=[], max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=30
        )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": too_long}], max_tokens=4
        )
    # Streaming requests are validated before the stream starts: a plain 400, not a broken stream.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_name, prompt="", stream=True)

    for call in (
        lambda: client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4),
        lambda: client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}], max_tokens=4
        ),
    ):
        with pytest.raises(openai.NotFoundError) as ei:
            call()
        assert ei.value.status_code == 404
        assert ei.value.body["code"] == 404 and "no-such-model" in ei.value.body["message"]

    # raw HTTP: malformed JSON, wrong body shapes, missing fields
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        r = httpx.post(
            url + path, content=b'{"prompt": "x', headers={"content-type": "application/json"}, timeout=10
        )
        assert_openai_error(r, 400)
        r = httpx.post(url + path, json=[1, 2], timeout=10)
        assert_openai_error(r, 400)
    assert_openai_error(httpx.post(url + "/v1/completions", json={"max_tokens": 4}, timeout=10), 400)
    assert_openai_error(httpx.post(url + "/v1/completions", json={"prompt": 5}, timeout=10), 400)
    assert_openai_error(
        httpx.post(url + "/v1/completions", json={"prompt": "x", "temperature": "hot"}, timeout=10), 400
    )
    assert_openai_error(
        httpx.post(url + "/v1/completions", json={"prompt": "x", "return_token_ids": "yes"}, timeout=10), 400
    )
    assert_openai_error(httpx.post(url + "/generate", json={"input_ids": []}, timeout=10), 400)
    assert_openai_error(httpx.post(url + "/generate", json={"input_ids": [5], "text": "x"}, timeout=10), 400)
    assert_openai_error(
        httpx.post(url + "/generate", json={"input_ids": [5], "sampling_params": {"foo": 1}}, timeout=10),
        400,
    )
    err = assert_openai_error(
        httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=10), 404
    )
    assert err["param"] == "model"

    # nothing of the above reached the engine; it is healthy and serves normally
    h = httpx.get(url + "/health", timeout=10)
    assert h.status_code == 200 and h.json() == {"status": "ok"}
    after_errors = metrics(url)
    finished = sum(v for k, v in after_errors.items() if k.startswith("pdserve_requests_finished_total"))
    assert finished == finished_before
    # An empty model name is the default, as vLLM reads it (a 404 "The model `` does not exist" before)
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": MSGS_X})):
        r = httpx.post(url + path, json=body | {"model": "", "max_tokens": 1}, timeout=10)
        assert r.status_code == 200 and r.json()["model"] == model_name, r.text
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4
    off = {"echo": False, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "best_of": 1}
    off |= {
        "min_tokens": 0,
        "prompt_logprobs": None,
        "response_format": {"type": "text"},
        "tool_choice": "none",
    }
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2, extra_body=off)
    assert r.usage.completion_tokens == 2  # the unsupported fields' "off" values are accepted
    after = wait_idle(url)
    assert after["pdserve_kv_pages_used"] == 0
    assert after["pdserve_kv_pages_total"] == total
    assert after["pdserve_num_requests_running"] == 0


def test_penalties_bias_and_min_tokens_over_http(client, model_name, url, llm):
    """The OpenAI client's own fields (frequency/presence penalty, logit_bias) and vLLM's extras
    (repetition_penalty, min_tokens) reach the sampler: the same tokens as the offline engine."""
    from pdserve import SamplingParams

    tok = offline(llm, PROMPT, 1).outputs[0].token_ids[0]
    kw = dict(frequency_penalty=0.8, presence_penalty=0.4)
    extra = {"repetition_penalty": 1.3, "min_tokens": 4}
    ref = llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=12, logit_bias={tok: -100.0}, **kw, **extra)
    )[0].outputs[0]
    r = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        logit_bias={str(tok): -100},
        extra_body=extra,
        **kw,
    )
    assert r.choices[0].text == ref.text and tok not in ref.token_ids
    chat = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=6,
        temperature=0,
        frequency_penalty=1.0,
        extra_body={"min_tokens": 6},
    )
    assert chat.usage.completion_tokens == 6
    for bad, word in (
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": "high"}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"logit_bias": {str(10**6): 1}}, "logit_bias"),  # outside the vocabulary
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ):
        r = httpx.post(
            url + "/v1/completions",
            json={"model": model_name, "prompt": PROMPT, "max_tokens": 4} | bad,
            timeout=10,
        )
        assert_openai_error(r, 400)
        assert word in r.json()["error"]["message"], r.text
    assert wait_idle(url)["pdserve_kv_pages_used"] == 0


def test_a_prompt_list_answers_as_one_request_per_prompt(client, model_name, url):
    """A list of prompts (strings or token-id lists) with n = 2: choice p·2 + j is what prompt p alone
    samples with seed + j (vLLM's order); usage counts each prompt once; streamed, the same texts."""
    prompts = [PROMPT, "import os\n", "class Stack:"]
    kw = dict(model=model_name, max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
    r = client.completions.create(**kw, prompt=prompts, n=2, seed=3)
    assert [c.index for c in r.choices] == list(range(6))
    alone = [client.completions.create(**kw, prompt=p, seed=3 + j) for p in prompts for j in range(2)]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone[::2])
    assert r.usage.completion_tokens == 36 and r.usage.total_tokens == r.usage.prompt_tokens + 36
    ids = [httpx.post(url + "/tokenize", json={"prompt": p}, timeout=10).json()["tokens"] for p in prompts]
    by_ids = client.completions.create(**kw, prompt=ids, seed=3)
    assert [c.text for c in by_ids.choices] == [a.choices[0].text for a in alone[::2]]
    body = {"model": model_name, "prompt": prompts, "max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 2}
    body |= {"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    texts = [""] * 6
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as s:
        assert s.status_code == 200
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    for e in events[:-1]:
        (choice,) = e["choices"]
        texts[choice["index"]] += choice["text"]
    assert texts == [c.text for c in r.choices]
    assert events[-1]["usage"]["prompt_tokens"] == r.usage.prompt_tokens
    assert wait_idle(url)["pdserve_kv_pages_used"] == 0


def test_a_prompt_list_with_echo_and_logprobs_is_lm_evals_batch(client, model_name):
    """lm-eval's loglikelihood batch: echo + logprobs over a prompt list, each choice as its prompt
    alone (the prompt's token logprobs lead, the first None)."""  # (greedy: one token each)
    prompts = ["The cat sat on", "def add(a, b):"]
    kw = dict(model=model_name, max_tokens=1, temperature=0, echo=True, logprobs=1)
    batch = client.completions.create(**kw, prompt=prompts)
    for choice, p in zip(batch.choices, prompts, strict=True):
        one = client.completions.create(**kw, prompt=p).choices[0]
        assert choice.text == one.text and choice.text.startswith(p)
        assert choice.logprobs.tokens == one.logprobs.tokens
        assert choice.logprobs.token_logprobs[0] is None and one.logprobs.token_logprobs[0] is None
        # (computed in one step with the other prompt, not alone: equal up to float32 summation order)
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(one.logprobs.token_logprobs[1:], abs=1e-4)


def test_lone_surrogates_are_400s_or_echoed_escaped_never_500s(url, model_name):
    """A JSON "\\ud800" without its pair is a str Python holds and UTF-8 cannot encode: the tokenizer
    library refused it with a TypeError (500s on /tokenize and chat, a cryptic 400 on completions),
    and a response echoing it (a rid, a model name in an error) failed to encode (a 500, after a
    /generate had run to its end). Now: a 400 that names the cause, or the value echoed \\u-escaped."""
    bad = "ab\ud800"

    def post(path: str, body: dict) -> httpx.Response:  # (as json.dumps writes it: \\u escapes)
        return httpx.post(
            url + path, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=30
        )

    cases = [
        ("/tokenize", {"prompt": bad}),
        ("/tokenize", {"messages": [{"role": "user", "content": bad}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": bad}], "max_tokens": 2}),
        ("/v1/completions", {"prompt": bad, "max_tokens": 2}),
        ("/generate", {"text": bad, "sampling_params": {"max_new_tokens": 2}}),
    ]
    for path, body in cases:
        err = assert_openai_error(post(path, body), 400)
        assert "surrogate" in err["message"], (path, err)
    err = assert_openai_error(
        post("/v1/completions", {"model": bad, "prompt": "a", "max_tokens": 2}),
        404,
    )
    assert bad in err["message"]  # (parsed back from its \\u escape)
    r = post("/generate", {"text": "a", "rid": bad, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and r.json()["meta_info"]["id"] == bad and b"\\ud800" in r.content
    r = post("/generate", {"text": ["a", "b"], "rid": [bad, "x"], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and [a["meta_info"]["id"] for a in r.json()] == [bad, "x"]
    wait_idle(url)


def test_a_schema_nested_thousands_deep_is_a_400(url):
    """A schema given as a string is parsed by json.loads, which raised RecursionError (a 500; through
    PD a prefill failure, retried into a 503)."""
    deep = "[" * 5000 + "]" * 5000
    for path, body in [
        ("/v1/completions", {"prompt": "a", "max_tokens": 2, "guided_json": deep}),
        ("/v1/completions", {"prompt": "a", "max_tokens": 2, "structured_outputs": {"json": deep}}),
        ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2, "json_schema": deep}}),
    ]:
        err = assert_openai_error(httpx.post(url + path, json=body, timeout=30), 400)
        assert "nested too deeply" in err["message"], (path, err)


def test_bad_prompt_lists_are_400s_and_leave_the_engine_clean(url, model_name):
    before = wait_idle(url)
    cases = [
        ({"prompt": ["a", [1, 2]]}, "prompt"),  # (the body's own validation: no such union member)
        ({"prompt": ["a"] * 1025}, "1025 prompts: more than 1024 choices"),
        ({"prompt": ["a"] * 20, "n": 60}, "more than 1024 choices"),
        ({"prompt": ["a", "hello " * (MAX_MODEL_LEN + 50)], "max_tokens": 4}, "maximum context length"),
        ({"prompt": ["a", ""]}, "prompt is empty"),
        ({"prompt": [[5, 6], []]}, "prompt is empty"),
        ({"prompt": ["a", ""], "stream": True}, "prompt is empty"),
    ]
    for extra, word in cases:
        r = httpx.post(url + "/v1/completions", json={"model": model_name} | extra, timeout=30)
        assert word in assert_openai_error(r, 400)["message"], r.text
    after = wait_idle(url)
    assert after["pdserve_kv_pages_used"] == 0 and after["pdserve_num_requests_running"] == 0
    finished = sum(v for k, v in after.items() if k.startswith("pdserve_requests_finished_total"))
    assert finished == sum(v for k, v in before.items() if k.startswith("pdserve_requests_finished_total"))


@pytest.mark.parametrize(
    "sp",
    [
        {"temperature": "hot"},
        {"max_new_tokens": "3"},
        {"stop": 5},
        {"max_new_tokens": 3, "max_tokens": 3},
        {"no_stop_trim": "yes"},
        {"spaces_between_special_tokens": 0},
    ],
    ids=["temperature", "max", "stop", "both-names", "no-stop-trim", "spaces"],
)
def test_generate_wrongly_typed_sampling_params_is_a_400(url, sp):
    r = httpx.post(url + "/generate", json={"input_ids": [5, 6], "sampling_params": sp}, timeout=10)
    assert_openai_error(r, 400)


def test_generate_takes_sglangs_sampling_param_names(url):
    """What SGLang rollout code sends (min_new_tokens, no_stop_trim, spaces_between_special_tokens)
    means what our names mean: the same tokens and text."""
    first = httpx.post(
        url + "/generate",
        json={"text": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}},
        timeout=30,
    ).json()
    stop = first["text"][2:5]
    sglang = {
        "max_new_tokens": 8,
        "min_new_tokens": 1,
        "temperature": 0,
        "stop": [stop],
        "no_stop_trim": True,
    }
    sglang["spaces_between_special_tokens"] = False
    ours = {
        "max_tokens": 8,
        "min_tokens": 1,
        "temperature": 0,
        "stop": [stop],
        "include_stop_str_in_output": True,
    }
    a, b = (
        httpx.post(url + "/generate", json={"text": PROMPT, "sampling_params": sp}, timeout=30).json()
        for sp in (sglang, ours)
    )
    assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"] and a["text"].endswith(stop)
    assert a["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    eos = {"max_new_tokens": 4, "temperature": 0, "logit_bias": {"1": 100.0}}  # (the demo's EOS: id 1)
    ended = httpx.post(url + "/generate", json={"text": PROMPT, "sampling_params": eos}, timeout=30).json()
    assert ended["output_ids"] == [1] and ended["meta_info"]["finish_reason"] == {
        "type": "stop",
        "matched": 1,
    }


def test_chat_max_completion_tokens_zero_is_a_400(client, model_name, llm):
    # a long message keeps the buggy path short: only max_model_len - prompt tokens get generated
    content = "hello " * 490  # (one token per word)
    msgs = [{"role": "user", "content": content}]
    tok = llm.get_tokenizer()
    n = len(tok.encode(tok.apply_chat_template(msgs, True), add_special_tokens=False))
    assert MAX_MODEL_LEN - 40 < n < MAX_MODEL_LEN - 8, n
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_name, messages=msgs, max_completion_tokens=0)


def test_chat_max_completion_tokens_wins_over_max_tokens(client, model_name):
    r = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=9,
        max_completion_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == 3
    assert r.choices[0].finish_reason == "length"


# ---- 8. client disconnect ------------------------------------------------------------------------
def test_client_disconnect_aborts_request(url, model_name):
    before = wait_idle(url)
    generated_before = before["pdserve_generation_tokens_total"]
    max_tokens = 400
    body = {
        "model": model_name,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            n = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    n += 1
                if n >= 3:
                    break
    # the response is closed: the engine must drop the request and free its pages
    after = wait_idle(url, timeout_s=5)
    assert after["pdserve_num_requests_running"] == 0
    assert after["pdserve_kv_pages_used"] == 0
    generated = after["pdserve_generation_tokens_total"] - generated_before
    assert 3 <= generated < max_tokens, generated  # aborted, not run to completion
    assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}


def test_client_disconnect_openai_stream_close(client, url, model_name):
    wait_idle(url)
    stream = client.completions.create(
        model=model_name,
        prompt="The Zen of Python, by",
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i >= 1:
            break
    stream.close()
    after = wait_idle(url, timeout_s=5)
    assert after["pdserve_num_requests_running"] == 0 and after["pdserve_kv_pages_used"] == 0


# ---- 9. concurrency ------------------------------------------------------------------------------
CONCURRENT_PROMPTS = [
    "def fibonacci(n):",
    "The Zen of Python, by",
    "import argparse\n\nparser =",
    "class Enum:",
    "Hello, world",
    "json.loads(",
    "# A calendar for the year",
    "return functools.reduce(",
]


def test_concurrent_requests_match_sequential(client, model_name, url):
    kw = dict(model=model_name, max_tokens=8, temperature=0)
    sequential = [client.completions.create(prompt=p, **kw) for p in CONCURRENT_PROMPTS]

    async def all_at_once():
        ac = openai.AsyncOpenAI(base_url=client.base_url, api_key="unused", max_retries=0, timeout=60)
        try:
            return await asyncio.gather(*(ac.completions.create(prompt=p, **kw) for p in CONCURRENT_PROMPTS))
        finally:
            await ac.close()

    concurrent = asyncio.run(all_at_once())
    assert len(concurrent) == len(CONCURRENT_PROMPTS)
    for p, s, c in zip(CONCURRENT_PROMPTS, sequential, concurrent, strict=True):
        assert c.choices[0].text == s.choices[0].text, p
        assert c.usage.completion_tokens == s.usage.completion_tokens
        assert c.usage.prompt_tokens == s.usage.prompt_tokens
    assert len({c.id for c in concurrent}) == len(concurrent)
    wait_idle(url)


# ---- 10. native /generate ------------------------------------------------------------------------
def test_generate_input_ids_matches_completion_and_offline(client, model_name, url, llm):
    ids = llm.get_tokenizer().encode("while True:")
    ref = offline(llm, {"prompt_token_ids": ids}, 10)
    r = httpx.post(
        url + "/generate",
        json={"input_ids": ids, "sampling_params": {"max_new_tokens": 10, "temperature": 0}},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_ids"] == ref.outputs[0].token_ids
    assert out["text"] == ref.outputs[0].text
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(ids)
    assert meta["completion_tokens"] == 10
    assert meta["finish_reason"] == {"type": "length", "length": 10}  # (SGLang's shape)
    sp = {"max_new_tokens": 10, "temperature": 0, "stop_token_ids": [out["output_ids"][2]]}
    stopped = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=30).json()
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": out["output_ids"][2]}
    assert stopped["output_ids"] == out["output_ids"][: stopped["output_ids"].index(out["output_ids"][2]) + 1]
    sp = {"max_new_tokens": 10, "temperature": 0, "stop": [out["text"][3:6]]}
    by_text = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=30).json()
    assert by_text["meta_info"]["finish_reason"] == {"type": "stop", "matched": out["text"][3:6]}

    cmpl = client.completions.create(model=model_name, prompt=[ids], max_tokens=10, temperature=0)
    assert cmpl.choices[0].text == out["text"]
    assert cmpl.usage.prompt_tokens == len(ids)
    flat = client.completions.create(model=model_name, prompt=ids, max_tokens=10, temperature=0)
    assert flat.choices[0].text == out["text"]


def test_generate_text_stream_and_logprobs(url, llm):
    ref = offline(llm, PROMPT, 6)
    sp = {"max_tokens": 6, "temperature": 0, "logprobs": 2}
    r = httpx.post(url + "/generate", json={"text": PROMPT, "sampling_params": sp}, timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_ids"] == ref.outputs[0].token_ids
    lps = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    assert all(len(top) == 2 for top in out["meta_info"]["output_top_logprobs"])

    events = []
    with httpx.stream(
        "POST", url + "/generate", json={"text": PROMPT, "sampling_params": sp, "stream": True}
    ) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["output_ids"] == out["output_ids"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": len(out["output_ids"])}
    assert all(json.loads(e)["meta_info"]["finish_reason"] is None for e in events[:-2])


def test_generate_custom_rid(url):
    r = httpx.post(
        url + "/generate",
        json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}, "rid": "my-rid-1"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["id"] == "my-rid-1"


def test_generate_default_max_new_tokens_is_sglangs_within_the_context(url):
    """Left out: SGLang's 128, or what the context leaves after a long prompt (no 400 for a default the
    client never set); null: up to the context; set too large: a 400 naming the limit."""

    def gen(ids, **sp):
        body = {"input_ids": ids, "sampling_params": {"temperature": 0, "ignore_eos": True, **sp}}
        return httpx.post(url + "/generate", json=body, timeout=60)

    r = gen([5, 6, 7])
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == 128
    assert r.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 128}
    long_ids = [5 + i % 50 for i in range(MAX_MODEL_LEN - 40)]
    r = gen(long_ids)
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == 40
    r = gen([5, 6, 7] * 100, max_new_tokens=None)
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == MAX_MODEL_LEN - 300
    r = gen(long_ids, max_new_tokens=41)
    assert_openai_error(r, 400)
    message = r.json()["error"]["message"]
    # (the figures as vLLM's refusal words them: agent clients parse them to shrink max_tokens)
    assert re.search(r"too large: (\d+)", message).group(1) == "41", message
    assert re.search(r"maximum context length is (\d+)", message).group(1) == str(MAX_MODEL_LEN)
    r = gen(long_ids, min_new_tokens=41)  # (no limit given: min_tokens past the room was a 200 before)
    assert "min_tokens (41) exceeds the 40 tokens" in assert_openai_error(r, 400)["message"]


def test_generate_duplicate_rid_is_refused_and_leaves_the_first_stream_alone(url):
    """A second request with a live request's rid gets a 409; the first streams on to its end."""
    body = {"input_ids": [1, 2, 3], "rid": "dup-rid", "stream": True}
    body["sampling_params"] = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", url + "/generate", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # the first is running
        second = {"input_ids": [4, 5, 6], "rid": "dup-rid", "sampling_params": {"max_new_tokens": 2}}
        err = assert_openai_error(c.post(url + "/generate", json=second), 409)
        assert "already active" in err["message"]
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["meta_info"]["finish_reason"]["type"] == "length" and len(last["output_ids"]) == 200
    wait_idle(url)


def test_streamed_text_never_shows_a_stop_string_the_final_text_cuts(client, model_name):
    """A stop string spanning two tokens: the streamed deltas join to exactly the non-streamed text
    (the stream holds back what could be a stop string's start, as vLLM does)."""
    kw = dict(model=model_name, prompt=PROMPT, max_tokens=20, temperature=0)
    deltas = [ch.choices[0].text for ch in client.completions.create(**kw, stream=True)]
    i = next(i for i in range(1, len(deltas) - 1) if len(deltas[i]) >= 2 and len(deltas[i + 1]) >= 2)
    stop = deltas[i][-2:] + deltas[i + 1][:2]  # spans the boundary between two tokens' text
    full = client.completions.create(**kw, stop=[stop]).choices[0]
    assert full.finish_reason == "stop" and stop not in full.text
    streamed = [ch.choices[0] for ch in client.completions.create(**kw, stop=[stop], stream=True)]
    assert "".join(c.text for c in streamed) == full.text
    assert streamed[-1].finish_reason == "stop"


def test_a_kept_stop_string_streams_without_hold_back(client, model_name):
    """include_stop_str_in_output: the final text keeps the stop string, so nothing streamed before
    it can be cut; the deltas are the unstopped stream's, token for token, up to the stop (vLLM holds
    back nothing here either)."""
    # (a prompt whose greedy answer varies: the demo model repeats itself after PROMPT)
    kw = dict(model=model_name, prompt="import os\n", max_tokens=20, temperature=0)
    deltas = [ch.choices[0].text for ch in client.completions.create(**kw, stream=True)]
    whole = "".join(deltas)

    def stop_at(i: int) -> str:  # the 4 characters across the boundary of deltas i and i + 1
        return deltas[i][-2:] + deltas[i + 1][:2]

    # (first found there: a repetitive output may spell the same 4 characters earlier)
    i = next(
        i
        for i in range(2, len(deltas) - 1)
        if len(deltas[i]) >= 2
        and len(deltas[i + 1]) >= 2
        and whole.find(stop_at(i)) == len("".join(deltas[: i + 1])) - 2
    )
    stop = stop_at(i)
    extra = {"include_stop_str_in_output": True}
    full = client.completions.create(**kw, stop=[stop], extra_body=extra).choices[0]
    assert full.finish_reason == "stop" and full.text.endswith(stop)
    streamed = [
        ch.choices[0] for ch in client.completions.create(**kw, stop=[stop], stream=True, extra_body=extra)
    ]
    assert "".join(c.text for c in streamed) == full.text
    texts = [c.text for c in streamed if c.text]
    assert texts[: i + 1] == deltas[: i + 1]  # held back, the first deltas would lag by up to 3 chars


def test_metrics_histograms_and_final_state(url):
    m = wait_idle(url)
    assert m["pdserve_time_to_first_token_seconds_count"] > 0
    assert m["pdserve_request_time_per_output_token_seconds_count"] > 0
    assert m["pdserve_kv_pages_total"] == NUM_PAGES
    assert m["pdserve_kv_pages_used"] == 0
    assert 0 < m["pdserve_prefix_cache_hit_rate"] <= 1


def test_non_streaming_client_disconnect_aborts_and_counts(url, model_name):
    """A non-streamed request whose client hangs up is aborted (not run to the end) and counted."""
    before = wait_idle(url)
    aborted_before = before.get('pdserve_requests_finished_total{finish_reason="abort"}', 0.0)
    generated_before = before["pdserve_generation_tokens_total"]
    # (as many tokens as the context holds: the server notices a hang-up at its next 0.5 s poll, and
    # a fast machine must not finish the answer before)
    num_tokens = MAX_MODEL_LEN - 16
    body = {
        "model": model_name,
        "prompt": PROMPT,
        "max_tokens": num_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/completions", json=body, timeout=0.4)
    after = wait_idle(url, timeout_s=10)
    assert after["pdserve_kv_pages_used"] == 0 and after["pdserve_num_requests_running"] == 0
    assert after["pdserve_generation_tokens_total"] - generated_before < num_tokens
    assert after['pdserve_requests_finished_total{finish_reason="abort"}'] == aborted_before + 1


def test_prompts_are_tokenized_off_the_event_loop(demo_model_dir):
    """A 50k-token prompt takes ~0.1 s to tokenize. On the event loop (and with the GIL held: the
    tokenizer's `encode` keeps it) that stalled every stream of the engine and its engine thread.
    Completions and chat now tokenize on a worker thread, with a tokenizer call that releases the GIL;
    the ids are the same."""
    import threading

    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.server.api import build_app

    engine = LLMEngine(EngineConfig.create(demo_model_dir, num_pages=64, max_model_len=MAX_MODEL_LEN))
    text = "def handler(request):\n    return request.body\n" * 20
    assert engine.tokenizer.encode(text) == engine.tokenizer._tok.encode(text).ids
    threads = []
    encode = engine.tokenizer.encode

    def recording(*a, **kw):
        threads.append(threading.get_ident())
        return encode(*a, **kw)

    engine.tokenizer.encode = recording
    app = build_app(engine)

    async def run():
        loop_thread = threading.get_ident()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post("/v1/completions", json={"prompt": text, "max_tokens": 2})
            assert r.status_code == 200, r.text
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]})
            assert r.status_code == 200, r.text
        return loop_thread

    try:
        loop_thread = asyncio.run(run())
    finally:
        app.state.engine.shutdown()
    assert len(threads) == 2 and loop_thread not in threads


@pytest.mark.parametrize(
    "fields",
    [
        {"sampling_params": {"max_new_tokens": 40, "temperature": 0, "logprobs": 2}},
        {  # SGLang's fields: token texts in the entries, the prompt's logprobs from position 1
            "sampling_params": {"max_new_tokens": 40, "temperature": 0},
            "return_logprob": True,
            "top_logprobs_num": 2,
            "logprob_start_len": 1,
            "return_text_in_logprobs": True,
        },
    ],
    ids=["logprobs", "sglang-fields"],
)
def test_generate_stream_chunks_are_what_json_dumps_writes(demo_model_dir, fields):
    """/generate streams cumulative chunks (SGLang's format). They are now encoded by extending the
    previous chunk's pieces (O(new tokens), where a full encode per chunk was O(output^2) per
    stream): each chunk must still be exactly `json.dumps` of its content, a prefix of the next, and
    the last one the non-streamed answer."""
    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.server.api import build_app

    engine = LLMEngine(EngineConfig.create(demo_model_dir, num_pages=64, max_model_len=MAX_MODEL_LEN))
    app = build_app(engine)
    body = {"text": 'def f(x):\n    """A "quoted" \\ doc."""'} | fields

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            streamed = (await c.post("/generate", json=body | {"stream": True})).text
            whole = (await c.post("/generate", json=body)).json()
        return streamed, whole

    try:
        streamed, whole = asyncio.run(run())
    finally:
        app.state.engine.shutdown()
    chunks = [
        line[6:] for line in streamed.splitlines() if line.startswith("data: ") and line != "data: [DONE]"
    ]
    assert len(chunks) > 10
    for text in chunks:
        assert json.dumps(json.loads(text)) == text  # byte for byte what json.dumps writes
    parsed = [json.loads(t) for t in chunks]
    for a, b in itertools.pairwise(parsed):
        n = len(a["output_ids"])
        assert b["output_ids"][:n] == a["output_ids"] and b["text"].startswith(a["text"])
        assert b["meta_info"]["output_token_logprobs"][:n] == a["meta_info"]["output_token_logprobs"]
    whole["meta_info"]["id"] = parsed[-1]["meta_info"]["id"]
    # The second request may reuse the full prompt pages the first left in the prefix cache (not when
    # it asks for the prompt's logprobs, which need every prompt position computed).
    n = whole["meta_info"]["prompt_tokens"]
    reused = 0 if "logprob_start_len" in fields else (n - 1) // PAGE_SIZE * PAGE_SIZE
    assert n > PAGE_SIZE and whole["meta_info"].pop("cached_tokens") == reused
    assert parsed[-1]["meta_info"].pop("cached_tokens") == 0
    assert parsed[-1] == whole and len(whole["output_ids"]) == 40
