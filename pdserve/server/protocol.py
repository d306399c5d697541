"""OpenAI-compatible request bodies (pydantic, as FastAPI validates them) and error bodies.

Length (~540 lines): the request models of completions, chat, SGLang's /generate, aborts and weight
updates, with the validators each field needs; they share the sampling fields and the error shape.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.responses import JSONResponse as _StarletteJSONResponse

from pdserve.sampling_params import SamplingParams, StructuredOutputs


def chat_id(request_id: str) -> str:
    """A chat answer's id for the request `cmpl-<x>`: `chatcmpl-<x>` (vLLM's and OpenAI's prefix)."""
    return "chatcmpl-" + request_id.removeprefix("cmpl-")


def request_id_of(answer_id: str) -> str:
    """The request behind an answer's id (`chat_id` undone): what /abort_request looks up."""
    return "cmpl-" + answer_id.removeprefix("chatcmpl-") if answer_id.startswith("chatcmpl-") else answer_id


# The request ids of health probes (`/health_generate`, the router's probe of a PD pair): not traffic,
# so the metrics leave them out (SGLang sends its probe with log_metrics=False).
HEALTH_PROBE_PREFIX = "HEALTH_CHECK_"

MAX_REQUEST_ID_CHARS = 256  # a client's request_id (a split request's children add "_<i>" to it)
MAX_CACHE_SALT_CHARS = 1024  # a client's cache_salt (hashed once per request)
MAX_ROUTER_ID_CHARS = 64  # a router's id (`pd.router_id`, AbortRequest.router_id): 32 hex chars


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    # (on by default when stream_options is given, as in vLLM: `{"continuous_usage_stats": true}` alone
    # asks for usage; without stream_options there is none)
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False  # (vLLM's: with include_usage, the usage in every chunk)


# OpenAI / vLLM fields whose meaning we do not implement, with the values that mean "off". Any other
# value is a 400: a client asking for an echo or beam search must not get a plain completion instead.
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "best_of": (1,),
    "echo": (False,),  # (chat only: completions have their own field; vLLM's chat echo is another thing)
    "suffix": ("",),
    "use_beam_search": (False,),
    # vLLM's extra parameters we do not implement: refused rather than silently ignored.
    "structural_tag": (),
    # Tools belong to chat completions (its own fields there, server/tool_calls.py); in a plain
    # completion, and in the legacy `functions` form, ignoring them would hand an agent plain text
    # where it expects calls.
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    # vLLM's: logprob tokens as "token_id:N" strings (ours are the tokens' text)
    "return_tokens_as_token_ids": (False,),
    # vLLM's extra parameters that change the answer, not implemented: refused, not ignored
    "allowed_token_ids": (),
    "bad_words": ([],),
    "truncate_prompt_tokens": (),
    "chat_template": (),
    "logits_processors": (),
    "length_penalty": (1.0, 1),
    "priority": (0,),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "prompt_embeds": (),  # (beside a prompt it was ignored: the answer was the text's, not the embeddings')
}
# The same for one route only: vLLM's defaults differ (a completion's prompt gets the tokenizer's
# special tokens, a chat's rendered template does not); a chat's final assistant message continued
# instead of closed is not implemented. Ignoring them gave a doubled BOS or a closed message.
UNSUPPORTED_COMPLETION_FIELDS: dict[str, tuple] = {"add_special_tokens": (True,)}
UNSUPPORTED_CHAT_FIELDS: dict[str, tuple] = {
    "add_special_tokens": (False,),
    "continue_final_message": (False,),
    "return_token_ids": (False,),  # (a completion's only, here)
}


# Integer fields that take a float of integral value (2048.0: a client's budget computed in float
# arithmetic, which vLLM's lax parsing accepts); 2048.5, "2048" and true stay 400s.
INTEGRAL_FLOAT_FIELDS = frozenset(
    {"max_tokens", "max_completion_tokens", "top_k", "seed", "n", "min_tokens", "logprobs",
     "top_logprobs", "prompt_logprobs"}
)  # fmt: skip


NULL_MEANS_DEFAULT = frozenset(
    {"temperature", "top_p", "top_k", "min_p", "stream", "ignore_eos", "skip_special_tokens",
     "include_stop_str_in_output", "min_tokens", "logprobs", "add_generation_prompt"}
)  # fmt: skip


class _SamplingFields(BaseModel):
    # Unknown OpenAI fields (user, ...) are ignored; known ones must have their JSON type (strict: no
    # false -> 0, "1" -> 1, "no" -> False coercions).
    model_config = ConfigDict(extra="allow", strict=True)
    # The route's own refused fields beside UNSUPPORTED_FIELDS (pydantic ignores ClassVars)
    unsupported_here: ClassVar[dict[str, tuple]] = {}

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        """OpenAI types these "or null" (the openai SDK sends an explicit None as null): null is the
        field's default, as in vLLM (a strict non-null field made `temperature=None` a 400). And an
        integer field's integral float is that integer (INTEGRAL_FLOAT_FIELDS)."""
        if isinstance(data, dict):
            return {
                k: int(v) if type(v) is float and k in INTEGRAL_FLOAT_FIELDS and v.is_integer() else v
                for k, v in data.items()
                if not (v is None and k in NULL_MEANS_DEFAULT)
            }
        return data

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, value in (self.model_extra or {}).items():
            off = self.unsupported_here.get(name, UNSUPPORTED_FIELDS.get(name))
            if (
                off is not None
                and value is not None
                and not any(value == v and type(value) is type(v) for v in off)
            ):
                raise ValueError(f"{name}={value!r} is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    model: str | None = None
    # vLLM's: the request's id is "cmpl-" + this (chat answers say "chatcmpl-"); it names the request
    # for /abort_request, and the choices of one request are its children "<id>_<i>".
    request_id: str | None = Field(default=None, min_length=1, max_length=MAX_REQUEST_ID_CHARS)
    # vLLM's: the request's prefix-cache and store keys are salted with it (a tenant's own), so only
    # requests of the same salt share KV (hashing.salted_root).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int | None = 1  # > 1: split into n requests and merged (server/fanout.py)
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # vLLM's extra parameter: keep the stop string in the text
    # Logits processors (model/logits_processors.py); null means the default, as in OpenAI's API.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extra parameter
    logit_bias: dict[str, float] | None = None  # token id (a JSON key: a string) -> bias in [-100, 100]
    min_tokens: int = 0  # vLLM's extra parameter
    prompt_logprobs: int | None = None  # vLLM's extra parameter: every prompt token's logprob (top-n)
    # Structured outputs (model/grammar.py): OpenAI's response_format, vLLM's structured_outputs and
    # its older guided_* fields; at most one of them.
    response_format: dict | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    structured_outputs: dict | None = None  # sampling_params.StructuredOutputs' fields
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> StructuredOutputs | None:
        """The one structured-output spec the request gives, if any (ValueError for two, or a bad one)."""
        specs = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                specs.append(StructuredOutputs(json_object=True))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict | bool):
                    raise ValueError("response_format json_schema needs {'json_schema': {'name', 'schema'}}")
                # (no schema: any JSON value that is an object, as OpenAI's json_object)
                specs.append(StructuredOutputs(json=js.get("schema", {"type": "object"})))
            elif kind != "text":
                raise ValueError(
                    f"response_format type {kind!r} is not supported (text, json_object, json_schema)"
                )
        if self.structured_outputs is not None:
            specs.append(StructuredOutputs.of(self.structured_outputs))
        guided = {
            "json": self.guided_json,
            "regex": self.guided_regex,
            "choice": self.guided_choice,
            "grammar": self.guided_grammar,
        }
        specs += [StructuredOutputs(**{k: v}) for k, v in guided.items() if v is not None]
        if len(specs) > 1:
            raise ValueError("give one of response_format, structured_outputs and guided_*, not several")
        return specs[0] if specs else None

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, defaults: dict | None = None
    ) -> SamplingParams:
        """`defaults`: the model's generation-config values (`ModelConfig.sampling_defaults`) for the
        sampling fields this request does not set (as vLLM applies them)."""
        if self.n not in (None, 1):  # (a route splits n > 1 into children of n = 1 before this)
            raise ValueError("n > 1 must be split into requests of n = 1 first")
        given = self.model_fields_set

        def pick(name: str, value):
            if defaults and name in defaults and (name not in given or value is None):
                return defaults[name]
            return value

        repetition = pick("repetition_penalty", self.repetition_penalty)  # (0 is refused: not "unset")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=pick("temperature", self.temperature),
            top_p=pick("top_p", self.top_p),
            top_k=pick("top_k", self.top_k),
            min_p=pick("min_p", self.min_p),
            seed=self.seed,
            stop=[] if self.stop is None else self.stop,  # ("" is refused, as in a list)
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            min_tokens=self.min_tokens,
            logit_bias=self.logit_bias or {},
            presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
            frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
            repetition_penalty=1.0 if repetition is None else repetition,
            structured_outputs=self.structured(),
            prompt_logprobs=self.prompt_logprobs,
        )


class CompletionRequest(_SamplingFields):
    unsupported_here: ClassVar[dict[str, tuple]] = UNSUPPORTED_COMPLETION_FIELDS
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    # The prompt before the completion; with `logprobs`, the prompt's tokens lead them (the first None)
    echo: bool | None = False  # (null: false, as vLLM reads it)
    # vLLM's extension: token ids beside the text (agentic clients build the next turn from them)
    return_token_ids: bool | None = False

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, defaults: dict | None = None
    ) -> SamplingParams:
        sp = super().sampling_params(max_tokens, logprobs, defaults)
        if self.echo and logprobs is not None:  # (the prompt's part needs its tokens' logprobs)
            sp = dataclasses.replace(sp, prompt_logprobs=max(sp.prompt_logprobs or 0, logprobs))
        return sp

    def single_prompt(self) -> str | dict:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:  # (a route splits a prompt list into children of one prompt before this)
                raise ValueError("a prompt list must be split into requests of one prompt first")
            p = p[0]
        return {"prompt_token_ids": p} if isinstance(p, list) else p


# Content part types read as text (OpenAI's "text"; the Responses API's "input_text"); any other
# (image_url, input_audio, ...) is a 400: this server serves text models, and answering without the
# image would be a silent wrong answer.
TEXT_PART_TYPES = ("text", "input_text")


class ContentPart(BaseModel):
    """One part of a chat message's content: {"type": "text", "text": ...}."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str | None = None
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type not in TEXT_PART_TYPES:
            raise ValueError(
                f"content part type {self.type!r} is not supported (text models: text parts only)"
            )
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # [{"type": "text", "text": ...}, ...], one per line (vLLM's)
            return "\n".join(part.text or "" for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    unsupported_here: ClassVar[dict[str, tuple]] = UNSUPPORTED_CHAT_FIELDS
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # More variables for the chat template (vLLM's), e.g. {"enable_thinking": false} for Qwen3.
    chat_template_kwargs: dict[str, Any] | None = None
    # Retrieved documents for a RAG template (HF's and vLLM's `documents`: Command-R, Granite, ...).
    documents: list[dict[str, Any]] | None = None
    # vLLM's: false drops the thinking a --reasoning-parser splits off (no reasoning_content).
    include_reasoning: bool = True
    # Tool calling (server/tool_calls.py): needs an engine started with --tool-call-parser.
    tools: list | None = None
    tool_choice: str | dict | None = None  # "auto" (default with tools) | "none"
    parallel_tool_calls: bool | None = None  # (accepted; the model decides how many calls it makes)

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self


# /generate's max_new_tokens when the client leaves it out: SGLang's default, lowered to the room the
# prompt leaves in the context (SGLang refuses such a prompt; a default the client never set should not).
# An explicit null means up to the context length, as in SGLang.
GENERATE_DEFAULT_MAX_NEW_TOKENS = 128


# SGLang's GenerateReqInput fields not implemented here (multimodal inputs, LoRA, extra outputs, ...).
UNSUPPORTED_GENERATE_FIELDS = frozenset(
    {"image_data", "video_data", "audio_data", "input_embeds", "lora_path", "lora_id",
     "return_hidden_states", "return_routed_experts", "return_entropy", "token_ids_logprob",
     "custom_logit_processor", "session_params", "extra_key"}
)  # fmt: skip
GENERATE_NULL_MEANS_DEFAULT = frozenset(
    {"sampling_params", "stream", "return_logprob", "top_logprobs_num", "logprob_start_len",
     "return_text_in_logprobs"}
)  # fmt: skip


class GenerateRequest(BaseModel):
    """Native endpoint (SGLang-like): token ids in, token ids out. A batch (a list of texts or of
    token-id lists) or `sampling_params.n` > 1 is one child request per prompt and sample, answered
    as a list (server/api.py): `sampling_params` then is one dict for all or one per prompt, and `rid`
    one id (child i gets `<rid>_<i>`) or one per child."""

    model_config = ConfigDict(strict=True)

    input_ids: list[int] | list[list[int]] | None = None
    text: str | list[str] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] = Field(default_factory=dict)
    stream: bool = False
    rid: str | list[str] | None = None
    # SGLang's logprob fields: each output token's logprob (and its top `top_logprobs_num`); with
    # `logprob_start_len` >= 0, the prompt's from that position too; entries [logprob, id, text or null].
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0)
    logprob_start_len: int = Field(default=-1, ge=-1)
    return_text_in_logprobs: bool = False
    # SGLang's (and vLLM's): the request's KV keys are salted with it (see _SamplingFields.cache_salt)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # pdserve's router: a PD half's room etc. (as a completion body's `pd`; refused on a colocated engine)
    pd: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default_and_refuse_unsupported(cls, data):
        """SGLang's optional fields given as null take their default (a strict field refused null).
        SGLang fields this server does not implement are a 400 unless off: they were ignored, and an
        answer from the text alone (`image_data`), the base model (`lora_path`) or without the asked
        extras (`return_routed_experts`, ...) was a silent wrong answer."""
        if not isinstance(data, dict):
            return data
        for name, value in data.items():
            if name in UNSUPPORTED_GENERATE_FIELDS and value not in (None, False, [], {}, ""):
                raise ValueError(f"{name} is not supported by this server")
        return {k: v for k, v in data.items() if not (v is None and k in GENERATE_NULL_MEANS_DEFAULT)}


class JSONResponse(_StarletteJSONResponse):
    """Starlette's, except that a body holding a lone surrogate (a client's "\\ud800" echoed back: a
    rid, a model name in an error) is written with \\u escapes, as json.dumps writes it by default,
    where encoding it as UTF-8 raised (a 500, after a /generate had run to its end)."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, allow_nan=False, separators=(",", ":")).encode()


async def http_error(_request, e) -> JSONResponse:
    """The apps' handler of Starlette's HTTPException (a body that is not JSON, 404 for an unknown
    path, 405): the OpenAI error shape, as every other refusal."""
    err_type = {404: "NotFoundError", 405: "MethodNotAllowed"}.get(e.status_code, "BadRequestError")
    return JSONResponse(
        error_body(str(e.detail), e.status_code, err_type), status_code=e.status_code, headers=e.headers
    )


def describe_errors(errors: list[dict]) -> str:
    """pydantic's errors (`ValidationError.errors()`, FastAPI's too) as one line, "field: message; ..."
    (its own str() adds its input and a link to its docs per error)."""
    parts = []
    for err in errors:
        if err.get("type") == "json_invalid":  # (FastAPI's "1: JSON decode error"; the router's words)
            parts.append("request body is not valid JSON")
            continue
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "invalid request body"


# A decode's 503 when the prefill named by its request's bootstrap URL cannot be reached: the router
# counts the attempt as the prefill's failure (the decode is fine; with one decode it is all there is).
PREFILL_UNREACHABLE = "PrefillUnreachable"


def error_body(message: str, code: int, err_type: str = "BadRequestError", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def sglang_failure(message: str) -> dict:
    """What SGLang's clients read beside OpenAI's `error` on its control routes' refusals."""
    return {"success": False, "message": message}


class APIError(Exception):
    """Raised by an engine's route: answered as `error_body(...)` with that status (server/api.py)."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        err_type: str = "BadRequestError",
        param: str | None = None,
        extra: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.err_type, self.param = status, err_type, param
        self.extra = extra or {}  # top-level fields beside "error" (SGLang's routes: success, message)


Role = Literal["colocated", "prefill", "decode"]


class AbortRequest(BaseModel):
    """POST /abort_request (SGLang's): the request `rid`, or every request with `abort_all`. (SGLang's
    other fields, e.g. `abort_message`, are accepted and have no effect here.)

    `router_id`, `router_epoch`: set by pdserve's router on an abort of everything (its id and abort
    count, `Router.abort_all`); a PD half that router sent before it (`pd.router_epoch` lower) but
    that reaches the engine only after it is aborted on arrival (`AsyncEngine.note_router_abort`).
    `router_id`, `router_named`: likewise on an abort of one `rid` (its count of named aborts,
    `Router.abort_named`; a half with a lower `pd.router_named` that it names is aborted on arrival).
    `room` (with `rid`): set by pdserve's router to end the PD half of that one room, whose id is
    `rid` (no prefix match), on its prefill: an attempt that answered its token 1 and is retried
    elsewhere (`Router._abort_answered_half`)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    rid: str = ""
    abort_all: bool = False
    router_id: str = Field("", max_length=MAX_ROUTER_ID_CHARS)
    router_epoch: int = Field(0, ge=0)
    router_named: int = Field(0, ge=0)
    room: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _one_target(self):
        if bool(self.rid) == self.abort_all:
            raise ValueError("give a rid or abort_all: true (one of them)")
        if self.router_epoch and not self.abort_all:
            raise ValueError("router_epoch comes with abort_all")
        if self.router_named and not self.rid:
            raise ValueError("router_named comes with a rid")
        if self.room and (not self.rid or self.router_id):
            raise ValueError("room comes with a rid and no router fields")
        return self


def now_iso() -> str:
    """The time now, as SGLang's load reports write it (ISO 8601, UTC)."""
    return datetime.datetime.now(datetime.UTC).isoformat()


class PauseGenerationRequest(BaseModel):
    """POST /pause_generation (SGLang's; an empty body is `{}`): what happens to the requests in flight
    (AsyncEngine.pause); new ones wait until `/continue_generation` in every mode."""

    model_config = ConfigDict(extra="forbid", strict=True)
    mode: Literal["abort", "in_place", "retract"] = "abort"

    @classmethod
    def parse(cls, raw: bytes) -> PauseGenerationRequest:
        """The body as an engine and the router read it (none at all is `{}`); ValueError says why not."""
        try:
            data = json.loads(raw) if raw.strip() else {}
        except ValueError:
            raise ValueError("invalid body: request body is not valid JSON") from None
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ValueError(f"invalid body: {describe_errors(e.errors())}") from None


LOAD_FORMATS = (None, "auto", "safetensors")  # (what the engines read; SGLang's field names more)


class UpdateWeightsRequest(BaseModel):
    """POST /update_weights_from_disk: a checkpoint directory of the served model's shape.

    SGLang's own fields, as RL frameworks built on it send them: `abort_all_requests` (our
    `abort_running`: either aborts), `load_format` (safetensors is what we read: null, "auto" or
    "safetensors"), `weight_version` (a label the engine reports from then on), `flush_cache` (the
    prefix cache computed with the old weights is always dropped: false is refused), `is_async` and
    `keep_pause` (on an engine paused in place or retracted, `/pause_generation`: true keeps its
    requests frozen after the load; false, SGLang's default, lets them go on under the new weights, new
    requests waiting still until `/continue_generation`), `is_async` (false only: the load is
    synchronous), `torch_empty_cache` and `recapture_cuda_graph` (hints about the GPU's memory and
    graphs: either value). Others: 400."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model_path: str = Field(min_length=1)
    abort_running: bool = False
    abort_all_requests: bool = False
    load_format: str | None = None
    weight_version: str | None = Field(None, min_length=1, max_length=256)
    flush_cache: bool = True
    is_async: bool = False
    keep_pause: bool = False
    torch_empty_cache: bool = False
    recapture_cuda_graph: bool = False

    @model_validator(mode="after")
    def _sglang_fields(self):
        if self.is_async:
            raise ValueError("is_async: true is not supported")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format {self.load_format!r} is not supported (safetensors checkpoints)")
        if not self.flush_cache:
            raise ValueError("flush_cache: false is not supported (old weights' KV never meets new weights)")
        self.abort_running = self.abort_running or self.abort_all_requests
        return self
