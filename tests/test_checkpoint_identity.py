"""A checkpoint's identity keys its KV: two models of the same shape never share stored blocks or PD
pages, and copies of one checkpoint do (`checkpoint_digest`, `model_identity`)."""

from __future__ import annotations

import shutil

import pytest

from pdserve.model.demo import make_demo_model
from pdserve.model.loader import CHECKPOINT_SAMPLE_BYTES, CheckpointError, checkpoint_digest


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """The demo shape trained from two seeds: equal config, different weights."""
    return [str(make_demo_model(tmp_path_factory.mktemp(f"seed{s}"), seed=s)) for s in (0, 1)]


def test_same_shape_different_weights_differ_and_copies_agree(two_models, tmp_path):
    a, b = two_models
    assert checkpoint_digest(a) != checkpoint_digest(b)
    copy = shutil.copytree(a, tmp_path / "elsewhere")
    assert checkpoint_digest(copy) == checkpoint_digest(a)
    assert len(checkpoint_digest(a)) == 16 and checkpoint_digest(a) == checkpoint_digest(a)


@pytest.mark.parametrize("where", ["first", "last"])
def test_an_edit_in_the_sampled_bytes_changes_the_digest(two_models, tmp_path, where):
    d = shutil.copytree(two_models[0], tmp_path / "m")
    path = d / "model.safetensors"
    data = bytearray(path.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    i = header_end + 3 if where == "first" else len(data) - 3
    assert i >= header_end and (
        i < header_end + CHECKPOINT_SAMPLE_BYTES or i >= len(data) - CHECKPOINT_SAMPLE_BYTES
    )
    data[i] ^= 0x40
    path.write_bytes(bytes(data))
    assert checkpoint_digest(d) != checkpoint_digest(two_models[0])


def test_a_config_edit_changes_the_digest(two_models, tmp_path):
    d = shutil.copytree(two_models[0], tmp_path / "m")
    cfg = d / "config.json"
    cfg.write_text(cfg.read_text().replace("{", '{"note": 1, ', 1))
    assert checkpoint_digest(d) != checkpoint_digest(two_models[0])


def test_a_file_that_is_not_safetensors_is_a_typed_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        checkpoint_digest(tmp_path)


def test_models_of_one_shape_get_separate_store_keys_and_pd_fingerprints(two_models):
    """What the reviewer found: the store keyed blocks by shape only, so a fine-tune read another
    model's KV as valid hits. Now the store layout and the PD fingerprint carry the weights' digest;
    the store's key omits the page size, the PD fingerprint keeps it."""
    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.server.pd_context import layout_fingerprint, model_identity
    from pdserve.store.keys import block_keys
    from pdserve.store.layout import BlockLayout

    engines = [
        LLMEngine(EngineConfig.create(two_models[0], num_pages=64, max_model_len=256, page_size=16)),
        LLMEngine(EngineConfig.create(two_models[1], num_pages=64, max_model_len=256, page_size=16)),
        LLMEngine(EngineConfig.create(two_models[0], num_pages=64, max_model_len=256, page_size=32)),
    ]
    ids = [model_identity(e) for e in engines]
    assert ids[0] != ids[1] and ids[0] == ids[2]
    layouts = [
        BlockLayout.from_kv_layout(e.runner.kv_cache.layout, 64, model=i)
        for e, i in zip(engines, ids, strict=True)
    ]
    tokens = list(range(1, 130))
    keys = [block_keys(tokens, 64, lay.fingerprint) for lay in layouts]
    assert keys[0] != keys[1]  # another model's blocks are never hits
    assert keys[0] == keys[2]  # one model's engines share blocks whatever their page size
    fps = [layout_fingerprint(e, i) for e, i in zip(engines, ids, strict=True)]
    assert len(set(fps)) == 3  # PD peers need the same model and the same page layout
