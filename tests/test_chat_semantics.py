"""Chat semantics a review found apart from vLLM, now matched: chat_template_kwargs reach the template
(chat and /tokenize), text parts join with newlines, an assistant's past reasoning reaches the template,
content parts a text model cannot read are a 400, not silently dropped, and blank text before a tool
call is streamed as the whole answer gives it (none)."""

from __future__ import annotations

import contextlib

from pdserve.server.protocol import ChatMessage
from pdserve.server.tool_calls import template_messages
from tests.conftest import post_in_process
from tests.test_tool_calls import CALL_LS, chat_body, run_chat, sse_chunks

# A Qwen3-like template tail: thinking off closes an empty think block in the prompt.
THINK_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


@contextlib.contextmanager
def template(engine, text):
    tok = engine.tokenizer
    old = tok.chat_template
    tok.set_chat_template(text)
    try:
        yield
    finally:
        tok.set_chat_template(old)


def test_chat_template_kwargs_reach_the_template(demo_engine):
    """vLLM passes `chat_template_kwargs` (e.g. Qwen3's enable_thinking=False) to the template."""
    msgs = [{"role": "user", "content": "hi"}]
    with template(demo_engine, THINK_TEMPLATE):
        plain, off = run_chat(
            demo_engine,
            "ok",
            [
                {"messages": msgs, "max_tokens": 2},
                {"messages": msgs, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}},
            ],
            parser=None,
        )
    assert plain.status_code == off.status_code == 200, (plain.text, off.text)
    n_plain = plain.json()["usage"]["prompt_tokens"]
    n_off = off.json()["usage"]["prompt_tokens"]
    assert n_off > n_plain, f"chat_template_kwargs silently ignored: prompt_tokens {n_plain} == {n_off}"


def test_tokenize_takes_chat_template_kwargs_and_counts_what_the_chat_route_renders(demo_engine):
    """vLLM's /tokenize (TokenizeChatRequest) takes chat_template_kwargs like the chat route; they may
    not replace the template's fixed variables (messages, tools, ...)."""
    msgs = [{"role": "user", "content": "hi"}]
    kwargs = {"enable_thinking": False}
    with template(demo_engine, THINK_TEMPLATE):
        (tok,) = post_in_process(
            demo_engine, [("/tokenize", {"messages": msgs, "chat_template_kwargs": kwargs})]
        )
        (chat,) = run_chat(
            demo_engine,
            "ok",
            [{"messages": msgs, "max_tokens": 2, "chat_template_kwargs": kwargs}],
            parser=None,
        )
        (bad,) = post_in_process(
            demo_engine, [("/tokenize", {"messages": msgs, "chat_template_kwargs": {"messages": []}})]
        )
    assert tok.status_code == 200, tok.text
    assert tok.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    assert bad.status_code == 400 and "may not set ['messages']" in bad.json()["error"]["message"]


def test_text_parts_join_with_newline_as_vllm():
    """vLLM's chat_utils joins a message's text parts with "\\n" (text_prompt = "\\n".join(texts))."""
    m = ChatMessage(
        role="user", content=[{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    )
    (msg,) = template_messages([m])
    assert msg["content"] == "first\nsecond", msg["content"]


def test_assistant_reasoning_reaches_the_template():
    """vLLM copies an assistant message's reasoning onto `reasoning` and `reasoning_content` for
    templates (Qwen3's reads message.reasoning_content for interleaved thinking)."""
    m = ChatMessage(role="assistant", content="ok", reasoning_content="I thought")
    (msg,) = template_messages([m])
    assert msg.get("reasoning_content") == "I thought", msg


def test_non_text_content_parts_are_not_silently_dropped(demo_engine):
    """An image part to a text-only model: vLLM refuses it (400); here it vanishes from the prompt."""
    parts = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]
    (r,) = run_chat(
        demo_engine, "ok", [{"messages": [{"role": "user", "content": parts}], "max_tokens": 2}], parser=None
    )
    assert r.status_code == 400, (r.status_code, r.text[:200])


def test_streamed_content_equals_whole_content_when_only_blank_text_comes_before_a_call(demo_engine):
    """Reasoning, then "\n\n", then a call (Qwen3's usual shape): the whole answer's content is null
    (blank content before a call is none), and the stream sent "\n\n" as content (found by review).
    Blank content is held until a non-blank character or the end: both now agree."""
    for answer in ("<think>plan</think>\n\n" + CALL_LS, "<think>plan</think>\n\nSure.\n" + CALL_LS):
        whole, stream = run_chat(
            demo_engine, answer, [chat_body(), chat_body(stream=True)], reasoning_parser="qwen3"
        )
        msg = whole.json()["choices"][0]["message"]
        deltas = [c["choices"][0]["delta"] for c in sse_chunks(stream)]
        streamed = "".join(d.get("content") or "" for d in deltas[1:])
        assert msg["tool_calls"] and any(d.get("tool_calls") for d in deltas)
        assert (msg["content"] or "") == streamed, (msg["content"], streamed)
