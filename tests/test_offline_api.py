"""The offline API (LLM / SamplingParams / RequestOutput) against vLLM's (v0.10.x, V1 engine), found
by a review on 2026-12-02 (each test failed before its fix): `LLM.chat`, `cumulative_logprob`, a
generate that raises leaves nothing queued or held, malformed inputs are ValueErrors, prompt fields
that cannot be honoured are refused, a secondary EOS is reported as the stop token, a max_tokens past
the context ends there."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pdserve import LLM, SamplingParams

P = "def parse_args(argv):\n    parser = argparse.ArgumentParser("


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> str:
    from pdserve.model.demo import make_demo_model

    return str(make_demo_model(tmp_path_factory.mktemp("demo")))


@pytest.fixture(scope="module")
def llm(demo_dir):
    return LLM(demo_dir, page_size=16, dtype="float32", num_pages=256, max_model_len=512)


def pages_in_use(llm) -> int:
    return sum(1 for c in llm.engine.kv.pool.ref_counts() if c)


def variant(demo_dir: str, tmp_path: Path, config: dict | None = None, generation: dict | None = None) -> str:
    """A copy of the demo checkpoint with config.json / generation_config.json fields changed."""
    d = tmp_path / "variant"
    shutil.copytree(demo_dir, d)
    for name, extra in (("config.json", config), ("generation_config.json", generation)):
        if extra:
            data = json.loads((d / name).read_text())
            data.update(extra)
            (d / name).write_text(json.dumps(data))
    return str(d)


# ---- 1. LLM.chat does not exist ------------------------------------------------------------------
def test_llm_chat_renders_the_template_and_generates(llm):
    """vLLM: LLM.chat(messages | list of conversations, sampling_params, chat_template_kwargs=...,
    add_generation_prompt=True) renders the model's chat template, tokenizes it without adding
    special tokens again, and generates. pdserve: AttributeError."""
    msgs = [{"role": "user", "content": "hello"}]
    sp = SamplingParams(temperature=0, max_tokens=4)
    tok = llm.get_tokenizer()
    ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False)
    ref = llm.generate({"prompt_token_ids": ids}, sp)[0]
    outs = llm.chat([msgs, msgs], sp)  # a list of conversations
    assert len(outs) == 2
    assert outs[0].prompt_token_ids == ids
    assert outs[1].outputs[0].token_ids == ref.outputs[0].token_ids


# ---- 3. CompletionOutput.cumulative_logprob is missing -------------------------------------------
def test_cumulative_logprob_is_the_sum_of_the_sampled_logprobs(llm):
    """vLLM: CompletionOutput.cumulative_logprob (None without logprobs, else the sum of the sampled
    tokens' logprobs). pdserve: AttributeError."""
    c = llm.generate(P, SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=1))[0].outputs[0]
    assert c.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in c.logprobs))
    c = llm.generate(P, SamplingParams(temperature=0, max_tokens=2))[0].outputs[0]
    assert c.cumulative_logprob is None


# ---- 6. An error raised mid-generate leaves the batch queued, holding pages -----------------------
def test_a_generate_that_raises_midway_leaves_nothing_queued_or_held(demo_dir, monkeypatch):
    """An exception out of a step (torch.cuda.OutOfMemoryError on a too-big batch, a KeyboardInterrupt
    in a notebook) propagates out of LLM.generate with every request of the batch still queued and
    holding KV pages. The next generate() (the user's retry with a smaller batch) silently runs the
    whole old batch again first (and, on a GPU, OOMs again)."""
    llm = LLM(demo_dir, page_size=16, dtype="float32", num_pages=256, max_model_len=512)  # (its own)
    engine = llm.engine
    real = engine.runner.execute
    calls = {"n": 0}

    def failing(sched):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(sched)

    monkeypatch.setattr(engine.runner, "execute", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        llm.generate([P, "x = 1", "import os"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    monkeypatch.undo()
    assert not engine.requests and not engine.has_unfinished()
    assert pages_in_use(llm) == 0
    engine.check_integrity()
    before = engine.num_generated_tokens
    llm.generate("y", SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.num_generated_tokens - before == 2  # only the retry's own tokens


# ---- 7. Malformed prompts / params: TypeError or AttributeError, not ValueError --------------------
@pytest.mark.parametrize(
    "prompts, params",
    [
        ([1, 2, 3], None),  # one token-id prompt given bare (tokenize_prompt accepts a list of ids)
        (5, None),
        ([{"prompt": 5}], None),
        ([None], None),
        ("hello", {"max_tokens": 3}),  # params as a dict: became ["max_tokens"]
    ],
)
def test_malformed_inputs_are_value_errors_and_change_nothing(llm, prompts, params):
    with pytest.raises(ValueError):
        llm.generate(prompts, params)
    assert not llm.engine.requests


# ---- 10. A prompt dict's keys pdserve cannot honour are dropped silently ---------------------------
@pytest.mark.parametrize(
    "prompt",
    [
        {"prompt": "hello", "multi_modal_data": {"image": "x.png"}},
        {"prompt_token_ids": [5, 6, 7], "multi_modal_data": {"audio": "x.wav"}},
    ],
)
def test_prompt_fields_that_cannot_be_honoured_are_refused(llm, prompt):
    """vLLM refuses multi_modal_data for a text-only model (a ValueError from its input processing).
    pdserve ignores the key and generates from the text alone."""
    with pytest.raises(ValueError):
        llm.generate(prompt, SamplingParams(max_tokens=2))


# ---- 11. A generation_config EOS other than the tokenizer's: stop_reason None ----------------------
def test_a_secondary_eos_from_generation_config_is_reported_as_the_stop_token(demo_dir, tmp_path):
    """vLLM (SamplingParams.update_from_generation_config): the generation_config's EOS ids other than
    the tokenizer's are added to stop_token_ids (unless ignore_eos), so ending on one (Llama-3's
    <|end_of_text|> beside <|eot_id|>) gives finish_reason "stop" with stop_reason = that id. pdserve
    stops on it too but reports stop_reason None, as for the primary EOS."""
    plain = LLM(demo_dir, dtype="float32", num_pages=64, max_model_len=256)
    greedy = plain.generate(P, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    other = greedy.token_ids[3]
    eos = plain.engine.tokenizer.eos_token_id
    gen = json.loads((Path(demo_dir) / "generation_config.json").read_text())
    d = variant(demo_dir, tmp_path, generation={**gen, "eos_token_id": [eos, other]})
    llm = LLM(d, dtype="float32", num_pages=64, max_model_len=256)
    out = llm.generate(P, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    assert out.token_ids[-1] == other and out.finish_reason == "stop"
    assert out.stop_reason == other


def test_a_max_tokens_past_the_context_is_capped_there_not_refused(llm):
    """vLLM V1 offline: only a prompt longer than max_model_len is refused; max_tokens beyond the room
    left ends the request at max_model_len (finish_reason "length"). pdserve raises InvalidRequest for
    the whole batch if any one prompt + max_tokens exceeds max_model_len (here 512)."""
    outs = llm.generate(
        ["hi", {"prompt_token_ids": [5] * 500}],
        SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
    )
    assert len(outs[0].outputs[0].token_ids) == 100
    assert len(outs[1].outputs[0].token_ids) == 12 and outs[1].outputs[0].finish_reason == "length"


def test_generation_config_sampling_values_are_the_defaults_offline_and_over_http(demo_dir, tmp_path):
    """vLLM >= 0.8 (generation_config="auto") takes the checkpoint's generation_config.json temperature,
    top_k, top_p, min_p, repetition_penalty (and offline max_new_tokens) as the defaults of a request
    that does not set them; pdserve sampled at temperature 1 whatever the model's creator set. A
    request's own value (or over HTTP its null: the default) still decides."""
    from pdserve.server.protocol import ChatCompletionRequest, CompletionRequest
    from tests.conftest import post_in_process

    d = variant(demo_dir, tmp_path, generation={"top_k": 1, "max_new_tokens": 5, "temperature": 0.7})
    llm = LLM(d, dtype="float32", num_pages=64, max_model_len=256)
    assert dict(llm.engine.config.model_config.sampling_defaults) == {
        "top_k": 1,
        "max_tokens": 5,
        "temperature": 0.7,
    }
    default = llm.generate(P)[0].outputs[0]
    greedy = llm.generate(P, SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert len(default.token_ids) == 5 and default.token_ids == greedy.token_ids  # (top_k 1: greedy)

    defaults = {"top_k": 1, "temperature": 0.7}
    sp = CompletionRequest.model_validate({"prompt": "x"}).sampling_params(16, None, defaults)
    assert (sp.top_k, sp.temperature, sp.max_tokens) == (1, 0.7, 16)
    sp = CompletionRequest.model_validate({"prompt": "x", "top_k": 5, "temperature": None}).sampling_params(
        16, None, defaults
    )
    assert (sp.top_k, sp.temperature) == (5, 0.7)
    sp = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}]}
    ).sampling_params(16, None, {"repetition_penalty": 1.05})
    assert sp.repetition_penalty == 1.05

    body = {"prompt": P, "max_tokens": 6, "seed": 3}
    r1, r2 = post_in_process(llm.engine, [("/v1/completions", body), ("/v1/completions", body | {"seed": 4})])
    assert r1.json()["choices"][0]["text"] == r2.json()["choices"][0]["text"]  # top_k 1 from the model


def test_n_choices_per_prompt_each_as_its_seed_alone_would_sample(llm):
    """vLLM's offline `SamplingParams(n=...)` (RL rollouts sample a group per prompt): it did not
    exist. Choice j is the request seeded seed + j, so each choice is reproducible alone, as over
    HTTP; the choices share the prompt's pages; nothing is left held."""
    sp = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=8, ignore_eos=True, logprobs=0)
    out = llm.generate([P, "x = 1"], [sp, SamplingParams(max_tokens=2, temperature=0)])
    assert [len(o.outputs) for o in out] == [3, 1]
    assert [c.index for c in out[0].outputs] == [0, 1, 2]
    alone = [
        llm.generate(P, SamplingParams(seed=11 + j, temperature=1.0, max_tokens=8, ignore_eos=True))[0]
        for j in range(3)
    ]
    assert [list(c.token_ids) for c in out[0].outputs] == [list(a.outputs[0].token_ids) for a in alone]
    assert [c.text for c in out[0].outputs] == [a.outputs[0].text for a in alone]
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1  # (different seeds, different samples)
    assert all(c.cumulative_logprob is not None and len(c.logprobs) == 8 for c in out[0].outputs)
    assert out[0].prompt == P and out[0].request_id != out[1].request_id
    assert pages_in_use(llm) == 0
    greedy = llm.generate(P, SamplingParams(n=2, temperature=0, max_tokens=4))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


@pytest.mark.parametrize("n", [0, -1, 65, True, 1.5, "2"])
def test_a_bad_n_is_a_value_error(n):
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=n)


def test_the_engine_refuses_n_above_one_rather_than_answer_one_choice(llm):
    from pdserve.engine.llm_engine import InvalidRequest

    with pytest.raises(InvalidRequest, match="one request per choice"):
        llm.engine.add_request(P, SamplingParams(n=2))
    assert not llm.engine.has_unfinished()


def test_sampled_tokens_logprobs_carry_their_rank(llm):
    """vLLM's Logprob has `rank` for the sampled token too (1 + how many tokens were likelier, a tie
    ranking with it); ours had it for prompt logprobs only."""
    out = llm.generate(
        P, SamplingParams(seed=3, temperature=1.5, max_tokens=24, ignore_eos=True, logprobs=20)
    )[0]
    ranks = [t.rank for t in out.outputs[0].logprobs]
    assert all(isinstance(r, int) and r >= 1 for r in ranks) and max(ranks) > 1  # (sampled hot: not all top)
    for t in out.outputs[0].logprobs:
        likelier = [v for _, v in t.top if v > t.logprob]
        if t.rank <= len(t.top):  # inside the top list: the tokens before it are exactly the likelier ones
            assert len(likelier) == t.rank - 1 and t.top[t.rank - 1][0] == t.token_id
        else:
            assert len(likelier) == len(t.top)
    greedy = llm.generate(P, SamplingParams(temperature=0, max_tokens=6, logprobs=0))[0]
    assert [t.rank for t in greedy.outputs[0].logprobs] == [1] * 6


def test_max_model_len_defaults_to_the_models_positions_as_far_as_the_pool_holds(demo_dir, tmp_path):
    """It defaulted to at most 4,096 tokens: a 32K-context model refused a 5,000-token prompt unless
    the user passed --max-model-len. Now the model's positions (vLLM's default), capped at what the
    KV pool holds, so any request the context admits fits the pool."""
    from pdserve.config import EngineConfig

    long = variant(demo_dir, tmp_path, config={"max_position_embeddings": 32768})
    assert EngineConfig.create(long).scheduler.max_model_len == 32768  # (0.5 GiB holds far more)
    assert EngineConfig.create(long, num_pages=40, page_size=16).scheduler.max_model_len == 640
    assert EngineConfig.create(long, num_pages=40, max_model_len=100).scheduler.max_model_len == 100
    small = LLM(long, kv_cache_memory_gib=0.002)  # sized by memory: the same pages as the default
    cfg = small.engine.config
    assert cfg.scheduler.max_model_len == small.engine.kv.pool.num_pages * cfg.cache.page_size < 32768
    prompt = {"prompt_token_ids": [5 + i % 4000 for i in range(5000)]}
    out = LLM(long).generate(prompt, SamplingParams(max_tokens=2))[0]
    assert len(out.outputs[0].token_ids) == 2
