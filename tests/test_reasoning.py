"""Reasoning parsers: `<think>...</think>` -> reasoning_content, whole and streamed at any chunking,
and the chat route in process (scripted answers, as in tests/test_tool_calls.py), with tool calls
after the thinking."""

from __future__ import annotations

import pytest

from pdserve.server.reasoning import DeepSeekR1Parser, Qwen3Parser, ReasoningStream
from tests.test_tool_calls import CALL_LS, chat_body, run_chat, sse_chunks

R1, Q3 = DeepSeekR1Parser(), Qwen3Parser()


@pytest.mark.parametrize(
    ("parser", "text", "expected"),
    [
        (R1, "plan it</think>the answer", ("plan it", "the answer")),
        (R1, "<think>plan it</think>the answer", ("plan it", "the answer")),
        (R1, "\n<think>plan</think>", ("plan", None)),
        (R1, "still thinking when cut", ("still thinking when cut", None)),
        (Q3, "<think>plan it</think>the answer", ("plan it", "the answer")),
        (Q3, "no thinking here", (None, "no thinking here")),
        (Q3, "<think>unclosed", (None, "<think>unclosed")),
        (Q3, "a </think> in prose", (None, "a </think> in prose")),
    ],
)
def test_split(parser, text, expected):
    assert parser.split(text) == expected


def streamed(parser, text: str, step: int) -> tuple[str, str]:
    s, pieces = ReasoningStream(parser), []
    for i in range(0, len(text), step):
        pieces += s.feed(text[i : i + step], i + step >= len(text))
    return (
        "".join(t for k, t in pieces if k == "reasoning"),
        "".join(t for k, t in pieces if k == "content"),
    )


@pytest.mark.parametrize("step", [1, 2, 5, 100])
@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (R1, "plan it</think>the answer"),
        (R1, "<think>plan it</think>the answer"),
        (Q3, "<think>plan it</think>the answer"),
        (Q3, "no thinking here"),
        (R1, "all thought, cut"),
    ],
)
def test_stream_equals_split_at_any_chunking(parser, text, step):
    reasoning, content = parser.split(text)
    assert streamed(parser, text, step) == (reasoning or "", content or "")


def test_route_splits_reasoning_then_parses_calls_whole_and_streamed(demo_engine):
    engine = demo_engine
    answer = "<think>list src first</think>Sure.\n" + CALL_LS
    whole, stream = run_chat(engine, answer, [chat_body(), chat_body(stream=True)], reasoning_parser="qwen3")
    msg = whole.json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "list src first" and msg["content"] == "Sure.\n"
    assert msg["tool_calls"][0]["function"]["name"] == "ls"
    assert whole.json()["choices"][0]["finish_reason"] == "tool_calls"
    deltas = [c["choices"][0]["delta"] for c in sse_chunks(stream)]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "list src first"
    assert "".join(d.get("content") or "" for d in deltas) == "Sure.\n"
    assert [t["function"]["name"] for d in deltas for t in d.get("tool_calls", [])] == ["ls"]


def test_route_without_tools_and_without_thinking(demo_engine):
    engine = demo_engine
    plain, stream = run_chat(
        engine,
        "just an answer",
        [chat_body(tools=None), chat_body(tools=None, stream=True)],
        parser=None,
        reasoning_parser="qwen3",
    )
    msg = plain.json()["choices"][0]["message"]
    assert msg["content"] == "just an answer" and msg["reasoning_content"] is None
    deltas = [c["choices"][0]["delta"] for c in sse_chunks(stream)]
    assert "".join(d.get("content") or "" for d in deltas) == "just an answer"
    assert not any(d.get("reasoning_content") for d in deltas)
