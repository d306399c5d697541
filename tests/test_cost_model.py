"""Model profiles from Hugging Face configs (`pdserve simulate --model path/to/config.json`)."""

from __future__ import annotations

import json

import pytest

from pdserve.dualpath.cost_model import (
    DS_660B,
    PROFILES,
    QWEN32B_PREFILL_S_PER_TOKEN,
    QWEN_32B,
    decode_attn_fn,
    decode_step_s,
    get_profile,
    prefill_request_fn,
    prefill_request_s,
    profile_from_hf_config,
)

# The published Qwen2.5-32B config's fields that the profile reads.
QWEN25_32B = {
    "hidden_size": 5120,
    "num_hidden_layers": 64,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "intermediate_size": 27648,
    "vocab_size": 152064,
    "torch_dtype": "bfloat16",
}

# DeepSeek-V3's MLA and MoE fields (bf16 checkpoint dtype).
DEEPSEEK_V3 = {
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "vocab_size": 129280,
    "torch_dtype": "bfloat16",
}


def test_gqa_config_gives_the_named_qwen_profile_kv_layout_and_speed():
    p = profile_from_hf_config(QWEN25_32B, name="qwen-from-config")
    # 2 (K, V) x 8 KV heads x 128 x 2 B = 4 KiB per token per layer, as the named profile.
    assert p.kv_bytes_per_token_layer == 4096 == QWEN_32B.kv_bytes_per_token_layer
    assert p.num_layers == 64 and p.kv_bytes_per_token == 64 * 4096
    # ~32 B activated parameters: within 3% of the anchor-fitted per-token prefill cost.
    assert p.prefill_s_per_new_token == pytest.approx(QWEN32B_PREFILL_S_PER_TOKEN, rel=0.03)
    assert p.prefill_ep_gpus == 1  # HF configs run as independent engines


def test_mla_moe_config_stores_the_latent_and_counts_active_experts_only():
    p = profile_from_hf_config(DEEPSEEK_V3)
    assert p.kv_bytes_per_token_layer == (512 + 64) * 2  # BF16 MLA: 1,152 B (notes/dualpath.md)
    # Activated MLP = top-8 + 1 shared expert, not all 256: far cheaper per token than a dense 671 B.
    dense_all = profile_from_hf_config({**DEEPSEEK_V3, "num_experts_per_tok": 256})
    assert p.prefill_s_per_new_token < dense_all.prefill_s_per_new_token / 10
    assert (
        profile_from_hf_config({**DEEPSEEK_V3, "torch_dtype": "float8_e4m3fn"}).kv_bytes_per_token_layer
        == 576
    )


def test_moe_config_puts_its_all_to_all_on_the_cnics_as_the_named_profile():
    """DeepEP per token per MoE layer: FP8 dispatch + bf16 combine, 3 B per hidden element; DeepSeek-V3's
    58 MoE layers (3 dense first) give ds-660b's 58 x 21 KiB. It was 0 (the dense profile's)."""
    p = profile_from_hf_config({**DEEPSEEK_V3, "first_k_dense_replace": 3})
    assert (
        p.model_cnic_bytes_per_prefill_token == DS_660B.model_cnic_bytes_per_prefill_token == 58 * 21 * 1024
    )
    assert p.model_cnic_bytes_per_decode_token == DS_660B.model_cnic_bytes_per_decode_token
    assert profile_from_hf_config(DEEPSEEK_V3).model_cnic_bytes_per_prefill_token == 61 * 7168 * 3
    assert profile_from_hf_config(QWEN25_32B).model_cnic_bytes_per_prefill_token == 0.0  # (dense)


def test_moe_config_spreads_its_experts_over_an_ep_group_that_leaves_half_the_hbm():
    """Per GPU: 34.2 GB of attention, shared expert and embeddings in bf16, plus 1/ep of 1.375 TB of
    routed experts; the smallest power of two with ≤ 70.5 GB (half an H200) is 64 (EP32: 77 GB). With
    fp8 weights (17.1 GB + 687.7 GB / ep) it is 16. A dense model stays on one GPU."""
    bf16 = profile_from_hf_config(DEEPSEEK_V3)
    fp8 = profile_from_hf_config({**DEEPSEEK_V3, "quantization_config": {"quant_method": "fp8"}})
    assert (bf16.prefill_ep_gpus, bf16.decode_ep_gpus) == (64, 64)
    assert (fp8.prefill_ep_gpus, fp8.decode_ep_gpus) == (16, 16)
    per_gpu_bf16 = 34_153_168_896 + 1_375_463_276_544 / 64
    assert bf16.decode_hbm_kv_bytes == int(141e9 - per_gpu_bf16 - 10e9)
    assert fp8.decode_hbm_kv_bytes > 70e9  # room for KV: before, the whole 1.4 TB counted on one GPU
    assert profile_from_hf_config(QWEN25_32B).decode_ep_gpus == 1


def test_kv_budget_follows_the_ep_group_a_run_uses():
    """A cluster smaller than the model's EP group holds more experts per GPU, so less KV; one too small
    for the weights at all is an error. Named profiles keep their documented budgets."""
    from pdserve.dualpath.cost_model import DS_660B, hbm_kv_bytes

    p = profile_from_hf_config(DEEPSEEK_V3)  # bf16: EP64
    full = hbm_kv_bytes(p, True, 64)
    assert full == p.decode_hbm_kv_bytes
    ep16 = hbm_kv_bytes(p, True, 16)
    assert full - ep16 == pytest.approx(1_375_463_276_544 * (1 / 16 - 1 / 64), rel=1e-9)
    with pytest.raises(ValueError, match="EP8 leave no HBM for KV.*: add nodes or use fp8 weights$"):
        hbm_kv_bytes(p, True, 8)
    # Already fp8: the refusal does not suggest fp8 (found by a new-user review, 2026-12-04).
    fp8 = profile_from_hf_config({**DEEPSEEK_V3, "quantization_config": {"quant_method": "fp8"}})
    assert fp8.fp8_weights and not p.fp8_weights
    with pytest.raises(ValueError, match=r"EP1 leave no HBM for KV \(the model asks for EP\d+\): add nodes$"):
        hbm_kv_bytes(fp8, True, 1)
    assert hbm_kv_bytes(DS_660B, False, 8) == DS_660B.prefill_hbm_kv_bytes
    # A named profile's budget stays fixed, but whether its weights fit a group is known.
    assert DS_660B.weights_fit(8) and not DS_660B.weights_fit(4)


def test_moe_detection_covers_mixtral_and_qwen_moe_and_caps_ep_at_the_expert_count():
    # Mixtral-8x22B: num_local_experts; 8 experts cap the group at 8 (before: sized as a dense model).
    mixtral = {
        "hidden_size": 6144,
        "num_hidden_layers": 56,
        "num_attention_heads": 48,
        "num_key_value_heads": 8,
        "intermediate_size": 16384,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32768,
        "torch_dtype": "bfloat16",
        "quantization_config": "not a dict",  # tolerated: no fp8 weights
    }
    p = profile_from_hf_config(mixtral)
    assert p.prefill_ep_gpus == 8 and p.routed_weight_bytes == 56 * 3 * 6144 * 16384 * 8 * 2
    # Qwen-MoE sizes its one shared expert with shared_expert_intermediate_size.
    qwen_moe = {**QWEN25_32B, "num_experts": 64, "moe_intermediate_size": 2560, "num_experts_per_tok": 8}
    with_shared = profile_from_hf_config({**qwen_moe, "shared_expert_intermediate_size": 20480})
    assert with_shared.other_weight_bytes - profile_from_hf_config(qwen_moe).other_weight_bytes == (
        64 * 3 * 5120 * 20480 * 2
    )


def test_a_bad_config_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("not json")
    with pytest.raises(ValueError, match="is not JSON"):
        get_profile(str(bad))
    bad.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="not an HF config.json: missing or bad 'num_hidden_layers'"):
        get_profile(str(bad))
    bad.write_text("[1, 2]")  # (was "missing or bad 'list' object has no attribute 'get'")
    with pytest.raises(ValueError, match="its top level is a JSON list, not an object"):
        get_profile(str(bad))


def test_get_profile_reads_a_config_file_or_its_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_32B))
    assert get_profile(str(tmp_path / "config.json")).kv_bytes_per_token_layer == 4096
    assert get_profile(str(tmp_path)).num_layers == 64
    assert get_profile("ds-660b").prefill_ep_gpus == 16
    # A mistyped path says so (it said "unknown model ... use one of [...]"); a mistyped name lists them.
    with pytest.raises(ValueError, match="missing.json': no such file"):
        get_profile(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match=r"unknown model 'ds-66b': use one of \['ds-27b'"):
        get_profile("ds-66b")


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_bound_cost_functions_give_the_reference_floats_exactly(name):
    """The simulator's hoisted copies (``prefill_request_fn``, ``decode_attn_fn`` + overhead + per
    sequence) must equal the reference formulas bit for bit: figures are compared to the last digit."""
    p = PROFILES[name]
    req, attn = prefill_request_fn(p), decode_attn_fn(p)
    for cached, new in ((0, 1), (0, 4096), (1000, 429), (33_000, 429), (200_000, 17)):
        assert req(cached, new) == prefill_request_s(p, cached, new)
    # Contexts below and above the sparse models' top-k, and an empty batch.
    for n, ctx in ((0, 0.0), (1, 500.0), (1, 33_000.0), (7, 7 * 1500.5), (64, 64 * 40_000.0)):
        step = p.decode_step_overhead_s + n * p.decode_s_per_seq + attn(n, ctx) if n else 0.0
        assert step == decode_step_s(p, n, ctx)
