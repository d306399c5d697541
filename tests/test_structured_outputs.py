"""Structured outputs: the spec's validation, the grammar's exact token mask, generation that always
matches (greedy and sampled, with penalties, under preemption), and the HTTP forms (response_format,
structured_outputs, guided_*, SGLang's /generate keys, tool_choice "required" and named)."""

from __future__ import annotations

import json
import re

import httpx
import numpy as np
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.llm_engine import InvalidRequest
from pdserve.model import grammar
from pdserve.sampling_params import StructuredOutputs
from pdserve.server.protocol import CompletionRequest
from tests.conftest import post_in_process

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["C", "F"]},
        "city": {"type": "string", "maxLength": 6},
    },
    "required": ["ok", "days", "unit", "city"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{3}-[0-9]{2}"
CHOICES = ["yes", "no", "not sure"]
LARK = 'start: item item? item? "."\nitem: "x" | "yy"'
LARK_AS_REGEX = r"(x|yy){1,3}\."


def check_schema(text: str) -> None:
    """`text` is one JSON object matching SCHEMA (in its property order)."""
    obj = json.loads(text)
    assert list(obj) == ["ok", "days", "unit", "city"]
    assert isinstance(obj["ok"], bool) and obj["unit"] in ("C", "F")
    assert isinstance(obj["days"], int) and 1 <= obj["days"] <= 7
    assert isinstance(obj["city"], str) and len(obj["city"]) <= 6


def replay(engine, spec: dict, token_ids: list[int], logprobs=None) -> None:
    """Feed `token_ids` to a fresh grammar of `spec`, asserting each was allowed when it came (and,
    with `logprobs`, that every top token reported with a probability was allowed too)."""
    g = engine.grammars.grammar_for(StructuredOutputs.of(spec))
    for i, t in enumerate(token_ids):
        logits = torch.zeros(1, engine.config.model_config.vocab_size)
        grammar.mask_logits(logits, [0], [g])
        allowed = torch.isfinite(logits[0])
        assert allowed[t], (i, t)
        if logprobs is not None:
            assert all(allowed[tid] for tid, v in logprobs[i].top if v > -9999.0)
            assert sum(v == -9999.0 for _, v in logprobs[i].top) == max(
                0, len(logprobs[i].top) - int(allowed.sum())
            )
        g.accept(t)


# ---- the spec (pure Python) ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"json": SCHEMA, "regex": "a"},
        {"json_object": True, "choice": ["a"]},
        {"json": "{not json"},
        {"json": [1]},
        {"json_object": "yes"},
        {"regex": ""},
        {"regex": 3},
        {"choice": []},
        {"choice": ["a", ""]},
        {"choice": "a"},
        {"grammar": ""},
        {"regex": "a", "disable_any_whitespace": 1},
    ],
)
def test_bad_specs_are_value_errors(kw):
    with pytest.raises(ValueError):
        StructuredOutputs(**kw)


def test_spec_forms_and_their_text():
    assert StructuredOutputs(json_object=True).kind == "json"
    assert StructuredOutputs(json_object=True).text == '{"type": "object"}'
    # A schema's text keeps the client's property order (properties are generated in that order).
    s = StructuredOutputs(json='{"properties": {"b": {}, "a": {}}}')
    assert s.json == {"properties": {"b": {}, "a": {}}} and s.text == '{"properties": {"b": {}, "a": {}}}'
    assert StructuredOutputs(choice=("a", "b")).text == '["a", "b"]'
    assert StructuredOutputs(regex="x+").cache_key() == ("regex", "x+", False, None)
    # vLLM clients serialise every field: nulls and the "off" values of its other options pass.
    vllm_style = {"regex": "x+", "json": None, "choice": None, "json_object": False, "disable_fallback": True}
    vllm_style |= {"disable_additional_properties": False, "structural_tag": None, "whitespace_pattern": None}
    assert StructuredOutputs.of(vllm_style).regex == "x+"
    for bad in (
        {"regex": "x", "disable_additional_properties": True},
        {"regex": "x", "structural_tag": "{}"},
    ):
        with pytest.raises(ValueError, match="not supported"):
            StructuredOutputs.of(bad)
    with pytest.raises(ValueError, match="too large"):
        StructuredOutputs(choice=["x" * 1000] * 300)
    assert StructuredOutputs.of({"grammar": LARK}).kind == "grammar"
    with pytest.raises(ValueError, match="unknown"):
        StructuredOutputs.of({"jsonschema": {}})
    p = SamplingParams(structured_outputs={"choice": ["a"]})
    assert isinstance(p.structured_outputs, StructuredOutputs) and p.structured_outputs.choice == ["a"]


def body(**kw) -> CompletionRequest:
    return CompletionRequest(prompt="x", **kw)


def test_request_fields_map_to_one_spec():
    assert body().structured() is None
    assert body(response_format={"type": "text"}).structured() is None
    assert body(response_format={"type": "json_object"}).structured().json_object
    js = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    assert body(response_format=js).structured().json == SCHEMA
    assert body(structured_outputs={"regex": REGEX}).structured().regex == REGEX
    assert body(guided_choice=CHOICES).structured().choice == CHOICES
    assert body(guided_json=SCHEMA).structured().json == SCHEMA
    assert body(guided_grammar=LARK).structured().grammar == LARK
    for bad in (
        dict(response_format={"type": "json_object"}, guided_regex="a"),
        dict(structured_outputs={"regex": "a"}, guided_choice=["a"]),
        dict(response_format={"type": "structural_tag"}),
        dict(response_format={"type": "json_schema"}),
    ):
        with pytest.raises(ValueError):
            body(**bad).structured()


# ---- the mask ------------------------------------------------------------------------------------
def test_mask_allows_exactly_the_tokens_that_continue_a_choice(demo_engine):
    """The allowed set, computed from the vocabulary by hand: every token whose text is a non-empty
    prefix of a choice (special tokens never spell text); other rows are left alone."""
    tok, vocab = demo_engine.tokenizer, demo_engine.config.model_config.vocab_size
    choices = ["the", "then", "that"]  # (the demo vocabulary spells them in 6 tokens: t, th, ...)
    g = demo_engine.grammars.grammar_for(StructuredOutputs(choice=choices))
    logits = torch.randn(3, vocab)
    untouched = logits.clone()
    grammar.mask_logits(logits, [1], [g])
    allowed = set(torch.isfinite(logits[1]).nonzero().flatten().tolist())
    special = {t for t in range(vocab) if tok.is_special(tok.decode([t], False))}
    expected = {
        t
        for t in range(vocab)
        if (s := tok.decode([t], False)) and t not in special and any(c.startswith(s) for c in choices)
    }
    assert allowed == expected and len(expected) >= 4
    assert torch.equal(logits[[0, 2]], untouched[[0, 2]])
    assert torch.equal(logits[1][sorted(allowed)], untouched[1][sorted(allowed)])


@pytest.mark.parametrize("vocab", [3200, 3190, 3169])
def test_the_cpu_and_device_expansions_of_the_bitmask_agree(vocab):
    """The CPU path (numpy unpack, little-endian words) and the device path (shifts; what a GPU runs)
    read the same bits: token 32w + b is allowed iff bit b of word w is set."""
    bits = np.random.default_rng(vocab).integers(-(2**31), 2**31, size=(5, 100), dtype=np.int64)
    bitmask = bits.astype(np.int32)
    allowed = grammar.allowed_on_device(bitmask, vocab, "cpu")
    assert torch.equal(allowed, ~grammar.forbidden_tokens(bitmask, vocab))
    w, b = 37, 5
    assert bool(allowed[2, 32 * w + b]) == bool((int(bitmask[2, w]) >> b) & 1)


def test_a_refused_token_terminates_the_grammar_and_only_eos_remains(demo_engine):
    """(The mask never allows such a token; a PD prefill's token 1 comes from the same grammar.) The
    matcher fails, `terminated` ends the request in check_stop, and its mask would allow EOS only."""
    tok = demo_engine.tokenizer
    g = demo_engine.grammars.grammar_for(StructuredOutputs(choice=["ab"]))
    assert not g.terminated
    g.accept(tok.encode("zz", add_special_tokens=False)[0])
    assert g.terminated and "zz" not in (g.failed or "zz")
    logits = torch.randn(1, demo_engine.config.model_config.vocab_size)
    grammar.mask_logits(logits, [0], [g])
    assert set(torch.isfinite(logits[0]).nonzero().flatten().tolist()) == set(demo_engine.eos_token_ids)


def test_grammars_compile_once_per_spec_and_bad_ones_are_invalid_requests(demo_engine):
    backend = demo_engine.grammars
    a = backend.grammar_for(StructuredOutputs(regex=REGEX))
    b = backend.grammar_for(StructuredOutputs(regex=REGEX))
    assert a.matcher is not b.matcher  # each request its own state, from one cached template
    assert ("regex", REGEX, False, None) in backend._templates
    for spec in ({"regex": "[0-9"}, {"grammar": "start: undefined_rule"}, {"json": {"type": "nonsense"}}):
        with pytest.raises(InvalidRequest, match="does not compile"):
            demo_engine.make_request("x", SamplingParams(structured_outputs=spec))
    assert not demo_engine.requests


# ---- generation ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM(demo_model_dir, max_model_len=512, num_pages=256)


SPECS = [
    ({"json": SCHEMA, "disable_any_whitespace": True}, check_schema),
    ({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
    ({"choice": CHOICES}, lambda t: t in CHOICES or pytest.fail(t)),
    ({"grammar": LARK}, lambda t: re.fullmatch(LARK_AS_REGEX, t) or pytest.fail(t)),
    # (any object: a noise model may write one key for ever, so only a finished one is parsed)
    ({"json_object": True, "disable_any_whitespace": True}, lambda t: isinstance(json.loads(t), dict)),
]


@pytest.mark.parametrize(("spec", "check"), SPECS, ids=["json", "regex", "choice", "lark", "json_object"])
def test_every_output_matches_its_grammar(llm, spec, check):
    """A random model writes noise; under a grammar it can only write what the grammar allows, and it
    stops ("stop") when the grammar is complete. Greedy, sampled, with penalties and a bias pushing
    hard for a token the grammar forbids; logprobs are finite and name only allowed tokens."""
    prompts = ["Hello there", "Write JSON:", "x = 1 +", "def f(a, b):"]
    forbidden = llm.get_tokenizer().encode("z", add_special_tokens=False)[0]  # never a first token here
    params = [
        SamplingParams(temperature=0, max_tokens=80, structured_outputs=spec),
        SamplingParams(temperature=1.0, seed=5, max_tokens=80, structured_outputs=spec, logprobs=3),
        SamplingParams(
            temperature=0.8,
            seed=9,
            max_tokens=80,
            structured_outputs=spec,
            repetition_penalty=1.5,
            presence_penalty=1.0,
            logit_bias={forbidden: 100.0},
        ),
    ]
    for p in params:
        for out in llm.generate(prompts, p):
            o = out.outputs[0]
            if o.finish_reason == "length" and spec.get("json_object"):
                assert o.text.startswith('{"') and len(o.token_ids) == 80
                continue
            assert o.finish_reason == "stop", (o.text, o.finish_reason)
            check(o.text)
            assert o.token_ids[0] != forbidden
            replay(llm.engine, spec, list(o.token_ids), o.logprobs if p.logprobs else None)
            if p.logprobs:
                assert all(-9999.0 < lp.logprob <= 0.0 for lp in o.logprobs)


def test_seeded_outputs_do_not_depend_on_the_batch_or_on_preemption(demo_model_dir, llm):
    """The grammar advances with each appended token only: a request preempted and recomputed (its
    output kept) goes on from where it was, so a tiny pool gives the same answers as a roomy one."""
    spec = {"regex": "[a-z ]{80,100}\\."}
    prompts = [f"# task {i}\n" + "x = value(y)\n" * (6 + i) for i in range(6)]  # (<= 83 tokens)
    p = SamplingParams(temperature=1.0, seed=3, max_tokens=100, structured_outputs=spec)
    roomy = [o.outputs[0].text for o in llm.generate(prompts, p)]
    tight = LLM(demo_model_dir, max_model_len=256, num_pages=50, page_size=4, max_num_batched_tokens=64)
    outs = tight.generate(prompts, p)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].text for o in outs] == roomy
    assert all(re.fullmatch("[a-z ]{80,100}\\.", t) for t in roomy)
    alone = llm.generate(prompts[2], p)[0].outputs[0].text
    assert alone == roomy[2]


def test_a_grammar_that_fails_midway_aborts_its_request_and_says_why(llm):
    """This regex compiles and its first mask is computed (at validation), but its second step exceeds
    llguidance's lexer limits: the request ends "abort" with the reason, not a "stop" whose text
    would not match."""
    (out,) = llm.generate("x", SamplingParams(max_tokens=20, structured_outputs={"regex": "(a{1000}){1000}"}))
    o = out.outputs[0]
    assert o.finish_reason == "abort" and o.stop_reason.startswith("structured output failed: lexer error")
    assert (
        llm.generate("x", SamplingParams(max_tokens=3, structured_outputs={"choice": ["ok"]}))[0]
        .outputs[0]
        .text
        == "ok"
    )  # (and the engine goes on)


def test_an_extreme_repetition_penalty_still_samples_what_the_grammar_allows(llm):
    """(The HTTP fuzzing's case: a 5e-324 penalty made softmax NaN, the sampler took token 0, which
    the grammar forbids, and the request aborted.)"""
    spec = {"choice": CHOICES}
    p = SamplingParams(
        temperature=1.0, seed=1, max_tokens=10, repetition_penalty=5e-324, structured_outputs=spec
    )
    for out in llm.generate(["x", "Hello there", "def f():"], p):
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in CHOICES


def test_a_grammar_ends_the_request_before_min_tokens_and_with_ignore_eos(llm):
    for kw in ({"min_tokens": 20}, {"ignore_eos": True}):
        (out,) = llm.generate("x", SamplingParams(max_tokens=50, structured_outputs={"choice": ["ok"]}, **kw))
        assert out.outputs[0].text == "ok" and out.outputs[0].finish_reason == "stop"


# ---- HTTP ----------------------------------------------------------------------------------------
def run_requests(engine, requests: list[tuple[str, dict]], sampler=None, **app_kw) -> list[httpx.Response]:
    return post_in_process(engine, requests, sampler, **({"tool_call_parser": "hermes"} | app_kw))


def sse(r: httpx.Response) -> list[dict]:
    lines = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


MSGS = [{"role": "user", "content": "weather in Paris?"}]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    # (bounded, as SCHEMA is: with open `properties` the random model's sampled keys could run past
    # any max_tokens, and whether a call ended in time depended on the seed)
    {
        "type": "function",
        "function": {
            "name": "ls",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "maxLength": 8}},
                "additionalProperties": False,
            },
        },
    },
]


def test_http_forms_constrain_the_answer(demo_engine):
    chat = {"messages": MSGS, "max_tokens": 80, "temperature": 0}
    rs = run_requests(
        demo_engine,
        [
            (
                "/v1/chat/completions",
                chat | {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
            ),
            ("/v1/completions", {"prompt": "x", "max_tokens": 20, "guided_choice": CHOICES, "seed": 1}),
            ("/v1/completions", {"prompt": "x", "max_tokens": 20, "guided_regex": REGEX, "stream": True}),
            ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 20, "regex": REGEX}}),
            ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 20, "ebnf": LARK}}),
        ],
    )
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    check_schema(rs[0].json()["choices"][0]["message"]["content"])
    assert rs[1].json()["choices"][0]["text"] in CHOICES
    assert re.fullmatch(REGEX, "".join(c["choices"][0]["text"] for c in sse(rs[2])))
    assert re.fullmatch(REGEX, rs[3].json()["text"])
    assert re.fullmatch(LARK_AS_REGEX, rs[4].json()["text"])


def test_response_format_json_schema_with_flexible_whitespace_stays_a_prefix(demo_engine):
    """The default (vLLM's): whitespace between tokens is free, so a noise model may wander in blanks
    until max_tokens; what it wrote is still a prefix of a matching document."""
    js = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    (r,) = run_requests(
        demo_engine,
        [
            (
                "/v1/chat/completions",
                {"messages": MSGS, "max_tokens": 40, "temperature": 0, "response_format": js},
            )
        ],
    )
    choice = r.json()["choices"][0]
    text = choice["message"]["content"]
    if choice["finish_reason"] == "stop":
        check_schema(text)
    ids = demo_engine.tokenizer.encode(text, add_special_tokens=False)
    assert demo_engine.tokenizer.decode(ids) == text
    # (re-encoding may split the text differently; a prefix is still a prefix of a matching document)
    g = demo_engine.grammars.grammar_for(StructuredOutputs(json=SCHEMA))
    assert all(g.matcher.consume_token(t) for t in ids) and not g.failed


def test_tool_choice_required_and_named_give_calls(demo_engine):
    base = {"messages": MSGS, "tools": TOOLS, "max_tokens": 120, "temperature": 1.0, "seed": 4}
    named = {"type": "function", "function": {"name": "get_weather"}}
    rs = run_requests(
        demo_engine,
        [
            ("/v1/chat/completions", base | {"tool_choice": "required", "parallel_tool_calls": False}),
            ("/v1/chat/completions", base | {"tool_choice": named}),
            ("/v1/chat/completions", base | {"tool_choice": named, "stream": True}),
        ],
    )
    for r, finish in zip(rs[:2], ("tool_calls", "stop"), strict=True):  # (named: "stop", as OpenAI)
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == finish, choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] in ("get_weather", "ls")
        args = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "get_weather":
            check_schema(json.dumps(args))
    assert rs[1].json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    chunks = sse(rs[2])
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [tc["function"] for tc in calls] == [
        tc["function"] for tc in rs[1].json()["choices"][0]["message"]["tool_calls"]
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("path", "extra", "word"),
    [
        ("/v1/completions", {"guided_regex": "[0-9"}, "does not compile"),
        ("/v1/completions", {"structured_outputs": {"json": {"type": "nope"}}}, "does not compile"),
        ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
        ("/v1/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "one of"),
        ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"function": {"name": "rm"}}}, "not among"),
        ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
        (
            "/v1/chat/completions",
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "cannot be combined",
        ),
        ("/generate", {"sampling_params": {"regex": "a", "structured_outputs": {"regex": "b"}}}, "not both"),
    ],
)
def test_bad_structured_requests_are_400s_and_change_no_state(demo_engine, path, extra, word):
    before = demo_engine.kv.pool.num_free_pages
    if path == "/generate":
        req = {"text": "x"} | extra
    elif path == "/v1/completions":
        req = {"prompt": "x", "max_tokens": 4} | extra
    else:
        req = {"messages": MSGS, "max_tokens": 4} | extra
    (r,) = run_requests(demo_engine, [(path, req)])
    assert r.status_code == 400 and word in r.json()["error"]["message"], r.text
    assert demo_engine.kv.pool.num_free_pages == before and not demo_engine.requests


def test_tools_with_defs_references_compile_under_a_forced_choice(demo_engine):
    """Pydantic and agent SDKs write parameters with `$defs` and `#/$defs/...` references: each tool's
    schema is its own root in the call grammar, with its definitions lifted there."""
    params = {
        "$defs": {"Unit": {"enum": ["C", "F"]}},
        "type": "object",
        "properties": {
            "unit": {"$ref": "#/$defs/Unit"},
            "days": {"type": "integer", "minimum": 1, "maximum": 3},
        },
        "required": ["unit", "days"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "forecast", "parameters": params}}, TOOLS[1]]
    named = {"type": "function", "function": {"name": "forecast"}}
    base = {"messages": MSGS, "tools": tools, "max_tokens": 60, "temperature": 1.0, "seed": 2}
    rs = run_requests(
        demo_engine,
        [
            ("/v1/chat/completions", base | {"tool_choice": named}),
            ("/v1/chat/completions", base | {"tool_choice": "required", "parallel_tool_calls": False}),
        ],
    )
    for r in rs:
        assert r.status_code == 200, r.text
        (call,) = r.json()["choices"][0]["message"]["tool_calls"]
        if call["function"]["name"] == "forecast":
            args = json.loads(call["function"]["arguments"])
            assert args["unit"] in ("C", "F") and 1 <= args["days"] <= 3


@pytest.mark.parametrize("markers", [("<tool_call>", "</tool_call>"), ("<|tool_call|>", "<|/tool_call|>")])
def test_a_call_marker_that_is_one_token_is_that_token(demo_model_dir, markers):
    """Qwen2.5 and Hermes have `<tool_call>` as an added token (other families write `<|...|>` ones,
    which llguidance never matches from a quoted literal): the forced call starts with exactly that
    token, as the model was trained to write it, and ends with the closing one."""
    from tokenizers import AddedToken, Tokenizer

    from pdserve.model.grammar import GrammarBackend
    from pdserve.server.tool_calls import HermesParser

    class Parser(HermesParser):
        start, end = markers

    tok = Tokenizer.from_file(f"{demo_model_dir}/tokenizer.json")
    tok.add_tokens([AddedToken(m, special=True) for m in markers])
    vocab = tok.get_vocab_size(with_added_tokens=True)
    backend = GrammarBackend(tok.to_str(), vocab, (1,))
    lark = Parser().call_grammar(TOOLS[1:], False, tok.token_to_id)
    g = backend.grammar_for(StructuredOutputs(grammar=lark))
    text = f'{markers[0]}\n{{"name": "ls", "arguments": {{}}}}\n'
    for t in tok.encode(text, add_special_tokens=False).ids:
        logits = torch.zeros(1, vocab)
        grammar.mask_logits(logits, [0], [g])
        assert torch.isfinite(logits[0, t])
        g.accept(t)
    logits = torch.zeros(1, vocab)
    grammar.mask_logits(logits, [0], [g])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [tok.token_to_id(markers[1])]


def test_with_a_reasoning_parser_the_grammar_starts_after_the_thinking(demo_engine):
    """A thinking model writes `...</think>` before its answer; no grammar describes the thought, so
    the grammar waits for the end marker (vLLM v1 does the same). Scripted answers: the thought, then
    a choice; without the wait the matcher would fail on the thought and the request would abort."""
    from tests.test_tool_calls import Scripted

    answer = "plan it</think>not sure"
    rs = run_requests(
        demo_engine,
        [("/v1/chat/completions", {"messages": MSGS, "max_tokens": 40, "guided_choice": CHOICES})],
        sampler=Scripted(demo_engine, answer),
        reasoning_parser="deepseek_r1",
    )
    choice = rs[0].json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert choice["message"]["reasoning_content"] == "plan it" and choice["message"]["content"] == "not sure"
    g = demo_engine.grammars.grammar_for(StructuredOutputs(choice=CHOICES, start_after="</think>"))
    for t in demo_engine.tokenizer.encode("plan it</th", add_special_tokens=False):
        g.accept(t)
    assert not g.active
    for t in demo_engine.tokenizer.encode("ink>", add_special_tokens=False):
        g.accept(t)
    assert g.active and not g.terminated


def test_n_choices_each_follow_the_grammar(demo_engine):
    (r,) = run_requests(
        demo_engine,
        [
            (
                "/v1/completions",
                {
                    "prompt": "x",
                    "max_tokens": 20,
                    "n": 4,
                    "temperature": 1.0,
                    "seed": 3,
                    "guided_choice": CHOICES,
                },
            )
        ],
    )
    texts = [c["text"] for c in r.json()["choices"]]
    assert len(texts) == 4 and all(t in CHOICES for t in texts)
