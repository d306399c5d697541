"""OpenAI-route fields an API review (2026-12-03) found accepted and ignored, or answered unlike vLLM,
now matched (each test failed before its fix): `stream_options` without `include_usage` asks for the
usage (vLLM's default), `"stop": ""` is a 400 as `[""]` was, chat `documents` reach the template (and
/tokenize's), and `include_reasoning: false` drops the thinking. The max_tokens refusal's wording is
checked in tests/test_server.py; `cache_salt` in tests/test_cache_salt.py."""

from __future__ import annotations

import pytest

from tests.conftest import post_in_process
from tests.test_chat_semantics import template
from tests.test_tool_calls import chat_body, run_chat, sse_chunks

BASE = {"prompt": "def f(x):", "max_tokens": 3, "temperature": 0, "ignore_eos": True, "stream": True}


def test_stream_options_without_include_usage_asks_for_the_usage(demo_engine):
    """vLLM's StreamOptions.include_usage defaults to true: `{}` or `{"continuous_usage_stats": true}`
    alone gets the usage (in every chunk with the latter); no stream_options, none."""
    empty, continuous, off, absent = post_in_process(
        demo_engine,
        [
            ("/v1/completions", BASE | {"stream_options": {}}),
            ("/v1/completions", BASE | {"stream_options": {"continuous_usage_stats": True}}),
            ("/v1/completions", BASE | {"stream_options": {"include_usage": False}}),
            ("/v1/completions", BASE),
        ],
    )
    chunks = sse_chunks(empty)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3, chunks[-1]
    chunks = sse_chunks(continuous)
    assert all(c.get("usage") for c in chunks), chunks
    for r in (off, absent):
        assert not any(c.get("usage") for c in sse_chunks(r))


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_an_empty_stop_string_is_refused_alone_as_in_a_list(demo_engine, route):
    body = {"max_tokens": 2, "stop": ""}
    body |= (
        {"prompt": "x"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    )
    (r,) = post_in_process(demo_engine, [(route, body)])
    assert r.status_code == 400, r.text  # (was a 200 with no stop at all)
    assert "stop" in r.json()["error"]["message"]


RAG_TEMPLATE = (
    "{{ bos_token }}{% if documents %}{% for d in documents %}<doc>{{ d['title'] }}: {{ d['text'] }}</doc>\n"
    "{% endfor %}{% endif %}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
DOCS = [{"title": "setup.py", "text": "from setuptools import setup; setup(name='demo')"}]


def test_chat_documents_reach_the_template_on_the_chat_route_and_tokenize(demo_engine):
    msgs = [{"role": "user", "content": "hi"}]
    with template(demo_engine, RAG_TEMPLATE):
        plain, docs, by_kwargs, tok_plain, tok_docs, both = post_in_process(
            demo_engine,
            [
                ("/v1/chat/completions", {"messages": msgs, "max_tokens": 1}),
                ("/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "documents": DOCS}),
                (
                    "/v1/chat/completions",
                    {"messages": msgs, "max_tokens": 1, "chat_template_kwargs": {"documents": DOCS}},
                ),
                ("/tokenize", {"messages": msgs}),
                ("/tokenize", {"messages": msgs, "documents": DOCS}),
                (
                    "/v1/chat/completions",
                    {
                        "messages": msgs,
                        "max_tokens": 1,
                        "documents": DOCS,
                        "chat_template_kwargs": {"documents": []},
                    },
                ),
            ],
        )
    for r in (plain, docs, by_kwargs, tok_plain, tok_docs):
        assert r.status_code == 200, r.text
    n_plain, n_docs = (r.json()["usage"]["prompt_tokens"] for r in (plain, docs))
    assert n_docs > n_plain, f"documents silently dropped: prompt_tokens {n_plain} == {n_docs}"
    assert by_kwargs.json()["usage"]["prompt_tokens"] == n_docs  # (as before: through the kwargs)
    assert (tok_plain.json()["count"], tok_docs.json()["count"]) == (n_plain, n_docs)
    assert both.status_code == 400 and "documents" in both.text, both.text  # (one of the two)


def test_include_reasoning_false_drops_the_thinking_whole_and_streamed(demo_engine):
    answer = "<think>list src first</think>Sure."
    whole, stream, kept = run_chat(
        demo_engine,
        answer,
        [
            chat_body(tools=None, include_reasoning=False),
            chat_body(tools=None, include_reasoning=False, stream=True),
            chat_body(tools=None),
        ],
        parser=None,
        reasoning_parser="qwen3",
    )
    msg = whole.json()["choices"][0]["message"]
    assert (msg["content"], msg["reasoning_content"]) == ("Sure.", None), msg
    deltas = [c["choices"][0]["delta"] for c in sse_chunks(stream)]
    assert not any(d.get("reasoning_content") for d in deltas), deltas
    assert "".join(d.get("content") or "" for d in deltas) == "Sure."
    assert kept.json()["choices"][0]["message"]["reasoning_content"] == "list src first"


def test_generation_configs_max_new_tokens_is_the_routes_default_max_tokens(demo_model_dir, tmp_path):
    """vLLM takes the checkpoint's generation_config.json max_new_tokens as the default max_tokens of
    the OpenAI routes too (pdserve did offline only: a chat client that leaves max_tokens out ran to
    EOS or the context; a completion's OpenAI default of 16 is lowered to it); a request's own
    max_tokens still decides, and the default never refuses a prompt (it is lowered to the room the
    prompt leaves)."""
    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from tests.test_offline_api import variant

    d = variant(demo_model_dir, tmp_path, generation={"max_new_tokens": 5})
    engine = LLMEngine(EngineConfig.create(d, num_pages=64, max_model_len=256))
    prompt = {"prompt": "def f(x):", "temperature": 0, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True}
    # (null: up to the context, so the default, lowered to the 3 tokens the prompt leaves)
    long_prompt = {"prompt": [7] * 253, "max_tokens": None, "temperature": 0, "ignore_eos": True}
    left_out, own, chat_left_out, chat_own, near_the_end = post_in_process(
        engine,
        [
            ("/v1/completions", prompt),
            ("/v1/completions", prompt | {"max_tokens": 8}),
            ("/v1/chat/completions", chat),
            ("/v1/chat/completions", chat | {"max_completion_tokens": 7}),
            ("/v1/completions", long_prompt),
        ],
    )
    tokens = [
        r.json()["usage"]["completion_tokens"] for r in (left_out, own, chat_left_out, chat_own, near_the_end)
    ]
    assert tokens == [5, 8, 5, 7, 3], tokens
    assert left_out.json()["choices"][0]["finish_reason"] == "length"


def test_integral_floats_are_integers_and_prompt_embeds_is_refused(demo_engine):
    """vLLM's lax parsing takes `"max_tokens": 4.0` (a budget computed in float arithmetic); pdserve's
    strict one refused it. Non-integral floats, strings and booleans stay 400s. `prompt_embeds` beside
    a prompt was ignored (the answer was the text's); now a 400."""
    body = {"prompt": "def f(x):", "temperature": 0, "ignore_eos": True}
    as_float, as_int, half, text, embeds = post_in_process(
        demo_engine,
        [
            ("/v1/completions", body | {"max_tokens": 4.0, "top_k": 1.0, "seed": 3.0, "n": 1.0}),
            ("/v1/completions", body | {"max_tokens": 4, "top_k": 1, "seed": 3}),
            ("/v1/completions", body | {"max_tokens": 4.5}),
            ("/v1/completions", body | {"max_tokens": "4"}),
            ("/v1/completions", body | {"max_tokens": 4, "prompt_embeds": "AAAA"}),
        ],
    )
    assert as_float.status_code == 200, as_float.text
    assert as_float.json()["choices"][0]["text"] == as_int.json()["choices"][0]["text"]
    assert as_float.json()["usage"]["completion_tokens"] == 4
    for r in (half, text, embeds):
        assert r.status_code == 400, r.text
    assert "prompt_embeds" in embeds.text
