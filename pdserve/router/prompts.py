"""The router's view of a prompt: its shape, its output-token limit, and its hit tokens estimated from
the prompts routed before (`PrefixIndex`). The router has no tokenizer; all of this only steers
placement (`router/placement.py`), and the engines read and count what is really there.

Hit tokens: the scheduler needs each request's hit tokens (stored KV to read) before any engine sees
it -- without any, a request is all new tokens and always reads on the PE side. The router estimates
them from the prompts it has routed, in a bounded index of chained hashes: a prompt's leading pieces
that an earlier prompt had are counted as hits (the decode wrote them back when that request
committed; the router records a prompt once an engine has taken it). Token-id prompts are cut into the store's blocks; the router has no tokenizer, so a text
prompt is cut into TEXT_CHUNK_CHARS-character chunks and a chat into its tools and messages (an
agent's next turn repeats the last turn's messages and appends to them), their hits counted at
CHARS_PER_TOKEN and rounded down to whole blocks. Estimates only steer placement; the engines read
what the store really has, and their load reports overwrite the scheduler's optimistic view within
50 ms.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict

from pdserve.kvcache.hashing import page_keys, root_key, salted_root

CHARS_PER_TOKEN = 4  # text and chat prompts: the router's estimate of their tokens (it has no tokenizer)
TEXT_CHUNK_CHARS = 256  # a text prompt's pieces for prefix hits (~64 tokens: one store block or less)
# Pieces hashed per prompt, at most: 1 MiB of text or 4,096 messages (far past any context) bound the
# router's work on a crafted body; a longer prompt's estimate stops there.
MAX_PROMPT_PIECES = 4096


class PrefixIndex:
    """Chained block keys of routed token-id prompts, LRU-bounded (`capacity` keys)."""

    def __init__(self, block_tokens: int, capacity: int = 1 << 20) -> None:
        self.block_tokens = block_tokens
        self.capacity = capacity
        self.root = root_key("router")
        self.text_root = root_key("router-text")  # (text and chat pieces: never equal to a block's key)
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def hit_tokens(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """Leading tokens of `token_ids` in whole blocks seen before (at least one token left), under
        the request's `cache_salt` (as the engines key its blocks: only its own salt's prompts hit)."""
        max_blocks = (len(token_ids) - 1) // self.block_tokens
        root = salted_root(self.root, cache_salt)
        keys = page_keys(token_ids[: max_blocks * self.block_tokens], self.block_tokens, root)
        return self._hits(keys, max_blocks)

    def record(self, token_ids: list[int], cache_salt: str | None = None) -> None:
        self.record_keys(page_keys(token_ids, self.block_tokens, salted_root(self.root, cache_salt)))

    def hit_tokens_and_keys(
        self, token_ids: list[int], cache_salt: str | None = None
    ) -> tuple[int, list[bytes]]:
        """`hit_tokens`, and the prompt's block keys for `record_keys` once an engine has taken it
        (the prompt is hashed once: a 32k-token prompt costs ~1 ms)."""
        keys = page_keys(token_ids, self.block_tokens, salted_root(self.root, cache_salt))
        return self._hits(keys, (len(token_ids) - 1) // self.block_tokens), keys

    def estimated_hits_and_keys(
        self, pieces: list[tuple[bytes, int]], num_tokens: int, cache_salt: str | None = None
    ) -> tuple[int, list[bytes]]:
        """Text and chat prompts: `pieces` are the prompt's pieces in order, (bytes, characters), from
        `prompt_pieces`. The leading pieces seen before count as hits, at CHARS_PER_TOKEN, in whole
        blocks, at least one token left of the estimated `num_tokens`; and the pieces' keys, for
        `record_keys`."""
        keys, parent = [], salted_root(self.text_root, cache_salt)
        for data, _ in pieces:
            parent = hashlib.blake2b(parent + data, digest_size=16).digest()
            keys.append(parent)
        matched_chars = 0
        for key, (_, chars) in zip(keys, pieces, strict=True):
            if key not in self._keys:
                break
            self._keys.move_to_end(key)
            matched_chars += chars
        hit_tokens = min(matched_chars // CHARS_PER_TOKEN, num_tokens - 1)
        return max(0, hit_tokens) // self.block_tokens * self.block_tokens, keys

    def _hits(self, keys: list[bytes], max_blocks: int) -> int:
        hits = 0
        for key in keys[:max_blocks]:
            if key not in self._keys:
                break
            self._keys.move_to_end(key)
            hits += 1
        return hits * self.block_tokens

    def record_keys(self, keys: list[bytes]) -> None:
        """Who calls: the router, once an engine has taken the request whose keys these are (a prompt
        the engines refused was never computed, so it must not count as a hit for the next ones)."""
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)


DEFAULT_PLACEMENT_TOKENS = 256  # a request without max_tokens reserves this much growth in placement
MAX_TOKEN_ID = 2**63 - 1  # placement hashes ids as signed 64-bit; no vocabulary comes near


def completion_view(path: str, body: dict) -> dict:
    """The prompt as placement reads it, under a completion's name: a `/generate` body's `input_ids`
    or `text` as `prompt`; any other body as it is."""
    if path != "/generate":
        return body
    return {"prompt": body.get("input_ids") if body.get("text") is None else body.get("text")}


def requested_max_tokens(path: str, body: dict) -> int | None:
    """The client's output-token limit as the engines read it (chat: `max_completion_tokens` wins over
    `max_tokens`; /generate: its sampling_params' `max_new_tokens`, or ours, `max_tokens`); None when
    absent. ValueError unless it is a positive JSON integer, or 0 on a completion with `echo` or on
    /generate (the engines' scoring forms: the prompt alone, computed with one token that is dropped)."""
    keys = ("max_completion_tokens", "max_tokens") if path.endswith("/chat/completions") else ("max_tokens",)
    if (
        path.endswith("/v1/completions")
        and body.get("echo") is True
        and type(body.get("max_tokens")) is int
        and body["max_tokens"] == 0
    ):
        return 1
    if path == "/generate":
        sp = body.get("sampling_params")
        body, keys = (sp if isinstance(sp, dict) else {}), ("max_new_tokens", "max_tokens")
        if type(body.get("max_new_tokens")) is int and body["max_new_tokens"] == 0:
            return 1  # (SGLang's scoring form: the prompt's logprobs alone; the engines run one token)
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        if type(value) is not int or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
        return value
    return None


def prompt_pieces(body: dict) -> list[tuple[bytes, int]] | None:
    """A text or chat body's pieces for prefix hits, in order, as (bytes, characters): a text's full
    TEXT_CHUNK_CHARS chunks; a chat's tools (and template fields), then each message (canonical
    JSON, so equal messages give equal bytes); MAX_PROMPT_PIECES at most. Characters are counted as
    `prompt_shape` counts them. None for token ids (and a body too deeply nested to write back)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        n = TEXT_CHUNK_CHARS
        ends = range(n, min(len(prompt), n * MAX_PROMPT_PIECES) + 1, n)
        return [(prompt[e - n : e].encode(errors="surrogatepass"), n) for e in ends]
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    # The first piece: what else shapes the rendered prompt before the first message.
    head = {k: body.get(k) for k in ("tools", "documents", "chat_template", "chat_template_kwargs")}
    try:
        pieces = [(_canonical(head), len(str(body.get("tools") or "")))]
        for m in messages[: MAX_PROMPT_PIECES - 1]:
            if isinstance(m, dict):
                chars = len(str(m.get("content") or "")) + len(str(m.get("tool_calls") or ""))
                pieces.append((_canonical(m), chars))
    except (RecursionError, ValueError):  # (nesting too deep to write back: no estimate)
        return None
    return pieces


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
        errors="surrogatepass"
    )


def prompt_shape(body: dict) -> tuple[list[int] | None, int]:
    """(token ids or None, prompt length in tokens) of a completion or chat body, for placement.
    Text is estimated at CHARS_PER_TOKEN (only placement uses it; engines tokenize).
    ValueError for a token id that is not a non-negative 64-bit integer."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        if any(not 0 <= t <= MAX_TOKEN_ID for t in prompt):
            raise ValueError("prompt token ids must be in [0, 2**63)")
        return prompt, len(prompt)
    if isinstance(prompt, str):
        return None, max(1, len(prompt) // CHARS_PER_TOKEN)
    messages = body.get("messages")
    if isinstance(messages, list):
        # Content, an assistant's past tool calls and the tool schemas all reach the prompt.
        chars = sum(
            len(str(m.get("content") or "")) + len(str(m.get("tool_calls") or ""))
            for m in messages
            if isinstance(m, dict)
        )
        chars += len(str(body.get("tools") or ""))
        return None, max(1, chars // CHARS_PER_TOKEN)
    return None, 1
