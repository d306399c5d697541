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
"""

from __future__ import annotations

from pdserve.server.tool_calls import partial_marker_len


class ReasoningParser:
    name = ""
    start = "<think>"
    end = "</think>"
    starts_inside = False  # the answer begins in the reasoning without writing `start`

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer; None for an empty part."""
        body = text
        opened = self.starts_inside
        stripped = body.lstrip()
        if stripped.startswith(self.start):
            body, opened = stripped[len(self.start) :], True
        if not opened:
            return None, text
        at = body.find(self.end)
        if at < 0:
            if not self.starts_inside:  # qwen3: an unclosed thought is plain text
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

    def __init__(self, parser: ReasoningParser) -> None:
        self.p = parser
        self.pending = ""
        # "start": before anything (a leading `<think>` may come); "reasoning"; "content".
        self.state = "start"

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
                self.state = "reasoning" if p.starts_inside else "content"
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
