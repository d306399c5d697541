"""`/generate` against SGLang's, from an audit of what RL frameworks (slime, verl, AReaL) send and read
(2026-12-03); each test failed before its fix: `cache_salt` isolates the KV cache as on the OpenAI
routes, `meta_info` carries the engine's `weight_version` (slime records it per sample), null is a
field's default, and SGLang fields this server does not implement are a 400 instead of ignored."""

from __future__ import annotations

import pytest

from tests.conftest import post_in_process
from tests.test_tool_calls import sse_chunks

IDS = list(range(10, 91))  # 81 tokens: 5 full pages of 16
BASE = {"input_ids": IDS, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


def test_cache_salt_isolates_the_prefix_cache(demo_engine):
    a, b, a_again, bad = post_in_process(
        demo_engine,
        [
            ("/generate", BASE | {"cache_salt": "tenantA"}),
            ("/generate", BASE | {"cache_salt": "tenantB"}),
            ("/generate", BASE | {"cache_salt": "tenantA"}),
            ("/generate", BASE | {"cache_salt": ""}),
        ],
    )
    cached = [r.json()["meta_info"]["cached_tokens"] for r in (a, b, a_again)]
    assert cached == [0, 0, 80], cached  # (was [0, 80, 80]: tenant B hit tenant A's pages)
    assert bad.status_code == 400, bad.text


def test_meta_info_carries_the_weight_version_whole_and_streamed(demo_engine):
    old = demo_engine.weight_version
    demo_engine.weight_version = "v7"
    try:
        whole, streamed = post_in_process(
            demo_engine, [("/generate", BASE), ("/generate", BASE | {"stream": True})]
        )
    finally:
        demo_engine.weight_version = old
    assert whole.json()["meta_info"]["weight_version"] == "v7", whole.json()
    events = sse_chunks(streamed)
    assert events and all(e["meta_info"]["weight_version"] == "v7" for e in events)


def test_null_is_the_default(demo_engine):
    nulls = {
        "input_ids": IDS,
        "sampling_params": {
            "max_new_tokens": 2,
            "temperature": 0,
            "top_k": None,
            "top_p": None,
            "min_p": None,
            "repetition_penalty": None,
            "ignore_eos": None,
            "skip_special_tokens": None,
        },
        "return_logprob": None,
        "logprob_start_len": None,
        "top_logprobs_num": None,
        "stream": None,
        "return_text_in_logprobs": None,
    }
    plain, with_nulls, all_null = post_in_process(
        demo_engine,
        [
            ("/generate", BASE),
            ("/generate", nulls),
            ("/generate", {"input_ids": IDS, "sampling_params": None}),
        ],
    )
    assert with_nulls.status_code == 200, with_nulls.text
    assert with_nulls.json()["output_ids"] == plain.json()["output_ids"]
    assert all_null.status_code == 200, all_null.text


@pytest.mark.parametrize(
    "field",
    [
        {"image_data": ["data:image/png;base64,AAAA"]},
        {"lora_path": "adapter"},
        {"return_routed_experts": True},
        {"return_hidden_states": True},
        {"token_ids_logprob": [5]},
    ],
)
def test_unimplemented_sglang_fields_are_refused_unless_off(demo_engine, field):
    name = next(iter(field))
    on, off = post_in_process(demo_engine, [("/generate", BASE | field), ("/generate", BASE | {name: None})])
    assert on.status_code == 400 and name in on.text, on.text  # (was a 200, answered without it)
    assert off.status_code == 200, off.text


def test_max_new_tokens_zero_answers_the_prompts_logprobs_alone(demo_engine):
    """slime's on-policy distillation: `max_new_tokens` 0 with `return_logprob` and
    `logprob_start_len` 0 reads `meta_info.input_token_logprobs` (SGLang allows 0; it was a 400)."""
    body = {
        "input_ids": IDS[:20],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    zero, one, streamed = post_in_process(
        demo_engine,
        [
            ("/generate", body),
            ("/generate", body | {"sampling_params": {"max_new_tokens": 1, "temperature": 0}}),
            ("/generate", body | {"stream": True}),
        ],
    )
    assert zero.status_code == 200, zero.text
    z, o = zero.json(), one.json()
    assert (z["output_ids"], z["text"]) == ([], "")
    assert z["meta_info"]["completion_tokens"] == 0 and z["meta_info"]["output_token_logprobs"] == []
    assert z["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert z["meta_info"]["input_token_logprobs"] == o["meta_info"]["input_token_logprobs"]
    assert len(z["meta_info"]["input_token_logprobs"]) == 20
    assert streamed.status_code == 400 and "max_new_tokens" in streamed.text


def test_sglangs_sampling_seed_is_the_seed_and_stream_interval_is_taken(demo_engine):
    """slime's deterministic mode sends `sampling_seed`; `stream_interval` only groups a stream's
    chunks. Both were 400s ("unknown sampling params")."""
    sample = {"max_new_tokens": 6, "temperature": 1.0}
    ours, theirs, other, interval = post_in_process(
        demo_engine,
        [
            ("/generate", {"input_ids": IDS, "sampling_params": sample | {"seed": 11}}),
            ("/generate", {"input_ids": IDS, "sampling_params": sample | {"sampling_seed": 11}}),
            ("/generate", {"input_ids": IDS, "sampling_params": sample | {"sampling_seed": 12}}),
            ("/generate", {"input_ids": IDS, "sampling_params": sample | {"seed": 11, "stream_interval": 4}}),
        ],
    )
    for r in (theirs, other, interval):
        assert r.status_code == 200, r.text
    assert theirs.json()["output_ids"] == ours.json()["output_ids"] == interval.json()["output_ids"]
    assert other.json()["output_ids"] != ours.json()["output_ids"]


def test_custom_params_without_a_logit_processor_are_inert_as_in_sglang(demo_engine):
    """SGLang's `custom_params` feed a request's `custom_logit_processor` (refused here); alone they
    change nothing there, so they are taken (they were a 400, "unknown sampling params")."""
    sp = BASE["sampling_params"]
    plain, with_params, not_an_object = post_in_process(
        demo_engine,
        [
            ("/generate", BASE),
            ("/generate", BASE | {"sampling_params": sp | {"custom_params": {"thinking_budget": 5}}}),
            ("/generate", BASE | {"sampling_params": sp | {"custom_params": [1]}}),
        ],
    )
    assert with_params.status_code == 200, with_params.text
    assert with_params.json()["output_ids"] == plain.json()["output_ids"]
    assert not_an_object.status_code == 400 and "custom_params" in not_an_object.text
