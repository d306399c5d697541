"""Tool calling: the hermes parser and its streaming form with exact outputs, the template's view of
tools and past calls, and the chat route end to end in process. The route tests script what the
model says (the sampler picks the next token of a fixed answer; the engine, detokenizer, route,
parser and stream are the real ones), since the demo model's own text is noise."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pdserve.model.sampler import SampleResult
from pdserve.server.protocol import ChatMessage
from pdserve.server.tool_calls import HermesParser, ToolStream, check_tools, template_messages

P = HermesParser()
CALL_LS = '<tool_call>{"name": "ls", "arguments": {"path": "src"}}</tool_call>'
CALL_CAT = '<tool_call>\n{"name": "cat", "arguments": {"file": "a.py", "lines": [1, 2]}}\n</tool_call>'


def strip_ids(calls: list[dict]) -> list[dict]:
    for c in calls:
        assert c["id"].startswith("call_") and len(c["id"]) == 29
    return [{k: v for k, v in c.items() if k != "id"} for c in calls]


def test_parse_content_then_calls():
    content, calls = P.parse("Let me look.\n" + CALL_LS + "\n" + CALL_CAT + "\ntrailing text")
    assert content == "Let me look.\n"
    assert strip_ids(calls) == [
        {"type": "function", "function": {"name": "ls", "arguments": '{"path": "src"}'}},
        {"type": "function", "function": {"name": "cat", "arguments": '{"file": "a.py", "lines": [1, 2]}'}},
    ]
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize(
    "text",
    [
        "no calls at all",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        CALL_LS + '<tool_call>["x"]</tool_call>',  # one bad block: the whole answer stays text
        '<tool_call>{"name": "ls"',  # never closed
    ],
)
def test_parse_leaves_non_calls_as_content(text):
    assert P.parse(text) == (text, [])


def test_a_call_cut_short_leaves_the_whole_answer_as_text():
    cut = "x" + CALL_LS + '\n<tool_call>{"name": "g", "argu'
    assert P.parse(cut) == (cut, [])


def test_arguments_that_are_not_json_come_back_json_encoded():
    _, calls = P.parse('<tool_call>{"name": "f", "arguments": "not json"}</tool_call>')
    assert json.loads(calls[0]["function"]["arguments"]) == "not json"
    _, calls = P.parse('<tool_call>{"name": "f", "arguments": null}</tool_call>')
    assert calls[0]["function"]["arguments"] == "{}"


def test_stream_keeps_only_the_first_call_when_parallel_calls_are_off():
    content, calls = merged(feed_by(CALL_LS + CALL_CAT, 5, max_calls=1))
    assert content == "" and [c["function"]["name"] for c in calls] == ["ls"]


def test_parse_blank_content_is_none_and_string_arguments_pass_through():
    content, calls = P.parse('  \n<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert content is None and calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}


def feed_by(text: str, step: int, max_calls: int | None = None) -> list[dict]:
    s, out = ToolStream(P, max_calls), []
    for start in range(0, len(text), step):
        out += s.feed(text[start : start + step], start + step >= len(text))
    return out


def merged(deltas: list[dict]) -> tuple[str, list[dict]]:
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    return content, calls


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_stream_gives_the_same_content_and_calls_at_any_chunking(step):
    text = "Let me look.\n" + CALL_LS + "\n" + CALL_CAT + "\nafter"
    deltas = feed_by(text, step)
    content, calls = merged(deltas)
    assert content == "Let me look.\n"
    assert [c["index"] for c in calls] == [0, 1]
    assert [c["function"] for c in calls] == [c["function"] for c in P.parse(text)[1]]
    # Nothing of the marker ever leaks into content, even a partial "<tool_c" at a chunk's end.
    assert all("<" not in d.get("content", "") for d in deltas)


def test_stream_holds_back_only_what_may_start_a_marker():
    s = ToolStream(P)
    assert s.feed("a <to", False) == [{"content": "a "}]
    assert s.feed("d", False) == [{"content": "<tod"}]  # not a marker after all
    assert s.feed(" <tool_call>{", False) == [{"content": " "}]
    assert s.feed('"name": "x"}</tool_call>', False)[0]["tool_calls"][0]["function"] == {
        "name": "x",
        "arguments": "{}",
    }
    assert s.num_calls == 1


def test_stream_sends_bad_or_unclosed_blocks_as_content():
    bad = "<tool_call>oops</tool_call>"
    assert merged(feed_by(bad, 4)) == (bad, [])
    cut = 'ok <tool_call>{"name": "ls", "argu'
    assert merged(feed_by(cut, 5)) == (cut, [])


def test_template_messages_decode_arguments_and_keep_tool_fields():
    msgs = [
        ChatMessage(role="user", content="list src"),
        ChatMessage(
            role="assistant",
            content=None,
            tool_calls=[
                {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"path": "src"}'}}
            ],
        ),
        ChatMessage(role="tool", content="a.py", tool_call_id="c1", name="ls"),
    ]
    out = template_messages(msgs)
    assert out[0] == {"role": "user", "content": "list src"}
    assert out[1]["tool_calls"][0]["function"] == {"name": "ls", "arguments": {"path": "src"}}
    assert out[1]["content"] == ""
    assert out[2] == {"role": "tool", "content": "a.py", "tool_call_id": "c1", "name": "ls"}
    with pytest.raises(ValueError, match="function.name"):
        template_messages([ChatMessage(role="assistant", tool_calls=[{"function": {}}])])
    with pytest.raises(ValueError, match="list"):
        template_messages([ChatMessage(role="assistant", tool_calls={"a": 1})])
    for bad in ({"a": 1}, [{"type": "function"}], [{"type": "function", "function": {"name": ""}}]):
        with pytest.raises(ValueError):
            check_tools(bad)


# ---- the chat route, in process, with a scripted answer ------------------------------------------
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "ls",
            "description": "List a directory",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


class Scripted:
    """The sampler of a model that answers `text` (then EOS), whatever it is asked."""

    def __init__(self, engine, text: str) -> None:
        self.ids = engine.tokenizer.encode(text, add_special_tokens=False) + [engine.tokenizer.eos_token_id]
        assert engine.tokenizer.decode(self.ids) == text

    def __call__(self, logits, params, generators, histories=None) -> SampleResult:
        picks = [self.ids[min(len(h.output_token_ids), len(self.ids) - 1)] for h in histories]
        return SampleResult(picks, [None] * len(picks))


@pytest.fixture(scope="module")
def engine(demo_engine):
    return demo_engine


def run_chat(
    engine, answer: str, bodies: list[dict], parser: str | None = "hermes", **app_kw
) -> list[httpx.Response]:
    from pdserve.server.api import build_app

    real = engine.runner.sampler
    engine.runner.sampler = Scripted(engine, answer)
    app = build_app(engine, tool_call_parser=parser, **app_kw)

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            return [await c.post("/v1/chat/completions", json=b) for b in bodies]

    try:
        return asyncio.run(go())
    finally:
        app.state.engine.shutdown()
        engine.runner.sampler = real


def chat_body(**kw) -> dict:
    return {
        "messages": [{"role": "user", "content": "what is in src?"}],
        "max_tokens": 64,
        "tools": TOOLS,
    } | kw


def sse_chunks(r: httpx.Response) -> list[dict]:
    lines = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_chat_returns_tool_calls_whole_and_streamed(engine):
    answer = "Looking.\n" + CALL_LS
    whole, streamed = run_chat(engine, answer, [chat_body(), chat_body(stream=True)])
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Looking.\n"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "ls", "arguments": '{"path": "src"}'}
    chunks = sse_chunks(streamed)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert content == "Looking.\n" and [tc["function"] for tc in calls] == [call["function"]]
    assert calls[0]["index"] == 0 and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_chat_with_tools_but_no_call_and_with_tool_choice_none_is_plain(engine):
    answer = "Nothing to call <tool_c here."
    r1, r2 = run_chat(engine, answer, [chat_body(), chat_body(tool_choice="none", stream=True)])
    c1 = r1.json()["choices"][0]
    assert c1["message"] == {"role": "assistant", "content": answer} and c1["finish_reason"] == "stop"
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in sse_chunks(r2))
    assert content == answer


# A turn after a call: the user's question, the assistant's call, the tool's result.
HISTORY = [
    {"role": "user", "content": "what is in src?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"path": "src"}'}}
        ],
    },
    {"role": "tool", "content": "a.py b.py", "tool_call_id": "c1"},
]


def test_tools_render_into_the_prompt_and_past_calls_too(engine):
    history = HISTORY
    plain, with_tools, turn2 = run_chat(
        engine,
        "ok",
        [
            chat_body(tools=None, max_tokens=2),
            chat_body(max_tokens=2),
            chat_body(messages=history, max_tokens=2),
        ],
    )
    n_plain, n_tools = (r.json()["usage"]["prompt_tokens"] for r in (plain, with_tools))
    tok = engine.tokenizer
    tools_text = json.dumps(TOOLS[0]["function"])
    assert n_tools > n_plain + len(tok.encode(tools_text, add_special_tokens=False)) - 5
    prompt = tok.apply_chat_template(template_messages([ChatMessage(**m) for m in history]), True, TOOLS)
    assert '<tool_call>{"name": "ls", "arguments": {"path": "src"}}</tool_call>' in prompt
    assert turn2.json()["usage"]["prompt_tokens"] == len(tok.encode(prompt, add_special_tokens=False))


@pytest.mark.parametrize(
    ("kw", "parser", "word"),
    [
        ({}, None, "--tool-call-parser"),
        ({"tool_choice": "required"}, None, "--tool-call-parser"),  # (its grammar is the parser's format)
        ({"tool_choice": {"type": "function", "function": {"name": "cat"}}}, "hermes", "not among"),
        ({"tools": [{"type": "function", "function": {}}]}, "hermes", "name"),
        ({"tools": "ls"}, "hermes", "tools"),
        ({"tools": None, "tool_choice": "required"}, "hermes", "tool_choice"),  # not ignored without tools
        ({"tools": None, "tool_choice": "auto"}, "hermes", "needs tools"),
        ({"tool_choice": "bogus"}, "hermes", "tool_choice"),
        ({"tools": [1], "tool_choice": "none"}, "hermes", "tool"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"x": 1}]}]}, "hermes", "function.name"),
    ],
)
def test_bad_tool_requests_are_400s_and_change_no_state(engine, kw, parser, word):
    before = engine.kv.pool.num_free_pages
    (r,) = run_chat(engine, "ok", [chat_body(**kw)], parser=parser)
    assert r.status_code == 400 and word in r.json()["error"]["message"], r.text
    assert engine.kv.pool.num_free_pages == before and not engine.requests


def test_length_cut_keeps_length_and_parallel_off_keeps_one_call(engine):
    two = CALL_LS + CALL_CAT
    n_tokens = len(engine.tokenizer.encode(two, add_special_tokens=False))
    cut, one, none_choice, auto = run_chat(
        engine,
        two,
        [
            chat_body(max_tokens=n_tokens - 3),  # the second call is cut short
            chat_body(parallel_tool_calls=False, max_tokens=200),
            chat_body(tool_choice="none", max_tokens=1),
            chat_body(max_tokens=1),
        ],
    )
    c = cut.json()["choices"][0]
    assert c["finish_reason"] == "length" and "tool_calls" not in c["message"]
    assert c["message"]["content"] == engine.tokenizer.decode(
        engine.tokenizer.encode(two, add_special_tokens=False)[: n_tokens - 3]
    )
    c = one.json()["choices"][0]
    assert c["finish_reason"] == "tool_calls" and [
        t["function"]["name"] for t in c["message"]["tool_calls"]
    ] == ["ls"]
    # tool_choice none still shows the tools to the model: the same prompt as auto
    assert none_choice.json()["usage"]["prompt_tokens"] == auto.json()["usage"]["prompt_tokens"]
