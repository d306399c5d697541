"""PD disaggregation end to end: real processes on loopback, the NIXL backend, the router.

Greedy tokens through router -> prefill -> (NIXL) -> decode must equal those of a colocated engine on
the same checkpoint, token for token, and token 1's logprobs must match; after the tests every
engine is idle with zero pages and zero rooms held (the engines run `check_integrity()` whenever they
go idle, and a failed check kills the engine thread, which turns /health to 503).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time
import uuid

import httpx
import pytest

from pdserve import LLM, SamplingParams
from pdserve.transfer.nixl_backend import nixl_available
from tests.conftest import assert_clear_greedy, requires_cuda, wait_until
from tests.test_engine_status import num_requests_on

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed"),
]

MAX_MODEL_LEN = 1024


def cluster_args(model_dir: str, **kw) -> argparse.Namespace:
    """Small pool, 128-token steps (long prompts are chunked), short deadlines; the abort lease is the
    safe minimum for them (3 x 8 s + 1 s: a decode never frees pages a late write may still reach)."""
    from pdserve.launch import cluster_args as launch_args

    base = dict(
        num_pages=400,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=128,
        served_model_name="demo",
        pd_deadline_s=8.0,
        pd_abort_lease_s=25.0,
    )
    return launch_args(model_dir, **(base | kw))


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) ([-+0-9.eE]+|NaN)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def wait_engine_idle(url: str, timeout_s: float = 15.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(url)
        if (
            m["pdserve_kv_pages_used"] == 0
            and m["pdserve_num_requests_running"] == 0
            and m["pdserve_pd_rooms_held"] == 0
        ):
            assert httpx.get(url + "/health", timeout=5).status_code == 200  # integrity checks passed
            return m
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{url} not idle: pages {m['pdserve_kv_pages_used']}, rooms {m['pdserve_pd_rooms_held']}"
            )
        time.sleep(0.1)


@pytest.fixture(
    scope="module",
    params=[
        "direct",
        "staged",
        pytest.param("cuda-direct", marks=requires_cuda),
        pytest.param("cuda-staged", marks=requires_cuda),
    ],
)
def cluster(request, demo_model_dir):
    """`staged`: every request's KV goes through the staging path (gather on the prefill, one write per
    region into the decode's staging slot, scatter there); `direct`: merged page runs. `cuda-*`: both
    engines keep their KV pool and staging on the GPU (float32, to compare with a colocated engine on
    the GPU), so NIXL moves GPU memory to GPU memory."""
    os.environ.setdefault("UCX_MODULES", "^ib*")
    from pdserve.launch import start_cluster

    device = "cuda" if request.param.startswith("cuda") else "cpu"
    staged = request.param.endswith("staged")
    threshold = -1.0 if staged else 2.0  # runs/pages never exceeds 1: never staged
    args = cluster_args(
        demo_model_dir,
        pd_staging_threshold=threshold,
        device=device,
        dtype="float32",
        tool_call_parser="hermes",
    )
    c = start_cluster(args, 1, 1)
    c.staged, c.device = staged, device
    c.engine_urls = [u for u in _engine_urls(c)]
    c.pd_info = {u: httpx.get(u + "/pd/info", timeout=5).json() for u in c.engine_urls}
    c.by_role = {info["role"]: u for u, info in c.pd_info.items()}  # (1P+1D: one engine per role)
    yield c
    c.stop()


def _engine_urls(c) -> list[str]:
    h = httpx.get(c.router_url + "/health", timeout=10).json()
    return list(h["engines"])


@pytest.fixture(scope="module")
def colocated(demo_model_dir):
    """device -> a colocated engine on it (built on first use)."""
    engines: dict[str, LLM] = {}

    def get(device: str) -> LLM:
        if device not in engines:
            engines[device] = LLM(
                demo_model_dir,
                max_model_len=MAX_MODEL_LEN,
                num_pages=400,
                max_num_batched_tokens=128,
                device=device,
                dtype="float32",
            )
        return engines[device]

    return get


BASE = "def handler(request, context):\n    result = process(request.body, context.user)\n"


def warm_prompts() -> list[str]:
    """Served first, so the decode (and prefill) caches hold them."""
    return [f"# task {i}\n" + BASE * (6 + i) for i in range(4)]


def prompts() -> list[str]:
    """16 prompts served all at once: extensions of the warm ones (decode-side prefix hits; long, so
    chunked), fresh long ones (> 128 tokens: several prefill chunks), and short ones."""
    warm = warm_prompts()
    out = []
    for i in range(16):
        if i % 4 == 0:
            out.append(warm[i // 4] + f"    return result{i}\n")
        elif i % 4 == 1:
            out.append(f"# fresh task {i}\n" + BASE * (5 + i // 2))
        elif i % 4 == 2:
            out.append(f"import os{i}")
        else:
            out.append(f"x = {i} * y + " + "z" * (i * 3))
    return out


async def _one(client: httpx.AsyncClient, url: str, prompt: str, stream: bool, max_tokens: int):
    body = {
        "model": "demo",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 5,
        "ignore_eos": True,
    }
    if not stream:
        r = await client.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        return data["choices"][0]["text"], data["choices"][0]["logprobs"], data["usage"]
    text, lps = "", None
    async with client.stream("POST", url + "/v1/completions", json=body | {"stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += chunk["choices"][0]["text"]
                if lps is None:
                    lps = chunk["choices"][0]["logprobs"]
    return text, lps, None


def test_pd_info_reports_each_engines_kv_capacity(cluster):
    """/pd/info's `kv_capacity_tokens` (the router tries a decode of a bigger pool for a request a
    smaller one refused): pages x page size, as configured (400 x 16)."""
    assert [info["kv_capacity_tokens"] for info in cluster.pd_info.values()] == [400 * 16] * 2


def test_pd_penalties_bias_and_min_tokens_equal_colocated(cluster, colocated):
    """Token 1 is sampled on the prefill, the rest on the decode: both apply the same processors."""
    ps = [warm_prompts()[0] + "    return", "import os", "x = 1 + " + "y" * 40]
    extra = {"repetition_penalty": 1.4, "frequency_penalty": 0.6, "presence_penalty": -0.3, "min_tokens": 5}
    ref_llm = colocated(cluster.device)
    banned = ref_llm.generate(ps[1], SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids[0]
    extra["logit_bias"] = {str(banned): -100}  # greedy's first token, pushed out
    params = SamplingParams(temperature=0, max_tokens=12, **(extra | {"logit_bias": {banned: -100.0}}))
    refs = ref_llm.generate(ps, params)
    for prompt, ref in zip(ps, refs, strict=True):
        body = {"model": "demo", "prompt": prompt, "max_tokens": 12, "temperature": 0} | extra
        r = httpx.post(cluster.router_url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref.outputs[0].text
        assert banned not in ref.outputs[0].token_ids
    bad = {"model": "demo", "prompt": "x", "max_tokens": 4, "logit_bias": {"999999": 1}}
    r = httpx.post(cluster.router_url + "/v1/completions", json=bad, timeout=30)
    assert r.status_code == 400 and "logit_bias" in r.text
    for url in cluster.engine_urls:
        wait_engine_idle(url)


def test_pd_a_streamed_split_of_more_children_than_a_connection_pool_answers(cluster):
    """120 prompts, streamed: each child holds its decode stream open until every child has started.
    The router's connection pool (httpx's default, 100) deadlocked it, and the health checks queued
    behind it marked both engines down (a review of prompt lists); the pool is unbounded now. A list
    of one-string lists is refused as the engine refuses it."""
    prompts = [f"item {i}: def f{i}(x):" for i in range(120)]
    body = {"model": "demo", "prompt": prompts, "max_tokens": 2, "ignore_eos": True, "stream": True}
    finished: set[int] = set()
    with httpx.stream("POST", cluster.router_url + "/v1/completions", json=body, timeout=60) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: {"):
                finished |= {c["index"] for c in json.loads(line[6:])["choices"] if c.get("finish_reason")}
    assert finished == set(range(120))
    assert httpx.get(cluster.router_url + "/health", timeout=10).json()["status"] == "ok"
    r = httpx.post(
        cluster.router_url + "/v1/completions",
        json={"model": "demo", "prompt": [["hello"], ["world"]], "max_tokens": 2},
        timeout=30,
    )
    assert r.status_code == 400 and "lists of integers only" in r.text
    for url in cluster.engine_urls:
        wait_engine_idle(url)


def test_pd_echo_with_max_tokens_0_answers_the_prompt_alone(cluster):
    """The scoring form through the router: placed as the one token both halves run, answered as the
    prompt with nothing generated; with logprobs it needs a colocated engine (a 400, nothing held)."""
    prompt = warm_prompts()[2] + "    pass"
    body = {"model": "demo", "prompt": prompt, "max_tokens": 0, "echo": True}
    r = httpx.post(cluster.router_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == prompt and r.json()["usage"]["completion_tokens"] == 0
    r = httpx.post(cluster.router_url + "/v1/completions", json=body | {"logprobs": 1}, timeout=60)
    assert r.status_code == 400 and "colocated" in r.text
    r = httpx.post(cluster.router_url + "/v1/completions", json=body | {"echo": False}, timeout=60)
    assert r.status_code == 400 and "max_tokens" in r.text
    for url in cluster.engine_urls:
        wait_engine_idle(url)


def test_pd_n_choices_equal_colocated_seeded_children(cluster, colocated):
    """The router splits n = 3 into three PD requests (seed + i each) and merges them: the same
    choices as one engine sampling each seed, streamed or not; bad n is a 400 from the router."""
    prompt = warm_prompts()[1] + "    if"
    body = {"model": "demo", "prompt": prompt, "max_tokens": 10, "temperature": 1.0, "seed": 21, "n": 3}
    body["ignore_eos"] = True
    ref_llm = colocated(cluster.device)
    refs = [
        ref_llm.generate(
            prompt, SamplingParams(temperature=1.0, seed=21 + i, max_tokens=10, ignore_eos=True)
        )[0]
        for i in range(3)
    ]
    r = httpx.post(cluster.router_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()
    assert [c["text"] for c in data["choices"]] == [x.outputs[0].text for x in refs]
    assert [c["index"] for c in data["choices"]] == [0, 1, 2] and data["usage"]["completion_tokens"] == 30
    texts = ["", "", ""]
    with httpx.stream(
        "POST", cluster.router_url + "/v1/completions", json=body | {"stream": True}, timeout=120
    ) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: {"):
                (choice,) = json.loads(line[6:])["choices"]
                texts[choice["index"]] += choice["text"]
    assert texts == [c["text"] for c in data["choices"]]
    for bad in (0, 65, "3"):
        r = httpx.post(cluster.router_url + "/v1/completions", json=body | {"n": bad}, timeout=30)
        assert r.status_code == 400 and "n must be" in r.text
    for url in cluster.engine_urls:
        wait_engine_idle(url)


def test_pd_prompt_list_equals_colocated_per_prompt(cluster, colocated):
    """A prompt list through the router: one PD request per prompt, merged in order, each choice what
    one engine samples for its prompt alone; usage counts both prompts."""
    prompts = [warm_prompts()[0] + "  return", "import sys\nprint("]
    body = {"model": "demo", "prompt": prompts, "max_tokens": 6, "temperature": 1.0, "seed": 4}
    r = httpx.post(cluster.router_url + "/v1/completions", json=body | {"ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    ref_llm = colocated(cluster.device)
    refs = ref_llm.generate(prompts, SamplingParams(temperature=1.0, seed=4, max_tokens=6, ignore_eos=True))
    assert [c["text"] for c in r.json()["choices"]] == [x.outputs[0].text for x in refs]
    assert r.json()["usage"]["prompt_tokens"] == sum(len(x.prompt_token_ids) for x in refs)
    for url in cluster.engine_urls:
        wait_engine_idle(url)


def test_pd_generate_equals_colocated_token_ids_batches_samples_and_stream(cluster, colocated):
    """SGLang's /generate through the router (RL rollouts send token ids): greedy output ids equal one
    engine's; a batch with n = 2 is split by the router into seeded PD children answered as a list in
    SGLang's order (prompt p's sample j at p·n + j, seed + j), streamed chunks tagged with their index;
    a left-out max_new_tokens is SGLang's 128 lowered to the room the prompt leaves, on both halves."""
    ref_llm = colocated(cluster.device)
    url = cluster.router_url + "/generate"
    # ("    for" put two tokens 7e-6 apart at step 3: PD once answered the runner-up)
    ids = ref_llm.engine.tokenizer.encode(warm_prompts()[2] + "    for i in")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    ref = ref_llm.generate({"prompt_token_ids": ids}, greedy)[0].outputs[0]
    assert_clear_greedy(ref)
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url, json={"input_ids": ids, "sampling_params": sp, "rid": "rollout-1"}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == list(ref.token_ids) and r.json()["text"] == ref.text
    meta = r.json()["meta_info"]
    assert meta["id"] == "rollout-1" and meta["prompt_tokens"] == len(ids)
    assert meta["finish_reason"] == {"type": "length", "length": 12}

    texts = ["import sys\nprint(", warm_prompts()[0] + "  return"]
    body = {"text": texts, "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "seed": 9, "n": 2}}
    body["sampling_params"]["ignore_eos"] = True
    r = httpx.post(url, json=body | {"rid": "batch"}, timeout=120)
    assert r.status_code == 200, r.text
    refs = [
        ref_llm.generate(t, SamplingParams(temperature=1.0, seed=9 + j, max_tokens=5, ignore_eos=True))[0]
        for t in texts
        for j in range(2)
    ]
    answers = r.json()
    assert [a["output_ids"] for a in answers] == [list(x.outputs[0].token_ids) for x in refs]
    assert [a["meta_info"]["id"] for a in answers] == [f"batch_{i}" for i in range(4)]
    streamed: dict[int, list[int]] = {}
    with httpx.stream("POST", url, json=body | {"stream": True}, timeout=120) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                streamed[chunk["index"]] = chunk["output_ids"]  # (cumulative: the last one is all)
    assert [streamed[i] for i in range(4)] == [a["output_ids"] for a in answers]

    room = 6  # (a prompt 6 tokens short of the context: the default lowers to 6, not a 400)
    long_ids = (ids * (MAX_MODEL_LEN // len(ids) + 1))[: MAX_MODEL_LEN - room]
    r = httpx.post(url, json={"input_ids": long_ids, "sampling_params": {"ignore_eos": True}}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["finish_reason"] == {"type": "length", "length": room}
    for u in cluster.engine_urls:
        wait_engine_idle(u)


def test_pd_generate_refusals_and_abort_by_rid_leave_every_engine_idle(cluster):
    """Bad /generate bodies are 400s with the field at fault (from the router's split, or from the
    prefill's validation, relayed); the engines take no batch or half without the router's room; a
    streamed request aborted by its rid ends with SGLang's abort reason long before its limit."""
    url = cluster.router_url + "/generate"
    bad = {
        "sampling_params": {"text": ["a", "b"], "sampling_params": [{}]},
        "n": {"text": "a", "sampling_params": {"n": 65}},
        "rid": {"text": ["a", "b"], "rid": ["x", "x"]},
        None: {"input_ids": [5, 10**9]},
    }
    for param, body in bad.items():
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.text
    r = httpx.post(url, json={"text": "a", "sampling_params": {"foo": 1}}, timeout=30)
    assert r.status_code == 400 and "unknown sampling params" in r.text
    r = httpx.post(url, json={"text": "a", "pd": {"room": 1}}, timeout=30)
    assert r.status_code == 400 and "reserved for the router" in r.text
    surrogate = json.dumps({"text": "a\ud800", "sampling_params": {"max_new_tokens": 2}})
    r = httpx.post(url, content=surrogate, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "surrogate" in r.text  # (a prefill's 500 was retried into a 503)
    for u in cluster.engine_urls:
        r = httpx.post(u + "/generate", json={"text": ["a", "b"]}, timeout=30)
        assert r.status_code == 400 and "split into requests by the router" in r.text
        r = httpx.post(u + "/generate", json={"text": "a"}, timeout=30)
        assert r.status_code == 400 and "send requests through the router" in r.text

    body = {"text": "def f(x):", "rid": "to-abort", "stream": True}
    body["sampling_params"] = {"max_new_tokens": 900, "temperature": 0, "ignore_eos": True}
    chunks, answer = [], None
    with httpx.stream("POST", url, json=body, timeout=120) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                if len(chunks) == 3:
                    answer = httpx.post(
                        cluster.router_url + "/abort_request", json={"rid": "to-abort"}, timeout=30
                    )
    assert answer.status_code == 200 and answer.json()["success"], answer.text
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert 3 <= len(chunks[-1]["output_ids"]) < 900
    for u in cluster.engine_urls:
        wait_engine_idle(u)


def test_pd_a_body_only_the_decode_refuses_is_its_400_at_once(cluster):
    """The prefill's copy of a request is never streamed, so `stream_options` without `stream` (or a
    malformed one) is refused by the decode alone: the client gets that 400, not a 503 after the
    prefill's Bootstrapping deadline (30 s per attempt before); nothing is retried or left held."""
    retries_before = httpx.get(cluster.router_url + "/health", timeout=10).json().get("num_retries")
    bodies = [
        {"model": "demo", "prompt": "hi", "max_tokens": 4, "stream_options": {"include_usage": True}},
        {
            "model": "demo",
            "prompt": "hi",
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": 3},
        },
    ]
    for body in bodies:
        r = httpx.post(cluster.router_url + "/v1/completions", json=body, timeout=20)
        assert r.status_code == 400, r.text
        assert "stream_options" in r.json()["error"]["message"]
    assert httpx.get(cluster.router_url + "/health", timeout=10).json().get("num_retries") == retries_before
    for url in cluster.engine_urls:
        wait_engine_idle(url)


def test_pd_chat_with_tools_renders_them_on_both_engines(cluster, colocated):
    """`launch --tool-call-parser` reaches both engines: the prefill renders the tools into the
    prompt it computes, the decode parses the answer; the tokens equal a colocated engine's on that
    prompt (the demo model writes noise, so no call is expected, but any would be parsed)."""
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "list the files"}]
    body = {"model": "demo", "messages": msgs, "tools": tools, "max_tokens": 8, "temperature": 0}
    r = httpx.post(cluster.router_url + "/v1/chat/completions", json=body | {"ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    ref_llm = colocated(cluster.device)
    tok = ref_llm.get_tokenizer()
    prompt_ids = tok.encode(tok.apply_chat_template(msgs, True, tools), add_special_tokens=False)
    ref = ref_llm.generate(
        {"prompt_token_ids": prompt_ids}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )[0]
    assert r.json()["usage"]["prompt_tokens"] == len(prompt_ids)
    assert r.json()["choices"][0]["message"]["content"] == ref.outputs[0].text
    bad = httpx.post(
        cluster.router_url + "/v1/chat/completions", json=body | {"tool_choice": {"function": {}}}, timeout=30
    )
    assert bad.status_code == 400 and "tool_choice" in bad.text
    for url in cluster.engine_urls:
        wait_engine_idle(url)


def test_pd_structured_outputs_equal_colocated(cluster, colocated):
    """The prefill samples token 1 under the request's grammar, the decode builds the same grammar from
    the same body, replays token 1 into it and goes on: the answer equals a colocated engine's, and
    matches. A named tool_choice gives its call through the router too."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["a", "b"]}},
        "required": ["n", "tag"],
        "additionalProperties": False,
    }
    spec = {"json": schema, "disable_any_whitespace": True}
    ref_llm = colocated(cluster.device)
    prompt = warm_prompts()[2] + "    return"
    for temp, seed in ((0, None), (1.0, 7)):
        ref = ref_llm.generate(
            prompt, SamplingParams(temperature=temp, seed=seed, max_tokens=40, structured_outputs=spec)
        )[0].outputs[0]
        body = {"model": "demo", "prompt": prompt, "max_tokens": 40, "temperature": temp, "seed": seed}
        r = httpx.post(
            cluster.router_url + "/v1/completions", json=body | {"structured_outputs": spec}, timeout=120
        )
        assert r.status_code == 200, r.text
        assert (
            r.json()["choices"][0]["text"] == ref.text and r.json()["choices"][0]["finish_reason"] == "stop"
        )
        assert set(json.loads(ref.text)) == {"n", "tag"}
    tools = [{"type": "function", "function": {"name": "ls", "parameters": schema}}]
    msgs = [{"role": "user", "content": "list the files"}]
    named = {"type": "function", "function": {"name": "ls"}}
    body = {"model": "demo", "messages": msgs, "tools": tools, "tool_choice": named, "max_tokens": 60}
    r = httpx.post(cluster.router_url + "/v1/chat/completions", json=body | {"temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "ls" and set(json.loads(call["function"]["arguments"])) == {"n", "tag"}
    bad = body | {"structured_outputs": {"regex": "(unclosed"}, "tool_choice": "none"}
    r = httpx.post(cluster.router_url + "/v1/chat/completions", json=bad, timeout=30)
    assert r.status_code == 400 and "does not compile" in r.text
    plp = {"model": "demo", "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 1}
    r = httpx.post(cluster.router_url + "/v1/completions", json=plp, timeout=30)
    assert r.status_code == 400 and "colocated" in r.text  # (the prompt is computed on the prefill)
    r = httpx.post(cluster.router_url + "/tokenize", json={"prompt": prompt}, timeout=30)  # (forwarded)
    assert r.status_code == 200 and r.json()["tokens"] == ref_llm.get_tokenizer().encode(prompt)
    r = httpx.post(cluster.router_url + "/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]
    for url in cluster.engine_urls:
        wait_engine_idle(url)


def test_pd_engines_refuse_a_weights_update_unless_enabled_and_reset_their_prefix_cache(
    cluster, demo_model_dir
):
    """Weight updates are off unless the engines were started with them. Dropping the unreferenced
    cached pages is fine on either role."""
    for url in cluster.engine_urls:
        r = httpx.post(url + "/update_weights_from_disk", json={"model_path": demo_model_dir}, timeout=30)
        assert r.status_code == 403 and "--enable-weight-updates" in r.json()["error"]["message"]
        r = httpx.post(url + "/reset_prefix_cache", timeout=30)
        assert r.status_code == 200 and r.json()["num_cached_pages_dropped"] >= 0
        wait_engine_idle(url)


def test_pd_abort_request_through_the_router_ends_a_stream_by_its_id(cluster):
    """An RL rollout manager aborts a streamed PD request by the id its chunks carry (the decode's):
    the router sends /abort_request to every engine, the stream ends with finish_reason "abort" long
    before max_tokens, and every engine is idle after; flush_cache goes to all engines too."""
    body = {"model": "demo", "prompt": "def f(x):", "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    texts, finish, answer = [], None, None
    with httpx.stream(
        "POST", cluster.router_url + "/v1/completions", json=body | {"stream": True}, timeout=120
    ) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            (choice,) = chunk["choices"]
            texts.append(choice["text"])
            finish = choice["finish_reason"] or finish
            if len(texts) == 3:
                answer = httpx.post(
                    cluster.router_url + "/abort_request", json={"rid": chunk["id"]}, timeout=30
                )
    assert answer.status_code == 200 and answer.json()["success"], answer.text
    per_engine = answer.json()["engines"]
    assert sorted(per_engine) == sorted(cluster.engine_urls)
    assert sum(a["num_requests_aborted"] for a in per_engine.values()) == 1  # (the decode's)
    assert finish == "abort" and 3 <= len(texts) < 900
    flushed = httpx.get(cluster.router_url + "/flush_cache", timeout=30)
    assert flushed.status_code == 200 and sorted(flushed.json()["engines"]) == sorted(cluster.engine_urls)
    bad = httpx.post(cluster.router_url + "/abort_request", json={}, timeout=30)
    assert bad.status_code == 400 and "rid or abort_all" in bad.json()["error"]["message"]
    for url in cluster.engine_urls:
        wait_engine_idle(url)


def test_pd_abort_all_while_prefilling_ends_requests_with_abort_not_a_retry(cluster):
    """abort_all through the router while the prefill computes three long prompts: each client gets
    its answer with finish_reason "abort" (the prefill's failed room reads as the abort, so the
    router does not retry it on a prefill elsewhere, nor answer 503), and every engine is idle after."""
    import concurrent.futures

    prefill = cluster.by_role["prefill"]
    retries = httpx.get(cluster.router_url + "/health", timeout=5).json()["num_retries"]
    prompts = [f"# job {i}\n" + BASE * 14 for i in range(3)]  # ~380 tokens each: 3 prefill steps of 128
    aborts = 'pdserve_requests_finished_total{finish_reason="abort"}'
    aborts_before = sum(metrics(u).get(aborts, 0) for u in cluster.engine_urls)

    def one(prompt: str) -> httpx.Response:
        body = {"model": "demo", "prompt": prompt, "max_tokens": 150, "temperature": 0, "ignore_eos": True}
        return httpx.post(cluster.router_url + "/v1/completions", json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(one, p) for p in prompts]
        deadline = time.monotonic() + 30
        while metrics(prefill)["pdserve_num_requests_running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        # (all three have reached the router: the abort is for each of them)
        wait_until(lambda: num_requests_on(cluster.router_url) == 3, 30, "3 requests at the router", 0.01)
        aborted = httpx.post(cluster.router_url + "/abort_request", json={"abort_all": True}, timeout=30)
        answers = [f.result() for f in futures]
    assert aborted.status_code == 200 and aborted.json()["success"], aborted.text
    assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
    finishes = [a.json()["choices"][0]["finish_reason"] for a in answers]
    assert finishes == ["abort"] * 3
    assert httpx.get(cluster.router_url + "/health", timeout=5).json()["num_retries"] == retries
    for url in cluster.engine_urls:
        wait_engine_idle(url)
    # Each counted once as an abort, by the engine that answers the client (the decode): a PD room
    # that ended before its first token was counted by neither engine (1 of 3, by where it stood).
    counted = {u: metrics(u).get(aborts, 0) for u in cluster.engine_urls}
    assert sum(counted.values()) - aborts_before == 3, counted


def test_pd_decode_counts_a_request_that_ends_at_its_handed_over_first_token(cluster):
    """max_tokens 1: the prefill's token is the whole answer; the decode ends the request when it takes
    the KV, outside any step. The decode (whose answer the client gets) counted neither its end nor
    its TTFT; a request of 6 tokens was counted (found by a review of the metrics)."""
    decode = cluster.by_role["decode"]
    length, ttft = (
        'pdserve_requests_finished_total{finish_reason="length"}',
        "pdserve_time_to_first_token_seconds_count",
    )
    before = metrics(decode)
    body = {"model": "demo", "prompt": BASE, "max_tokens": 1, "temperature": 0}
    r = httpx.post(cluster.router_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    deadline = time.monotonic() + 10
    while metrics(decode).get(length, 0) - before.get(length, 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    after = metrics(decode)
    assert after.get(length, 0) - before.get(length, 0) == 1
    assert after[ttft] - before[ttft] == 1
    assert (
        after["pdserve_generation_tokens_total"] == before["pdserve_generation_tokens_total"]
    )  # (the prefill's)


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_pd_abort_request_reaching_one_engine_ends_the_requests_as_aborts(cluster, side):
    """/abort_request ends PD requests on one engine only while the prefill computes (as when the
    other engine had not registered its half yet when the abort came; here the client sends the abort
    to one engine, naming its own `request_id`s by their common prefix). The aborted half tells its
    peer the room ended on purpose, so each client still gets an answer with finish_reason "abort".
    Before: aborted on the prefill, the decode answered 503; aborted on the decode, the prefill
    answered 503, and the router retried it on a prefill to a full answer."""
    import concurrent.futures

    urls = cluster.by_role
    retries = httpx.get(cluster.router_url + "/health", timeout=5).json()["num_retries"]
    base = f"one-side-{side}-{uuid.uuid4().hex[:6]}"

    def one(i: int) -> httpx.Response:
        body = {
            "model": "demo",
            "prompt": f"# {side} {i}\n" + BASE * 30,  # ~815 tokens each: 7 prefill steps of 128
            "max_tokens": 150,
            "temperature": 0,
            "ignore_eos": True,
            "request_id": f"{base}_{i}",  # (the client sees "cmpl-" + it, as vLLM makes it)
        }
        return httpx.post(cluster.router_url + "/v1/completions", json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(one, i) for i in range(3)]
        deadline = time.monotonic() + 30
        while metrics(urls["prefill"])["pdserve_num_requests_running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        if side == "decode":  # (all three halves on the decode: the abort there is for each of them)
            wait_until(lambda: num_requests_on(urls["decode"]) == 3, 30, "3 requests at the decode", 0.005)
        aborted = httpx.post(urls[side] + "/abort_request", json={"rid": f"cmpl-{base}"}, timeout=30)
        answers = [f.result() for f in futures]
    assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
    finishes = sorted(a.json()["choices"][0]["finish_reason"] for a in answers)
    assert aborted.status_code == 200 and aborted.json()["num_requests_aborted"] >= 1, aborted.text
    if side == "decode":  # (the client's half: every one ends now)
        assert finishes == ["abort"] * 3
    else:  # a request whose prefill half had already handed its KV over (on a slow machine) runs on
        assert "abort" in finishes and set(finishes) <= {"abort", "length"}
    assert httpx.get(cluster.router_url + "/health", timeout=5).json()["num_retries"] == retries
    for url in cluster.engine_urls:
        wait_engine_idle(url)


def test_pd_halves_the_router_aborted_answer_abort_at_once_in_the_clients_format(cluster):
    """`pd.aborted` (the router got an abort of everything while it held the request): each engine
    answers "abort" with no token and no room, streamed or whole; a non-boolean is a 400."""
    prefill, decode = cluster.by_role["prefill"], cluster.by_role["decode"]
    room = 77_000 + uuid.uuid4().int % 1000
    pd = {"room": room, "read_path": "none", "aborted": True}
    body = {"model": "demo", "prompt": [5, 6, 7, 8, 9], "max_tokens": 40, "temperature": 0}
    whole = httpx.post(prefill + "/v1/completions", json=body | {"pd": pd}, timeout=30)
    assert whole.status_code == 200, whole.text
    assert whole.json()["choices"][0]["finish_reason"] == "abort"
    assert whole.json()["usage"]["prompt_tokens"] == 5 and whole.json()["usage"]["completion_tokens"] == 0
    de_pd = pd | {"bootstrap_url": cluster.pd_info[prefill]["bootstrap_url"]}
    chat = {
        "model": "demo",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 40,
        "stream": True,
    }
    with httpx.stream("POST", decode + "/v1/chat/completions", json=chat | {"pd": de_pd}, timeout=30) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert r.status_code == 200 and chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == ""
    bad = httpx.post(prefill + "/v1/completions", json=body | {"pd": pd | {"aborted": 1}}, timeout=30)
    assert bad.status_code == 400 and "pd.aborted" in bad.json()["error"]["message"]
    for url in cluster.engine_urls:
        wait_engine_idle(url)


@pytest.mark.parametrize("reached", ["both", "prefill", "decode"])
def test_pd_halves_sent_before_a_routers_abort_all_that_arrive_after_it_answer_abort(cluster, reached):
    """The router's two halves of a request race its abort of everything to the engines (separate
    connections). A half that reaches an engine after the abort (on `reached` engines: the other's may
    have failed), carrying an earlier abort count of that router (`pd.router_epoch`), is aborted on
    arrival, and its role tells the peer: both answer "abort" with no token and no room left. A half
    of the abort's own count, or of another router (a restarted one counts from 0 again), runs. Bad
    router fields are a 400 that changes nothing. Before, such a half ran to the end."""
    if cluster.staged:
        pytest.skip("aborted before any KV moves: the direct cluster covers it")
    import concurrent.futures

    from pdserve.engine.pd_common import new_room

    prefill, decode = cluster.by_role["prefill"], cluster.by_role["decode"]
    router_id = uuid.uuid4().hex
    everything = {"abort_all": True, "router_id": router_id, "router_epoch": 3}
    for url in {"both": (prefill, decode), "prefill": (prefill,), "decode": (decode,)}[reached]:
        assert httpx.post(url + "/abort_request", json=everything, timeout=30).status_code == 200
    body = {
        "model": "demo",
        "prompt": [5, 6, 7, 8, 9, 10],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }

    def pair(rid: str, epoch: int) -> list[dict]:
        pd = {"room": new_room(), "read_path": "none", "router_id": rid, "router_epoch": epoch}
        legs = [
            (prefill, body | {"pd": pd}),
            (decode, body | {"pd": pd | {"bootstrap_url": cluster.pd_info[prefill]["bootstrap_url"]}}),
        ]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(
                pool.map(lambda leg: httpx.post(leg[0] + "/v1/completions", json=leg[1], timeout=60), legs)
            )
        assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
        return [a.json() for a in answers]

    late = pair(router_id, 2)
    assert [a["choices"][0]["finish_reason"] for a in late] == ["abort", "abort"]
    if reached == "both":  # (a stale abort of that router, delivered late, lowers nothing)
        stale = everything | {"router_epoch": 1}
        assert httpx.post(prefill + "/abort_request", json=stale, timeout=30).status_code == 200
        assert pair(router_id, 2)[0]["choices"][0]["finish_reason"] == "abort"
    assert late[1]["usage"]["completion_tokens"] == 0 and late[1]["choices"][0]["text"] == ""
    if reached != "both":
        for url in cluster.engine_urls:
            wait_engine_idle(url)
        return
    for rid, epoch in ((router_id, 3), (uuid.uuid4().hex, 0)):
        prefill_answer, decode_answer = pair(rid, epoch)
        assert decode_answer["choices"][0]["finish_reason"] == "length", (rid, epoch)
        assert decode_answer["usage"]["completion_tokens"] == 6
    for bad in ({"router_epoch": "2"}, {"router_epoch": -1}, {"router_id": 7}, {"router_id": "x" * 65}):
        pd = {"room": new_room(), "read_path": "none"} | bad
        r = httpx.post(prefill + "/v1/completions", json=body | {"pd": pd}, timeout=30)
        assert r.status_code == 400 and "pd.router_" in r.json()["error"]["message"], (bad, r.text)
    for refused in (
        {"rid": "x", "router_id": router_id, "router_epoch": 1},
        {"abort_all": True, "router_id": router_id, "router_named": 1},
    ):
        r = httpx.post(prefill + "/abort_request", json=refused, timeout=30)
        assert r.status_code == 400 and "comes with" in r.text, r.text
    for url in cluster.engine_urls:
        wait_engine_idle(url)


@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
def test_pd_halves_sent_before_a_routers_abort_of_their_name_that_arrive_after_it_answer_abort(cluster, path):
    """As for an abort of everything, for an abort of one name: the router's halves of a request race
    its `/abort_request` of that request's `rid` to the engines. A half that reaches them after it,
    sent at an earlier count of that router's named aborts (`pd.router_named`), is aborted on arrival
    if the abort names it (a `/generate` rid, or an OpenAI `request_id` or "cmpl-" + it); one sent at
    the abort's own count, of another name or of another router runs. Before, it ran to the end."""
    if cluster.staged:
        pytest.skip("aborted before any KV moves: the direct cluster covers it")
    import concurrent.futures

    from pdserve.engine.pd_common import new_room

    prefill, decode = cluster.by_role["prefill"], cluster.by_role["decode"]
    router_id = uuid.uuid4().hex
    name = f"victim-{uuid.uuid4().hex[:8]}"
    abort = {
        "rid": name if path == "/generate" else f"cmpl-{name}",
        "router_id": router_id,
        "router_named": 3,
    }
    for url in (prefill, decode):
        assert httpx.post(url + "/abort_request", json=abort, timeout=30).status_code == 200

    def pair(request_name: str, rid: str, named: int) -> list[str]:
        pd = {"room": new_room(), "read_path": "none", "router_id": rid, "router_named": named}
        if path == "/generate":
            params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
            body = {"input_ids": [5, 6, 7, 8, 9, 10], "sampling_params": params, "rid": request_name}
        else:
            body = {"model": "demo", "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 6, "temperature": 0}
            body |= {"ignore_eos": True, "request_id": request_name}
        legs = [
            (prefill, body | {"pd": pd}),
            (decode, body | {"pd": pd | {"bootstrap_url": cluster.pd_info[prefill]["bootstrap_url"]}}),
        ]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda leg: httpx.post(leg[0] + path, json=leg[1], timeout=60), legs))
        assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
        if path == "/generate":
            return [a.json()["meta_info"]["finish_reason"]["type"] for a in answers]
        return [a.json()["choices"][0]["finish_reason"] for a in answers]

    assert pair(name, router_id, 2) == ["abort", "abort"]
    # An earlier abort of that router (another name, count 1) reaches the engines after the abort of
    # `name` (count 3), as separate connections allow: that one still holds for a half sent at count 2.
    late = {"rid": f"other-{name}", "router_id": router_id, "router_named": 1}
    for url in (prefill, decode):
        assert httpx.post(url + "/abort_request", json=late, timeout=30).status_code == 200
    assert pair(name, router_id, 2) == ["abort", "abort"]
    assert pair(f"{name}_1", router_id, 0)[1] == "abort"  # (a child of the name: "<name>_<i>")
    for other in ((name, router_id, 3), (f"other-{name}", router_id, 2), (name, uuid.uuid4().hex, 0)):
        assert pair(*other)[1] == "length", other
    for bad in ({"router_named": "2"}, {"router_named": -1}, {"router_named": True}):
        pd = {"room": new_room(), "read_path": "none"} | bad
        r = httpx.post(
            prefill + "/v1/completions", json={"model": "demo", "prompt": [5], "pd": pd}, timeout=30
        )
        assert r.status_code == 400 and "pd.router_named" in r.json()["error"]["message"], (bad, r.text)
    for url in cluster.engine_urls:
        wait_engine_idle(url)


def test_pd_greedy_equals_colocated(cluster, colocated):
    ps = prompts()
    max_tokens = [8 + (i * 5) % 24 for i in range(len(ps))]

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.gather(*[_one(client, cluster.router_url, p, False, 4) for p in warm_prompts()])
            # All 16 concurrently; every other one streams.
            return await asyncio.gather(
                *[_one(client, cluster.router_url, p, i % 2 == 1, max_tokens[i]) for i, p in enumerate(ps)]
            )

    results = asyncio.run(run())
    ref = colocated(cluster.device).generate(
        ps, [SamplingParams(temperature=0, max_tokens=m, logprobs=5, ignore_eos=True) for m in max_tokens]
    )
    text_of = colocated(cluster.device).engine.tokenizer.token_text
    for i, out in enumerate(ref):
        text, lps, usage = results[i]
        assert text == out.outputs[0].text, f"prompt {i}"
        lp0 = out.outputs[0].logprobs[0]
        # On the CPU the same kernels give the same bits; on a GPU the kernels a batch gets depend
        # on its shape (the prefill's batches are not the colocated engine's), float32 rounding apart.
        tol = dict(rel=1e-6) if cluster.device == "cpu" else dict(abs=1e-4)
        assert lps["token_logprobs"][0] == pytest.approx(lp0.logprob, **tol)
        # (keyed by token text, as in vLLM: two of the top tokens may spell the same text, e.g. "\ufffd")
        top = {text_of(t): v for t, v in lp0.top} | {text_of(out.outputs[0].token_ids[0]): lp0.logprob}
        assert list(lps["top_logprobs"][0]) == list(top)
        assert list(lps["top_logprobs"][0].values()) == pytest.approx(list(top.values()), **tol)
        if i % 4 == 0:  # non-streamed extensions of warm prompts: the prefill had the prefix cached
            assert usage["prompt_tokens_details"]["cached_tokens"] > 0
    idle = {url: wait_engine_idle(url) for url in cluster.engine_urls}
    decode_url = cluster.by_role["decode"]
    # The decode matched its own prefix cache for the extended prompts and asked only for the rest.
    assert idle[decode_url]["pdserve_prefix_cache_hit_tokens_total"] > 0
    prefill_url = [u for u in cluster.engine_urls if u != decode_url][0]
    assert idle[prefill_url]["pdserve_pd_pages_sent_total"] > 0
    assert (idle[decode_url]["pdserve_pd_staged_requests_total"] > 0) == cluster.staged
    # Registrations: the one decode on the prefill, the prefill on the decode; none idle long enough
    # to be forgotten (PDConfig.peer_idle_s).
    assert idle[prefill_url]["pdserve_pd_peers"] == 1 and idle[decode_url]["pdserve_pd_peers"] >= 1
    assert idle[prefill_url]["pdserve_pd_peers_forgotten_total"] == 0


def test_a_decode_whose_prefill_cannot_be_reached_answers_a_typed_503_and_holds_nothing(cluster):
    """The router reads this 503's type as the prefill's failure (router/app.py): the decode's own
    lookup of a dead prefill's bootstrap may answer before the router sees that prefill's death."""
    if cluster.staged:
        pytest.skip("no KV moves: the direct cluster covers it")
    import socket

    from pdserve.engine.pd_common import new_room

    with socket.socket() as s:  # a port nothing listens on (bound, then closed: refused)
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    decode = cluster.by_role["decode"]
    pd = {"room": new_room(), "read_path": "none", "bootstrap_url": dead}
    body = {"model": "demo", "prompt": [5, 6, 7], "max_tokens": 4, "pd": pd}
    r = httpx.post(decode + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["type"] == "PrefillUnreachable" and dead in r.json()["error"]["message"]
    m = wait_engine_idle(decode)
    assert m["pdserve_kv_pages_used"] == 0 and m["pdserve_pd_rooms_held"] == 0
