"""Greedy tokens and logits of pdserve == Hugging Face `transformers` on the same checkpoint.

Prompts are served concurrently, with chunked prefill (a 32-token step budget), prefix-cache hits
(a second batch that extends prompts of the first) and, in one test, preemption (a pool too small
for the batch). HF runs each prompt alone, unpadded, so its result is the reference.
"""

from __future__ import annotations

import json

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.offline import hf_dtype_kw
from tests.conftest import ARCHS, requires_cuda, tiny_hf_model

MAX_NEW = 12


def hf_greedy(model, prompt: list[int], n: int = MAX_NEW) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


def prompts_for(seed: int, lengths=(3, 9, 16, 17, 40, 64, 77, 130)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_with_chunking_and_prefix_hits(arch, hf_checkpoints):
    path, hf = hf_checkpoints[arch]
    llm = LLM(path, page_size=4, dtype="float32", num_pages=400, max_num_batched_tokens=32, max_model_len=512)
    first = prompts_for(1)
    # Second batch: extensions of first-batch prompts (prefix hits) mixed with fresh prompts.
    second = [first[4] + [5, 6, 7], first[7][:100] + [1] * 9, first[5] + first[6]] + prompts_for(
        2, (5, 33, 70)
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    for batch, expect_hits in ((first, False), (second, True)):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
        for prompt, out in zip(batch, outs, strict=True):
            assert out.outputs[0].token_ids == hf_greedy(hf, prompt), (
                f"{arch}: prompt of {len(prompt)} tokens"
            )
            assert out.outputs[0].finish_reason == "length"
        if expect_hits:
            cached = [o.num_cached_tokens for o in outs]
            assert cached[:3] == [40, 100, 64], cached  # whole pages of the shared prefix
            assert cached[3:] == [0, 0, 0]
        llm.engine.check_integrity()
    assert llm.engine.kv.pool.num_used_pages == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_first_token_logprobs_match_hf(arch, hf_checkpoints):
    """Top-20 log-probs of the first generated token (computed after chunked prefill) vs HF."""
    path, hf = hf_checkpoints[arch]
    llm = LLM(path, page_size=4, dtype="float32", num_pages=400, max_num_batched_tokens=16, max_model_len=512)
    prompts = prompts_for(3, (7, 50, 90))
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=1, logprobs=20)
    )
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
        lp = out.outputs[0].logprobs[0]
        ids = [t for t, _ in lp.top]
        ours = torch.tensor([v for _, v in lp.top])
        assert ids == ref.topk(20).indices.tolist()
        torch.testing.assert_close(ours, ref[ids], rtol=1e-4, atol=1e-5)
        assert lp.logprob == pytest.approx(lp.top[0][1])


@pytest.mark.parametrize("arch", ARCHS)
def test_last_position_logits_match_hf(arch, hf_checkpoints):
    """The model's raw logits through the paged path (prefix in the pool, then the rest) vs HF."""
    path, hf = hf_checkpoints[arch]
    llm = LLM(path, page_size=4, dtype="float32", num_pages=64, max_model_len=512)
    prompt = prompts_for(4, (45,))[0]
    engine = llm.engine
    req = engine.make_request({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1))
    engine.add(req)
    # Compute the first 30 tokens, then run the last 15 by hand to capture the logits.
    assert engine.kv.allocate(req, 30)
    from pdserve.engine.scheduler import SchedulerOutput

    engine.runner.execute(SchedulerOutput([req], [30]))
    req.num_computed_tokens = 30
    assert engine.kv.allocate(req, 15)
    ids, pos, meta, wmasks, rows = engine.runner.prepare(SchedulerOutput([req], [15]))
    with torch.no_grad():
        hidden = engine.runner.model(ids, pos, engine.runner._kv_views, meta, wmasks)
        ours = engine.runner.model.compute_logits(hidden[-1:])[0]
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    engine.abort(req.request_id)
    engine.check_integrity()


def test_preemption_keeps_greedy_outputs(hf_checkpoints):
    """A pool too small for the batch forces preemption by recompute; tokens must not change."""
    path, hf = hf_checkpoints["llama"]
    llm = LLM(path, page_size=4, dtype="float32", num_pages=40, max_num_batched_tokens=64, max_model_len=256)
    prompts = prompts_for(5, (30, 41, 52, 35, 44))
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=30)
    )
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(o.metrics["num_preemptions"] > 0 for o in outs)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 30)
    llm.engine.check_integrity()


@pytest.mark.parametrize("variant", ["tied", "sharded"])
def test_tied_embeddings_and_sharded_checkpoints(variant, tmp_path):
    hf = tiny_hf_model("qwen2", tie=variant == "tied", seed=3)
    hf.save_pretrained(tmp_path, max_shard_size="100KB" if variant == "sharded" else "5GB")
    if variant == "sharded":
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("*.safetensors"))) > 2
    llm = LLM(str(tmp_path), page_size=8, dtype="float32", num_pages=64, max_model_len=512)
    prompts = prompts_for(6, (11, 37))
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_NEW)
    )
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_close_to_hf(dtype, tmp_path):
    """bf16/fp16: same checkpoint, HF loaded in the same dtype; top-5 logprobs agree to 2e-3 (they were
    compared at 0.05, a margin that came from HF's `.to(dtype)` rounding its RoPE frequencies)."""
    import transformers

    tiny_hf_model("llama", seed=4).to(getattr(torch, dtype)).save_pretrained(tmp_path)
    # Loaded in the dtype (not `.to(dtype)`, which also rounds HF's RoPE inv_freq buffer to it).
    kw = {hf_dtype_kw(): getattr(torch, dtype)}
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, **kw).eval()
    llm = LLM(str(tmp_path), page_size=4, dtype=dtype, num_pages=64, max_model_len=512)
    assert llm.engine.runner.kv_cache.k[0].dtype == getattr(torch, dtype)
    prompt = prompts_for(7, (33,))[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1, logprobs=5))[
        0
    ]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    top = out.outputs[0].logprobs[0].top
    assert top[0][0] == int(ref.argmax())
    # Equal to the last bit on this machine (2026-11-30); the margin covers other CPUs' kernels.
    torch.testing.assert_close(
        torch.tensor([v for _, v in top]), ref[[t for t, _ in top]], rtol=0.0, atol=2e-3
    )


def test_half_precision_weights_are_never_held_in_float32_while_loading(tmp_path, monkeypatch):
    """Parameters were allocated in float32, filled, then cast: a bf16 model took twice its memory on
    the GPU while loading (found by a review). Every checkpoint tensor now lands in a parameter of the
    serving dtype, and the model is the same: its logprobs equal those of a float32 load cast to bf16."""
    from pdserve.model import loader

    tiny_hf_model("llama", seed=4).save_pretrained(tmp_path)  # a float32 checkpoint
    seen = []
    copy = loader._copy
    monkeypatch.setattr(
        loader, "_copy", lambda param, t, name: seen.append(param.dtype) or copy(param, t, name)
    )
    llm = LLM(str(tmp_path), page_size=4, dtype="bfloat16", num_pages=64, max_model_len=512)
    assert seen and set(seen) == {torch.bfloat16}
    model = llm.engine.runner.model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary.cos.dtype == torch.bfloat16  # the RoPE table as the whole-model cast left it
    monkeypatch.setattr(loader, "_copy", copy)
    ref = LLM(
        str(tmp_path), page_size=4, dtype="float32", num_pages=64, max_model_len=512
    ).engine.runner.model
    ref = ref.to(torch.bfloat16)  # what loading did before
    for (name, p), (_, q) in zip(model.state_dict().items(), ref.state_dict().items(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen2-no-layer-types", "llama"])
def test_sliding_window_matches_hf(arch, tmp_path):
    """A window (8 tokens) much shorter than the context, in prefill chunks and decode. Qwen2 configs
    saved before transformers 4.53 have no `layer_types` (derived from max_window_layers). Llama's
    attention has no window: a `sliding_window` key is ignored, so the reference is the same weights
    without it (transformers' modeling_llama.py never reads the key, though its generate truncates the
    cache to it while the prefill attends to everything). Both were read wrong once."""
    extra = {"sliding_window": 8}
    if arch.startswith("qwen2"):
        extra |= {
            "use_sliding_window": True,
            "max_window_layers": 1,
            "layer_types": ["full_attention", "sliding_attention"],
        }
    hf = tiny_hf_model(arch.removesuffix("-no-layer-types"), seed=8, **extra)
    hf.save_pretrained(tmp_path)
    if arch == "qwen2-no-layer-types":
        cfg = json.loads((tmp_path / "config.json").read_text())
        del cfg["layer_types"]
        (tmp_path / "config.json").write_text(json.dumps(cfg))
    expected = {"mistral": (8, 8), "llama": (None, None)}.get(arch, (None, 8))
    if arch == "llama":
        hf = tiny_hf_model("llama", seed=8)  # the same weights; what the architecture computes
    llm = LLM(
        str(tmp_path),
        page_size=4,
        dtype="float32",
        num_pages=128,
        max_num_batched_tokens=16,
        max_model_len=512,
    )
    assert llm.engine.config.model_config.sliding_windows == expected
    prompts = prompts_for(9, (6, 29, 51))
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_NEW)
    )
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt)


@requires_cuda
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_bf16_matches_hf(arch, hf_checkpoints):
    """On CUDA in bf16: first-token logprobs within bf16 tolerance of HF (same device, same dtype),
    and greedy tokens equal on most prompts (bf16 argmax near-ties may flip late tokens)."""
    path, _ = hf_checkpoints[arch]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, **{hf_dtype_kw(): torch.bfloat16}).cuda().eval()
    llm = LLM(
        path,
        page_size=4,
        dtype="bfloat16",
        device="cuda",
        num_pages=400,
        max_num_batched_tokens=32,
        max_model_len=512,
    )
    prompts = prompts_for(1)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5),
    )
    same = 0
    for prompt, out in zip(prompts, outs, strict=True):
        ref_tokens = hf.generate(
            torch.tensor([prompt], device="cuda"), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None
        )[0, len(prompt) :].tolist()
        same += out.outputs[0].token_ids == ref_tokens
        assert out.outputs[0].token_ids[0] == ref_tokens[0]
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt], device="cuda")).logits[0, -1].float(), -1).cpu()
        top = out.outputs[0].logprobs[0].top
        torch.testing.assert_close(
            torch.tensor([v for _, v in top]), ref[[t for t, _ in top]], rtol=0.05, atol=0.05
        )
    assert same >= len(prompts) - 1
    llm.engine.check_integrity()


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_bias_keys_the_hf_model_ignores_are_ignored(arch, tmp_path):
    """Mistral and Qwen2 never read `attention_bias` / `mlp_bias` (HF builds no such tensors and loads
    the checkpoint): we loaded bias parameters anyway and refused it for lacking them."""
    hf = tiny_hf_model(arch, seed=8, attention_bias=True, mlp_bias=True)
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["attention_bias"] is True
    llm = LLM(str(tmp_path), page_size=8, dtype="float32", num_pages=64, max_model_len=512)
    prompt = prompts_for(9, (21,))[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=MAX_NEW))[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt)


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_an_activation_other_than_silu_is_refused(act, tmp_path):
    """The decoder's MLP is SwiGLU; a config with another `hidden_act` ran as SiLU (every greedy token
    wrong against HF). Refused with the reason instead."""
    from pdserve.config import ConfigError

    tiny_hf_model("llama", seed=1, hidden_act=act).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=f"unsupported hidden_act '{act}'"):
        LLM(str(tmp_path), dtype="float32", num_pages=16, max_model_len=256)


@pytest.mark.parametrize(
    ("saved", "device", "expected"),
    [
        ("float16", "cuda", "float16"),  # an fp16 checkpoint stays fp16 on a GPU (vLLM, HF)
        ("bfloat16", "cuda", "bfloat16"),
        ("float32", "cuda", "bfloat16"),
        ("float16", "cpu", "float32"),  # the CPU runs float32, even on a machine with a GPU
        ("float16", "auto", "float16"),
        ("bfloat16", "cuda-pre-ampere", "float16"),  # no bf16 arithmetic before compute capability 8
        ("float32", "cuda-pre-ampere", "float16"),
    ],
)
def test_auto_dtype_follows_the_checkpoint_and_the_resolved_device(
    saved, device, expected, tmp_path, monkeypatch
):
    from pdserve import config

    tiny_hf_model("llama", seed=1).to(getattr(torch, saved)).save_pretrained(tmp_path)
    monkeypatch.setattr(config, "_cuda_available", lambda: True)  # as on a GPU machine
    old_gpu = device.endswith("-pre-ampere")
    monkeypatch.setattr(config, "_cuda_bf16_supported", lambda device: not old_gpu)
    device = device.removesuffix("-pre-ampere")
    cfg = config.EngineConfig.create(str(tmp_path), dtype="auto", device=device, num_pages=16)
    assert cfg.dtype == expected


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("use_sliding_window", [False, True])
def test_keys_a_config_leaves_out_mean_what_transformers_defaults_them_to(arch, use_sliding_window, tmp_path):
    """A config.json without `num_key_value_heads`, `head_dim`, `sliding_window` or
    `max_position_embeddings` (hand-written or converted; `save_pretrained` writes them all) is read
    as transformers reads it (and so vLLM): Mistral's window is 4,096 tokens, Qwen's kv heads 32, Qwen3's
    head_dim 128. Before, an absent window was none (every logit past 4,096 tokens differed from HF's)
    and the rest the generic fallbacks."""
    import transformers

    from pdserve.config import ModelConfig

    tiny_hf_model(arch).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    for key in (
        "num_key_value_heads",
        "head_dim",
        "sliding_window",
        "max_position_embeddings",
        "layer_types",
    ):
        raw.pop(key, None)
    raw["use_sliding_window"] = use_sliding_window
    raw["max_window_layers"] = 1  # (Qwen: layer 1 slides when the flag is on)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    ours = ModelConfig.from_dir(tmp_path)
    assert ours.num_kv_heads == hf.num_key_value_heads
    assert ours.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert ours.max_position_embeddings == hf.max_position_embeddings
    if arch == "llama":  # (its attention never reads the key)
        expected = (None, None)
    elif arch == "mistral":
        expected = (hf.sliding_window,) * 2
    else:
        expected = tuple(hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types)
    assert ours.sliding_windows == expected
    if arch == "mistral" or (arch != "llama" and use_sliding_window):
        assert 4096 in ours.sliding_windows


def _overflowing_checkpoint(path, x: int) -> None:
    """A float16 Llama whose layer-0 V overflows to inf for token `x` only (an fp16 activation
    overflow): x's embedding is one-hot in dim 0 (RMSNorm makes it 8) and v_proj row 0 reads it with
    weight 9000 (8 * 9000 > 65504). That V dimension never reaches other tokens' residual stream
    (the o_proj columns reading kv head 0's dim 0 are zero), so a prompt without x is well-defined."""
    hf = tiny_hf_model("llama", seed=1)
    with torch.no_grad():
        hf.model.embed_tokens.weight[x] = 0
        hf.model.embed_tokens.weight[x, 0] = 1.0
        attn = hf.model.layers[0].self_attn
        attn.v_proj.weight[0] = 0
        attn.v_proj.weight[0, 0] = 9000.0
        attn.o_proj.weight[:, 0] = 0  # (query heads 0 and 1 read kv head 0; head_dim 16)
        attn.o_proj.weight[:, 16] = 0
    hf.to(torch.float16).save_pretrained(path)


@pytest.mark.parametrize("company", ["batched (page table padded with page 0)", "alone (reused page's tail)"])
def test_one_requests_overflowed_kv_never_reaches_another_request(company, tmp_path):
    """Batched decode reads whole pages (the padding of a short page table points at page 0; a reused
    page's unwritten tail holds its last owner's slots) and hides them by the mask alone; SDPA's 0
    weight times an inf left there is NaN. A request whose fp16 activations overflowed turned a later,
    unrelated request's tokens to garbage (token 0, NaN logprobs): the pool now holds finite values only
    (found by a review; vLLM's kernels never read past a sequence's length)."""
    import math

    x = 7
    _overflowing_checkpoint(tmp_path, x)
    g = torch.Generator().manual_seed(0)
    b = torch.randint(0, 256, (5,), generator=g).tolist()
    c = torch.randint(0, 256, (40,), generator=g).tolist()
    assert x not in b + c
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    batched = company.startswith("batched")
    kw = dict(dtype="float16", page_size=4, num_pages=64, max_model_len=256, enable_prefix_caching=batched)
    alone = LLM(str(tmp_path), **kw).generate({"prompt_token_ids": b}, sp)[0].outputs[0]
    assert all(math.isfinite(t.logprob) for t in alone.logprobs)
    llm = LLM(str(tmp_path), **kw)
    if batched:  # (its pages stay cached, page 0 among them)
        llm.generate({"prompt_token_ids": [x] * 8 + [1, 2, 3]}, sp)
        out = llm.generate([{"prompt_token_ids": b}, {"prompt_token_ids": c}], sp)[0].outputs[0]
    else:  # (no prefix cache: its freed pages are reused at once, lowest id first)
        llm.generate({"prompt_token_ids": [x] * 8}, SamplingParams(temperature=0, max_tokens=1))
        out = llm.generate({"prompt_token_ids": b}, sp)[0].outputs[0]
    assert all(math.isfinite(t.logprob) for t in out.logprobs), [t.logprob for t in out.logprobs]
    assert out.token_ids == alone.token_ids
    llm.engine.check_integrity()
