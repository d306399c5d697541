"""Reasoning in chat completions: a thinking model's `<think>...</think>` -> `reasoning_content`.

Who calls it: the chat route (`server/api.py`) of an engine started with `--reasoning-parser NAME`.
The answer's reasoning goes to `message.reasoning_content` (streamed as `delta.reasoning_content`)
and only the rest is `content` — what a client shows and sends back in its history, and what the
tool-call parser reads. Parsers by name, as vLLM's `--reasoning-parser`:

* `deepseek_r1`: the chat template opens `<think>` itself, so the answer starts inside the reasoning
  (a leading `<think>` is skipped); it ends at `</think>`. An answer without `</think>` is all
  reasoning (cut by max_tokens mid-thought).
* `qwen3`: reasoning only when the answer holds `<think>` ... `</think>` (Qwen3's template leaves
  thinking to the model, and `enable_thinking=False` answers have none); otherwise it is all content.
  While streaming, text before `</think>` counts as reasoning once `<think>` opened the answer.

The prompt decides first (`prompt_state`): one that ends with `</think>` closed the thinking (Qwen3's
`enable_thinking: false`, a DeepSeek template asked not to think), so the answer is all content; one
that ends with `<think>` opened it (DeepSeek-R1's newer templates, Qwen3 Thinking-2507), so the answer
starts inside the reasoning whichever parser reads it. Without either, the parser's own rule holds.
(The chat route constrains a structured answer from the same reading: it must agree with the split,
or a forced tool call landed in `reasoning_content` and a JSON answer kept the thought.)
"""

from __future__ import annotations

from pdserve.server.tool_calls import partial_marker_len


class ReasoningParser:
    name = ""
    start = "<think>"
    end = "</think>"
    starts_inside = False  # the answer begins in the reasoning without writing `start`

    def prompt_state(self, prompt: str) -> str | None:
        """ "closed" (the prompt ends with the end marker: no thinking), "open" (it ends with the start
        marker: the answer begins inside the thought), or None (the parser's own rule)."""
        tail = prompt.rstrip()
        if tail.endswith(self.end):
            return "closed"
        return "open" if tail.endswith(self.start) else None

    def inside_at_start(self, state: str | None) -> bool:
        return self.starts_inside if state is None else state == "open"

    def split(self, text: str, state: str | None = None) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer; None for an empty part. `state`: `prompt_state`."""
        if state == "closed":
            return None, text
        inside = self.inside_at_start(state)
        body, opened = text, inside
        stripped = body.lstrip()
        if stripped.startswith(self.start):
            body, opened = stripped[len(self.start) :], True
        if not opened:
            return None, text
        at = body.find(self.end)
        if at < 0:
            if not inside:  # qwen3: an unclosed thought the answer opened itself is plain text
                return None, text
            return (body or None), None
        reasoning, content = body[:at], body[at + len(self.end) :]
        return (reasoning or None), (content or None)


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    starts_inside = True


class Qwen3Parser(ReasoningParser):
    name = "qwen3"


PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (DeepSeekR1Parser, Qwen3Parser)}


def make_parser(name: str) -> ReasoningParser:
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()


class ReasoningStream:
    """One streamed answer: `feed(delta, finished)` returns ("reasoning" | "content", text) pieces in
    order. Markers are held back while they may be forming; only unsent text is kept."""

    def __init__(self, parser: ReasoningParser, prompt_state: str | None = None) -> None:
        self.p = parser
        self.pending = ""
        self.inside = parser.inside_at_start(prompt_state)
        # "start": before anything (a leading `<think>` may come); "reasoning"; "content".
        self.state = "content" if prompt_state == "closed" else "start"

    def feed(self, delta: str, finished: bool) -> list[tuple[str, str]]:
        p, out = self.p, []
        self.pending += delta
        while self.pending:
            if self.state == "start":
                s = self.pending.lstrip()
                if s.startswith(p.start):
                    self.pending, self.state = s[len(p.start) :], "reasoning"
                    continue
                if p.start.startswith(s) and not finished:
                    return out  # may still become `<think>`
                self.state = "reasoning" if self.inside else "content"
                continue
            if self.state == "content":
                out.append(("content", self.pending))
                self.pending = ""
                break
            at = self.pending.find(p.end)
            if at >= 0:
                if at:
                    out.append(("reasoning", self.pending[:at]))
                self.pending, self.state = self.pending[at + len(p.end) :], "content"
                continue
            keep = 0 if finished else partial_marker_len(self.pending, p.end)
            if len(self.pending) > keep:
                out.append(("reasoning", self.pending[: len(self.pending) - keep]))
                self.pending = self.pending[len(self.pending) - keep :]
            break
        if finished and self.pending:  # (a held-back partial marker at the very end)
            out.append(("reasoning" if self.state == "reasoning" else "content", self.pending))
            self.pending = ""
        return out
