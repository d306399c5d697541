"""Schemathesis fuzzing of the HTTP API of a colocated engine (a real `pdserve serve` subprocess on
127.0.0.1 with the demo checkpoint), against the server's own OpenAPI schema.

Per operation (`/v1/completions`, `/v1/chat/completions`, `/generate`, `/v1/models`, `/health`) a bounded
number of bodies is generated -- schema-valid ("positive") and schema-violating ("negative") -- and every
response is checked:
  - no 5xx at all (a colocated engine has no legitimate 503: its engine thread never dies on bad input);
  - status code, content type, headers and body conform to the schema. The schema FastAPI generates
    documents only 200 (with an empty schema) and 422 (which the server never sends: validation errors
    are 400 OpenAI errors), so before the run the test completes it with what the server promises: the
    OpenAI error body for 400/404/413, the success objects, and `text/event-stream` for `stream: true`;
  - the request schemas are tightened to the constraints the server validates (`request_contract`), so
    positive bodies mostly reach the engine and every negative body must get a 4xx;
  - SSE streams are `data: <json>` events ending in `[DONE]`.
Afterwards the engine must be idle, with zero KV pages held, and still serve a normal request.

Bugs found here whose fixes live outside the test's files are listed in KNOWN_BUGS, each with a probe:
while one is present the run steers around its trigger (or tolerates exactly its answer) and
`test_known_bug_fixed[<name>]` xfails; once fixed, the probe says so and the steering switches off.

Generated `max_tokens` above MAX_TOKENS are clamped (a random model rarely emits EOS, so each would
decode up to max_model_len) and the server runs with a small max_model_len; a run takes ~15-30 s.
Knobs: PDSERVE_FUZZ_SCALE multiplies the example counts; PDSERVE_FUZZ_RANDOM=1 draws fresh examples
instead of the fixed (derandomized) sequence `make test` uses.
"""

from __future__ import annotations

import copy
import json
import re
import time
from collections import Counter
from pathlib import Path

import httpx
import pydantic
import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import Phase, given  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from pdserve.sampling_params import MAX_TOP_LOGPROBS  # noqa: E402
from pdserve.server.fanout import MAX_N  # noqa: E402
from pdserve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest  # noqa: E402
from tests.conftest import serve_subprocess  # noqa: E402
from tests.fuzz_helpers import fuzz_settings  # noqa: E402

pytestmark = pytest.mark.timeout(240)

MAX_MODEL_LEN = 64
NUM_PAGES = 64
PAGE_SIZE = 16
MAX_TOKENS = 8

# (path, method, generation mode, max_examples). GETs without parameters have one distinct case.
TARGETS = [
    ("/v1/completions", "POST", GenerationMode.POSITIVE, 40),
    ("/v1/completions", "POST", GenerationMode.NEGATIVE, 25),
    ("/v1/chat/completions", "POST", GenerationMode.POSITIVE, 35),
    ("/v1/chat/completions", "POST", GenerationMode.NEGATIVE, 25),
    ("/generate", "POST", GenerationMode.POSITIVE, 40),
    ("/generate", "POST", GenerationMode.NEGATIVE, 25),
    ("/tokenize", "POST", GenerationMode.POSITIVE, 15),
    ("/tokenize", "POST", GenerationMode.NEGATIVE, 10),
    ("/detokenize", "POST", GenerationMode.POSITIVE, 10),
    ("/detokenize", "POST", GenerationMode.NEGATIVE, 10),
    ("/v1/models", "GET", GenerationMode.POSITIVE, 5),
    ("/health", "GET", GenerationMode.POSITIVE, 5),
]
EXAMPLES_RUN: Counter[str] = Counter()
TOLERATED: Counter[str] = Counter()
LOG_OFFSET: dict[str, int] = {}

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]

# ---- the schema, completed with what the server promises ---------------------------------------
ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string", "minLength": 1},
                "type": {"type": "string", "minLength": 1},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer", "minimum": 400, "maximum": 599},
            },
        }
    },
}
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"],
    "properties": {
        "prompt_tokens": {"type": "integer", "minimum": 1},
        "completion_tokens": {"type": "integer", "minimum": 0},
        "total_tokens": {"type": "integer", "minimum": 1},
    },
}
# ("abort": a structured output whose grammar failed midway, e.g. a regex past llguidance's limits)
_FINISH = {"enum": ["stop", "length", "abort"]}
_ENVELOPE = ["id", "object", "created", "model", "choices", "usage"]
SUCCESS_SCHEMAS = {
    "/v1/completions": {
        "type": "object",
        "required": _ENVELOPE,
        "properties": {
            "object": {"const": "text_completion"},
            "id": {"type": "string"},
            "choices": {  # (n per prompt, two prompts at most: the request schema below)
                "type": "array",
                "minItems": 1,
                "maxItems": 2 * MAX_N,
                "items": {
                    "type": "object",
                    "required": ["index", "text", "finish_reason", "logprobs"],
                    "properties": {
                        "index": {"type": "integer", "minimum": 0, "maximum": 2 * MAX_N - 1},
                        "text": {"type": "string"},
                        "finish_reason": _FINISH,
                    },
                },
            },
            "usage": _USAGE,
        },
    },
    "/v1/chat/completions": {
        "type": "object",
        "required": _ENVELOPE,
        "properties": {
            "object": {"const": "chat.completion"},
            "choices": {
                "type": "array",
                "minItems": 1,
                "maxItems": MAX_N,
                "items": {
                    "type": "object",
                    "required": ["index", "message", "finish_reason"],
                    "properties": {
                        "message": {
                            "type": "object",
                            "required": ["role", "content"],
                            "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}},
                        },
                        "finish_reason": _FINISH,
                    },
                },
            },
            "usage": _USAGE,
        },
    },
    "/generate": {
        "type": "object",
        "required": ["output_ids", "text", "meta_info"],
        "properties": {
            "output_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "text": {"type": "string"},
            "meta_info": {
                "type": "object",
                "required": ["id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason"],
                "properties": {  # (SGLang's shape: server/native_stream.finish_reason)
                    "finish_reason": {
                        "type": "object",
                        "required": ["type"],
                        "properties": {"type": _FINISH},
                    }
                },
            },
        },
    },
    "/tokenize": {
        "type": "object",
        "required": ["count", "max_model_len", "tokens"],
        "properties": {
            "count": {"type": "integer", "minimum": 0},
            "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        },
    },
    "/detokenize": {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
    "/v1/models": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "minItems": 1,
                "items": {"type": "object", "required": ["id", "object"]},
            },
        },
    },
    "/health": {
        "type": "object",
        "required": ["status"],
        "properties": {"status": {"const": "ok"}},
    },
}


# The request contract: every constraint here is one the server enforces unconditionally (each
# violation -> 4xx), so positive bodies mostly reach the engine and every negative body must be refused.
# Fields whose check depends on another field (chat max_tokens vs max_completion_tokens, top_logprobs
# without logprobs, a `stop` of "" that means "none") keep the schema FastAPI generated.
_I64 = 2**63


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _token_ids(vocab: int) -> dict:
    return {
        "type": "array",
        "minItems": 1,
        "maxItems": MAX_MODEL_LEN - 1,
        "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1},
    }


def _sampling_fields(model_name: str) -> dict:
    return {
        "model": _nullable({"enum": [model_name]}),
        "temperature": {"type": "number", "minimum": 0},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "seed": _nullable({"type": "integer", "minimum": -_I64, "maximum": 2**64 - 1}),
        "stop_token_ids": _nullable({"type": "array", "items": {"type": "integer", "minimum": 0}}),
        "n": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_N}),  # n > 1: server/fanout.py
        "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "repetition_penalty": _nullable({"type": "number", "exclusiveMinimum": 0}),
        "min_tokens": {"type": "integer", "minimum": 0},  # (above max_tokens: a 400 the contract cannot say)
        "prompt_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}),
        # Structured outputs (the other forms' checks need a compiler: a 400 the contract cannot say)
        "guided_choice": _nullable(
            {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}
        ),
        "logit_bias": _nullable(
            {
                "type": "object",
                "propertyNames": {"pattern": "^[0-9]+$"},  # (ids beyond the vocabulary: a 400 too)
                "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
            }
        ),
    }


def request_contract(raw: dict, model_name: str, vocab: int) -> dict:
    comps = raw["components"]["schemas"]
    ids = _token_ids(vocab)
    comp = comps["CompletionRequest"]["properties"]
    comp.update(_sampling_fields(model_name))
    comp["max_tokens"] = _nullable({"type": "integer", "minimum": 1}) | {"default": 16}
    comp["logprobs"] = _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS})
    comp["echo"] = {"type": "boolean"}
    comp["stop"] = {
        "anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "string", "minLength": 1}},
            {"type": "null"},
        ]
    }
    comp["prompt"] = {
        "anyOf": [
            {"type": "string", "minLength": 1},
            ids,
            # (prompt lists: server/fanout.py; two at most, as n goes to 64 and each child is a request)
            {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "string", "minLength": 1}},
            {"type": "array", "minItems": 1, "maxItems": 2, "items": ids},
        ]
    }
    chat = comps["ChatCompletionRequest"]["properties"]
    chat.update(_sampling_fields(model_name))
    chat["max_completion_tokens"] = _nullable({"type": "integer", "minimum": 1})
    text_part = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}},
    }
    content = comps["ChatMessage"]["properties"]["content"]
    content["anyOf"][1]["items"] = {"anyOf": [text_part, {"type": "object"}]}
    sp = {
        "max_tokens": _nullable({"type": "integer", "minimum": 1}),
        "temperature": {"type": "number", "minimum": 0},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "seed": _nullable({"type": "integer", "minimum": -_I64, "maximum": 2**64 - 1}),
        "stop": _nullable(
            {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "array", "items": {"type": "string", "minLength": 1}},
                ]
            }
        ),
        "stop_token_ids": _nullable({"type": "array", "items": {"type": "integer", "minimum": 0}}),
        "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}),
        # Booleans are not type-checked by SamplingParams (see the report); left free here.
        "ignore_eos": {},
        "skip_special_tokens": {},
        "include_stop_str_in_output": {},
    }
    comps["DetokenizeRequest"]["properties"]["tokens"] = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1},
    }
    gen = comps["GenerateRequest"]
    gen["properties"]["sampling_params"] = {"type": "object", "properties": sp, "additionalProperties": False}
    gen["oneOf"] = [
        {"required": ["input_ids"], "properties": {"input_ids": ids, "text": {"type": "null"}}},
        {
            "required": ["text"],
            "properties": {"text": {"type": "string", "minLength": 1}, "input_ids": {"type": "null"}},
        },
    ]
    return raw


def complete_schema(raw: dict, model_name: str, vocab: int) -> dict:
    """The server's OpenAPI document with its real responses documented and the request contract
    tightened to what the server validates (see the module docstring)."""
    raw = request_contract(copy.deepcopy(raw), model_name, vocab)
    for path, ops in raw["paths"].items():
        for method, op in ops.items():
            responses = op.setdefault("responses", {})
            ok = responses.setdefault("200", {"description": "OK"})
            ok["content"] = {"application/json": {"schema": SUCCESS_SCHEMAS.get(path, {})}}
            if method == "post":
                ok["content"]["text/event-stream"] = {}
                responses.pop("422", None)  # never sent: validation errors are 400 OpenAI errors
                for code in ("400", "404", "413"):
                    responses[code] = {
                        "description": "OpenAI-style error",
                        "content": {"application/json": {"schema": ERROR_SCHEMA}},
                    }
    return raw


def bound_body(body) -> None:
    """Clamp generated token budgets (only ints; other types stay, so negative cases stay negative)."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens", "max_new_tokens"):
        v = body.get(key)
        if type(v) is int and v > MAX_TOKENS:
            body[key] = MAX_TOKENS
    bound_body(body.get("sampling_params"))


def check_sse(response) -> None:
    """A streamed answer: `data: <json>` events, the last one `data: [DONE]`; an in-band error event
    has the OpenAI error shape."""
    content_type = response.headers.get("content-type") or [""]  # schemathesis: name -> list of values
    if not content_type[0].startswith("text/event-stream"):
        return
    events = [line for line in response.text.split("\n") if line]
    assert events and events[-1] == "data: [DONE]", response.text[-500:]
    for e in events[:-1]:
        assert e.startswith("data: "), e
        obj = json.loads(e.removeprefix("data: "))
        if "error" in obj:
            assert set(obj) == {"error"} and {"message", "type", "param", "code"} <= set(obj["error"])


# ---- bugs this fuzzing found whose fix is outside the test's reach --------------------------------
# Each has a probe that tells "fixed" (the correct answer) from "known" (exactly the buggy answer once
# seen); anything else fails the probe. While a bug is "known", the fuzzing steers around its trigger
# (or tolerates exactly its signature) so the rest of the run stays meaningful, and
# `test_known_bug_fixed[...]` reports it as xfail; once fixed, the steering switches itself off.
KNOWN_BUGS = {
    "parse-error-body": "a body that is not JSON gets FastAPI's {'detail': ...} 400, not an OpenAI error "
    "(fix: an HTTPException handler in server/api.py build_app)",
    "seed-overflow": "a seed outside [-2**63, 2**64) raises in torch.Generator.manual_seed on the engine "
    "thread: 500, or a stream cut without [DONE] (fix: range check in SamplingParams)",
    "chat-text-part": "a chat content part {'type': 'text', 'text': <not a str>} -> TypeError -> 500 "
    "(fix: ChatMessage.text in server/protocol.py)",
    "lax-coercion": "request models validate in pydantic's lax mode: false/true pass as 0/1 for integer "
    "fields ('logprobs': false returns logprobs), numeric strings as numbers, 'no' as a bool "
    "(fix: ConfigDict(strict=True) on the models in server/protocol.py)",
    "top-k-overflow": "a top_k >= 2**63 passes validation and overflows torch.tensor in the sampler on "
    "the engine thread: the engine dies and every later request gets 503 (fix: clamp top_k to the vocab "
    "in model/sampler.py and bound it in SamplingParams)",
    "sampling-bool-types": "/generate sampling_params booleans are not type-checked: a list for "
    "skip_special_tokens kills the engine thread (every later request 503) and 'false' counts as true "
    "(fix: bool checks in SamplingParams)",
}
BOOL_PARAMS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")


def _is_openai_error(r: httpx.Response, status: int) -> bool:
    try:
        body = r.json()
    except ValueError:
        return False
    return r.status_code == status and isinstance(body, dict) and set(body) == {"error"}


def probe_known_bugs(url: str) -> dict[str, str]:
    """name -> "fixed" | "known" for every entry of KNOWN_BUGS."""
    from pdserve.sampling_params import SamplingParams

    out = {}

    def post(path: str, **kw) -> httpx.Response:  # one connection each: a 500 makes uvicorn close it
        return httpx.post(url + path, timeout=30, **kw)

    r = post("/v1/completions", content=b"\xff{", headers={"content-type": "application/json"})
    known = r.status_code == 400 and r.json() == {"detail": "There was an error parsing the body"}
    assert known or _is_openai_error(r, 400), r.text
    out["parse-error-body"] = "known" if known else "fixed"

    answers = [
        post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "seed": seed})
        for seed in (2**64, -(2**63) - 1)
    ]
    known = all(r.status_code == 500 for r in answers)
    assert known or all(_is_openai_error(r, 400) for r in answers), [r.text for r in answers]
    out["seed-overflow"] = "known" if known else "fixed"

    r = post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "logprobs": False})
    assert r.status_code == 200 or _is_openai_error(r, 400), r.text
    out["lax-coercion"] = "known" if r.status_code == 200 else "fixed"

    msgs = [{"role": "user", "content": [{"type": "text", "text": 5}]}]
    r = post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})
    assert r.status_code == 500 or _is_openai_error(r, 400), r.text
    out["chat-text-part"] = "known" if r.status_code == 500 else "fixed"
    # Probed offline: over HTTP these triggers would kill the fuzzed engine.
    import torch

    from pdserve.model.sampler import Sampler

    try:
        params = SamplingParams(top_k=2**63, temperature=1.0)
    except ValueError:
        out["top-k-overflow"] = "fixed"
    else:
        try:
            Sampler("cpu", 0)(torch.zeros(1, 8), [params], [None])
            out["top-k-overflow"] = "fixed"
        except (ValueError, RuntimeError, OverflowError):
            out["top-k-overflow"] = "known"

    refused = []
    for name in BOOL_PARAMS:
        try:
            SamplingParams(**{name: ["x"]})
            refused.append(False)
        except (TypeError, ValueError):
            refused.append(True)
    out["sampling-bool-types"] = "fixed" if all(refused) else "known"
    return out


def steer_around(body, known: dict[str, str]) -> list[str]:
    """Rewrite the triggers of still-present known bugs out of a generated body (in place); returns
    the bugs steered around."""
    steered = []
    if not isinstance(body, dict):
        return steered
    for holder in (body, body.get("sampling_params")):
        top_k = holder.get("top_k") if isinstance(holder, dict) else None
        if known["top-k-overflow"] == "known" and type(top_k) is int and top_k >= 2**63:
            holder["top_k"] = 2**63 - 1
            steered.append("top-k-overflow")
        seed = holder.get("seed") if isinstance(holder, dict) else None
        if known["seed-overflow"] == "known" and type(seed) is int and not -(2**63) <= seed < 2**64:
            holder["seed"] = seed % 2**63
            steered.append("seed-overflow")
    sp = body.get("sampling_params")
    if known["sampling-bool-types"] == "known" and isinstance(sp, dict):
        for name in BOOL_PARAMS:
            if name in sp and not isinstance(sp[name], bool):
                sp[name] = False
                steered.append("sampling-bool-types")
    messages = body.get("messages")
    if known["chat-text-part"] == "known" and isinstance(messages, list):
        for m in messages:
            parts = m.get("content") if isinstance(m, dict) else None
            for part in parts if isinstance(parts, list) else ():
                if isinstance(part, dict) and part.get("type") == "text" and "text" in part:
                    if not isinstance(part["text"], str):
                        part["text"] = str(part["text"])
                        steered.append("chat-text-part")
    return steered


REQUEST_MODELS = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/generate": GenerateRequest,
}


def only_lax_valid(path: str, body) -> bool:
    """The body passes the endpoint's pydantic model in lax mode but not in strict mode."""
    model = REQUEST_MODELS.get(path)
    if model is None or isinstance(body, bytes):
        return False
    raw = json.dumps(body)
    try:
        model.model_validate_json(raw)
    except pydantic.ValidationError:
        return False
    try:
        model.model_validate_json(raw, strict=True)
    except pydantic.ValidationError:
        return True
    return False


def tolerated(response, known: dict[str, str], path: str, body, negative: bool) -> str | None:
    """The known bug whose exact signature this response is, if it is still present."""
    if known["lax-coercion"] == "known" and negative and response.status_code == 200:
        if only_lax_valid(path, body):
            return "lax-coercion"
    if known["parse-error-body"] == "known" and response.status_code == 400:
        try:
            if response.json() == {"detail": "There was an error parsing the body"}:
                return "parse-error-body"
        except ValueError:
            pass
    return None


_METRIC_RE = re.compile(r"^(pdserve_[A-Za-z0-9_]+(?:\{[^}]*\})?) ([-+0-9.eE]+|NaN|[-+]Inf)$", re.M)


def wait_idle(url: str, timeout_s: float) -> dict[str, float]:
    """Poll /metrics until nothing runs, waits or holds KV pages (as tests/test_server.py does)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(url + "/metrics", timeout=10).text
        m = {k: float(v) for k, v in _METRIC_RE.findall(text)}
        keys = ("pdserve_num_requests_running", "pdserve_num_requests_waiting", "pdserve_kv_pages_used")
        if all(m[k] == 0 for k in keys):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout_s}s: {m}")
        time.sleep(0.05)


# ---- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(demo_model_dir, tmp_path_factory):
    flags = ["--role", "colocated", "--max-model-len", str(MAX_MODEL_LEN), "--num-pages", str(NUM_PAGES)]
    flags += ["--page-size", str(PAGE_SIZE), "--max-num-seqs", "8"]
    with serve_subprocess(demo_model_dir, tmp_path_factory.mktemp("fuzz-server-log"), *flags) as running:
        yield running


@pytest.fixture(scope="module")
def schema(server, demo_model_dir):
    url = server[0]
    raw = httpx.get(url + "/openapi.json", timeout=10).json()
    model_name = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    vocab = json.loads((Path(demo_model_dir) / "config.json").read_text())["vocab_size"]
    # Read whole streams (schemathesis stops after 20 events by default; ours end by [DONE]).
    config = schemathesis.Config.from_dict({"max-stream-events": 10 * MAX_MODEL_LEN})
    return schemathesis.openapi.from_dict(complete_schema(raw, model_name, vocab), config=config)


@pytest.fixture(scope="module")
def known_bugs(server) -> dict[str, str]:
    url = server[0]
    out = probe_known_bugs(url)
    wait_idle(url, timeout_s=30)  # the probes leave nothing behind
    LOG_OFFSET["after_probes"] = server[2].stat().st_size  # their tracebacks are expected
    return out


@pytest.fixture(scope="module")
def session():
    import requests

    with requests.Session() as s:
        yield s


# ---- the fuzzing ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "path,method,mode,max_examples",
    TARGETS,
    ids=[f"{m} {p} {mode.value}" for p, m, mode, _ in TARGETS],
)
def test_fuzz_endpoint(server, schema, known_bugs, session, path, method, mode, max_examples):
    url, proc, log_path = server
    operation = schema[path][method]
    checks = CHECKS + ([negative_data_rejection] if mode == GenerationMode.NEGATIVE else [])
    label = f"{method} {path} {mode.value}"
    statuses: Counter[int] = Counter()

    @fuzz_settings(
        max_examples,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure is reported as found
        print_blob=True,
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        bound_body(case.body)
        steered = steer_around(case.body, known_bugs)
        TOLERATED.update(steered)
        response = case.call(base_url=url, session=session, timeout=60)
        EXAMPLES_RUN[label] += 1
        statuses[response.status_code] += 1
        bug = tolerated(response, known_bugs, path, case.body, mode == GenerationMode.NEGATIVE)
        if bug is not None:
            TOLERATED[bug] += 1
            return
        try:
            # A steered negative body may have become valid: its rejection is not checked.
            case.validate_response(response, checks=[c for c in checks if not steered or c in CHECKS])
            check_sse(response)
        except BaseException:
            body = json.dumps(case.body, ensure_ascii=True) if not isinstance(case.body, bytes) else case.body
            print(
                f"request body: {str(body)[:20000]}\nresponse {response.status_code}: {response.text[:2000]}"
            )
            raise

    try:
        run()
    finally:
        print(f"{label}: {EXAMPLES_RUN[label]} examples, statuses {dict(statuses)}")
    assert proc.poll() is None, log_path.read_text(errors="replace")[-5000:]
    assert EXAMPLES_RUN[label] >= 1


def test_after_fuzzing_engine_is_idle_and_serves(server, known_bugs):
    url, proc, log_path = server
    assert proc.poll() is None, log_path.read_text(errors="replace")[-5000:]
    m = wait_idle(url, timeout_s=30)
    assert m["pdserve_kv_pages_used"] == 0
    assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
    r = httpx.post(
        url + "/v1/completions",
        json={"prompt": "def f(x):", "max_tokens": 4, "temperature": 0, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    wait_idle(url, timeout_s=30)
    log = log_path.read_bytes()[LOG_OFFSET.get("after_probes", 0) :].decode(errors="replace")
    assert "Traceback" not in log, log[-5000:]
    print(
        "examples run per target:",
        dict(EXAMPLES_RUN),
        "known-bug triggers steered around / answers tolerated:",
        dict(TOLERATED),
    )


@pytest.mark.parametrize("name", sorted(KNOWN_BUGS))
def test_known_bug_fixed(known_bugs, name):
    """xfail while the bug is there (the probe saw exactly its signature); passes once it is fixed."""
    if known_bugs[name] == "known":
        pytest.xfail(
            f"{name}: {KNOWN_BUGS[name]}; steered around or tolerated {TOLERATED[name]} time(s) while fuzzing"
        )
