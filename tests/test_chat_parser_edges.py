"""Tool calls and reasoning in the chat route, whole and streamed, at their edges (a review of tool
calls, reasoning parsers and structured outputs, 2026-12-02, fifth session; each test failed before
its fix): blank text before a block that is not a call, a call after a bad block, a whole call
without its closing tag, and a prompt that already closed or opened the thinking.

Technique as in tests/test_tool_calls.py: a scripted sampler forces an exact token sequence; the
engine, detokenizer, route, parsers and streams are the real ones.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pdserve.model.sampler import SampleResult
from tests.test_chat_semantics import template


# ---- harness -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.model.demo import make_demo_model

    d = make_demo_model(tmp_path_factory.mktemp("demo"))
    return LLMEngine(EngineConfig.create(str(d), num_pages=128, max_model_len=1024))


class Ids:
    """A sampler that emits `ids` in order (the last repeated), whatever the logits."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def __call__(self, logits, params, generators, histories=None) -> SampleResult:
        picks = [self.ids[min(len(h.output_token_ids), len(self.ids) - 1)] for h in histories]
        return SampleResult(picks, [None] * len(picks))


def ids_of(eng, text: str, eos: bool = True) -> list[int]:
    ids = eng.tokenizer.encode(text, add_special_tokens=False)
    assert eng.tokenizer.decode(ids) == text
    return ids + ([eng.tokenizer.eos_token_id] if eos else [])


def post(eng, bodies: list[dict], ids: list[int], **app_kw) -> list[httpx.Response]:
    from pdserve.server.api import build_app

    real = eng.runner.sampler
    eng.runner.sampler = Ids(ids)
    app = build_app(eng, **app_kw)

    async def go():
        t = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=t, base_url="http://t", timeout=120) as c:
            return [await c.post("/v1/chat/completions", json=b) for b in bodies]

    try:
        return asyncio.run(go())
    finally:
        app.state.engine.shutdown()
        eng.runner.sampler = real


def merged(r: httpx.Response) -> tuple[str, str, list[dict], str | None]:
    """A stream's (content, reasoning_content, calls [{name, arguments}], finish_reason), as an OpenAI
    client accumulates the deltas."""
    lines = [x[6:] for x in r.text.split("\n") if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    content, thought, calls, finish = "", "", {}, None
    for c in map(json.loads, lines[:-1]):
        if not c["choices"]:
            continue
        ch = c["choices"][0]
        d = ch["delta"]
        content += d.get("content") or ""
        thought += d.get("reasoning_content") or ""
        for tc in d.get("tool_calls", []):
            cur = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            cur["name"] += tc.get("function", {}).get("name") or ""
            cur["arguments"] += tc.get("function", {}).get("arguments") or ""
        finish = ch["finish_reason"] or finish
    return content, thought, [calls[k] for k in sorted(calls)], finish


def whole(r: httpx.Response) -> tuple[str, str, list[dict], str | None]:
    """The same four of a whole answer (null content / reasoning as "")."""
    ch = r.json()["choices"][0]
    m = ch["message"]
    calls = [dict(c["function"]) for c in m.get("tool_calls") or []]
    return m.get("content") or "", m.get("reasoning_content") or "", calls, ch["finish_reason"]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "ls",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


def body(**kw) -> dict:
    return {
        "messages": [{"role": "user", "content": "what is in src?"}],
        "max_tokens": 200,
        "tools": TOOLS,
    } | kw


# A template whose generation prompt ends as Qwen3's with enable_thinking=False (thinking closed),
# and one whose generation prompt opens the thinking (`<think>\n`: Qwen3-*-Thinking-2507, Qwen3.5,
# DeepSeek-R1-0528): the model then writes only `...</think>answer`.
TAIL = "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
CLOSED_TEMPLATE = TAIL + (
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
OPEN_TEMPLATE = TAIL + "{% if add_generation_prompt %}<|assistant|>\n<think>\n{% endif %}"


# ---- 1. stream drops blank content held before a block that then is not a call ---------------------
@pytest.mark.parametrize(
    ("answer", "cut"),
    [
        # Qwen3's usual shape ("\n\n" then a call), cut by max_tokens inside the call
        ('\n\n<tool_call>{"name": "ls", "arguments": {"pa', True),
        # a block that is not a call, after blank text
        ("  <tool_call>not json</tool_call> and more", False),
    ],
)
def test_stream_keeps_blank_text_before_a_block_that_is_not_a_call(eng, answer, cut):
    """tool_calls.py ToolStream.feed (~l.206-218): blank content before a `<tool_call>` is held back
    (before a call it is none) and then DROPPED at `if at and (self.sent_content or
    rest[:at].strip())` — even when the block turns out not to be a call (it does not parse, or a
    length cut leaves it unclosed). The whole answer is then all text (`parse` -> (text, [])), blank
    prefix included; the stream sends the same text minus its blank start. The module says a bad or
    unclosed block "is sent as content so no text is lost". Expected: concatenated stream content ==
    whole content (e.g. '\\n\\n<tool_call>{...'); actual: the stream lacks the leading '\\n\\n' / '  '."""
    ids = ids_of(eng, answer, eos=not cut)
    kw = {"max_tokens": len(ids)} if cut else {}
    w, s = post(eng, [body(**kw), body(stream=True, **kw)], ids, tool_call_parser="hermes")
    assert whole(w)[0] == answer  # (the whole answer keeps everything)
    assert merged(s)[0] == whole(w)[0], (merged(s)[0], whole(w)[0])


# ---- 2. stream sends a call after a bad block; the whole answer has none ----------------------------
def test_stream_sends_no_call_after_a_bad_block_when_the_whole_answer_has_none(eng):
    """tool_calls.py ToolStream.feed (~l.240-244): after a block that does not parse, with no call sent
    yet, the stream goes back to plain text ("unless a call went out: the whole answer keeps it too")
    — but the next `<tool_call>` is then parsed and sent as a call, and the blank text between the two
    blocks is dropped (the bad block's content never sets `sent_content`). The whole answer
    (all-or-nothing, as vLLM's `extract_tool_calls`) is the raw text, no calls, finish "stop". No call
    had gone out before the bad block, so this is not the documented "cannot take back calls already
    sent" case: the stream could, and says it means to, match the whole answer.
    Expected: stream == whole == (whole text, no calls, "stop"); actual: stream content
    '<tool_call>not json</tool_call>' + a call to ls, finish_reason "tool_calls"."""
    answer = (
        '<tool_call>not json</tool_call>\n<tool_call>{"name": "ls", "arguments": {"path": "x"}}</tool_call>'
    )
    w, s = post(eng, [body(), body(stream=True)], ids_of(eng, answer), tool_call_parser="hermes")
    assert whole(w) == (answer, "", [], "stop")
    assert merged(s) == whole(w), merged(s)


# ---- 3. a call whose closing tag never came, though its JSON is complete and the model stopped ------
@pytest.mark.parametrize("how", ["eos", "stop string"])
def test_a_complete_call_without_its_closing_tag_is_a_call_as_in_vllm(eng, how):
    """tool_calls.py ToolCallParser.parse (~l.60-66) and ToolStream (~l.229): a block with no
    `</tool_call>` never decodes ("an unclosed block, cut by max_tokens"), so the answer is plain text.
    But the model may stop right after a complete call: EOS after the JSON (small Qwen/Hermes models
    do), or the client's `stop: ["</tool_call>"]` (the stop string is not in the text). vLLM's hermes
    parser matches `<tool_call>(.*?)</tool_call>|<tool_call>(.*)` precisely for this: the tail
    json.loads and is a call (finish "tool_calls"); only a real cut (JSON incomplete) stays text.
    Expected: one call ls({"path": "x"}), content "Sure.\\n", finish "tool_calls"; actual: the whole
    answer as content, no tool_calls, finish "stop" (same in the stream)."""
    call = '<tool_call>\n{"name": "ls", "arguments": {"path": "x"}}\n'
    if how == "eos":
        ids, kw = ids_of(eng, "Sure.\n" + call), {}
    else:
        ids, kw = ids_of(eng, "Sure.\n" + call + "</tool_call>"), {"stop": ["</tool_call>"]}
    w, s = post(eng, [body(**kw), body(stream=True, **kw)], ids, tool_call_parser="hermes")
    expected = ("Sure.\n", "", [{"name": "ls", "arguments": '{"path": "x"}'}], "tool_calls")
    assert whole(w) == expected, whole(w)
    assert merged(s) == expected, merged(s)


# ---- 4/5. the reasoning parsers ignore the prompt's thinking state (the grammar does not) ----------
def test_deepseek_r1_parser_with_thinking_closed_by_the_prompt_returns_the_forced_call(eng):
    """api.py chat_completion params() (~l.665-672) sees that the prompt already closed the thinking
    (`prompt.rstrip().endswith(thinking.end)`, e.g. Qwen3 with enable_thinking=False — Qwen3 was
    launched with `--reasoning-parser deepseek_r1`) and constrains the answer from its first token;
    but the answer is then split by DeepSeekR1Parser.split (reasoning.py ~l.28-40), which always
    `starts_inside` the thought: an answer without `</think>` is all reasoning. So tool_choice
    "required" — whose grammar forced a `<tool_call>` — comes back with NO tool_calls: the call's text
    in reasoning_content, content null, finish "stop" (stream alike). Breaks the guarantee
    tests/test_tool_call_edges.py states ("tool_choice required always answers with tool_calls").
    Expected: tool_calls [ls({"path": "x"})], finish "tool_calls", reasoning null; actual: as above."""
    answer = '<tool_call>\n{"name": "ls", "arguments": {"path": "x"}}\n</tool_call>'
    kw = {"tool_choice": "required", "chat_template_kwargs": {"enable_thinking": False}}
    with template(eng, CLOSED_TEMPLATE):
        w, s = post(
            eng,
            [body(**kw), body(stream=True, **kw)],
            ids_of(eng, answer),
            tool_call_parser="hermes",
            reasoning_parser="deepseek_r1",
        )
    expected = ("", "", [{"name": "ls", "arguments": '{"path": "x"}'}], "tool_calls")
    assert whole(w) == expected, whole(w)
    assert merged(s) == expected, merged(s)


def test_qwen3_parser_with_thinking_opened_by_the_prompt_keeps_the_thought_out_of_json_content(eng):
    """The converse: a template whose generation prompt opens the thought (`<think>\\n`: Qwen3
    Thinking-2507, Qwen3.5) — the model writes `plan</think>{json}`. The route's grammar waits for
    `</think>` (prompt not closed) and constrains only what follows; but Qwen3Parser.split
    (reasoning.py ~l.31-35) finds no leading `<think>` in the answer and returns it ALL as content, so
    `response_format: json_object` returns content 'plan it</think>{"a": 1}' — not JSON (README: "The
    answer always matches"). vLLM's current qwen3 parser strips an optional `<think>` and splits on
    `</think>` (reasoning "plan it", content '{"a": 1}').
    Expected: reasoning_content "plan it", content '{"a": 1}' (whole and stream); actual: content is
    the thought + '</think>' + JSON, reasoning_content null."""
    ids = ids_of(eng, "plan it</think>", eos=False) + ids_of(eng, '{"a": 1}')  # (marker tokens apart)
    kw = {"tools": None, "response_format": {"type": "json_object"}}
    with template(eng, OPEN_TEMPLATE):
        w, s = post(eng, [body(**kw), body(stream=True, **kw)], ids, reasoning_parser="qwen3")
    assert w.json()["choices"][0]["finish_reason"] == "stop"  # (the grammar did constrain the tail)
    expected = ('{"a": 1}', "plan it", [], "stop")
    assert whole(w) == expected, whole(w)
    assert merged(s) == expected, merged(s)
