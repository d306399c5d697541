"""Tool calls at their edges (found by a review of tool calling against vLLM's, 2026-12-02; each test
failed before its fix): a tool whose parameters are not a schema object is a 400; a forced call's
arguments are their own schema root (references into the tool's schema resolve, a recursive `#`
means the arguments); an argument holding the end marker's text does not end the call; a stream
keeps the text after a block that is not a call, as the whole answer does."""

from __future__ import annotations

import json

import pytest

from pdserve.model.grammar import InvalidGrammar
from pdserve.sampling_params import StructuredOutputs
from pdserve.server.tool_calls import HermesParser, ToolStream
from tests.conftest import post_in_process
from tests.test_tool_calls import Scripted

P = HermesParser()
MSGS = [{"role": "user", "content": "hi"}]


def grammar_accepts(engine, lark: str, text: str) -> bool:
    """Whether the grammar `lark` accepts `text` (tokenized as the model would write it) to the end."""
    g = engine.grammars.grammar_for(StructuredOutputs(grammar=lark))
    for t in engine.tokenizer.encode(text, add_special_tokens=False):
        if not g.matcher.consume_token(t):
            return False
    return g.matcher.is_accepting()


def post(engine, body: dict, sampler=None):
    """One chat request in process; an exception escaping the app is what a server answers with a 500."""
    try:
        (r,) = post_in_process(engine, [("/v1/chat/completions", body)], sampler, tool_call_parser="hermes")
    except Exception as e:  # (ASGITransport re-raises what the app raised: a 500 in a real server)
        pytest.fail(f"500: the route raised {type(e).__name__}: {e}")
    return r


# ---- 1. a tool whose `parameters` is not an object: 500 under a forced tool_choice ----------------
@pytest.mark.parametrize("params", ["oops", [1], 5])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_tool_parameters_that_are_not_an_object_are_a_400_not_a_500(demo_engine, params, choice):
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    r = post(demo_engine, {"messages": MSGS, "max_tokens": 4, "tools": tools, "tool_choice": choice})
    assert r.status_code == 400 and "parameters" in r.json()["error"]["message"], r.text


# ---- 2. forced tool_choice: the tool's schema is not the root of its arguments' grammar -----------
def test_named_tool_with_a_reference_into_its_own_properties_compiles(demo_engine):
    """zod-to-json-schema (TypeScript agent SDKs) writes a reused sub-schema as `#/properties/...`; the
    schema is valid (as a root it compiles) but the forced call grammar puts it under
    `properties.arguments` of the call object, where the pointer does not exist: a 400."""
    params = {
        "type": "object",
        "properties": {
            "src": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
            "dst": {"$ref": "#/properties/src"},
        },
        "required": ["src", "dst"],
        "additionalProperties": False,
    }
    demo_engine.grammars.grammar_for(StructuredOutputs(json=params))  # (valid: compiles as a root)
    lark = P.call_grammar([{"type": "function", "function": {"name": "move", "parameters": params}}], False)
    try:
        demo_engine.grammars.grammar_for(StructuredOutputs(grammar=lark))
    except InvalidGrammar as e:
        pytest.fail(f"a valid tool schema does not compile as a forced call: {str(e)[:160]}")


def test_named_tool_with_a_recursive_root_reference_constrains_to_its_schema(demo_engine):
    """`{"$ref": "#"}` (a tree) means the parameters schema itself; in the call grammar `#` is the
    call object, so a schema-valid call is refused and a schema-invalid one is forced instead."""
    tree = {
        "type": "object",
        "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["v"],
        "additionalProperties": False,
    }
    lark = P.call_grammar([{"type": "function", "function": {"name": "tree", "parameters": tree}}], False)
    valid = '<tool_call>\n{"name": "tree", "arguments": {"v": 1, "kids": [{"v": 2}]}}\n</tool_call>'
    invalid = (
        '<tool_call>\n{"name": "tree", "arguments": {"v": 1, "kids": '
        '[{"name": "tree", "arguments": {"v": 2}}]}}\n</tool_call>'
    )
    assert (grammar_accepts(demo_engine, lark, valid), grammar_accepts(demo_engine, lark, invalid)) == (
        True,
        False,
    )


# ---- 3. tool_choice "required": the grammar allows a call the parser cannot read ------------------
WRITE = [
    {
        "type": "function",
        "function": {
            "name": "write",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string"}},
                "required": ["text"],
            },
        },
    }
]
CALL_WITH_MARKER = '<tool_call>\n{"name": "write", "arguments": {"text": "x </tool_call> y"}}\n</tool_call>'


def test_a_forced_call_whose_argument_contains_the_end_marker_is_still_a_call(demo_engine):
    lark = P.call_grammar(WRITE, True)
    assert grammar_accepts(demo_engine, lark, CALL_WITH_MARKER)  # the grammar lets the model write it
    content, calls = P.parse(CALL_WITH_MARKER)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"text": "x </tool_call> y"}], content


def test_tool_choice_required_always_answers_with_tool_calls(demo_engine):
    body = {"messages": MSGS, "tools": WRITE, "tool_choice": "required", "max_tokens": 100}
    r = post(demo_engine, body, Scripted(demo_engine, CALL_WITH_MARKER))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"].get("tool_calls"), choice


# ---- 4. streaming: text after a block that is not a call is lost ---------------------------------
@pytest.mark.parametrize("step", [1, 4, 1000])
def test_stream_sends_text_after_a_bad_block_like_the_whole_answer(step):
    """The module says a block that does not parse "is sent as content so no text is lost"; the
    non-streamed answer is the whole text, the stream drops everything after the bad block."""
    text = "<tool_call>not json</tool_call> and the rest of the answer"
    s, deltas = ToolStream(P), []
    for i in range(0, len(text), step):
        deltas += s.feed(text[i : i + step], i + step >= len(text))
    streamed = "".join(d.get("content", "") for d in deltas)
    assert P.parse(text) == (text, [])
    assert streamed == text


# ---- 5. JSON nested past the parser's depth (a review, 2026-12-05) -------------------------------
DEEP = "[" * 1200


def test_a_model_call_nested_past_the_json_parsers_depth_is_content_not_a_500():
    """A looping model writes `<tool_call>` and a thousand `[`: json.loads raises RecursionError, not a
    ValueError; the whole answer was a 500, a stream an in-band 503 "engine failure" (RecursionError is
    a RuntimeError) with every token lost. It is content, as any block that is not a call."""
    text = f"<tool_call>{DEEP}</tool_call>"
    assert P.parse(text) == (text, [])
    s = ToolStream(P)
    assert "".join(d.get("content", "") for d in s.feed(text, True)) == text
    wrapped = '<tool_call>{"name": "f", "arguments": "' + DEEP + '"}</tool_call>'
    _, calls = P.parse(wrapped)  # (arguments that are a string too deep to parse stay that string)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [DEEP]


def test_a_history_tool_call_nested_past_the_json_parsers_depth_is_not_a_500(demo_engine):
    """An assistant message whose tool call's `arguments` nests 2,000 deep: rendering the chat template
    raised RecursionError, a plain-text 500 (and the same from /tokenize). The arguments stay the
    string they were."""
    history = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 2000}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    r = post(demo_engine, {"messages": history, "max_tokens": 1})
    assert r.status_code in (200, 400), r.text
    (t,) = post_in_process(demo_engine, [("/tokenize", {"messages": history})])
    assert t.status_code in (200, 400), t.text
