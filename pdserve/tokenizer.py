"""Tokenizer and chat template from a HF model directory (`tokenizer.json`, `tokenizer_config.json`).

Uses the `tokenizers` library directly (no `transformers` at serving time) and renders chat templates
with a sandboxed jinja2 environment configured the way HF renders them.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

SPACE_MARKER = "\u2581"  # SentencePiece's "▁": a piece's leading space
# tokenizer_config keys of special tokens given to chat templates beside bos_token and eos_token
SPECIAL_TOKEN_KEYS = ("unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
DECODE_CONTEXT_TOKENS = 5  # prompt tokens an output is decoded after (vLLM: 5)


class TokenizerError(ValueError):
    pass


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`, which training templates wrap the assistant's part in
    (transformers marks it for its assistant-token mask): rendered as its body. Unknown, the template
    did not compile and every chat request was a 400."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # AddedToken serialisation
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"no tokenizer.json in {str(model_dir)!r}")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        # Chat templates by name, as transformers reads them: tokenizer_config's (one, or a list of named
        # ones), then `chat_template.jinja`, which replaces the default (it used to lose to the
        # config's), then `additional_chat_templates/<name>.jinja`. A request with tools renders
        # "tool_use" when there is one (Hermes-2-Pro's), else "default".
        self.chat_templates: dict[str, str] = {}
        template = cfg.get("chat_template")
        if isinstance(template, list):
            self.chat_templates = {
                t["name"]: t["template"]
                for t in template
                if isinstance(t, dict) and {"name", "template"} <= set(t)
            }
        elif isinstance(template, str):
            self.chat_templates["default"] = template
        if (model_dir / "chat_template.jinja").is_file():
            self.chat_templates["default"] = (model_dir / "chat_template.jinja").read_text()
        extra = model_dir / "additional_chat_templates"
        if extra.is_dir():
            for f in sorted(extra.glob("*.jinja")):
                self.chat_templates[f.stem] = f.read_text()
        self._compiled: dict[str, jinja2.Template] = {}  # by name, compiled on first use
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        # The other special tokens a template may name (transformers passes its special-tokens map)
        self.special_tokens = {
            key: text for key in SPECIAL_TOKEN_KEYS if (text := _token_text(cfg.get(key))) is not None
        }
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        # Byte-fallback tokens (<0x00>..<0xFF>, sentencepiece-style vocabularies; none in byte-level BPE).
        self.byte_token_ids = frozenset(
            i for b in range(256) if (i := self._tok.token_to_id(f"<0x{b:02X}>")) is not None
        )
        # SentencePiece vocabularies write a word's leading space as U+2581 in its pieces ("▁Paris");
        # byte-level BPE ones never hold that character raw (it would be three byte symbols).
        self._has_space_marker = any(piece.startswith(SPACE_MARKER) for piece in self._tok.get_vocab())

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what llguidance reads for structured outputs)."""
        return self._tok.to_str()

    def token_id(self, text: str) -> int | None:
        """The id of `text` if it is one entry of the vocabulary (an added token such as `<tool_call>`)."""
        return self._tok.token_to_id(text)

    def is_special(self, text: str) -> bool:
        """Whether `text` is one special token of this vocabulary (dropped by skip_special_tokens)."""
        return self._tok.token_to_id(text) in self._special_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # `encode_batch` releases the GIL while it works; `encode` holds it throughout (~0.1 s for a
        # 50k-token prompt, during which the engine thread could not step). Same ids.
        try:
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError:
            # (the library's message, "TextEncodeInput must be Union[...]", names no cause)
            if isinstance(text, str) and any("\ud800" <= c <= "\udfff" for c in text):
                raise TokenizerError(
                    "text holds a lone UTF-16 surrogate (e.g. a JSON \\ud800 escape without its pair): "
                    "not valid Unicode"
                ) from None
            raise

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text as logprobs show it (special tokens included). SentencePiece decoders
        (Metaspace, Llama-2's Strip) drop the leading space of a sequence's first piece, so "▁Paris"
        decoded alone read "Paris"; the spaces its piece starts with are put back, as vLLM does."""
        text = self._tok.decode([token_id], skip_special_tokens=False)
        if self._has_space_marker:
            piece = self._tok.id_to_token(token_id) or ""
            num_marked = len(piece) - len(piece.lstrip(SPACE_MARKER))
            num_missing = num_marked - (len(text) - len(text.lstrip(" ")))
            if num_missing > 0:
                text = " " * num_missing + text
        return text

    def token_bytes(self, token_id: int, text: str | None = None) -> bytes:
        """One token's own bytes (OpenAI's logprobs `bytes`): a token holding part of a character
        decodes alone to U+FFFD, whose bytes never combine into the answer; its raw byte is read from
        its piece instead -- `<0xNN>` in a byte-fallback vocabulary, byte-level BPE's one symbol per
        byte otherwise. `text`: its `token_text`, when the caller has it already."""
        text = self.token_text(token_id) if text is None else text
        if "\ufffd" not in text:
            return text.encode()
        piece = self._tok.id_to_token(token_id) or ""
        if token_id in self.byte_token_ids:
            return bytes([int(piece[3:5], 16)])
        try:
            return bytes(_BYTE_OF_SYMBOL[c] for c in piece)
        except KeyError:  # (not a byte-level piece: its text is all there is)
            return text.encode()

    def chat_prompt(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
        documents: list[dict] | None = None,
    ) -> tuple[str, list[int]]:
        """The chat template applied to `messages` and its token ids. The template writes the BOS
        itself, so the text is encoded without special tokens (the chat route and `LLM.chat`)."""
        prompt = self.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs, documents)
        return prompt, self.encode(prompt, add_special_tokens=False)

    def incremental(
        self, skip_special_tokens: bool = True, context: list[int] = ()
    ) -> IncrementalDetokenizer:
        """A detokenizer for one request's growing output (see `IncrementalDetokenizer`), decoded after
        `context` (`decode_context`)."""
        return IncrementalDetokenizer(self, skip_special_tokens, list(context))

    def decode_context(self, prompt_ids: list[int], skip_special_tokens: bool = True) -> list[int]:
        """The last few prompt tokens an output is decoded after (as vLLM's detokenizer starts from the
        prompt's): SentencePiece decoders (Metaspace, Llama-2's Strip) drop the leading space of a
        sequence's first piece, so an output decoded alone lost it ("is" + "▁Paris" read "isParis").
        The longest tail of at most DECODE_CONTEXT_TOKENS whose text is whole (no partial character)."""
        for n in range(min(DECODE_CONTEXT_TOKENS, len(prompt_ids)), 0, -1):
            tail = list(prompt_ids[-n:])
            if tail[-1] not in self.byte_token_ids and "\ufffd" not in self.decode(tail, skip_special_tokens):
                return tail
        return []

    def decode_after(self, context: list[int], token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text `token_ids` add after `context` (`decode_context`)."""
        if not context:
            return self.decode(token_ids, skip_special_tokens)
        head = self.decode(context, skip_special_tokens)
        full = self.decode(context + list(token_ids), skip_special_tokens)
        # (a decoder whose text of the context changes with what follows: the output alone)
        return full[len(head) :] if full.startswith(head) else self.decode(token_ids, skip_special_tokens)

    @property
    def chat_template(self) -> str | None:
        """The default chat template (None: the model has none)."""
        return self.chat_templates.get("default")

    def set_chat_template(self, text: str | None, name: str = "default") -> None:
        """Replace (or, with None, remove) a named chat template."""
        if text is None:
            self.chat_templates.pop(name, None)
        else:
            self.chat_templates[name] = text
        self._compiled.pop(name, None)

    def _compiled_template(self, name: str = "default"):
        """A chat template, compiled once (compiling took ~6.5 ms per request for Qwen2.5's, with the
        GIL held; rendering a compiled one ~0.05 ms). A race of two first callers compiles it twice.
        The environment is transformers': its `tojson` (with `json.dumps`' options), the `generation`
        tag of training templates, `raise_exception` and `strftime_now` (Llama 3.2's templates write
        today's date with it, and a fixed one without)."""
        compiled = self._compiled.get(name)
        if compiled is None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationTag]
            )

            def raise_exception(message):
                raise TokenizerError(f"chat template error: {message}")

            def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
                return json.dumps(
                    x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
                )

            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = tojson
            compiled = self._compiled[name] = env.from_string(self.chat_templates[name])
        return compiled

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
        documents: list[dict] | None = None,
    ) -> str:
        """`tools`: OpenAI tool objects, shown to the model by the template as it sees fit (HF's
        `tools` argument; a template that ignores them ignores them); `documents` likewise (HF's, for
        retrieval-augmented templates). `template_kwargs`: more variables
        for the template (the request's `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`); they
        cannot replace the ones above (TokenizerError)."""
        name = "tool_use" if tools is not None and "tool_use" in self.chat_templates else "default"
        if not self.chat_templates.get(name):
            raise TokenizerError("this model has no chat template; use /v1/completions")
        fixed = {
            **self.special_tokens,
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
        }
        if documents is not None:  # (else chat_template_kwargs may give them, as they could before)
            fixed["documents"] = documents
        taken = sorted(set(template_kwargs or {}) & set(fixed))
        if taken:
            raise TokenizerError(f"chat_template_kwargs may not set {taken}: give them as request fields")
        try:
            return self._compiled_template(name).render(**(template_kwargs or {}), **fixed)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template error: {e}") from e


def _byte_level_symbols() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): the printable character each byte is written as in a
    piece -> the byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[chr(b)] = b
        else:
            symbols[chr(256 + extra)] = b
            extra += 1
    return symbols


_BYTE_OF_SYMBOL = _byte_level_symbols()


class IncrementalDetokenizer:
    """The text of a growing list of token ids, decoded a few tokens at a time.

    Decoding the whole output at every step costs O(output) per step: at 2,000 output tokens ~0.24 ms
    per request and step on the engine thread, so 64 streams of an RL rollout's 8k-token answers spent
    more time detokenizing than a GPU spends on the step. Here each step decodes a window that starts
    at the last settled token (`prefix_offset`): the text the new ids add is the window's text minus
    what the window decoded to before them. The window keeps the decoders' context (a byte-level BPE
    or byte-fallback character split over tokens, Metaspace's leading space, which both decodes of a
    window strip alike), so the text is the full decode's at every step, a trailing incomplete
    character (U+FFFD) included.

    Nothing is settled while the text ends in U+FFFD (a character may still complete) or the last
    token is a byte-fallback token: the ByteFallback decoder turns a whole run of byte tokens into
    U+FFFD once a later byte makes the run invalid, valid bytes before it too, so a run is final only
    once a token that is not a byte ends it. (HF `tokenizers.decoders.DecodeStream` does this job
    too, but raises on some byte-fallback sequences a sampler can produce.)
    """

    def __init__(
        self, tokenizer: Tokenizer, skip_special_tokens: bool = True, context: list[int] = ()
    ) -> None:
        self._decode = tokenizer.decode
        self._skip = skip_special_tokens
        self._byte_ids = tokenizer.byte_token_ids
        self._context = list(context)  # prompt tokens the window starts with (`decode_context`)
        self._start()
        self._num_seen = 0  # output tokens `text` covers
        self.text = ""

    def _start(self) -> None:
        # Offsets index context + output: the first window is the context, whose text is subtracted.
        self._settled = ""  # the text of output tokens before read_offset
        self._prefix_offset = 0  # window start: the tokens before it are settled text
        self._read_offset = len(self._context)

    def update(self, token_ids: list[int]) -> str:
        """`token_ids`: the whole output so far (it only grows). Returns the text so far."""
        if len(token_ids) < self._num_seen:  # not an append: start over
            self._start()
        elif len(token_ids) == self._num_seen:
            return self.text
        self._num_seen = len(token_ids)
        c = len(self._context)
        if self._prefix_offset < c:  # (the window still starts in the context: only at first)
            window = self._context[self._prefix_offset :] + token_ids
        else:
            window = token_ids[self._prefix_offset - c :]
        before = self._decode(window[: self._read_offset - self._prefix_offset], self._skip)
        after = self._decode(window, self._skip)
        new = after[len(before) :]
        self.text = self._settled + new
        if new and not new.endswith("\ufffd") and token_ids[-1] not in self._byte_ids:
            self._settled = self.text
            self._prefix_offset, self._read_offset = self._read_offset, c + len(token_ids)
        return self.text
