"""vLLM's `cache_salt`: a request's prefix-cache and store keys are salted with it, so requests of
another salt (another tenant) share none of its KV and cannot learn from a hit's timing that it was
sent. Found by an API review (2026-12-03): the field was accepted and ignored, and a second tenant's
identical prompt reported `cached_tokens: 96` from the first's pages. Each test failed before the fix
(the offline and HTTP ones by the hit; the store one over a PD cluster in test_multiturn_hits.py)."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.kvcache.hashing import page_keys, root_key, salted_root
from pdserve.router.prompts import PrefixIndex, prompt_pieces
from tests.conftest import post_in_process

PROMPT_IDS = list(range(10, 110))  # 100 tokens: 6 full pages of 16


def test_salted_roots_differ_per_salt_and_none_is_the_root():
    root = root_key("m")
    assert salted_root(root, None) == root
    alice, bob = salted_root(root, "alice"), salted_root(root, "bob")
    assert len({root, alice, bob}) == 3
    assert salted_root(root, "alice") == alice  # deterministic (no builtin hash())
    # every key of the chain differs, not only the first
    assert not set(page_keys(PROMPT_IDS, 16, alice)) & set(page_keys(PROMPT_IDS, 16, bob))


def test_router_estimates_hits_among_prompts_of_the_same_salt_only():
    idx = PrefixIndex(block_tokens=16)

    def ids_then_record(salt=None) -> int:
        hits, keys = idx.hit_tokens_and_keys(PROMPT_IDS, salt)
        idx.record_keys(keys)
        return hits

    def text_then_record(salt) -> int:
        hits, keys = idx.estimated_hits_and_keys(prompt_pieces({"prompt": "x" * 1024}), 300, salt)
        idx.record_keys(keys)
        return hits

    assert ids_then_record("alice") == 0
    assert ids_then_record("bob") == 0
    assert ids_then_record() == 0
    assert ids_then_record("alice") == 96
    assert text_then_record("alice") == 0
    assert text_then_record("bob") == 0
    assert text_then_record("alice") == 256


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM(demo_model_dir, page_size=16, dtype="float32", num_pages=256, max_model_len=512)


def test_offline_salts_isolate_the_prefix_cache(llm):
    greedy = SamplingParams(max_tokens=1, temperature=0)

    def cached(prompt) -> int:
        return llm.generate(prompt, greedy, use_tqdm=False)[0].num_cached_tokens

    ids = [7, 8, 9] + PROMPT_IDS
    assert cached({"prompt_token_ids": ids, "cache_salt": "alice"}) == 0
    assert cached({"prompt_token_ids": ids, "cache_salt": "bob"}) == 0  # was 96: alice's pages
    assert cached({"prompt_token_ids": ids}) == 0  # no salt: its own chain too
    assert cached({"prompt_token_ids": ids, "cache_salt": "alice"}) == 96
    assert cached({"prompt_token_ids": ids}) == 96


@pytest.mark.parametrize("salt", ["", 5, ["a"]])
def test_offline_bad_salt_is_a_value_error_and_changes_nothing(llm, salt):
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt_token_ids": PROMPT_IDS, "cache_salt": salt}, SamplingParams(max_tokens=1))
    assert not llm.engine.requests


def test_http_salts_isolate_the_prefix_cache_on_both_routes(demo_engine):
    text = "def parse_args(argv):\n    parser = argparse.ArgumentParser(" * 6
    chat = [{"role": "user", "content": text}]

    def completion(**kw):
        return ("/v1/completions", {"prompt": text, "max_tokens": 1, "temperature": 0, **kw})

    def chat_completion(**kw):
        return ("/v1/chat/completions", {"messages": chat, "max_tokens": 1, "temperature": 0, **kw})

    responses = post_in_process(
        demo_engine,
        [
            completion(cache_salt="alice"),
            completion(cache_salt="bob"),
            completion(cache_salt="alice"),
            chat_completion(cache_salt="carol"),
            chat_completion(cache_salt="dave"),
            chat_completion(cache_salt="carol", n=2),
            completion(cache_salt=""),
            completion(cache_salt=7),
            chat_completion(cache_salt=None),
        ],
    )
    for r in responses[:6] + responses[8:]:
        assert r.status_code == 200, r.text
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in responses[:6]]
    assert cached[0] == cached[1] == cached[3] == cached[4] == 0, cached
    assert cached[2] > 0 and cached[5] > 0, cached
    for r in responses[6:8]:
        assert r.status_code == 400, r.text
        assert "cache_salt" in r.text
