"""Tool calls in chat completions: the model's text -> OpenAI `tool_calls`, whole or streamed.

Who calls it: the chat route (`server/api.py`) of an engine started with `--tool-call-parser NAME`,
for requests that carry `tools` (with `tool_choice` "auto", the default). The request's tools and its
messages (assistant `tool_calls`, `tool` results) go to the chat template, which shows them to the
model its own way; the model answers in text, and a parser, chosen by name from `PARSERS`, finds the
calls in it. Under PD the decode, which streams the answer, parses it; the prefill only renders.

`hermes` (Hermes 2 Pro, Qwen2.5, Qwen3 and others): each call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. The message's `content` is the text
before the first call (None when blank); text after a call is dropped, as vLLM's parser does. A
block that is not such JSON leaves the whole answer as content, with no calls (all or nothing). The
last block may lack its closing tag (the model stopped on EOS or a stop string right after the JSON):
it is a call if what follows the marker is one whole call, as vLLM reads `<tool_call>(.*)`; a block
cut mid-JSON by max_tokens is not. `finish_reason` becomes "tool_calls" when calls were found.

Streaming (`ToolStream`): content streams until a call starts, holding back an unfinished `<tool_call>`
marker (and blank text before it, which a call makes none); each call goes out whole, as one
`tool_calls` delta, once its closing tag arrived (or the answer ended on its whole JSON; OpenAI
clients accumulate deltas by `index`, so one delta per call is valid). A block that does not parse,
or an unclosed one at the end (a length cut), is sent as content with the blank text held before it,
so no text is lost; with no call sent yet, the rest of the answer is then plain content too, as the
whole answer reads it. A bad block after a call was sent cannot take that call back, so only there the
streamed form is not all-or-nothing. A length cut keeps `finish_reason` "length" in both forms.
`parallel_tool_calls: false` keeps the first call only.
"""

from __future__ import annotations

import json
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
        i = at
        while i >= 0:
            body = i + len(self.start)
            close = BlockEnd(self.end).find(text, body)
            # (an unclosed block is a call only if the rest is one: a block cut by max_tokens never
            # decodes, and leaves the whole answer as text rather than vanishing)
            call = self.decode_call(text[body:close] if close >= 0 else text[body:])
            if call is None:
                return text, []
            calls.append(openai_call(call))
            if close < 0:
                break
            i = text.find(self.start, close + len(self.end))
        content = text[:at]
        return (content if content.strip() else None), calls


class HermesParser(ToolCallParser):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def decode_call(self, block: str) -> dict | None:
        try:
            obj = json.loads(block)
        except (ValueError, RecursionError):  # (nested past the parser's depth: a looping model)
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
            except (
                ValueError,
                RecursionError,
            ):  # not JSON: encoded, so the client's json.loads gives it back
                pass
        return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}

    def call_grammar(self, tools: list[dict], parallel: bool, token_id=lambda text: None) -> str:
        # Each call is one JSON object, the tool's name then arguments matching its parameters, in the
        # compact form Hermes and Qwen templates show (`{"name": "f", "arguments": {"x": 1}}`). One
        # %json alternative per tool: each is its own schema root, so its `$defs` resolve.
        def marker(text: str) -> str:
            tid = token_id(text)
            return json.dumps(text) if tid is None else f"<[{tid}]>"

        # The call object is spelled out around each tool's arguments, which are their own %json
        # root: the tool's schema as written, so its references (`#/$defs/...`, `#/properties/...`,
        # a recursive `#`) mean what they mean there (nested under the call object, a `#` meant the
        # call and `#/properties/x` did not resolve).
        lines = [
            f"start: call ({json.dumps(NL)} call)*" if parallel else "start: call",
            f"call: {marker(self.start)} {json.dumps(NL)} body {json.dumps(NL)} {marker(self.end)}",
            "body: " + " | ".join(f"call_{i}" for i in range(len(tools))),
        ]
        for i, t in enumerate(tools):
            fn = t["function"]
            head = '{"name": ' + json.dumps(fn["name"], ensure_ascii=False) + ', "arguments": '
            lines.append(f'call_{i}: {json.dumps(head)} args_{i} "}}"')
            lines.append(f"args_{i}: %json {json.dumps(arguments_schema(fn))}")
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


class BlockEnd:
    """Where a call block's end marker is: the first one outside JSON strings once every bracket
    opened in the block is closed (an argument holding the end marker's text, e.g. code or a log, cut
    the call there: no call came back even under tool_choice "required"). Fed incrementally: `find`
    resumes where the last call on the same text stopped (a stream's O(answer))."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.pos = -1  # next character to scan (-1: not started)
        self.in_string = self.escaped = False
        self.depth = 0

    def find(self, text: str, start: int) -> int:
        """Index of the end marker in `text` (scanning from `start` on the first call), or -1."""
        if self.pos < 0:
            self.pos = start
        i, n, first = self.pos, len(text), self.marker[0]
        while i < n:
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
            elif c == first and self.depth <= 0 and text.startswith(self.marker, i):
                self.pos = i
                return i
            elif c == first and self.depth <= 0 and self.marker.startswith(text[i:]):
                break  # (the marker may be arriving: look again from here)
            i += 1
        self.pos = i
        return -1


class ToolStream:
    """One streamed answer: `feed(delta, finished)` with the text the step added returns the deltas
    to send (each {"content": str} or {"tool_calls": [item]}); `num_calls` counts the calls sent.
    Only the text not yet sent is kept, and an open call is searched for its end from where the last
    search stopped: O(answer) over the whole stream."""

    def __init__(self, parser: ToolCallParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls  # parallel_tool_calls=false: 1 (later calls are dropped)
        self.pending = ""  # text received and not yet sent (or dropped)
        self.block_end: BlockEnd | None = None  # in an open call: where its end marker is
        self.in_calls = False  # a call has started: no more plain content, only calls
        self.sent_content = False  # non-blank content went out (blank content is held: see feed)
        self.held_blank = ""  # blank text before the open block: content if the block is not a call
        self.plain = False  # a block failed before any call: the rest is content, as `parse` reads it
        self.num_calls = 0

    def feed(self, delta: str, finished: bool) -> list[dict]:
        p, out = self.parser, []
        self.pending += delta
        while True:
            rest = self.pending
            if self.plain:
                if rest:
                    out.append({"content": rest})
                self.pending = ""
                return out
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
                elif at:  # (blank so far: none if a call follows, content if the block is not one)
                    self.held_blank = rest[:at]
                self.pending, self.in_calls, self.block_end = rest[at:], True, None
                continue
            if self.block_end is None:
                at = rest.find(p.start)
                if at < 0:  # text after the last call is dropped (see the module docstring)
                    self.pending = "" if finished else rest[max(0, len(rest) - len(p.start) + 1) :]
                    return out
                if at:  # (text between calls is dropped)
                    rest = self.pending = rest[at:]
                self.block_end = BlockEnd(p.end)
            close = self.block_end.find(rest, len(p.start))
            if close < 0 and not finished:
                return out
            # (the answer ended in an unclosed block: a call if the rest is one whole call, else text
            # cut by max_tokens)
            block_len = len(rest) if close < 0 else close + len(p.end)
            call = p.decode_call(rest[len(p.start) : close if close >= 0 else len(rest)])
            self.block_end = None
            if call is None:
                out.append({"content": self.held_blank + rest[:block_len]})
                self.sent_content = True
                # (no call went out: the whole answer has none either, so the rest is plain content;
                # after a call, later text is dropped as before)
                self.plain = self.num_calls == 0
                self.in_calls = self.num_calls > 0
            elif self.max_calls is None or self.num_calls < self.max_calls:
                out.append({"tool_calls": [{"index": self.num_calls, **openai_call(call)}]})
                self.num_calls += 1
            self.held_blank = ""
            self.pending = rest[block_len:]
            if close < 0:
                return out


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
        except (ValueError, RecursionError):  # (RecursionError: nested ~1,000 deep, a 500 before)
            pass  # left as the string it was: the template shows it as such
    return {**c, "function": {**fn, "arguments": args}}


NL = "\n"


def arguments_schema(fn: dict) -> dict:
    """JSON schema of the arguments of a call to `fn` (a tool's `function`): its parameters, written
    compact as the Hermes and Qwen templates show calls (a schema's own "x-guidance" wins)."""
    params = fn.get("parameters") or {"type": "object"}
    return {**params, "x-guidance": params.get("x-guidance", COMPACT_JSON)}


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
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            # (a forced call's grammar read it as a schema: a 500)
            raise ValueError("each tool's function.parameters must be a JSON schema object")
    return tools
