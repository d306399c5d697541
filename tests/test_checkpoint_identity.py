"""A checkpoint's identity keys its KV: two models of the same shape never share stored blocks or PD
pages, and copies of one checkpoint do (`checkpoint_digest`, `model_identity`)."""

from __future__ import annotations

import json
import shutil

import pytest

from pdserve.model.demo import make_demo_model
from pdserve.model.loader import CheckpointError, checkpoint_digest


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


def _tensor_span(path, name: str) -> tuple[int, int]:
    """Byte range [begin, end) of one tensor inside a safetensors file."""
    data = path.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8 : 8 + header_len])[name]["data_offsets"]
    return 8 + header_len + begin, 8 + header_len + end


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_tuning_one_middle_layer_changes_the_digest(two_models, tmp_path, where):
    """A fine-tune of one layer (or a LoRA merge into it) changes that tensor throughout: the digest
    samples every tensor, not just the ends of each file (which missed 36 of the demo's 39 tensors)."""
    d = shutil.copytree(two_models[0], tmp_path / "m")
    path = d / "model.safetensors"
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    names = sorted(k for k in json.loads(path.read_bytes()[8 : 8 + header_len]) if ".layers." in k)
    begin, end = _tensor_span(path, names[len(names) // 2])  # a layer in the middle of the file
    at = {"start": begin, "middle": (begin + end) // 2, "end": end - 1}[where]
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))
    assert checkpoint_digest(d) != checkpoint_digest(two_models[0])


def test_a_config_edit_changes_the_digest(two_models, tmp_path):
    d = shutil.copytree(two_models[0], tmp_path / "m")
    cfg = d / "config.json"
    cfg.write_text(cfg.read_text().replace("{", '{"note": 1, ', 1))
    assert checkpoint_digest(d) != checkpoint_digest(two_models[0])


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (None, "not a safetensors file"),  # a header length past the end of the file
        (b"[1, 2]", "malformed"),
        (b'{"w": {"dtype": "F32"}}', "malformed"),
        (b'{"w": {"data_offsets": [0, 4096]}}', "outside the file"),
    ],
)
def test_a_file_that_is_not_safetensors_is_a_typed_error(tmp_path, header, message):
    path = tmp_path / "model.safetensors"
    if header is None:
        path.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    else:
        path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 16)
    with pytest.raises(CheckpointError, match=message):
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


def test_the_demo_tokenizers_training_text_is_the_same_everywhere():
    """The demo checkpoint is the same on every machine and interpreter only if its tokenizer is (the
    vocabulary size sets the weights' shapes): the training text is generated from a seed, never read
    from the interpreter's files. Trained on the standard library's sources, 3.11.2 and 3.11.7 gave
    different tokenizers, and tests tied to one failed on the other. This digest was the same on
    CPython 3.11.2, 3.11.7, 3.12.1 and 3.13.0; a deliberate change of the text updates it."""
    import hashlib

    from pdserve.model.demo import CORPUS_NUM_LINES, corpus_lines

    lines = corpus_lines()
    assert len(lines) == CORPUS_NUM_LINES and lines == corpus_lines()
    assert hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16] == "5e0e341e5369e919"
