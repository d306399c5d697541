"""`/generate` streaming (SGLang's native API): every chunk carries the whole output so far.

Who calls it: `server/api.py`'s `/generate` with `"stream": true`, one `CumulativeChunks` per stream.
The format is cumulative -- each chunk repeats all output ids, the text and, when asked, every
token's logprobs -- so encoding each chunk from scratch cost O(output) per chunk, O(output^2) per
stream (8k tokens: ~0.5 ms a chunk, ~32 ms of the event loop per step at 64 streams). Here each
chunk extends the previous one's encoded pieces with the new tokens only. JSON escapes a string one
character at a time, so the pieces join into exactly the bytes `json.dumps` gives for the whole chunk.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from pdserve.outputs import CompletionOutput, RequestOutput

TokenText = Callable[[int], str] | None  # a token id's text, for logprob entries (None: no text)


def finish_reason(o: CompletionOutput) -> dict | None:
    """SGLang's shape, which RL rollout code reads (`meta_info["finish_reason"]["type"]`):
    {"type": "stop", "matched": the stop token id or string} | {"type": "length", "length": tokens}
    | {"type": "abort", "message": why}; None while running."""
    if o.finish_reason is None:
        return None
    if o.finish_reason == "length":
        return {"type": "length", "length": len(o.token_ids)}
    if o.finish_reason == "stop":  # (an EOS token sets no stop_reason: it is the last token, as SGLang says)
        matched = o.stop_reason if o.stop_reason is not None else (o.token_ids[-1] if o.token_ids else None)
        return {"type": "stop", "matched": matched}
    return {
        "type": o.finish_reason,
        "message": o.stop_reason if isinstance(o.stop_reason, str) else "aborted",
    }


def logprob_entry(logprob: float | None, token_id: int, token_text: TokenText) -> list:
    """SGLang's [logprob, token id, token text] (the text with `return_text_in_logprobs`, else None)."""
    return [logprob, token_id, token_text(token_id) if token_text is not None else None]


def top_entries(top: list[tuple[int, float]], token_text: TokenText) -> list[list]:
    """One position's top-k as SGLang lists them: [[logprob, token id, text], ...], best first."""
    return [logprob_entry(lp, tid, token_text) for tid, lp in top]


def input_logprobs(out: RequestOutput, start: int, token_text: TokenText) -> dict:
    """`input_token_logprobs` / `input_top_logprobs` of prompt positions `start`.. (SGLang's
    `logprob_start_len`); the first prompt token has none (null). Empty when the prompt was not
    scored (SGLang writes the keys whenever logprobs are asked for)."""
    pl, ids = out.prompt_logprobs, out.prompt_token_ids
    if pl is None:
        return {"input_token_logprobs": [], "input_top_logprobs": []}
    # Positions never scored (a request aborted before or in its prompt) are null, as the OpenAI
    # routes pad them; indexing them was an IndexError: a 500, or a stream cut without [DONE].
    entries = [pl[i] if 0 < i < len(pl) else None for i in range(start, len(ids))]
    return {
        "input_token_logprobs": [
            logprob_entry(None if e is None else e.logprob, ids[i], token_text)
            for i, e in enumerate(entries, start)
        ],
        "input_top_logprobs": [None if e is None else top_entries(e.top, token_text) for e in entries],
    }


def meta_info(out: RequestOutput, weight_version: str | None = None) -> dict:
    """A `/generate` answer's `meta_info` before its logprobs (which come last, when asked for);
    `weight_version`: the engine's label of its weights (SGLang's, in every meta_info: RL frameworks
    record which weights produced each sample)."""
    o = out.outputs[0]
    meta = {
        "id": out.request_id,
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": len(o.token_ids),
        "cached_tokens": out.num_cached_tokens,
        "finish_reason": finish_reason(o),
    }
    if weight_version is not None:
        meta["weight_version"] = weight_version
    return meta


class CumulativeChunks:
    def __init__(self, token_text: TokenText = None, input_start: int | None = None) -> None:
        self._token_text = token_text
        self._input_start = input_start  # (`input_logprobs` from this position; None: not asked for)
        self._inputs = ""  # their `"input_token_logprobs": ..., "input_top_logprobs": ...`, once known
        self._num_ids = 0
        self._ids = ""  # "1, 2, 3": the ids array's inside, as json.dumps writes it
        self._text = ""
        self._text_json = ""  # the text's JSON string, without the quotes
        self._num_logprobs = 0
        self._logprobs = ""  # "[lp, id, text], ..."
        self._tops = ""  # "[[lp, id, text], ...], ..."

    def encode(self, out: RequestOutput, weight_version: str | None = None) -> str:
        """json.dumps of {"output_ids", "text", "meta_info"} for `out` (server/api.py's `native`), with
        `weight_version`, the weights served as it is sent."""
        o = out.outputs[0]
        new_ids = o.token_ids[self._num_ids :]
        if new_ids:
            more = ", ".join(map(str, new_ids))
            self._ids = f"{self._ids}, {more}" if self._ids else more
            self._num_ids = len(o.token_ids)
        text = o.text
        if not out.finished:  # a character whose bytes are still arriving: held back, as the OpenAI
            text = text.rstrip("\ufffd")  # streams hold it (a chunk never shows a U+FFFD it takes back)
        if text.startswith(self._text):
            self._text_json += json.dumps(text[len(self._text) :])[1:-1]
        else:  # (the engine's text only grows; kept for safety: a client reads the whole text anyway)
            self._text_json = json.dumps(text)[1:-1]
        self._text = text
        meta = json.dumps(meta_info(out, weight_version))
        if o.logprobs is not None:
            new = o.logprobs[self._num_logprobs :]
            if new:
                lps = ", ".join(
                    json.dumps(logprob_entry(lp.logprob, lp.token_id, self._token_text)) for lp in new
                )
                tops = ", ".join(json.dumps(top_entries(lp.top, self._token_text)) for lp in new)
                self._logprobs = f"{self._logprobs}, {lps}" if self._logprobs else lps
                self._tops = f"{self._tops}, {tops}" if self._tops else tops
                self._num_logprobs = len(o.logprobs)
            meta = (
                f'{meta[:-1]}, "output_token_logprobs": [{self._logprobs}], '
                f'"output_top_logprobs": [{self._tops}]}}'
            )
        if self._input_start is not None:
            if not self._inputs:  # (the prompt's are known from the first output on, and never change)
                self._inputs = json.dumps(input_logprobs(out, self._input_start, self._token_text))[1:-1]
            meta = f"{meta[:-1]}, {self._inputs}}}"
        return f'{{"output_ids": [{self._ids}], "text": "{self._text_json}", "meta_info": {meta}}}'
