"""Config and checkpoint files read as Hugging Face transformers reads them (a review of model support,
2026-12-02, fifth session: each test failed before its fix). RoPE blocks beside transformers 5's
`rope_parameters`, llama3 RoPE without `original_max_position_embeddings`, which safetensors files
are the checkpoint, and the unsupported-architecture message. Reference: transformers reading the
same directory (greedy tokens and first-token logprobs, float32)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import tiny_hf_model

pytestmark = pytest.mark.filterwarnings("ignore")


def _edit_config(path, fn) -> None:
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def _hf_from_dir(path):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _prompt(n: int, seed: int = 1, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _ours_vs_hf(path, hf, prompt, max_tokens=20):
    """(our greedy tokens, HF's greedy tokens, max |our top-5 logprob - HF's| of the first token)."""
    from pdserve import LLM, SamplingParams

    llm = LLM(
        str(path), page_size=4, dtype="float32", num_pages=256, max_num_batched_tokens=16, max_model_len=256
    )
    out = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5)
    )[0].outputs[0]
    with torch.no_grad():
        ref_lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), -1)
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None
        )
    err = max(abs(v - ref_lp[t].item()) for t, v in out.logprobs[0].top)
    return out.token_ids, ref[0, len(prompt) :].tolist(), err


# ---- 1. rope_scaling next to rope_parameters: the scaling is silently dropped ----------------------


def test_rope_scaling_added_to_a_v5_config_is_not_silently_ignored(tmp_path):
    """pdserve/config.py `_rope` (`params = {**scaling, **params}`): when config.json has both
    `rope_parameters` (what transformers >= 5 writes, with "rope_type": "default") and a
    `rope_scaling` entry (what the Qwen / Llama model cards tell users to add to config.json to extend
    the context), pdserve lets rope_parameters' "rope_type": "default" win key by key, so the scaling is
    silently dropped. transformers reads `rope_scaling` as the whole RoPE config (it replaces
    rope_parameters: `self.rope_parameters = rope_scaling or self.rope_parameters`).

    Here the scaling is a supported type (linear, factor 4; theta 10000 in both, so HF's reading is
    unambiguous). Expected: pdserve computes linear RoPE like HF. Before its fix: default RoPE, different
    logprobs/tokens for a 120-token prompt."""
    from pdserve.config import ModelConfig

    tiny_hf_model("llama", seed=5).save_pretrained(tmp_path)
    _edit_config(tmp_path, lambda c: c.update(rope_scaling={"type": "linear", "factor": 4.0}))
    assert json.loads((tmp_path / "config.json").read_text())["rope_parameters"]["rope_type"] == "default"
    hf = _hf_from_dir(tmp_path)
    assert hf.config.rope_parameters["rope_type"] == "linear"  # HF applies the scaling
    rope = ModelConfig.from_dir(tmp_path).rope
    ours, ref, err = _ours_vs_hf(tmp_path, hf, _prompt(120))
    assert err < 1e-4 and ours == ref, (
        f"pdserve reads {rope.rope_type!r} (factor {rope.factor}), HF 'linear'; first-token logprob "
        f"error {err:.3g}; tokens equal: {ours == ref}"
    )


def test_unsupported_rope_scaling_next_to_rope_parameters_is_refused(tmp_path):
    """pdserve/config.py `_rope`: a YaRN `rope_scaling` (unsupported: pdserve refuses
    {"rope_scaling": {"rope_type": "yarn"}} alone with ConfigError) is ACCEPTED without a word when the
    config.json also has `rope_parameters` ("rope_type": "default", as transformers >= 5 writes it),
    e.g. a Qwen3 fine-tune saved with transformers 5 to which a user added the YaRN block Qwen's model
    card prescribes. transformers then computes YaRN RoPE (scaled frequencies and an attention factor);
    pdserve computes plain RoPE: every logit past the first token differs, silently.
    Expected: ConfigError "unsupported rope_type 'yarn'". Before its fix: the engine starts."""
    from pdserve.config import ConfigError, ModelConfig

    tiny_hf_model("qwen3", seed=6).save_pretrained(tmp_path)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    _edit_config(tmp_path, lambda c: c.update(rope_scaling=yarn))
    assert json.loads((tmp_path / "config.json").read_text())["rope_parameters"]["rope_type"] == "default"
    assert _hf_from_dir(tmp_path).model.rotary_emb.rope_type == "yarn"  # what HF computes
    with pytest.raises(ConfigError, match="yarn"):
        rope = ModelConfig.from_dir(tmp_path).rope
        pytest.fail(f"accepted; pdserve computes {rope}")


# ---- 2. llama3 RoPE without original_max_position_embeddings ---------------------------------------


def test_llama3_rope_without_original_max_position_embeddings_matches_hf(tmp_path):
    """pdserve/config.py `_rope`: `original_max_position_embeddings` defaults to 8192 when the llama3
    rope block lacks it. transformers (>= 5; `standardize_rope_params`) defaults it to the config's
    `max_position_embeddings`, so for any hand-written / converted llama3 config without the key the
    frequency smoothing differs (low/high wavelength bounds 8192 and 2048 instead of 256 and 64 here).
    Expected: pdserve's logits equal HF's (atol 1e-4). Before its fix: they differ (a silent numeric divergence;
    pdserve neither matches HF nor refuses the config)."""
    from pdserve.config import ModelConfig

    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "rope_theta": 10000.0,
    }
    tiny_hf_model("llama", seed=7, rope_parameters=dict(rope), max_position_embeddings=256).save_pretrained(
        tmp_path
    )
    _edit_config(tmp_path, lambda c: c["rope_parameters"].pop("original_max_position_embeddings", None))
    hf = _hf_from_dir(tmp_path)
    assert hf.config.rope_parameters["original_max_position_embeddings"] == 256
    ours_cfg = ModelConfig.from_dir(tmp_path).rope
    ours, ref, err = _ours_vs_hf(tmp_path, hf, _prompt(120))
    assert err < 1e-4 and ours == ref, (
        f"original_max_position_embeddings: pdserve {ours_cfg.original_max_position_embeddings}, HF 256; "
        f"first-token logprob error {err:.3g}; tokens equal: {ours == ref}"
    )


# ---- 3. which files are the checkpoint: not HF's rule ------------------------------------------------


def test_stale_index_left_by_save_pretrained_does_not_break_loading(tmp_path):
    """pdserve/model/loader.py `safetensors_files`: an index file wins over `model.safetensors`. HF's
    rule is the reverse (`model.safetensors` first, the index only without it). transformers' own
    `save_pretrained` produces the case: save a model sharded into a directory, then save (e.g. an
    updated model) unsharded into the same directory: the old shards are removed but the old
    `model.safetensors.index.json` stays, pointing at files that no longer exist.
    Expected: pdserve loads `model.safetensors` (as HF does) and generates HF's tokens.
    Before its fix: the engine dies at start with a raw FileNotFoundError from safetensors
    (model-00001-of-0000N.safetensors), not even a CheckpointError."""
    from pdserve import LLM, SamplingParams

    tiny_hf_model("llama", seed=30).save_pretrained(tmp_path, max_shard_size="100KB")
    hf = tiny_hf_model("llama", seed=31)
    hf.save_pretrained(tmp_path)  # unsharded, same directory
    assert (tmp_path / "model.safetensors.index.json").is_file()  # stale, left by transformers
    assert not list(tmp_path.glob("model-0000*.safetensors"))
    assert torch.equal(_hf_from_dir(tmp_path).lm_head.weight, hf.lm_head.weight)  # HF loads it fine
    llm = LLM(str(tmp_path), page_size=4, dtype="float32", num_pages=64, max_model_len=128)
    prompt = _prompt(20)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=10))[0]
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()


def test_an_extra_safetensors_file_beside_model_safetensors_is_not_loaded(tmp_path):
    """pdserve/model/loader.py `safetensors_files`: without an index, every `*.safetensors` of the
    directory is read as part of the checkpoint. HF reads `model.safetensors` only, so a directory
    that also holds another safetensors file (Mistral repos ship a `consolidated.safetensors` in
    Mistral's own format; a PEFT `adapter_model.safetensors` left beside merged weights) loads in HF.
    Expected: pdserve loads model.safetensors like HF. Before its fix: CheckpointError "unexpected tensor
    'layers.0.attention.wq.weight' in consolidated.safetensors" (the model does not start)."""
    from safetensors.torch import load_file, save_file

    from pdserve import LLM

    hf = tiny_hf_model("mistral", seed=15)
    hf.save_pretrained(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    save_file(
        {"layers.0.attention.wq.weight": sd["model.layers.0.self_attn.q_proj.weight"].clone()},
        str(tmp_path / "consolidated.safetensors"),
    )
    _hf_from_dir(tmp_path)  # loads
    LLM(str(tmp_path), page_size=4, dtype="float32", num_pages=64, max_model_len=128)


# ---- 4. the unsupported-architecture message -------------------------------------------------------


def test_unsupported_architecture_error_does_not_call_it_a_wrong_type(tmp_path):
    """pdserve/config.py `ModelConfig.from_dir`: `UnsupportedArchitecture` (registry.py) is a ValueError,
    so from_dir's `except (TypeError, ValueError, AttributeError)` rewraps it as
    "<path>/config.json: a value of the wrong type (architecture 'GemmaForCausalLM' is not supported...)":
    the refusal is right but its first words blame a malformed value. Expected: a ConfigError that says
    the architecture is not supported (as the unsupported rope_type / hidden_act errors do, unwrapped).
    Before its fix: prefixed with "a value of the wrong type"."""
    from pdserve.config import ConfigError, ModelConfig

    raw = dict(
        architectures=["GemmaForCausalLM"],
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=256,
    )
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="not supported") as e:
        ModelConfig.from_dir(tmp_path)
    assert "wrong type" not in str(e.value), str(e.value)


# ---- a review of model loading (2026-12-04, evening) ------------------------------------------------


def test_rope_scaling_beside_a_saved_theta_takes_transformers_theta(tmp_path):
    """A v5 config (theta 1e6 inside `rope_parameters`) with a `rope_scaling` block added: transformers
    drops the saved block, theta with it, and uses the top level's or 10,000. We took the saved 1e6:
    greedy tokens and logprobs (2.15 off) other than HF's."""
    tiny_hf_model("qwen3", seed=5).save_pretrained(tmp_path)

    def edit(c):
        c["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
        c["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
        c.pop("rope_theta", None)

    _edit_config(tmp_path, edit)
    ours, ref, err = _ours_vs_hf(tmp_path, _hf_from_dir(tmp_path), _prompt(120))
    assert err < 1e-4 and ours == ref


def test_a_tied_config_with_a_distinct_lm_head_is_refused_and_an_equal_one_loads(tmp_path):
    """tie_word_embeddings true, and the checkpoint holds an lm_head.weight that is not the embedding:
    transformers unties them and uses that head; the head was dropped here without a word (every
    logit other than HF's). Now a CheckpointError says to fix the config; an equal head (some
    checkpoints store both) loads as before and matches HF."""
    from safetensors.torch import load_file, save_file

    from pdserve import LLM
    from pdserve.model.loader import CheckpointError

    tiny_hf_model("qwen2", seed=11, tie=True).save_pretrained(tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ours, ref, err = _ours_vs_hf(tmp_path, _hf_from_dir(tmp_path), _prompt(40))
    assert err < 1e-4 and ours == ref
    weights["lm_head.weight"] = torch.randn_like(weights["model.embed_tokens.weight"])
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="set tie_word_embeddings to false"):
        LLM(str(tmp_path), dtype="float32", num_pages=16, max_model_len=64)


def test_quantized_checkpoints_are_refused_with_a_clear_error(tmp_path):
    """A quantization_config loaded until its first scale tensor, a raw KeyError for a fused
    projection's (`q_proj.weight_scale`)."""
    from safetensors.torch import load_file, save_file

    from pdserve import LLM
    from pdserve.config import ConfigError
    from pdserve.model.loader import CheckpointError

    tiny_hf_model("llama", seed=1).save_pretrained(tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights["model.layers.0.self_attn.q_proj.weight_scale"] = torch.ones(1)
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match="unexpected tensor 'model.layers.0.self_attn.q_proj.weight_scale'"
    ):
        LLM(str(tmp_path), dtype="float32", num_pages=16, max_model_len=64)
    _edit_config(tmp_path, lambda c: c.update(quantization_config={"quant_method": "fp8"}))
    with pytest.raises(ConfigError, match=r"quantized checkpoints \(fp8\) are not supported"):
        LLM(str(tmp_path), dtype="float32", num_pages=16, max_model_len=64)
