"""Structured outputs: a request's grammar masks its logits so the answer matches it (JSON schema,
regex, choice, Lark grammar), with llguidance (the engine behind vLLM's `guidance` backend).

Who calls what:
- `LLMEngine.make_request` (HTTP worker thread) builds the request's `RequestGrammar` from its
  `SamplingParams.structured_outputs` through the engine's `GrammarBackend`: compiled (or copied from
  the cache) and its first mask computed there, so a grammar that does not compile, or blows up
  llguidance's limits on its first step, is an `InvalidGrammar` (a 400) before the engine thread sees it.
- `Sampler` (engine thread) calls `mask_logits` on the rows whose grammar is active, before logprobs
  and every other logits processor (vLLM v1's order: the bitmask is applied to the logits the sampler
  receives, so logprobs of forbidden tokens are -inf, reported as -9999.0).
- `Request.append_output` advances the grammar with every token the request gets: sampled here, or
  token 1 that a PD prefill sampled under the same grammar (the decode rebuilds the grammar from the
  same request body and replays the token). Preemption keeps the output, so the state stays valid.
- `LLMEngine.check_stop` ends a request whose grammar is complete (finish_reason "stop"), or aborts
  one whose matcher failed (stop_reason says why; a mask-respecting token cannot do that, a grammar
  hitting llguidance's limits later can).

`start_after` (a reasoning model's end-of-thinking marker, set by the chat route): the grammar waits,
unmasked, until the answer's text contains the marker, then constrains what follows (vLLM v1 holds
structured outputs back until the reasoning parser sees the reasoning end, the same way).

State is the matcher's alone; it lives on the request and only the engine thread touches it after
`make_request`.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable

import llguidance
import numpy as np
import torch

from pdserve.sampling_params import COMPACT_JSON, StructuredOutputs

# Grammars compiled per engine, by (kind, text, whitespace): the n children of a request, or an agent's
# turns with the same schema, compile once. A template matcher is deep-copied for each request.
_CACHE_SIZE = 64


class InvalidGrammar(ValueError):
    """The request's structured-output spec does not compile (the message says where)."""


class RequestGrammar:
    """One request's position in its grammar. Engine thread only (after construction)."""

    def __init__(
        self, matcher: llguidance.LLMatcher, backend: GrammarBackend, start_after: str | None
    ) -> None:
        self.matcher = matcher
        self.backend = backend
        self.start_after = start_after  # None once active (see the module docstring)
        self._text_tail = ""  # while waiting: the answer's last characters, searched for the marker

    @property
    def active(self) -> bool:
        return self.start_after is None

    def accept(self, token_id: int) -> None:
        """Advance past `token_id` (a token the mask allowed). A refused token leaves the matcher in
        its error state, which `failed` reports."""
        if self.start_after is not None:
            # (a marker token followed by more text in the same token: that text is not constrained)
            self._text_tail = (self._text_tail + self.backend.decode(token_id))[-4 * len(self.start_after) :]
            if self.start_after in self._text_tail:
                self.start_after = None
            return
        self.matcher.consume_token(token_id)

    @property
    def terminated(self) -> bool:
        """No further token is allowed: the grammar is complete (or the matcher failed)."""
        return self.active and (self.matcher.is_stopped() or self.matcher.is_error())

    @property
    def failed(self) -> str | None:
        """Why the matcher failed (a token it refused, a limit it hit), or None."""
        if self.active and self.matcher.is_error():
            return self.matcher.get_error() or "matcher failed"
        return None


class GrammarBackend:
    """One per engine: the tokenizer as llguidance sees it (built on first use, under the lock: 1 s
    for a 150k vocabulary on a quiet 2-core machine, several on a busy one) and the compiled-grammar
    cache. Thread-safe: requests are validated on worker threads.

    `decode(token_id)`: a token's text (special tokens included), for `start_after`."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        decode: Callable[[int], str] | None = None,
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size  # the model's (logits width); ids past the tokenizer's never match
        self._eos = list(eos_token_ids) or None
        self.decode = decode or (lambda token_id: "")
        self._tok: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._templates: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()
        self.executor = llguidance.LLExecutor()  # computes the masks of a step's rows in parallel

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tok is None:
                self._tok = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos
                )
            return self._tok

    def grammar_for(self, spec: StructuredOutputs) -> RequestGrammar:
        """A fresh matcher at the start of `spec`'s grammar (waiting for `spec.start_after` if set);
        InvalidGrammar if it does not compile or fails on its first step (computed here, on the
        caller's thread, not on the engine's)."""
        key = spec.cache_key()
        tok = self.tokenizer()
        with self._lock:
            template = self._templates.get(key)
            if template is not None:
                self._templates.move_to_end(key)
                return RequestGrammar(template.deep_copy(), self, spec.start_after)
        template = llguidance.LLMatcher(tok, _llguidance_grammar(spec), log_level=0)
        if not template.is_error():
            template.compute_bitmask()  # (the lexer's first states: where a pathological regex blows up)
        if template.is_error():
            raise InvalidGrammar(f"structured output ({spec.kind}) does not compile: {template.get_error()}")
        with self._lock:
            self._templates[key] = template
            while len(self._templates) > _CACHE_SIZE:
                self._templates.popitem(last=False)
            return RequestGrammar(template.deep_copy(), self, spec.start_after)


def mask_logits(logits: torch.Tensor, rows: list[int], grammars: list[RequestGrammar]) -> None:
    """Set to -inf, in place, every logit of `logits` [N, V] rows `rows` that the row's grammar forbids
    next (`grammars[j]` is row `rows[j]`'s; all of one engine's backend). The bitmask is computed on the
    CPU, in parallel over rows (one bit per token: [R, ceil(V / 32)] int32, ~2 ms for 64 rows of a
    152k vocabulary). (A failed matcher allows EOS only, and `check_stop` ends its request before
    that; a row whose mask allows nothing at all is left alone rather than sampled from nothing.)"""
    backend = grammars[0].backend
    num_words = (backend.vocab_size + 31) // 32
    bitmask = np.zeros((len(rows), num_words), dtype=np.int32)
    backend.executor.unsafe_compute_mask_ptr(
        [(g.matcher, j) for j, g in enumerate(grammars)], bitmask.ctypes.data, num_words * 4, len(rows)
    )
    keep = bitmask.any(axis=1)
    if not keep.all():
        rows = [r for r, k in zip(rows, keep.tolist(), strict=True) if k]
        bitmask = bitmask[keep]
    if not rows:
        return
    vocab = logits.shape[-1]
    if logits.device.type == "cpu":
        # Unpacked by numpy (~1 ms) and applied row by row in place: a gather / scatter of the rows
        # and torch's bit arithmetic over [R, V] cost ~130 ms per step at 64 x 152k.
        forbidden = forbidden_tokens(bitmask, vocab)
        for j, r in enumerate(rows):
            logits[r].masked_fill_(forbidden[j], float("-inf"))
    else:
        # The bits cross to the device (1/32 of a float mask) and are expanded there.
        allowed = allowed_on_device(bitmask, vocab, logits.device)
        idx = torch.tensor(rows, device=logits.device)
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))


def forbidden_tokens(bitmask: np.ndarray, vocab: int) -> torch.Tensor:
    """[R, W] int32 allowed-bits (bit b of word w: token 32w + b) -> [R, vocab] bool, True = forbidden."""
    inverted = np.ascontiguousarray(~bitmask).view(np.uint8)  # little-endian words: byte order = token order
    bits = np.unpackbits(inverted, axis=1, count=vocab, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_))


def allowed_on_device(bitmask: np.ndarray, vocab: int, device) -> torch.Tensor:
    """The same bits expanded on `device`: [R, vocab] bool, True = allowed."""
    words = torch.from_numpy(bitmask).to(device)
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    return ((words[:, :, None] >> shifts) & 1).reshape(len(bitmask), -1)[:, :vocab].bool()


def _llguidance_grammar(spec: StructuredOutputs) -> str:
    """The spec as an llguidance grammar (its JSON form)."""
    # (as defaults: a schema's own "x-guidance" options win, as in vLLM)
    options = dict(COMPACT_JSON) if spec.disable_any_whitespace else {}
    if spec.whitespace_pattern is not None:
        options["whitespace_pattern"] = spec.whitespace_pattern
    try:
        if spec.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=options or None)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.text)
        if spec.kind == "choice":  # (a JSON string is a Lark string literal)
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(map(json.dumps, spec.choice))
            )
        return llguidance.grammar_from("grammar", spec.text)  # Lark (llguidance's dialect) or GBNF
    except ValueError as e:
        raise InvalidGrammar(f"structured output ({spec.kind}): {e}") from None
