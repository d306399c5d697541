"""Per-request sampling settings, shaped like vLLM's `SamplingParams`. Pure Python.

Invalid values raise `ValueError` at construction, so a bad request is refused before it touches any
engine state.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 1024  # (OpenAI takes 4; vLLM and SGLang set no bound, and RL recipes use a few)
MAX_STOP_TOKEN_IDS = 1024
MAX_SPEC_CHARS = 256 * 1024  # a structured-output spec's text (schema, regex, choices, grammar)
MAX_N = 64  # choices per prompt (each is a request of its own on the engines)
_SEED_SPAN = 2**64  # seeds are taken in [-2**63, 2**64): a choice's seed wraps inside it


def child_seed(seed, i: int):
    """Choice i's seed when one prompt is sampled n times (offline `n`, the HTTP routes' `n`):
    seed + i, wrapped into the accepted range, so each choice is reproducible alone; anything else is
    left as it was (an unseeded request stays unseeded; a bad seed is refused by each choice as by
    the parent)."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not -(2**63) <= seed < _SEED_SPAN:
        return seed
    s = seed + i
    return s - _SEED_SPAN if s >= _SEED_SPAN else s


# llguidance's JSON options for `disable_any_whitespace`: Python's json.dumps separators (the form most
# models write), no other whitespace.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class StructuredOutputs:
    """Constrain the output to a grammar (vLLM's `structured_outputs`), compiled and applied by
    `model/grammar.py`. Exactly one of:

    - `json`: a JSON schema (a dict, or its text); `json_object`: any JSON object;
    - `regex`: a regular expression (Rust `regex` syntax) the whole output must match;
    - `choice`: the output is one of these strings;
    - `grammar`: a context-free grammar, Lark in llguidance's dialect (may embed `%json {...}`) or GBNF.

    `disable_any_whitespace`: JSON with no optional whitespace (only `, ` and `: ` between items, the
    form json.dumps writes and models mostly learned; vLLM's guidance backend also drops those two
    spaces), which keeps a weak model from running on in blanks until max_tokens.
    `whitespace_pattern`: a regex for JSON's whitespace. `start_after` (pdserve's; the chat route
    sets it for reasoning models): the grammar applies only once the answer contains this text.
    The spec's text is at most MAX_SPEC_CHARS (a 50k-entry choice takes seconds to compile).
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    start_after: str | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.json_object, bool), "json_object must be a boolean", self.json_object)
        given = [
            name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object is not False else [])
        _check(
            len(given) == 1,
            "structured_outputs needs exactly one of json, json_object, regex, choice, grammar",
            given,
        )
        _check(
            isinstance(self.disable_any_whitespace, bool),
            "disable_any_whitespace must be a boolean",
            self.disable_any_whitespace,
        )
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError:
                    _check(False, "structured_outputs.json must be a JSON schema (an object)", self.json)
                except RecursionError:
                    raise ValueError("structured_outputs.json is nested too deeply") from None
            _check(
                isinstance(schema, dict | bool), "structured_outputs.json must be a JSON schema", self.json
            )
            self.json = schema
        for name in ("regex", "grammar", "whitespace_pattern", "start_after"):
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, str) and value),
                f"{name} must be a non-empty string",
                value,
            )
        if self.choice is not None:
            _check(
                isinstance(self.choice, list | tuple)
                and len(self.choice) > 0
                and all(isinstance(c, str) and c for c in self.choice),
                "choice must be a non-empty list of non-empty strings",
                self.choice,
            )
            self.choice = list(self.choice)
        size = len(self.text)
        _check(
            size <= MAX_SPEC_CHARS, f"structured output spec is too large (> {MAX_SPEC_CHARS} chars)", size
        )

    @classmethod
    def of(cls, value) -> StructuredOutputs | None:
        """From a request's JSON (a dict with the fields above). A null field is an absent one (a
        vLLM client serialises every field of its params); vLLM's `disable_fallback` is accepted (one
        backend here), its `disable_additional_properties` and `structural_tag` only when off; other
        keys are a ValueError."""
        if value is None or isinstance(value, StructuredOutputs):
            return value
        _check(isinstance(value, dict), "structured_outputs must be an object", value)
        value = {k: v for k, v in value.items() if v is not None}
        value.pop("disable_fallback", None)
        for key in ("disable_additional_properties", "structural_tag"):
            _check(value.pop(key, False) is False, f"structured_outputs.{key} is not supported", key)
        if value.get("json_object") is False:
            value.pop("json_object")
        unknown = set(value) - set(cls.__dataclass_fields__)
        _check(not unknown, "unknown structured_outputs fields", sorted(unknown))
        return cls(**value)

    @property
    def kind(self) -> str:
        """json (json_object included) | regex | choice | grammar."""
        if self.json is not None or self.json_object:
            return "json"
        return "regex" if self.regex is not None else "choice" if self.choice is not None else "grammar"

    @functools.cached_property
    def text(self) -> str:
        """The spec as one string: a schema's JSON (keys in the client's order: properties are
        generated in the order the schema lists them), the choices' JSON list. Computed once (the size
        check, the cache key and the compiler read it)."""
        if self.json_object:
            return '{"type": "object"}'
        if self.json is not None:
            return json.dumps(self.json)
        if self.choice is not None:
            return json.dumps(self.choice)
        return self.regex if self.regex is not None else self.grammar

    def cache_key(self) -> tuple:
        return self.kind, self.text, self.disable_any_whitespace, self.whitespace_pattern


@dataclass
class SamplingParams:
    # Choices per prompt. The engine runs one sequence per request: `LLM.generate` and the HTTP routes
    # split n > 1 into n requests (choice j seeded `child_seed(seed, j)`), which share the prompt's pages.
    n: int = 1
    max_tokens: int | None = 16  # None: up to max_model_len
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; n >= 0: chosen token plus top-n
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Token-dependent logits processors (model/logits_processors.py; vLLM v1's formulas and order).
    min_tokens: int = 0  # no EOS / stop token (nor stop string match) before this many output tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt or output (HF/CTRL form)
    # Structured outputs (model/grammar.py): the answer must match this grammar. A dict is converted.
    structured_outputs: StructuredOutputs | None = None
    # None: none; n >= 0: every prompt token's logprob given the ones before it, plus the top-n there
    # (vLLM's extra parameter; such a request takes no prefix-cache hit: cached tokens have no logits)
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        self.stop = self.stop if self.stop is not None else []
        _check(
            isinstance(self.stop_token_ids, list | tuple | type(None)),
            "stop_token_ids must be a list",
            self.stop_token_ids,
        )
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = _token_bias(self.logit_bias)
        self.structured_outputs = StructuredOutputs.of(self.structured_outputs)
        _check(
            isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool),
            "min_tokens must be an integer",
            self.min_tokens,
        )
        for name in ("n", "max_tokens", "top_k", "logprobs", "prompt_logprobs", "seed"):
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, int) and not isinstance(value, bool)),
                f"{name} must be an integer",
                value,
            )
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            _check(
                isinstance(value, int | float) and not isinstance(value, bool),
                f"{name} must be a number",
                value,
            )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            _check(isinstance(value, bool), f"{name} must be a boolean", value)
        _check(isinstance(self.stop, list), "stop must be a string or a list of strings", self.stop)
        if self.top_k == -1:
            self.top_k = 0
        _check(1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}]", self.n)
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be >= 1", self.max_tokens)
        _check(0.0 <= self.temperature < math.inf, "temperature must be finite and >= 0", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", self.top_p)
        _check(0 <= self.top_k < 2**63, "top_k must be -1, 0 (disabled) or >= 1", self.top_k)
        _check(0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]", self.min_p)
        _check(self.min_tokens >= 0, "min_tokens must be >= 0", self.min_tokens)
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens must be <= max_tokens ({self.max_tokens})",
            self.min_tokens,
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, f"{name} must be in [-2, 2]", value)
        _check(
            0.0 < self.repetition_penalty < math.inf,
            "repetition_penalty must be finite and > 0",
            self.repetition_penalty,
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or 0 <= value <= MAX_TOP_LOGPROBS,
                f"{name} must be in [0, {MAX_TOP_LOGPROBS}]",
                value,
            )
        # Every stop string is searched for after every token, on the engine thread: 1.5M of them
        # (13.5 MB, under the body limit) held every other request of the engine ~100x longer.
        _check(len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings", len(self.stop))
        _check(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids",
            len(self.stop_token_ids),
        )
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty", self.stop)
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "bad stop_token_ids",
            self.stop_token_ids,
        )
        _check(
            self.seed is None or -(2**63) <= self.seed < 2**64, "seed must be in [-2**63, 2**64)", self.seed
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def _token_bias(bias) -> dict[int, float]:
    """logit_bias as {token id: bias}: JSON keys are strings ("50256"), so digit strings are accepted;
    biases must lie in [-100, 100] (OpenAI's range; vLLM clamps, we refuse)."""
    if bias is None:
        return {}
    _check(isinstance(bias, dict), "logit_bias must be a map of token id to bias", bias)
    out: dict[int, float] = {}
    for key, value in bias.items():
        tok = key
        if isinstance(key, str) and key.isascii() and key.isdigit():
            tok = int(key)
        _check(
            isinstance(tok, int) and not isinstance(tok, bool) and tok >= 0, "bad logit_bias token id", key
        )
        _check(
            isinstance(value, int | float) and not isinstance(value, bool) and -100.0 <= value <= 100.0,
            "logit_bias values must be numbers in [-100, 100]",
            value,
        )
        out[tok] = float(value)
    return out


def _check(ok: bool, message: str, value) -> None:
    if not ok:
        shown = repr(value)
        if len(shown) > 200:  # (a huge list's repr would make a huge error body)
            shown = shown[:200] + f"... ({len(shown)} chars)"
        raise ValueError(f"{message}, got {shown}")
