"""Layerwise prefill (DualPath): a request's new tokens computed layer by layer over a prefix whose KV
is handed in one layer at a time must give the same logits and KV as the paged path and as HF."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.scheduler import SchedulerOutput
from tests.conftest import ARCHS
from tests.test_hf_equivalence import prompts_for


@pytest.mark.parametrize("arch", ARCHS)
def test_layerwise_prefill_matches_paged_and_hf(arch, hf_checkpoints):
    path, hf = hf_checkpoints[arch]
    llm = LLM(path, page_size=4, dtype="float32", num_pages=64, max_model_len=512)
    engine, runner = llm.engine, llm.engine.runner
    prompt = prompts_for(11, (50,))[0]
    num_prefix = 36  # the "stored" part; the last 14 tokens are computed layerwise
    req = engine.make_request({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1))
    engine.add(req)
    assert engine.kv.allocate(req, num_prefix)
    runner.execute(SchedulerOutput([req], [num_prefix]))  # the prefix's KV, via the paged path
    req.num_computed_tokens = num_prefix
    ps = engine.kv.page_size
    slots = torch.tensor([req.page_ids[p // ps] * ps + p % ps for p in range(num_prefix)])
    loaded, emitted = [], {}

    def load_layer(i):
        loaded.append(i)
        k_cache, v_cache = runner._kv_views[i]
        return k_cache[slots].clone(), v_cache[slots].clone()

    def emit_layer(i, k, v):
        emitted[i] = (k.clone(), v.clone())

    new = torch.tensor(prompt[num_prefix:])
    pos = torch.arange(num_prefix, len(prompt))
    with torch.no_grad():
        hidden = runner.model.forward_layerwise(new, pos, load_layer, emit_layer)
        ours = runner.model.compute_logits(hidden[-1:])[0]
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    assert loaded == list(range(len(runner.model.layers)))  # strictly one layer after another
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    # The emitted KV equals what the paged path writes for those tokens.
    assert engine.kv.allocate(req, len(prompt) - num_prefix)
    runner.execute(SchedulerOutput([req], [len(prompt) - num_prefix]))
    new_slots = torch.tensor([req.page_ids[p // ps] * ps + p % ps for p in range(num_prefix, len(prompt))])
    for i, (k, v) in emitted.items():
        k_cache, v_cache = runner._kv_views[i]
        torch.testing.assert_close(k, k_cache[new_slots], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, v_cache[new_slots], rtol=1e-5, atol=1e-5)
    engine.abort(req.request_id)
    engine.check_integrity()
