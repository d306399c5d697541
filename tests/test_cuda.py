"""The engine on a CUDA GPU against the CPU reference (skipped without a GPU).

CI has no GPU; these run where one is lent (docs/benchmarks.md records each run with the card's name).
The PD and DualPath paths on the GPU are the `cuda-*` parameters of tests/test_pd_e2e.py,
tests/test_dualpath_e2e.py and tests/test_transfer_backends.py; HF bf16 equivalence is
tests/test_hf_equivalence.py::test_cuda_bf16_matches_hf.
"""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.request import Request
from tests.conftest import requires_cuda

BASE = "def handler(request, context):\n    result = process(request.body, context.user)\n"


def _llm(model_dir: str, device: str, **kw) -> LLM:
    # 64-token steps: the long prompts are prefilled in several chunks; small pool: preemption-free here.
    base = dict(dtype="float32", page_size=16, num_pages=512, max_model_len=1024, max_num_batched_tokens=64)
    return LLM(model_dir, device=device, **(base | kw))


@pytest.fixture(scope="module")
def engines(demo_model_dir):
    return _llm(demo_model_dir, "cpu"), _llm(demo_model_dir, "cuda")


def _prompts() -> list[str]:
    """Shared prefixes (prefix-cache hits), long prompts (chunked), short ones."""
    return [f"# task {i % 3}\n" + BASE * (4 + 3 * (i % 3)) + f"    return {i}\n" for i in range(6)] + [
        "import os",
        "x = 1 + ",
    ]


@requires_cuda
def test_greedy_on_cuda_equals_the_cpu_reference(engines):
    cpu, cuda = engines
    params = [SamplingParams(temperature=0, max_tokens=24, logprobs=3, ignore_eos=True)] * len(_prompts())
    for _ in range(2):  # the second round hits the prefix cache on both
        ref, out = cpu.generate(_prompts(), params), cuda.generate(_prompts(), params)
        for i, (r, o) in enumerate(zip(ref, out, strict=True)):
            assert o.outputs[0].token_ids == r.outputs[0].token_ids, f"prompt {i}"
            for lp_r, lp_o in zip(r.outputs[0].logprobs, o.outputs[0].logprobs, strict=True):
                assert lp_o.logprob == pytest.approx(lp_r.logprob, abs=1e-4)
    assert cuda.engine.runner.kv_cache.k[0].is_cuda
    assert ref[0].num_cached_tokens > 0 and out[0].num_cached_tokens == ref[0].num_cached_tokens
    cuda.engine.check_integrity()


@requires_cuda
def test_penalties_bias_and_min_tokens_on_cuda_equal_the_cpu_reference(engines):
    """The logits processors index the logits on the GPU with ids built on the host."""
    cpu, cuda = engines
    ps = _prompts()
    banned = cpu.generate(ps[:1], SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids[0]
    params = SamplingParams(
        temperature=0,
        max_tokens=16,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.2,
        min_tokens=4,
        stop_token_ids=[banned],
        logit_bias={banned: -5.0, 7: 2.0},
    )
    ref, out = cpu.generate(ps, params), cuda.generate(ps, params)
    for i, (r, o) in enumerate(zip(ref, out, strict=True)):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids, f"prompt {i}"
    cuda.engine.check_integrity()


@requires_cuda
def test_structured_outputs_and_prompt_logprobs_on_cuda_equal_the_cpu_reference(engines):
    """The grammar's bits are expanded on the GPU (the CPU unpacks them with numpy); prompt logprobs
    slice the GPU's hidden states."""
    cpu, cuda = engines
    ps = _prompts()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}}}
    spec = {"json": schema | {"required": ["n", "ok"]}, "disable_any_whitespace": True}
    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs=spec, prompt_logprobs=2)
    ref, out = cpu.generate(ps, params), cuda.generate(ps, params)
    for i, (r, o) in enumerate(zip(ref, out, strict=True)):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids, f"prompt {i}"
        for e_r, e_o in zip(r.prompt_logprobs[1:], o.prompt_logprobs[1:], strict=True):
            assert e_o.token_id == e_r.token_id and e_o.logprob == pytest.approx(e_r.logprob, abs=1e-4)
    cuda.engine.check_integrity()


@requires_cuda
def test_seeded_sampling_on_cuda_is_reproducible_and_batch_independent(engines):
    _, cuda = engines
    prompt = "def parse_args(argv):\n    parser = argparse.ArgumentParser("

    def alone(seed: int) -> list[int]:
        return (
            cuda.generate(prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=24))[0]
            .outputs[0]
            .token_ids
        )

    first = alone(7)
    assert alone(7) == first
    batch = cuda.generate(
        ["other prompt", prompt, "x = 1"],
        [
            SamplingParams(temperature=1.0, max_tokens=24),
            SamplingParams(temperature=1.0, seed=7, max_tokens=24),
            SamplingParams(temperature=0.7, seed=1, top_k=5, top_p=0.9, max_tokens=5),
        ],
    )
    assert batch[1].outputs[0].token_ids == first
    assert alone(8) != first


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_store_write_back_and_read_round_trip(device, demo_model_dir, tmp_path, monkeypatch):
    """Pages of a pool -> chunked write-back gather -> files -> a read into host memory -> scatter into
    other pages: byte-identical, for every layer's K and V. The CPU case runs in CI, so the test keeps
    up with the engine's request (a real `Request`) where no GPU is lent."""
    from pdserve.engine import store_connector
    from pdserve.engine.store_connector import StoreConnector
    from pdserve.store.block_store import KVBlockStore
    from pdserve.store.layout import BlockLayout

    engine = _llm(demo_model_dir, device).engine
    kv = engine.runner.kv_cache
    g = torch.Generator(device=device).manual_seed(0)
    for t in [*kv.k, *kv.v]:
        t.copy_(torch.randn(t.shape, generator=g, device=device, dtype=t.dtype))
    layout = BlockLayout.from_kv_layout(kv.layout, 32, model="cuda-test")  # 2 pages per block
    store = KVBlockStore(tmp_path, layout, 1 << 30)
    monkeypatch.setattr(store_connector, "PERSIST_CHUNK_NBYTES", 3 * layout.block_nbytes)  # 3 chunks
    conn = StoreConnector(engine, store)
    num_blocks = 7
    src_pages = [5, 9, 2, 40, 41, 42, 100, 7, 8, 300, 11, 12, 77, 78]
    tokens = [(j * 7919) % 4000 for j in range(num_blocks * 32 + 1)]
    req = Request("r", tokens, SamplingParams(max_tokens=1), max_tokens=1)
    req.page_ids, req.num_computed_tokens = src_pages, num_blocks * 32
    assert conn.persist(req) == num_blocks
    conn.flush()
    assert conn.num_blocks_written == num_blocks and conn.num_write_failures == 0
    assert conn.lookup(req) == num_blocks
    pending = conn.start_read(req, num_blocks)
    result = pending.future.result(timeout=30)
    assert result.num_ok == num_blocks, result
    dst_pages = [400 + j for j in range(len(src_pages))]
    conn.scatter_blocks(pending.buffer, num_blocks, dst_pages)
    src, dst = torch.tensor(src_pages, device=device), torch.tensor(dst_pages, device=device)
    for t in [*kv.k, *kv.v]:
        assert torch.equal(t.index_select(0, src), t.index_select(0, dst))
