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
or an unclosed one at the end (a length cut), is sent as content so no text is lost.
"""

from __future__ import annotations

import json
import re
import uuid


class ToolCallParser:
    """Finds tool calls in a model's answer. Subclasses set the markers; `decode_call` reads one."""

    name = ""
    start = ""  # marker that opens a call
    end = ""  # marker that closes it

    def decode_call(self, block: str) -> dict | None:
        """One call's text (between the markers) -> {"name", "arguments" (a JSON string)}; None if
        it is not a call."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, calls) of a whole answer; calls are OpenAI `tool_calls` items (with fresh ids)."""
        at = text.find(self.start)
        if at < 0:
            return text, []
        calls = []
        for m in re.finditer(re.escape(self.start) + r"(.*?)" + re.escape(self.end), text[at:], re.DOTALL):
            call = self.decode_call(m.group(1))
            if call is None:
                return text, []
            calls.append(openai_call(call))
        if not calls:  # an opening marker without a closed call: plain text
            return text, []
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
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string already
            return {"name": obj["name"], "arguments": args}
        return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


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
    """One streamed answer: `feed(text, finished)` with the whole text so far returns the deltas to
    send (each {"content": str} or {"tool_calls": [item]}); `num_calls` counts the calls sent."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.num_sent = 0  # characters of the text consumed (sent as content or as a call)
        self.in_calls = False  # a call has started: no more plain content, only calls
        self.num_calls = 0

    def feed(self, text: str, finished: bool) -> list[dict]:
        p, out = self.parser, []
        while True:
            rest = text[self.num_sent :]
            if not self.in_calls:
                at = rest.find(p.start)
                if at < 0:
                    # Hold back a tail that may be the start of the marker (unless the answer ended).
                    keep = 0 if finished else _partial_suffix(rest, p.start)
                    if len(rest) > keep:
                        out.append({"content": rest[: len(rest) - keep]})
                        self.num_sent += len(rest) - keep
                    return out
                if at:
                    out.append({"content": rest[:at]})
                self.num_sent += at
                self.in_calls = True
                continue
            at = rest.find(p.start)
            if at < 0:  # text after the last call is dropped (see the module docstring)
                self.num_sent = len(text) if finished else self.num_sent
                return out
            close = rest.find(p.end, at + len(p.start))
            if close < 0:
                if finished:  # an unclosed call (cut by max_tokens): its text goes out as content
                    out.append({"content": rest[at:]})
                    self.num_sent = len(text)
                return out
            block = rest[at + len(p.start) : close]
            call = p.decode_call(block)
            if call is None:
                out.append({"content": rest[at : close + len(p.end)]})
            else:
                out.append({"tool_calls": [{"index": self.num_calls, **openai_call(call)}]})
                self.num_calls += 1
            self.num_sent += close + len(p.end)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
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
