"""HTTP API of one engine: OpenAI `/v1/completions`, `/v1/chat/completions`, `/v1/models`, native
`/generate`, `/health`, `/metrics`, (server/tokenize.py) `/tokenize`, `/detokenize`, and
(server/admin.py) the control endpoints: `/abort_request`, cache resets, weight updates, pauses, and
(server/engine_status.py) `/v1/loads`, `/get_server_info`, `/health_generate`.

Every handler validates fully (`AsyncEngine.validate`, read-only) before the engine thread sees the
request, so a bad request gets a 4xx with an OpenAI-style error body and changes no engine state.

Length (~1,050 lines): one ``build_app`` whose routes share the validation, usage, logprobs and
streaming closures (splitting it would pass a dozen closures around); the request schemas are in
``protocol.py``, the metrics in ``metrics.py``, tool calls, reasoning and n > 1 in their own modules.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve import faults
from pdserve.engine.async_engine import (
    ABORTED_IN_TRANSIT_EPOCH,
    ROUTER_ABORTED_EPOCH,
    AsyncEngine,
    EngineDeadError,
)
from pdserve.engine.llm_engine import (
    DuplicateRequestId,
    EngineAsleep,
    InvalidRequest,
    LLMEngine,
    WeightsLost,
)
from pdserve.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams, StructuredOutputs
from pdserve.server import fanout, reasoning, tool_calls
from pdserve.server.admin import admin_routes
from pdserve.server.auth import ApiKey
from pdserve.server.content_type import JsonBodies
from pdserve.server.disconnect import ClientGone, unless_gone
from pdserve.server.engine_status import status_routes
from pdserve.server.fanout import StreamThen
from pdserve.server.limits import DEFAULT_MAX_BODY_BYTES, BodySizeLimit
from pdserve.server.metrics import EngineMetrics, PDMetrics
from pdserve.server.native_stream import (
    CumulativeChunks,
    input_logprobs,
    logprob_entry,
    meta_info,
    top_entries,
)
from pdserve.server.pd_context import PDContext
from pdserve.server.protocol import (
    GENERATE_DEFAULT_MAX_NEW_TOKENS,
    MAX_ROUTER_ID_CHARS,
    PREFILL_UNREACHABLE,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    JSONResponse,
    StreamOptions,
    chat_id,
    describe_errors,
    error_body,
    http_error,
    sglang_failure,
)
from pdserve.server.tokenize import render_chat, tokenize_routes
from pdserve.tokenizer import TokenizerError

SGLANG_STATUS_ROUTES = frozenset({"/update_weights_from_disk"})  # answers carry `success`, `message`

# The engine's abort count when the request came in, read by its route before anything awaits (the
# children of a split request inherit it): an abort from then on names the request also while its chat
# is rendered, its check waits for a worker thread, or it is tokenized (AsyncEngine.validate).
ARRIVAL_EPOCH: contextvars.ContextVar[int | None] = contextvars.ContextVar("arrival_epoch", default=None)


def in_band_status(e: InvalidRequest) -> tuple[int, str]:
    """The code and type of a refusal reported inside a stream that already started."""
    return (409, "Conflict") if isinstance(e, DuplicateRequestId) else (400, "BadRequestError")


# /generate's sampling_params under SGLang's names -> ours (the meaning is the same).
SGLANG_SAMPLING_NAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "no_stop_trim": "include_stop_str_in_output",
    "sampling_seed": "seed",  # (SGLang's deterministic sampling; slime's deterministic mode sends it)
}


def stop_reason_of(o, finish: str | None) -> str | int | None:
    """vLLM's `stop_reason` of a choice: the stop string or stop token id that ended it; None when an
    EOS, the length or an abort did (or it has not ended)."""
    return o.stop_reason if o is not None and finish == "stop" else None


def build_app(
    engine: LLMEngine,
    pd: PDContext | None = None,
    enable_fault_injection: bool = False,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    enable_weight_updates: bool = False,
    api_key: str | None = None,
) -> FastAPI:
    """`pd` (prefill or decode role) plugs the role into the engine thread and the handlers.
    `enable_fault_injection` adds `GET/POST /debug/faults` (pdserve.faults; chaos tests only).
    `tool_call_parser` (a name in server/tool_calls.PARSERS) lets chat requests carry `tools`;
    `reasoning_parser` (server/reasoning.PARSERS) moves a chat answer's thinking to `reasoning_content`.
    `enable_weight_updates` turns on `POST /update_weights_from_disk` (it aborts requests and swaps
    the weights: off unless asked for, as vLLM keeps such endpoints to its dev mode)."""
    tool_parser = tool_calls.make_parser(tool_call_parser) if tool_call_parser else None
    thinking = reasoning.make_parser(reasoning_parser) if reasoning_parser else None
    metrics = EngineMetrics()
    if pd is not None:
        metrics.pd = PDMetrics(metrics.registry, pd)
    aengine = AsyncEngine(
        engine,
        on_step=metrics.on_step,
        on_abort=metrics.observe_end,
        role=pd.role if pd else None,
        on_output=metrics.observe,
        on_failed=metrics.observe_failed,
    )
    role_name = pd.role_name if pd else "colocated"
    metrics.on_step(engine, [])
    model_name = engine.config.model_name
    # (the generation config's sampling values, for fields a request leaves out; its max_new_tokens is
    # the OpenAI routes' default max_tokens, as in vLLM, lowered to the room the prompt leaves: without
    # one a request left without max_tokens runs up to the context)
    sampling_defaults = dict(engine.config.model_config.sampling_defaults)
    default_max_tokens = sampling_defaults.pop("max_tokens", None)
    tokenizer = engine.tokenizer
    vocab_size = engine.config.model_config.vocab_size
    app = FastAPI(title="pdserve", default_response_class=JSONResponse)
    app.add_middleware(BodySizeLimit, max_bytes=DEFAULT_MAX_BODY_BYTES)
    app.add_middleware(JsonBodies)  # (a cross-site page's text/plain POST is never read as JSON)
    app.add_middleware(ApiKey, key=api_key)  # (outermost: a request without the key is not read)
    app.state.engine = aengine
    app.state.metrics = metrics

    @app.on_event("shutdown")
    async def _shutdown() -> None:
        aengine.shutdown()
        if pd is not None:
            await pd.aclose()

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return JSONResponse(error_body(str(e), e.status, e.err_type, e.param) | e.extra, status_code=e.status)

    app.add_exception_handler(StarletteHTTPException, http_error)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(http: Request, e: RequestValidationError):
        message = describe_errors(e.errors())
        body = error_body(message, 400)
        if http.url.path in SGLANG_STATUS_ROUTES:  # (SGLang's clients read `success`)
            body |= sglang_failure(message)
        return JSONResponse(body, status_code=400)

    def check_model(name: str | None) -> None:
        if name and name != model_name:  # (an empty name is the default model, as vLLM reads it)
            raise APIError(f"The model `{name}` does not exist.", 404, "NotFoundError", "model")

    async def validate(
        make_prompt,
        make_params,
        pd_field=None,
        request_id: str | None = None,
        default_max_tokens: int | None = None,
        cache_salt: str | None = None,
    ):
        """Build and check everything; any bad value becomes a 400 before the engine sees it (a child
        of an `n` > 1 or prompt-list request then waits for its siblings' checks: server/fanout.py).
        With `request_id` (vLLM's field), the client knows the request as "cmpl-" + it (`client_id`)."""
        req, text = await validate_one(
            make_prompt, make_params, pd_field, request_id, default_max_tokens, cache_salt
        )
        await fanout.validated()
        return req, text

    async def validate_one(
        make_prompt, make_params, pd_field, request_id, default_max_tokens=None, cache_salt=None
    ):
        """(validate's checks, for one request; `default_max_tokens`: `LLMEngine.make_request`'s; the
        abort count is the one its route read on arrival, `ARRIVAL_EPOCH`; `cache_salt` goes with the
        prompt, as in an offline prompt dict)

        Tokenizing runs on a worker thread (a 50k-token prompt takes ~0.1 s): on the event loop it
        stalled every stream this engine serves meanwhile.

        PD roles: the prefill validates the client's request as given (so both engines refuse the same
        requests) and then runs it for exactly one token; `req.pd` carries the room.
        """
        try:
            params: SamplingParams = make_params()
            prompt, rid = make_prompt(), f"cmpl-{uuid.uuid4().hex}"
            if cache_salt is not None:  # (as an offline prompt dict's: `make_request` salts its keys)
                if not isinstance(prompt, dict):
                    prompt = {"prompt_token_ids" if isinstance(prompt, list) else "prompt": prompt}
                prompt = {**prompt, "cache_salt": cache_salt}
            req, text = await asyncio.to_thread(
                aengine.validate, prompt, params, rid, default_max_tokens, ARRIVAL_EPOCH.get()
            )
        except (InvalidRequest, TokenizerError, ValueError, TypeError) as e:
            raise APIError(str(e)) from None
        except RecursionError:  # (a value nested thousands deep, e.g. a schema given as a string)
            raise APIError("request nested too deeply") from None
        except (WeightsLost, EngineAsleep) as e:
            raise APIError(str(e), 503, "ServiceUnavailable") from None
        if request_id is not None:
            req.client_id = f"cmpl-{request_id}"
        if role_name == "colocated":
            if pd_field is not None:
                raise APIError("'pd' is only accepted by prefill and decode engines", param="pd")
            return req, text
        if params.prompt_logprobs is not None:
            # (the prefill computes the prompt, the decode answers: the logprobs would have to cross)
            raise APIError(
                "the prompt's logprobs (prompt_logprobs, echo with logprobs, /generate's input logprobs) "
                "need a colocated engine",
                param="prompt_logprobs",
            )
        if (
            not isinstance(pd_field, dict)
            or not isinstance(pd_field.get("room"), int)
            or pd_field["room"] <= 0
        ):
            raise APIError(f"this is a {role_name} engine: send requests through the router", param="pd")
        read_path = pd_field.get("read_path", "none")
        if read_path not in ("none", "pe", "de"):
            raise APIError("pd.read_path must be none, pe or de", param="pd")
        req.read_path = read_path
        if not isinstance(pd_field.get("aborted", False), bool):
            raise APIError("pd.aborted must be a boolean", param="pd")
        router_id, router_epoch = pd_field.get("router_id", ""), pd_field.get("router_epoch", 0)
        if not isinstance(router_id, str) or len(router_id) > MAX_ROUTER_ID_CHARS:
            raise APIError(
                f"pd.router_id must be a string of at most {MAX_ROUTER_ID_CHARS} chars", param="pd"
            )
        router_named = pd_field.get("router_named", 0)
        for key, value in (("router_epoch", router_epoch), ("router_named", router_named)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise APIError(f"pd.{key} must be a non-negative integer", param="pd")
        req.pd_router_id, req.pd_router_named = router_id, router_named
        if pd_field.get("aborted"):  # an abort_all reached the router while it held the request
            req.abort_epoch = ROUTER_ABORTED_EPOCH
        elif aengine.aborted_in_transit(router_id, router_epoch):  # ... or here, before this half did
            req.abort_epoch = ABORTED_IN_TRANSIT_EPOCH
        if role_name == "prefill":
            # (min_tokens >= 1 still keeps token 1 from being a stop token)
            req.sampling_params = dataclasses.replace(
                params, max_tokens=1, min_tokens=min(params.min_tokens, 1)
            )
            req.max_tokens = 1
            req.pd = pd_field["room"]
        else:
            if not isinstance(pd_field.get("bootstrap_url"), str):
                raise APIError("decode requests need pd.bootstrap_url", param="pd")
            req.pd = (pd_field["room"], pd_field["bootstrap_url"])
        return req, text

    async def resolve_pd(req, http: Request) -> None:
        """Decode: turn the prefill's bootstrap URL into its control address (cached; off the engine
        thread, so a slow or dead prefill never stalls the scheduler). Not for a half the router
        aborted: it answers "abort" without its prefill. A lookup outlived by its client (the router
        closed a failed attempt's leg) ends with it: a `/generate` rid it holds is free for the retry."""
        if role_name == "decode" and req.abort_epoch != ROUTER_ABORTED_EPOCH:
            room, bootstrap_url = req.pd
            try:
                addr = await unless_gone(http, pd.control_address_of(bootstrap_url))
            except ClientGone:
                raise APIError("client disconnected", 499, "ClientClosedRequest") from None
            except Exception as e:  # noqa: BLE001
                # (its own type: the router reads it as the prefill's failure, not this decode's)
                raise APIError(
                    f"prefill bootstrap {bootstrap_url} unreachable: {e}", 503, PREFILL_UNREACHABLE
                ) from None
            req.pd = (room, addr)

    def envelope(rid: str, obj: str, created: int, choices: list) -> dict:
        return {"id": rid, "object": obj, "created": created, "model": model_name, "choices": choices}

    def num_returned(o, num_dropped_tokens: int) -> int:
        """Output tokens the answer counts: `num_dropped_tokens` were run but not returned (echo's
        scoring), never below 0 (a scoring request aborted before its one token ran)."""
        return max(0, len(o.token_ids) - num_dropped_tokens)

    def usage(out: RequestOutput, num_dropped_tokens: int = 0) -> dict:
        n_prompt, n_out = len(out.prompt_token_ids), num_returned(out.outputs[0], num_dropped_tokens)
        return {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out,
            # cached_tokens: prompt tokens not recomputed, from an engine's prefix cache or the store.
            "prompt_tokens_details": {
                "cached_tokens": out.num_cached_tokens,
                "cached_tokens_storage": out.metrics.get("cached_tokens_storage", 0),
            },
        }

    @functools.lru_cache(maxsize=1 << 18)  # (prompt logprobs of a 32k prompt at k = 20: ~690k lookups)
    def token_str(tid: int) -> str:
        return tokenizer.token_text(tid) if tokenizer else str(tid)

    def token_str_all(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False) if tokenizer else ""

    def completion_logprobs(lps, start: int, starts: list[int]) -> dict | None:
        """`starts`: the request's running character offsets, starts[i] = where token i begins in the
        completion; kept by the caller across a stream's chunks and extended here as tokens arrive."""
        if lps is None:
            return None
        items = lps[start:]
        tokens = [token_str(lp.token_id) for lp in items]
        while len(starts) <= len(lps):
            starts.append(starts[-1] + len(token_str(lps[len(starts) - 1].token_id)))
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in items],
            # (the sampled token's too, as OpenAI's legacy completions and vLLM give it: up to n + 1)
            "top_logprobs": [
                {token_str(t): v for t, v in lp.top} | {token_str(lp.token_id): lp.logprob} for lp in items
            ],
            "text_offset": starts[start : len(lps)],
        }

    def prompt_logprobs_body(entries, num_prompt_tokens: int, num_top: int) -> list | None:
        """vLLM's `prompt_logprobs`: [None, {token id: {logprob, rank, decoded_token}}, ...], each entry
        holding the prompt's own token and the top `num_top` at that position (null past what was
        computed: a request aborted mid-prompt). The engine may keep more (`echo` with a larger
        `logprobs` asks for them): a client's explicit `prompt_logprobs` is what it gets."""
        if entries is None:
            return None
        out: list = [None]
        for e in entries[1:num_prompt_tokens]:
            d = {
                str(t): {"logprob": v, "rank": r, "decoded_token": token_str(t)}
                for r, (t, v) in enumerate(e.top[:num_top], 1)
            }
            d[str(e.token_id)] = {
                "logprob": e.logprob,
                "rank": e.rank,
                "decoded_token": token_str(e.token_id),
            }
            out.append(d)
        return out + [None] * (num_prompt_tokens - len(out))

    def echo_logprobs(entries, prompt_ids: list[int], num_top: int) -> dict:
        """The prompt's part of an echoed completion's logprobs (OpenAI's legacy shape): its tokens,
        their logprobs (the first None: nothing scores it) and top-`num_top` (with the token itself)."""
        tokens = [token_str(t) for t in prompt_ids]
        offsets = [0]
        for t in tokens[:-1]:
            offsets.append(offsets[-1] + len(t))
        missing = [None] * (len(prompt_ids) - len(entries))  # (aborted mid-prompt)
        # (top `logprobs`, as the generated part has, and vLLM: `prompt_logprobs` may have asked for more)
        tops = [
            {token_str(t): v for t, v in e.top[:num_top]} | {token_str(e.token_id): e.logprob}
            for e in entries[1:]
        ]
        return {
            "tokens": tokens,
            "token_logprobs": [None] + [e.logprob for e in entries[1:]] + missing,
            "top_logprobs": [None] + tops + missing,
            "text_offset": offsets,
        }

    def top_entry(token_id: int, logprob: float) -> dict:
        text = token_str(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(tokenizer.token_bytes(token_id, text))}

    def chat_logprobs(lps, start: int) -> dict | None:
        if lps is None:
            return None
        content = []
        for lp in lps[start:]:
            s = token_str(lp.token_id)
            content.append(
                {
                    "token": s,
                    "logprob": lp.logprob,
                    "bytes": list(tokenizer.token_bytes(lp.token_id, s)),
                    "top_logprobs": [top_entry(t, v) for t, v in lp.top],
                }
            )
        return {"content": content}

    async def run_to_end(req, text, http: Request) -> RequestOutput:
        """Collect a non-streamed result; abort the request if the client goes away meanwhile."""

        async def consume():
            final = None
            async for out in aengine.generate(req, text):
                final = out
            return final

        await resolve_pd(req, http)
        try:
            return await unless_gone(http, consume())  # cancelled: the generator's `finally` aborts
        except ClientGone:
            raise APIError("client disconnected", 499, "ClientClosedRequest") from None
        except DuplicateRequestId as e:  # (its id taken meanwhile by a request started first)
            raise APIError(str(e), 409, "Conflict") from None
        except InvalidRequest as e:  # refused on the engine thread (e.g. a duplicate PD room)
            raise APIError(str(e)) from None
        except (RuntimeError, EngineDeadError) as e:  # PD transfer failure, dead engine
            raise APIError(str(e), 503, "ServiceUnavailable") from None

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    async def stream(
        req,
        text,
        chunk_fn,
        options: StreamOptions | None,
        head: list[dict] = (),
        every_token: bool = False,
        num_dropped_tokens: int = 0,
    ) -> AsyncIterator[str]:
        """Turn the engine's cumulative outputs into SSE deltas; hold back a trailing partial UTF-8 char.
        `every_token`: a chunk for every new token even when its text is held back (token-id clients).
        `options` (the client's stream_options): `include_usage` adds a last chunk with the usage;
        with `continuous_usage_stats` too (vLLM's), every chunk carries the usage so far.
        `num_dropped_tokens`: output tokens `chunk_fn` drops, left out of the usage."""
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options.continuous_usage_stats)

        def so_far(num_output_tokens: int) -> dict:  # (as vLLM's: the three counts, no details)
            n = req.num_prompt_tokens
            return {
                "prompt_tokens": n,
                "completion_tokens": num_output_tokens,
                "total_tokens": n + num_output_tokens,
            }

        for h in head:
            yield sse(h | {"usage": so_far(0)} if continuous else h)
        sent_text, sent_tokens, last = 0, 0, None
        try:
            async for out in aengine.generate(req, text):
                last = out
                o = out.outputs[0]
                upto = len(o.text)
                if not out.finished:
                    while upto > sent_text and o.text[upto - 1] == "\ufffd":
                        upto -= 1
                delta = o.text[sent_text:upto]
                new_tokens = len(o.token_ids) > sent_tokens
                if delta or out.finished or (new_tokens and (every_token or o.logprobs)):
                    made = chunk_fn(delta, o, sent_tokens, o.finish_reason if out.finished else None)
                    for c in made if isinstance(made, list) else (made,):  # (tool calls: 0..n chunks)
                        yield sse(
                            c | {"usage": so_far(num_returned(o, num_dropped_tokens))} if continuous else c
                        )
                    sent_text, sent_tokens = max(sent_text, upto), len(o.token_ids)  # (never back)
        except InvalidRequest as e:  # the stream already started: report in-band
            yield sse(error_body(str(e), *in_band_status(e)))
            yield "data: [DONE]\n\n"
            return
        except (RuntimeError, EngineDeadError) as e:
            yield sse(error_body(str(e), 503, "ServiceUnavailable"))
            yield "data: [DONE]\n\n"
            return
        if include_usage and last is not None:
            yield sse(
                chunk_fn(None, None, 0, None) | {"choices": [], "usage": usage(last, num_dropped_tokens)}
            )
        yield "data: [DONE]\n\n"

    @app.get("/version")
    async def version():
        """vLLM's: the server's version (tooling checks it)."""
        from pdserve import __version__

        return {"version": __version__}

    def status() -> dict:
        """{"status": "ok"}, or why this engine serves nothing (with its error)."""
        if not aengine.alive:
            return {"status": "dead", "error": repr(aengine.error)}
        if engine.weights_lost:
            return {"status": "weights lost", "error": engine.weights_lost}
        return {"status": "ok"}

    @app.get("/health")
    async def health():
        state = status()
        return JSONResponse(state, status_code=200 if state["status"] == "ok" else 503)

    @app.get("/pd/info")
    async def pd_info():
        """Who this engine is and whether it serves (`status`: the router's health check reads it, so
        an engine whose thread died or whose weights were lost is taken out of service)."""
        info = {"role": role_name, "model": model_name, "model_path": engine.weights_dir} | status()
        if pd is not None:
            info |= pd.info()
        return info

    if enable_fault_injection:

        @app.get("/debug/faults")
        async def get_faults():
            return {"rules": faults.snapshot()}

        @app.post("/debug/faults")
        async def set_faults(http: Request):
            """Replace this process's fault rules: {"rules": [...], "seed": 0} (see pdserve.faults)."""
            try:
                body = json.loads(await http.body())
                faults.configure(body.get("rules"), int(body.get("seed", 0)))
            except (ValueError, TypeError, AttributeError) as e:
                raise APIError(f"bad fault rules: {e}") from None
            return {"rules": faults.snapshot()}

    @app.get("/pd/load")
    async def pd_load():
        """Load report for the router's DualPath placement (pdserve.engine.pd_load)."""
        if pd is None:
            raise APIError(f"/pd/load is served by PD engines; this is a {role_name} engine", 404, "NotFound")
        return Response(msgspec.json.encode(pd.load()), media_type="application/json")

    @app.get("/metrics")
    async def prom():
        if metrics.pd is not None:
            metrics.pd.update_any_thread()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    started_s = int(time.time())  # (vLLM's cards say when they were made; 0 read as 1970)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": started_s,
                    "owned_by": "pdserve",
                    "max_model_len": engine.config.scheduler.max_model_len,
                }
            ],
        }

    async def split(body, http: Request, one) -> Response | dict:
        """`n` > 1 or a list of prompts: a child of one prompt and one choice each (server/fanout.py);
        else the request itself."""
        try:
            n = fanout.num_choices(body.n)
        except ValueError as e:
            raise APIError(str(e), param="n") from None
        try:
            prompts = fanout.batch_of(body.prompt) if isinstance(body, CompletionRequest) else None
            fanout.num_children(len(prompts or [None]), n)  # (refuses too many)
        except ValueError as e:
            raise APIError(str(e), param="prompt") from None
        if n == 1 and prompts is None:
            return await one(body, http)
        if role_name != "colocated":
            what = "n > 1" if prompts is None else "a prompt list"
            raise APIError(f"{what} is split into requests by the router", param="prompt" if prompts else "n")

        try:  # (child i: base_id_i; the merged answer's: base_id)
            base_id = fanout.base_request_id(body.request_id, uuid.uuid4().hex)
        except ValueError as e:
            raise APIError(str(e), param="request_id") from None
        updates = fanout.child_updates(n, prompts, base_id, body.seed)
        children = fanout.gated([functools.partial(one, body.model_copy(update=u), http) for u in updates])
        include = bool(body.stream and body.stream_options and body.stream_options.include_usage)
        return await fanout.merged(children, bool(body.stream), include, n)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        ARRIVAL_EPOCH.set(aengine.num_aborts)
        return await split(body, http, completion)

    async def completion(body: CompletionRequest, http: Request):
        check_model(body.model)
        pd_field = (body.model_extra or {}).get("pd")
        # echo with max_tokens 0 (OpenAI's and vLLM's scoring form; lm-eval's loglikelihood): the prompt
        # alone, with its logprobs. The engine runs one token to finish the prompt; it is dropped.
        scoring = bool(body.echo) and body.max_tokens == 0
        max_tokens = 1 if scoring else body.max_tokens
        if default_max_tokens is not None and "max_tokens" not in body.model_fields_set:
            max_tokens = min(max_tokens, default_max_tokens)  # (OpenAI's 16 left out: the model's, if less)
        req, text = await validate(
            body.single_prompt,
            lambda: body.sampling_params(max_tokens, body.logprobs, sampling_defaults),
            pd_field,
            body.request_id,
            default_max_tokens,
            body.cache_salt,
        )
        created, rid = int(time.time()), req.client_id or req.request_id
        want_ids = bool(body.return_token_ids)
        echoed = ""  # `echo`: the prompt as given (a token prompt: decoded), before the completion
        token_starts = [0]  # (with echo the offsets run on from the prompt's tokens', as in vLLM)
        if body.echo:
            echoed = text if text is not None else token_str_all(req.prompt_token_ids)
            if body.logprobs is not None:
                token_starts = [sum(len(token_str(t)) for t in req.prompt_token_ids)]

        def chunk(delta, o, start, finish):
            returned = o is not None and not scoring  # (the generated part, if any is returned)
            lps = completion_logprobs(o.logprobs, start, token_starts) if returned else None
            first = o is not None and start == 0  # (the first chunk of a stream, or the whole answer)
            if scoring:
                delta = ""
            if first and body.echo:
                delta = echoed + delta
                if body.logprobs is not None:
                    head = echo_logprobs(req.prompt_logprobs, req.prompt_token_ids, body.logprobs)
                    lps = head if lps is None else {key: head[key] + lps[key] for key in lps}
            choice = {
                "index": 0,
                "text": delta,
                "finish_reason": finish,
                "stop_reason": stop_reason_of(o, finish),
                "logprobs": lps,
            }
            if first and body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_body(
                    req.prompt_logprobs, req.num_prompt_tokens, body.prompt_logprobs
                )
            if want_ids and first:
                choice["prompt_token_ids"] = list(req.prompt_token_ids)
            if want_ids and o is not None:
                choice["token_ids"] = list(o.token_ids[start:]) if returned else []
            return envelope(rid, "text_completion", created, [choice])

        num_dropped = int(scoring)
        if body.stream and role_name != "prefill":
            await resolve_pd(req, http)
            events = stream(
                req, text, chunk, body.stream_options, every_token=want_ids, num_dropped_tokens=num_dropped
            )
            return StreamingResponse(events, media_type="text/event-stream")
        out = await run_to_end(req, text, http)
        o = out.outputs[0]
        resp = chunk(o.text, o, 0, o.finish_reason)
        return resp | {"usage": usage(out, num_dropped)}

    def chat_tools(body: ChatCompletionRequest) -> tuple[list[dict] | None, bool, str | None]:
        """(tools for the template, whether to parse the answer for calls, the grammar the answer must
        follow). The tools are shown to the model even under `tool_choice` "none" (vLLM's default: the
        prompt, and its prefix-cache hits, stay the same from turn to turn); calls are parsed under
        "auto", "required" and a named function, the last two constrained to calls in the parser's
        format (`ToolCallParser.call_grammar`). 400 for a choice without tools, malformed tools, a
        name not among them, or tools to parse without a parser."""
        choice = body.tool_choice
        if choice not in (None, "auto", "none", "required") and not isinstance(choice, dict):
            raise APIError(
                "tool_choice must be 'auto', 'none', 'required' or a named function", param="tool_choice"
            )
        if not body.tools:
            if choice is not None and choice != "none":
                raise APIError(f"tool_choice {choice!r} needs tools", param="tool_choice")
            return None, False, None
        try:
            tools = tool_calls.check_tools(body.tools)
        except ValueError as e:
            raise APIError(str(e), param="tools") from None
        try:
            forced = tool_calls.forced_tools(tools, choice)
        except ValueError as e:
            raise APIError(str(e), param="tool_choice") from None
        if choice == "none":
            return tools, False, None
        if tool_parser is None:
            raise APIError(
                "tools need an engine started with --tool-call-parser (e.g. hermes); otherwise the "
                "model's calls would come back as plain text",
                param="tools",
            )
        if forced is None:
            return tools, True, None
        names, parallel = forced
        return (
            tools,
            True,
            tool_parser.call_grammar(
                names, parallel and body.parallel_tool_calls is not False, tokenizer.token_id
            ),
        )

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: Request):
        ARRIVAL_EPOCH.set(aengine.num_aborts)
        return await split(body, http, chat_completion)

    async def chat_completion(body: ChatCompletionRequest, http: Request):
        check_model(body.model)
        if tokenizer is None:
            raise APIError("this model has no tokenizer; chat is unavailable")
        if body.prompt_logprobs is not None and body.stream:
            raise APIError("prompt_logprobs with stream is not supported on chat", param="prompt_logprobs")
        tools, parse_calls, call_grammar = chat_tools(body)
        try:  # (on a worker thread, as `validate`'s tokenizing; /tokenize renders the same way)
            prompt, prompt_ids = await asyncio.to_thread(
                render_chat,
                tokenizer,
                body.messages,
                body.add_generation_prompt,
                tools,
                body.chat_template_kwargs,
                body.documents,
            )
        except TokenizerError as e:  # (the template refused the chat)
            raise APIError(str(e)) from None
        except ValueError as e:  # a malformed message (tool_calls)
            raise APIError(str(e), param="messages") from None
        top = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        pd_field = (body.model_extra or {}).get("pd")

        # (whether the prompt opened or closed the thinking: the grammar and the split read it alike)
        thought_state = thinking.prompt_state(prompt) if thinking is not None else None

        def params() -> SamplingParams:
            sp = body.sampling_params(max_tokens, top, sampling_defaults)
            if call_grammar is not None:
                if sp.structured_outputs is not None:
                    raise ValueError(
                        "tool_choice 'required' or a named function already constrains the answer; it "
                        "cannot be combined with response_format, structured_outputs or guided_*"
                    )
                sp = dataclasses.replace(sp, structured_outputs=StructuredOutputs(grammar=call_grammar))
            if thinking is not None and sp.structured_outputs is not None:
                # The answer starts with the model's thinking, which no grammar describes: constrain
                # what follows its end marker (unless the prompt already closed it: thinking off).
                closed = thought_state == "closed"
                spec = dataclasses.replace(
                    sp.structured_outputs, start_after=None if closed else thinking.end
                )
                sp = dataclasses.replace(sp, structured_outputs=spec)
            if parse_calls and tokenizer.is_special(tool_parser.start):
                # The call markers are special tokens of this model (Hermes 2 Pro): keep them in the
                # text, or no call could ever be found (vLLM's hermes parser does the same).
                sp = dataclasses.replace(sp, skip_special_tokens=False)
            return sp

        req, _ = await validate(
            lambda: {"prompt_token_ids": prompt_ids},
            params,
            pd_field,
            body.request_id,
            default_max_tokens,
            body.cache_salt,
        )
        created, rid = int(time.time()), chat_id(req.client_id or req.request_id)
        max_calls = 1 if body.parallel_tool_calls is False else None
        named = isinstance(body.tool_choice, dict)

        def finish_with_calls(finish: str | None) -> str | None:
            """An answer that made calls finishes "tool_calls", unless cut ("length") or the calls were
            a named function's, the only possible answer ("stop", as OpenAI and vLLM say)."""
            return finish if finish in (None, "length") or named else "tool_calls"

        calls_stream = tool_calls.ToolStream(tool_parser, max_calls) if parse_calls else None
        thought_stream = reasoning.ReasoningStream(thinking, thought_state) if thinking else None

        def deltas_of(delta: str, finished: bool) -> list[dict]:
            """A step's text as chat deltas: reasoning first (if a parser splits it off), the rest as
            content or, with tools, through the tool-call parser."""
            pieces = thought_stream.feed(delta, finished) if thought_stream else [("content", delta)]
            out: list[dict] = []
            for kind, text in pieces:
                if kind == "reasoning":
                    if body.include_reasoning:
                        out.append({"reasoning_content": text})
                elif calls_stream is not None:
                    out += calls_stream.feed(text, False)
                else:
                    out.append({"content": text})
            if finished and calls_stream is not None:
                out += calls_stream.feed("", True)  # what it held back
            return out

        def chunk(delta, o, start, finish):
            lps = chat_logprobs(o.logprobs, start) if o is not None else None
            if (calls_stream is None and thought_stream is None) or o is None:  # (head and usage: as is)
                choice = {
                    "index": 0,
                    "delta": {} if delta is None else {"content": delta},
                    "finish_reason": finish,
                    "stop_reason": stop_reason_of(o, finish),
                    "logprobs": lps,
                }
                return envelope(rid, "chat.completion.chunk", created, [choice])
            # Tools: the text goes through the parser; a step yields zero or more deltas.
            deltas = deltas_of(delta, finish is not None)
            if calls_stream is not None and calls_stream.num_calls:
                finish = finish_with_calls(finish)
            if not deltas and (finish is not None or lps is not None):
                deltas = [{}]
            return [
                envelope(
                    rid,
                    "chat.completion.chunk",
                    created,
                    [
                        {
                            "index": 0,
                            "delta": d,
                            "finish_reason": finish if k == len(deltas) - 1 else None,
                            "stop_reason": stop_reason_of(o, finish) if k == len(deltas) - 1 else None,
                            "logprobs": lps if k == 0 else None,
                        }
                    ],
                )
                for k, d in enumerate(deltas)
            ]

        if body.stream and role_name != "prefill":
            await resolve_pd(req, http)
            head = chunk("", None, 0, None)
            head["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            return StreamingResponse(
                stream(req, prompt, chunk, body.stream_options, [head]), media_type="text/event-stream"
            )
        out = await run_to_end(req, prompt, http)
        o = out.outputs[0]
        message: dict = {"role": "assistant", "content": o.text}
        finish = o.finish_reason
        if thinking is not None:
            thought, answer = thinking.split(o.text, thought_state)
            message = {
                "role": "assistant",
                "content": answer,
                "reasoning_content": thought if body.include_reasoning else None,
            }
        if parse_calls and message["content"] is not None:
            content, calls = tool_parser.parse(message["content"])
            if calls:
                message |= {"content": content, "tool_calls": calls[:max_calls]}
                finish = finish_with_calls(finish)
        choice = {
            "index": 0,
            "message": message,
            "logprobs": chat_logprobs(o.logprobs, 0),
            "finish_reason": finish,
            "stop_reason": stop_reason_of(o, finish),
        }
        resp = envelope(rid, "chat.completion", created, [choice]) | {"usage": usage(out)}
        if body.prompt_logprobs is not None:  # (vLLM puts them beside the choices in chat)
            resp["prompt_logprobs"] = await asyncio.to_thread(
                prompt_logprobs_body, req.prompt_logprobs, req.num_prompt_tokens, body.prompt_logprobs
            )
        return resp

    @app.post("/generate")
    async def generate(body: GenerateRequest, http: Request):
        """SGLang's native endpoint. A batch of prompts or `sampling_params.n` > 1: one child request
        per prompt p and sample j (child p·n + j; seeded: seed + j), all validated before any
        starts, answered as a list in that order (streamed: each chunk with its `index`)."""
        ARRIVAL_EPOCH.set(aengine.num_aborts)
        if (body.input_ids is None) == (body.text is None):
            raise APIError("give exactly one of input_ids or text")
        if body.text == []:
            raise APIError("text is an empty list", param="text")
        fields = {"text": body.text, "input_ids": body.input_ids, "rid": body.rid}
        try:  # (the fields a split reads; each child is this body with its own of them)
            split = fanout.generate_children(
                fields | {"sampling_params": body.sampling_params}, f"gen-{uuid.uuid4().hex}"
            )
        except fanout.BadSplit as e:
            raise APIError(str(e), param=e.param) from None
        if split is None:  # (one prompt, one sample: `n` 1 or absent)
            sp = {k: v for k, v in body.sampling_params.items() if k != "n"}
            return await generate_one(body.model_copy(update={"sampling_params": sp}), http)
        if role_name != "colocated":
            raise APIError("a batch or n > 1 is split into requests by the router", param="n")
        n, children = split
        bodies = [body.model_copy(update=child) for child in children]
        handlers = fanout.gated([functools.partial(generate_one, b, http) for b in bodies])
        return await fanout.merged(handlers, body.stream, False, n, native=True)

    async def generate_one(body: GenerateRequest, http: Request):
        """One prompt, one sample (`sampling_params` a dict)."""
        prompt = body.text if body.text is not None else {"prompt_token_ids": body.input_ids}
        # (null is the default, as in SGLang, except max_new_tokens', which means up to the context)
        sp = {
            k: v
            for k, v in body.sampling_params.items()
            if v is not None or k in ("max_new_tokens", "max_tokens")
        }
        for sglang_name, ours in SGLANG_SAMPLING_NAMES.items():  # (SGLang's names for ours)
            if sglang_name in sp:
                if ours in sp:
                    raise APIError(f"give {sglang_name} or {ours}, not both")
                sp[ours] = sp.pop(sglang_name)
        # SGLang's `stream_interval` only groups a stream's chunks (every chunk here is cumulative:
        # the same answer, one chunk per step).
        if type(sp.pop("stream_interval", 1)) is not int:
            raise APIError("stream_interval must be an integer")
        # SGLang's `spaces_between_special_tokens` acts in slow tokenizers only; ours are fast ones.
        if type(sp.pop("spaces_between_special_tokens", True)) is not bool:
            raise APIError("spaces_between_special_tokens must be a boolean")
        # SGLang's `custom_params` are the arguments of a request's `custom_logit_processor`, which is
        # refused (UNSUPPORTED_GENERATE_FIELDS): without one SGLang ignores them too.
        if not isinstance(sp.pop("custom_params", None), dict | None):
            raise APIError("custom_params must be an object")
        # SGLang's names for structured outputs (a schema's text, a regex, an EBNF grammar).
        sglang = {"json_schema": "json", "regex": "regex", "ebnf": "grammar"}
        given = {sglang[k]: v for k in list(sp) if k in sglang and (v := sp.pop(k)) is not None}
        if given:
            if "structured_outputs" in sp:
                raise APIError("give structured_outputs or json_schema / regex / ebnf, not both")
            sp["structured_outputs"] = given
        unknown = set(sp) - set(SamplingParams.__dataclass_fields__)
        if unknown:
            raise APIError(f"unknown sampling params: {sorted(unknown)}")
        if body.return_logprob:  # (SGLang's top-level fields; sampling_params.logprobs is ours)
            if "logprobs" in sp or "prompt_logprobs" in sp:
                raise APIError("give return_logprob or sampling_params' logprobs / prompt_logprobs, not both")
            sp["logprobs"] = body.top_logprobs_num
            if body.logprob_start_len >= 0:  # (-1, SGLang's default: no prompt logprobs, empty lists)
                sp["prompt_logprobs"] = body.top_logprobs_num
        # max_new_tokens 0 (SGLang's; e.g. slime's on-policy distillation): the prompt's logprobs alone.
        # The engine runs one token to finish the prompt; the answer drops it.
        scoring = sp.get("max_tokens") == 0
        if scoring:
            if body.stream:
                raise APIError("max_new_tokens 0 (the prompt alone) is not streamed", param="max_new_tokens")
            sp["max_tokens"] = 1
        default_max_tokens = None
        if "max_tokens" not in sp:  # (SGLang's default, within the context; null: up to the context)
            sp["max_tokens"], default_max_tokens = None, GENERATE_DEFAULT_MAX_NEW_TOKENS
        # (PD roles: the router's half, as for a completion; the prefill runs it for one token)
        req, text = await validate_one(
            lambda: prompt, lambda: SamplingParams(**sp), body.pd, None, default_max_tokens, body.cache_salt
        )
        # The meta_info's input logprobs: from this position; None when no logprob was asked for.
        input_start = max(0, body.logprob_start_len)
        if req.prompt_logprobs is not None and input_start >= req.num_prompt_tokens:
            raise APIError(
                f"logprob_start_len {input_start} must be below the prompt's {req.num_prompt_tokens} tokens",
                param="logprob_start_len",
            )
        if body.rid:
            if aengine.is_active(body.rid) and not await aengine.earlier_attempt_ended(body.rid, req):
                raise APIError(f"request id {body.rid!r} is already active", 409, "Conflict")
            req.request_id = body.rid
            # Held until `generate()` takes the id over (a concurrent twin gets a 409 meanwhile): while
            # its siblings are checked, a PD half looks up its peer, and a stream's headers go out. Let
            # go before that, a twin could take the id in the gap, and this stream, already a 200,
            # failed in-band: its prefill waited out its deadline for a KV request never sent, and the
            # client got a 503 "no healthy prefill" (an audit of duplicate rids, 2026-12-03).
            aengine.reserve(req)
        stream_lets_go = False
        try:
            response = await generate_reserved(body, req, text, input_start, http, scoring)
            stream_lets_go = isinstance(response, StreamThen)
            return response
        finally:
            if not stream_lets_go:  # (a no-op once `generate()` took the id)
                aengine.unreserve(req)

    async def generate_reserved(body: GenerateRequest, req, text, input_start, http: Request, scoring: bool):
        """(`generate_one` past its checks, `req`'s rid reserved)"""
        await fanout.validated()  # (a child of a batch: every check above passed; wait for its siblings)
        token_text = token_str if body.return_text_in_logprobs else None
        if req.prompt_logprobs is None and not body.return_logprob:
            input_start = None

        def native(out: RequestOutput) -> dict:
            o = out.outputs[0]
            # (read per output, as SGLang: a request held by a pause, or kept running through an update,
            # runs on the weights loaded meanwhile; read at its start it named the old ones)
            meta = meta_info(out, engine.weight_version)
            if o.logprobs is not None:  # (SGLang's [logprob, token id, text or null] entries)
                meta["output_token_logprobs"] = [
                    logprob_entry(lp.logprob, lp.token_id, token_text) for lp in o.logprobs
                ]
                meta["output_top_logprobs"] = [top_entries(lp.top, token_text) for lp in o.logprobs]
            if input_start is not None:
                meta |= input_logprobs(out, input_start, token_text)
            if scoring:  # (the one token run to finish the prompt is not the client's)
                meta["completion_tokens"] = 0
                if o.finish_reason == "length":  # (an abort stays one)
                    meta["finish_reason"] = {"type": "length", "length": 0}
                if o.logprobs is not None:
                    meta |= {"output_token_logprobs": [], "output_top_logprobs": []}
                return {"output_ids": [], "text": "", "meta_info": meta}
            return {"output_ids": list(o.token_ids), "text": o.text, "meta_info": meta}

        if body.stream and role_name != "prefill":
            await resolve_pd(req, http)

            async def events():
                # (the same bytes as sse(native(out)), O(new tokens))
                chunks = CumulativeChunks(token_text, input_start)
                try:
                    async for out in aengine.generate(req, text):
                        yield f"data: {chunks.encode(out, engine.weight_version)}\n\n"
                except InvalidRequest as e:  # the stream already started: report in-band
                    yield sse(error_body(str(e), *in_band_status(e)))
                except (RuntimeError, EngineDeadError) as e:
                    yield sse(error_body(str(e), 503, "ServiceUnavailable"))
                yield "data: [DONE]\n\n"

            # (the id is let go when the stream ends, also one whose body never started: its client left
            # before the headers went out; `generate()` takes it over as it starts)
            return StreamThen(events(), lambda: aengine.unreserve(req), media_type="text/event-stream")
        return native(await run_to_end(req, text, http))

    app.include_router(admin_routes(aengine, engine, enable_weight_updates, pd))
    app.include_router(status_routes(aengine, engine, pd))
    app.include_router(
        tokenize_routes(tokenizer, engine.config.scheduler.max_model_len, vocab_size, check_model)
    )
    return app
