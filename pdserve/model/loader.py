"""Load a Hugging Face checkpoint directory (`*.safetensors`, sharded or not) into `CausalLM`.

HF stores q/k/v and gate/up as separate matrices; we fuse them (one matmul each), so their rows are
concatenated here in the order the forward splits them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pdserve.config import ModelConfig
from pdserve.model.decoder import CausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# HF suffix -> (our parameter suffix, index of this part inside the fused tensor)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class CheckpointError(ValueError):
    pass


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's files, chosen as transformers chooses them: `model.safetensors` if there is
    one (a stale index that `save_pretrained` leaves beside it is ignored), else the shards the index
    names, else every `*.safetensors` file. (Every file was loaded beside `model.safetensors`: Mistral's
    `consolidated.safetensors` or a leftover adapter refused the checkpoint as unexpected tensors.)"""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    elif index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {str(model_dir)!r}")
    return files


CHECKPOINT_SAMPLE_BYTES = 512  # bytes hashed at the start, middle and end of every tensor


def checkpoint_digest(model_dir: str | Path) -> str:
    """A short, deterministic identity of a checkpoint's weights (16 hex chars, blake2b).

    KV written by one model must never be read by another with the same shape (a fine-tune, a LoRA
    merge, new weights after an upgrade): the KV store keys blocks by it, and PD peers compare it. It
    covers `config.json`, every safetensors file's size and header (tensor names, dtypes, shapes,
    offsets) and `CHECKPOINT_SAMPLE_BYTES` at the start, middle and end of *every tensor*: training
    changes a tensor's values throughout, so a tensor that was tuned at all changes the digest, even
    one layer of many. The cost is three small positioned reads per tensor (a 600 GB MoE with ~100 k
    tensors: ~150 MB in ~300 k reads, seconds on a warm cache), not a pass over the weights. Not detected: an edit confined to bytes no sample covers (a
    hand-patched element). Copies of one checkpoint at different paths agree (directories are not
    hashed).
    """
    model_dir = Path(model_dir)
    h = hashlib.blake2b(digest_size=8)

    def add(part: bytes) -> None:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)

    cfg = model_dir / "config.json"
    add(cfg.read_bytes() if cfg.is_file() else b"")
    n = CHECKPOINT_SAMPLE_BYTES
    for path in safetensors_files(model_dir):
        size = path.stat().st_size
        # Unbuffered positioned reads: a buffered file would fetch a whole I/O block (1-4 MiB on network
        # file systems) for every 512-byte sample.
        fd = os.open(path, os.O_RDONLY)
        try:
            header_len = int.from_bytes(os.pread(fd, 8, 0), "little")
            if header_len <= 0 or 8 + header_len > size:
                raise CheckpointError(f"{path.name} is not a safetensors file (header of {header_len} bytes)")
            header = os.pread(fd, header_len, 8)
            add(path.name.encode())
            add(size.to_bytes(8, "little"))
            add(header)
            data_start = 8 + header_len
            try:
                tensors = json.loads(header)
                spans = sorted((k, *v["data_offsets"]) for k, v in tensors.items() if k != "__metadata__")
            except (ValueError, TypeError, KeyError, AttributeError):
                raise CheckpointError(f"{path.name}: its safetensors header is malformed") from None
            for name, begin, end in spans:
                if not 0 <= begin <= end <= size - data_start:
                    raise CheckpointError(f"{path.name}: tensor {name!r} lies outside the file")
                middle = (begin + end) // 2
                for at in sorted({begin, max(begin, middle - n // 2), max(begin, end - n)}):
                    add(os.pread(fd, min(n, end - at), data_start + at))
        finally:
            os.close(fd)
    return h.hexdigest()


def load_model(
    model_dir: str | Path, cfg: ModelConfig, dtype: str, device: str, max_positions: int
) -> CausalLM:
    torch_dtype = DTYPES[dtype]
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions)
    # Parameters are allocated once, in the serving dtype: allocating them in float32 and casting at
    # the end took twice a bf16 model's memory on the GPU while loading (an 8B model: 32 GB, not 16).
    model = model.to(torch_dtype).to_empty(device=device)
    # Buffers (RoPE tables) were created on meta; rebuild them for real on the target device (computed
    # in float32, kept in the model's dtype, as the cast of the whole model used to leave them).
    with torch.device(device):
        from pdserve.model.layers import RotaryEmbedding

        model.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope).to(torch_dtype)
    load_weights_into(model, model_dir, cfg)
    return model.eval()


def _target(hf_name: str) -> tuple[str, int | None] | None:
    """Our parameter for a checkpoint tensor: (name, index of this part in a fused tensor or None);
    None for tensors we do not keep (RoPE caches)."""
    name = hf_name.removeprefix("model.")
    if "rotary_emb" in name:
        return None
    for hf_suffix, (ours, idx) in _FUSED.items():
        if f".{hf_suffix}." in f".{name}":
            kind = name.rsplit(".", 1)[1]  # weight | bias
            return name.replace(hf_suffix, ours).rsplit(".", 1)[0] + "." + kind, idx
    return name, None


def _entries(model_dir: str | Path, params: dict, cfg: ModelConfig):
    """(open file, checkpoint name, our parameter name, fused part index or None) of every tensor of
    the checkpoint we keep; CheckpointError for one the model has no parameter for."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                target = _target(hf_name)
                if target is None:
                    continue
                name, idx = target
                if name not in params:
                    if name == "lm_head.weight" and cfg.tie_word_embeddings:
                        continue  # (tied: the embedding is the head; `_check_tied_head`)
                    # (a fused target too: a quantized checkpoint's q_proj.weight_scale was a KeyError)
                    raise CheckpointError(f"unexpected tensor {hf_name!r} in {path.name}")
                yield f, hf_name, name, idx


def load_weights_into(model: CausalLM, model_dir: str | Path, cfg: ModelConfig) -> None:
    """Copy every tensor of the checkpoint into the model's parameters, in place (one tensor in memory
    at a time, but the parts of a fused one). CheckpointError for an unexpected, missing or misshapen
    one. On a serving model, call `check_checkpoint` first: a failure here (e.g. a file rewritten
    meanwhile) leaves a mix of old and new weights."""
    params = dict(model.named_parameters())
    fused_parts: dict[str, dict[int, torch.Tensor]] = {}
    loaded: set[str] = set()
    for f, hf_name, name, idx in _entries(model_dir, params, cfg):
        if idx is not None:
            fused_parts.setdefault(name, {})[idx] = f.get_tensor(hf_name)
            continue
        _copy(params[name], f.get_tensor(hf_name), hf_name)
        loaded.add(name)
    for target, parts in fused_parts.items():
        ordered = [parts[i] for i in sorted(parts)]
        _copy(params[target], torch.cat(ordered, dim=0), target)
        loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    if cfg.tie_word_embeddings:
        _check_tied_head(model_dir, params["embed_tokens.weight"])


def _check_tied_head(model_dir: str | Path, embedding: torch.Tensor) -> None:
    """A config that ties the embeddings, with an `lm_head.weight` in the checkpoint that is not the
    embedding: transformers then unties them and uses that head (warning that the config is wrong);
    the head was dropped here without a word, and every logit differed from HF's (a review,
    2026-12-04). CheckpointError, saying what to change."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            if "lm_head.weight" in f.keys():
                head = f.get_tensor("lm_head.weight").to(embedding.dtype)
                if tuple(head.shape) != tuple(embedding.shape) or not torch.equal(head, embedding.cpu()):
                    raise CheckpointError(
                        "config.json ties the word embeddings (tie_word_embeddings), but the checkpoint's "
                        "lm_head.weight differs from the embedding; transformers uses that head: set "
                        "tie_word_embeddings to false"
                    )
                return


def check_checkpoint(model: CausalLM, model_dir: str | Path, cfg: ModelConfig) -> None:
    """Raise CheckpointError unless loading `model_dir` into `model` would succeed: every tensor
    expected, present and of its shape (each part of a fused one too). Reads only the files'
    headers (no tensor data), so a bad checkpoint is refused before a weight of the model changes."""
    try:
        _check_headers(model, model_dir, cfg)
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError, SafetensorError) as e:
        raise CheckpointError(f"unreadable checkpoint {str(model_dir)!r}: {e!r}") from e


def _part_rows(name: str, idx: int, cfg: ModelConfig) -> int:
    """Rows of part `idx` of a fused parameter: q | k | v, or gate | up."""
    if "qkv_proj" in name:
        return (cfg.num_heads if idx == 0 else cfg.num_kv_heads) * cfg.head_dim
    return cfg.intermediate_size


def _check_headers(model: CausalLM, model_dir: str | Path, cfg: ModelConfig) -> None:
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    fused_rows: dict[str, dict[int, tuple]] = {}
    seen: set[str] = set()
    for f, hf_name, name, idx in _entries(model_dir, params, cfg):
        shape = tuple(f.get_slice(hf_name).get_shape())
        if idx is not None:
            fused_rows.setdefault(name, {})[idx] = shape
            continue
        if shape != params[name]:
            raise CheckpointError(f"{hf_name}: shape {shape} != expected {params[name]}")
        seen.add(name)
    for name, parts in fused_rows.items():  # (`_entries` refused any fusing into no parameter)
        want = params[name]
        num_parts = 3 if "qkv_proj" in name else 2
        for idx in range(num_parts):
            expected = (_part_rows(name, idx, cfg), *want[1:])
            if parts.get(idx) != expected:
                raise CheckpointError(f"{name} part {idx}: shape {parts.get(idx)} != expected {expected}")
        seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """Copy one tensor in; CheckpointError for another shape, or for a NaN or infinite value once in
    the serving dtype (a diverged trainer's checkpoint, or a bf16 value past float16's range): such
    weights answer garbage, or logprobs JSON cannot carry, while /health says ok. Checked on the
    parameter, on its device (one pass over memory the copy just wrote)."""
    if tuple(param.shape) != tuple(tensor.shape):
        raise CheckpointError(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))
        if not bool(torch.isfinite(param).all()):
            raise CheckpointError(f"{name}: holds NaN or infinite values (in {param.dtype})")
