"""Structured outputs: a request's grammar masks its logits so the answer matches it (JSON schema,
regex, choice, Lark grammar), with llguidance (the engine behind vLLM's `guidance` backend).

Who calls what:
- `LLMEngine.make_request` (HTTP worker thread) builds the request's `RequestGrammar` from its
  `SamplingParams.structured_outputs` through the engine's `GrammarBackend`; a grammar that does not
  compile is an `InvalidGrammar` (a 400) and nothing changed.
- `Sampler` (engine thread) calls `mask_logits` on the rows that carry a grammar, before logprobs and
  every other logits processor (vLLM v1's order: the bitmask is applied to the logits the sampler
  receives, so logprobs of forbidden tokens are -inf).
- `Request.append_output` advances the grammar with every token the request gets: sampled here, or
  token 1 that a PD prefill sampled under the same grammar (the decode rebuilds the grammar from the
  same request body and replays the token). Preemption keeps the output, so the state stays valid.
- `LLMEngine.check_stop` ends a request whose grammar cannot be extended (finish_reason "stop").

State is the matcher's alone; it lives on the request and only the engine thread touches it after
`make_request`.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

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

    def __init__(self, matcher: llguidance.LLMatcher, backend: GrammarBackend) -> None:
        self.matcher = matcher
        self.backend = backend

    def accept(self, token_id: int) -> None:
        """Advance past `token_id` (a token the mask allowed); a refused token leaves the matcher in
        its error state, which `terminated` reports (the request then stops rather than run on)."""
        self.matcher.consume_token(token_id)

    @property
    def terminated(self) -> bool:
        """No further token is allowed (the grammar is complete, or the matcher failed)."""
        return self.matcher.is_stopped() or self.matcher.is_error()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class GrammarBackend:
    """One per engine: the tokenizer as llguidance sees it (built on first use, ~1 s for a 150k
    vocabulary) and the compiled-grammar cache. Thread-safe: requests are validated on worker threads."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size  # the model's (logits width); ids past the tokenizer's never match
        self._eos = list(eos_token_ids) or None
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
        """A fresh matcher at the start of `spec`'s grammar; InvalidGrammar if it does not compile."""
        key = spec.cache_key()
        tok = self.tokenizer()
        with self._lock:
            template = self._templates.get(key)
            if template is not None:
                self._templates.move_to_end(key)
                return RequestGrammar(template.deep_copy(), self)
        text = _llguidance_grammar(spec)
        error = llguidance.LLMatcher.validate_grammar(text, tok)
        if error:
            raise InvalidGrammar(f"structured output ({spec.kind}) does not compile: {error.strip()}")
        template = llguidance.LLMatcher(tok, text, log_level=0)
        if template.is_error():
            raise InvalidGrammar(f"structured output ({spec.kind}) does not compile: {template.get_error()}")
        with self._lock:
            self._templates[key] = template
            while len(self._templates) > _CACHE_SIZE:
                self._templates.popitem(last=False)
        return RequestGrammar(template.deep_copy(), self)


def mask_logits(logits: torch.Tensor, rows: list[int], grammars: list[RequestGrammar]) -> None:
    """Set to -inf, in place, every logit of `logits` [N, V] rows `rows` that the row's grammar forbids
    next (`grammars[j]` is row `rows[j]`'s; all of one engine's backend). The bitmask is computed on the
    CPU, in parallel over rows (one bit per token: [R, ceil(V / 32)] int32), and expanded on the
    logits' device. (A failed matcher allows EOS only, and `check_stop` ends its request before
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
    words = torch.from_numpy(bitmask).to(logits.device)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words[:, :, None] >> shifts) & 1).reshape(len(rows), -1)[:, : logits.shape[-1]].bool()
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))


def _llguidance_grammar(spec: StructuredOutputs) -> str:
    """The spec as an llguidance grammar (its JSON form)."""
    options = COMPACT_JSON if spec.disable_any_whitespace else None
    try:
        if spec.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.text, overrides=options)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.text)
        if spec.kind == "choice":
            choices = json.loads(spec.text)
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in choices)
            )
        return llguidance.grammar_from("grammar", spec.text)  # Lark (llguidance's dialect) or GBNF
    except ValueError as e:
        raise InvalidGrammar(f"structured output ({spec.kind}): {e}") from None
