"""Tool calls in chat completions: the model's text -> OpenAI `tool_calls`, whole or streamed.

Who calls it: the chat route (`server/api.py`) of an engine started with `--tool-call-parser NAME`,
for requests that carry `tools` (with `tool_choice` "auto", the default). The request's tools and its
messages (assistant `tool_calls`, `tool` results) go to the chat template, which shows them to the
model its own way; the model answers in text, and a parser, chosen by name from `PARSERS`, finds the
calls in it. Under PD the decode, which streams the answer, parses it; the prefill only renders.

`hermes` (Hermes 2 Pro, Qwen2.5, Qwen3 and others): each call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. The message's `content` is the text
before the first call (None when blank); text after a call is dropped, as vLLM's parser does. A
block that is not such JSON leaves the whole answer as content, with no calls (all or nothing).
`finish_reason` becomes "tool_calls" when calls were found.

Streaming (`ToolStream`): content streams until a call starts, holding back an unfinished `<tool_call>`
marker; each call goes out whole, as one `tool_calls` delta, once its closing tag arrived (OpenAI
clients accumulate deltas by `index`, so one delta per call is valid). A block that does not parse,
or an unclosed one at the end (a length cut), is sent as content so no text is lost (the streamed
form cannot take back calls already sent, so it is not all-or-nothing). A length cut keeps
`finish_reason` "length" in both forms. `parallel_tool_calls: false` keeps the first call only.
"""

from __future__ import annotations

import json
import re
import uuid

from pdserve.sampling_params import COMPACT_JSON


class ToolCallParser:
    """Finds tool calls in a model's answer. Subclasses set the markers; `decode_call` reads one."""

    name = ""
    start = ""  # marker that opens a call
    end = ""  # marker that closes it

    def decode_call(self, block: str) -> dict | None:
        """One call's text (between the markers) -> {"name", "arguments" (a JSON string)}; None if
        it is not a call."""
        raise NotImplementedError

    def call_grammar(self, tools: list[dict], parallel: bool, token_id=lambda text: None) -> str:
        """A grammar (Lark, llguidance's dialect) of an answer made only of calls to `tools`, in this
        parser's format: one call, or with `parallel` one or more. Used for `tool_choice` "required"
        and a named function: the model writes calls the way its template taught it, and the parser
        reads them back (SGLang constrains its parsers' formats the same way). `token_id(text)`: the
        id of `text` if it is one token of the vocabulary (a marker is then that token, as the model
        was trained to write it, not spelled out in pieces)."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, calls) of a whole answer; calls are OpenAI `tool_calls` items (with fresh ids)."""
        at = text.find(self.start)
        if at < 0:
            return text, []
        calls = []
        # A closed block, or an unclosed one running to the end (cut by max_tokens): the latter never
        # decodes, so a cut call leaves the whole answer as text rather than vanishing.
        block = re.escape(self.start) + r"(.*?)" + re.escape(self.end) + "|" + re.escape(self.start) + "(.*)"
        for m in re.finditer(block, text[at:], re.DOTALL):
            call = self.decode_call(m.group(1)) if m.group(2) is None else None
            if call is None:
                return text, []
            calls.append(openai_call(call))
        content = text[:at]
        return (content if content.strip() else None), calls


class HermesParser(ToolCallParser):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def decode_call(self, block: str) -> dict | None:
        try:
            obj = json.loads(block)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments")
        if args is None:
            args = {}
        if isinstance(args, str):  # some models write the arguments as a JSON string already
            try:
                json.loads(args)
                return {"name": obj["name"], "arguments": args}
            except ValueError:  # not JSON: encoded, so that the client's json.loads gives it back
                pass
        return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}

    def call_grammar(self, tools: list[dict], parallel: bool, token_id=lambda text: None) -> str:
        # Each call is one JSON object, the tool's name then arguments matching its parameters, in the
        # compact form Hermes and Qwen templates show (`{"name": "f", "arguments": {"x": 1}}`). One
        # %json alternative per tool: each is its own schema root, so its `$defs` resolve.
        def marker(text: str) -> str:
            tid = token_id(text)
            return json.dumps(text) if tid is None else f"<[{tid}]>"

        bodies = " | ".join(f"%json {json.dumps(call_schema(t['function']))}" for t in tools)
        lines = [
            f"start: call ({json.dumps(NL)} call)*" if parallel else "start: call",
            f"call: {marker(self.start)} {json.dumps(NL)} body {json.dumps(NL)} {marker(self.end)}",
            f"body: {bodies}",
        ]
        return NL.join(lines) + NL


PARSERS: dict[str, type[ToolCallParser]] = {HermesParser.name: HermesParser}


def make_parser(name: str) -> ToolCallParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()


def openai_call(call: dict) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call["name"], "arguments": call["arguments"]},
    }


class ToolStream:
    """One streamed answer: `feed(delta, finished)` with the text the step added returns the deltas
    to send (each {"content": str} or {"tool_calls": [item]}); `num_calls` counts the calls sent.
    Only the text not yet sent is kept, and an open call is searched for its end from where the last
    search stopped: O(answer) over the whole stream."""

    def __init__(self, parser: ToolCallParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls  # parallel_tool_calls=false: 1 (later calls are dropped)
        self.pending = ""  # text received and not yet sent (or dropped)
        self.searched = 0  # in an open call: `pending` up to here holds no end marker
        self.in_calls = False  # a call has started: no more plain content, only calls
        self.sent_content = False  # non-blank content went out (blank content is held: see feed)
        self.num_calls = 0

    def feed(self, delta: str, finished: bool) -> list[dict]:
        p, out = self.parser, []
        self.pending += delta
        while True:
            rest = self.pending
            if not self.in_calls:
                at = rest.find(p.start)
                if at < 0:
                    # Hold back a tail that may be the start of the marker (unless the answer ended),
                    # and content that is blank so far: before a call, blank content is none (`parse`
                    # answers null), so the stream must not have sent it.
                    keep = 0 if finished else partial_marker_len(rest, p.start)
                    if not (finished or self.sent_content or rest[: len(rest) - keep].strip()):
                        return out
                    if len(rest) > keep:
                        out.append({"content": rest[: len(rest) - keep]})
                        self.pending, self.sent_content = rest[len(rest) - keep :], True
                    return out
                if at and (self.sent_content or rest[:at].strip()):
                    out.append({"content": rest[:at]})
                self.pending, self.in_calls, self.searched = rest[at:], True, 0
                continue
            at = rest.find(p.start)
            if at < 0:  # text after the last call is dropped (see the module docstring)
                self.pending = "" if finished else rest[max(0, len(rest) - len(p.start) + 1) :]
                return out
            if at:  # (text between calls is dropped)
                rest = self.pending = rest[at:]
                self.searched = 0
            close = rest.find(p.end, max(len(p.start), self.searched))
            if close < 0:
                self.searched = max(len(p.start), len(rest) - len(p.end) + 1)
                if finished:  # an unclosed call (cut by max_tokens): its text goes out as content
                    out.append({"content": rest})
                    self.pending = ""
                return out
            call = p.decode_call(rest[len(p.start) : close])
            if call is None:
                out.append({"content": rest[: close + len(p.end)]})
            elif self.max_calls is None or self.num_calls < self.max_calls:
                out.append({"tool_calls": [{"index": self.num_calls, **openai_call(call)}]})
                self.num_calls += 1
            self.pending, self.searched = rest[close + len(p.end) :], 0


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (a stream holds that
    much back: it may still become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def template_messages(messages: list) -> list[dict]:
    """Chat messages as the template sees them: role, content as text, and an assistant's
    `tool_calls` (arguments decoded from their JSON string, as HF templates expect a mapping), a tool
    result's `tool_call_id` and `name`. ValueError for a malformed `tool_calls`."""
    out = []
    for m in messages:
        msg: dict = {"role": m.role, "content": m.text()}
        extra = m.model_extra or {}
        if extra.get("tool_calls") is not None:
            calls = extra["tool_calls"]
            if not isinstance(calls, list):
                raise ValueError("messages[].tool_calls must be a list")
            msg["tool_calls"] = [_template_call(c) for c in calls]
        for key in ("tool_call_id", "name"):
            if isinstance(extra.get(key), str):
                msg[key] = extra[key]
        # An assistant's past thinking, as this server returned it (`reasoning_content`; `reasoning`
        # in newer clients): templates that replay it read `reasoning_content` (vLLM sets both).
        thought = extra.get("reasoning_content", extra.get("reasoning"))
        if m.role == "assistant" and isinstance(thought, str):
            msg["reasoning_content"] = msg["reasoning"] = thought
        out.append(msg)
    return out


def _template_call(c) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError("each messages[].tool_calls item needs function.name")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            pass  # left as the string it was: the template shows it as such
    return {**c, "function": {**fn, "arguments": args}}


NL = "\n"


def call_schema(fn: dict) -> dict:
    """JSON schema of one call to function `fn` (a tool's `function`): its name, its arguments. The
    parameters' definitions (`$defs`, `definitions`: what pydantic and agent SDKs write) move to the
    call's root, where their `#/$defs/...` references point."""
    params = dict(fn.get("parameters") or {"type": "object"})
    defs = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": COMPACT_JSON,
        **defs,
    }


def forced_tools(tools: list[dict], choice) -> tuple[list[dict], bool] | None:
    """For `tool_choice` "required" or a named function ({"type": "function", "function": {"name"}}):
    (the tools the answer must call, whether several calls may follow one another); None for "auto"
    and "none". ValueError for a name not among the tools or a malformed choice."""
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        return tools, True
    fn = choice.get("function") if isinstance(choice, dict) else None
    if (
        not isinstance(fn, dict)
        or choice.get("type", "function") != "function"
        or not isinstance(fn.get("name"), str)
    ):
        raise ValueError(
            "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}"
        )
    named = [t for t in tools if t["function"]["name"] == fn["name"]]
    if not named:
        raise ValueError(f"tool_choice names {fn['name']!r}, which is not among the request's tools")
    return named[:1], False


def check_tools(tools) -> list[dict]:
    """The request's `tools`: a list of {"type": "function", "function": {"name": ..., ...}}."""
    if not isinstance(tools, list):
        raise ValueError("tools must be a list")
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError('each tool must be {"type": "function", "function": {...}}')
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError("each tool's function needs a name")
    return tools
