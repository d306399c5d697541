"""`POST /update_weights_from_disk` (an RL trainer's new checkpoint into a running engine) and
`POST /reset_prefix_cache`, through the app in process: outputs switch to the new weights exactly
(the same tokens as an engine loaded from them), the prefix cache computed with the old weights is
dropped, a checkpoint of another shape is refused with nothing changed, and requests in flight either
block the update (409) or are aborted by it."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.model import loader
from pdserve.model.demo import make_demo_model
from tests.conftest import run_in_process

PROMPT = "def handler(request, context):\n    return process(request.body)\n" * 3
KW = dict(num_pages=128, max_model_len=1024, page_size=16)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Same shape, other weights (seed 1): the trainer's next checkpoint; and a different shape."""
    root = tmp_path_factory.mktemp("ckpts")
    a = make_demo_model(root / "a", seed=0)
    b = make_demo_model(root / "b", seed=1)
    wide = make_demo_model(root / "wide", seed=0, hidden_size=320)
    return str(a), str(b), str(wide)


def greedy_ref(model_dir: str, n: int = 12) -> str:
    llm = LLM(model_dir, dtype="float32", **KW)
    return (
        llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0].text
    )


def completion(c: httpx.AsyncClient, n: int = 12, **kw):
    body = {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True} | kw
    return c.post("/v1/completions", json=body)


def run(engine: LLMEngine, scenario, **app_kw):
    return run_in_process(engine, scenario, **({"enable_weight_updates": True} | app_kw))


def test_new_weights_serve_exactly_what_an_engine_loaded_from_them_does(checkpoints):
    a, b, wide = checkpoints
    engine = LLMEngine(EngineConfig.create(a, dtype="float32", **KW))

    async def scenario(c):
        before = (await completion(c)).json()["choices"][0]["text"]
        refused = await c.post("/update_weights_from_disk", json={"model_path": wide})
        unchanged = (await completion(c)).json()["choices"][0]["text"]
        missing = await c.post("/update_weights_from_disk", json={"model_path": "/nonexistent"})
        extra = await c.post("/update_weights_from_disk", json={"model_path": b, "flush": 1})
        updated = await c.post("/update_weights_from_disk", json={"model_path": b})
        after = (await completion(c)).json()["choices"][0]["text"]
        reset = await c.post("/reset_prefix_cache")
        return before, refused, unchanged, missing, extra, updated, after, reset

    before, refused, unchanged, missing, extra, updated, after, reset = run(engine, scenario)
    assert before == greedy_ref(a)
    assert refused.status_code == 400 and "shape" in refused.json()["error"]["message"]
    assert unchanged == before  # a refused checkpoint changed nothing
    assert missing.status_code == 400 and extra.status_code == 400
    assert updated.status_code == 200, updated.text
    info = updated.json()
    assert info["success"] and info["num_weight_updates"] == 1
    assert info["num_cached_pages_dropped"] > 0  # the old weights' prompt pages went
    assert after == greedy_ref(b) and after != before
    assert reset.status_code == 200 and reset.json()["num_cached_pages_dropped"] > 0
    engine.check_integrity()
    assert engine.kv.pool.num_used_pages == 0


def test_requests_in_flight_block_the_update_or_are_aborted_by_it(checkpoints):
    a, b, _ = checkpoints
    engine = LLMEngine(EngineConfig.create(a, dtype="float32", **KW))

    async def scenario(c):
        long = asyncio.ensure_future(completion(c, n=600))
        for _ in range(500):  # until the engine holds it
            if engine.requests:
                break
            await asyncio.sleep(0.01)
        busy = await c.post("/update_weights_from_disk", json={"model_path": b})
        forced = await c.post("/update_weights_from_disk", json={"model_path": b, "abort_running": True})
        return busy, forced, await long

    busy, forced, long = run(engine, scenario)
    assert busy.status_code == 409 and "in flight" in busy.json()["error"]["message"]
    assert forced.status_code == 200 and forced.json()["num_requests_aborted"] == 1
    assert long.status_code == 200 and long.json()["choices"][0]["finish_reason"] == "abort"
    assert engine.kv.pool.num_used_pages == 0 and not engine.requests
    engine.check_integrity()


def test_weight_updates_are_off_unless_enabled(checkpoints):
    a, b, _ = checkpoints
    engine = LLMEngine(EngineConfig.create(a, dtype="float32", **KW))

    async def scenario(c):
        return await c.post("/update_weights_from_disk", json={"model_path": b})

    r = run(engine, scenario, enable_weight_updates=False)
    assert r.status_code == 403 and "--enable-weight-updates" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def broken(tmp_path_factory, checkpoints):
    """Checkpoints that must be refused: config.json not JSON; a weights file that is not safetensors;
    q and k of swapped sizes (the fused total is right, the parts are not)."""
    a = checkpoints[0]
    root = tmp_path_factory.mktemp("broken")
    bad_json = shutil.copytree(a, root / "bad_json")
    (bad_json / "config.json").write_text("{not json")
    bad_file = shutil.copytree(a, root / "bad_file")
    (bad_file / "model.safetensors").write_bytes(b"\x00" * 64)
    swapped = shutil.copytree(a, root / "swapped")
    tensors = load_file(str(swapped / "model.safetensors"))
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    rows_q, rows_k = tensors[q].shape[0], tensors[k].shape[0]
    both = torch.cat([tensors[q], tensors[k]])
    tensors[q], tensors[k] = both[:rows_k].contiguous(), both[rows_k:].contiguous()
    assert tensors[q].shape[0] == rows_k != rows_q
    save_file(tensors, str(swapped / "model.safetensors"), metadata={"format": "pt"})
    return [str(bad_json), str(bad_file), str(swapped)]


def test_unreadable_or_misshapen_checkpoints_are_400s_that_change_nothing(checkpoints, broken):
    a = checkpoints[0]
    engine = LLMEngine(EngineConfig.create(a, dtype="float32", **KW))

    async def scenario(c):
        before = (await completion(c)).json()["choices"][0]["text"]
        answers = [await c.post("/update_weights_from_disk", json={"model_path": p}) for p in broken]
        after = (await completion(c)).json()["choices"][0]["text"]
        return before, answers, after

    before, answers, after = run(engine, scenario)
    assert [r.status_code for r in answers] == [400, 400, 400], [r.text for r in answers]
    assert "part 0" in answers[2].json()["error"]["message"]
    assert after == before and engine.num_weight_updates == 0


def test_a_diverged_checkpoint_with_a_nan_weight_is_refused_and_the_old_weights_are_back(
    checkpoints, tmp_path
):
    """An RL step that diverged writes NaN weights of the right shapes: the headers pass, the copy finds
    the NaN (in the last layer: most weights are new by then), and the old weights are loaded back."""
    a = checkpoints[0]
    diverged = shutil.copytree(a, tmp_path / "diverged")
    tensors = load_file(str(diverged / "model.safetensors"))
    last = max(n for n in tensors if n.startswith("model.layers.") and n.endswith("mlp.down_proj.weight"))
    tensors[last][0, 0] = float("nan")
    save_file(tensors, str(diverged / "model.safetensors"), metadata={"format": "pt"})
    engine = LLMEngine(EngineConfig.create(a, dtype="float32", **KW))

    async def scenario(c):
        before = (await completion(c)).json()["choices"][0]["text"]
        refused = await c.post("/update_weights_from_disk", json={"model_path": str(diverged)})
        after = (await completion(c)).json()["choices"][0]["text"]
        health = await c.get("/health")
        return before, refused, after, health

    before, refused, after, health = run(engine, scenario)
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert f"{last}: holds NaN or infinite values" in message and "previous weights are back" in message
    assert after == before and health.status_code == 200 and engine.weights_dir == a
    with pytest.raises(loader.CheckpointError, match="NaN or infinite"):
        LLM(str(diverged), dtype="float32", **KW)  # (nor does an engine start on it)


def test_a_copy_that_fails_midway_restores_the_old_weights_or_takes_the_engine_out(checkpoints, monkeypatch):
    a, b, _ = checkpoints
    engine = LLMEngine(EngineConfig.create(a, dtype="float32", **KW))
    real = loader.load_weights_into
    fail_on = {b}

    def flaky(model, model_dir, cfg):
        real(model, model_dir, cfg) if model_dir not in fail_on else None
        if model_dir in fail_on:
            # Half of the new weights copied, then the file is gone (rewritten by the trainer).
            first = next(model.parameters())
            first.data.zero_()
            raise OSError("file changed while reading")

    monkeypatch.setattr(loader, "load_weights_into", flaky)

    async def scenario(c):
        before = (await completion(c)).json()["choices"][0]["text"]
        restored = await c.post("/update_weights_from_disk", json={"model_path": b})
        again = (await completion(c)).json()["choices"][0]["text"]
        fail_on.add(a)  # now the old checkpoint cannot be read back either
        lost = await c.post("/update_weights_from_disk", json={"model_path": b})
        health = await c.get("/health")
        refused = await completion(c)
        return before, restored, again, lost, health, refused

    before, restored, again, lost, health, refused = run(engine, scenario)
    assert restored.status_code == 400 and "previous weights are back" in restored.json()["error"]["message"]
    assert again == before
    assert lost.status_code == 503 and health.status_code == 503
    assert refused.status_code == 503 and "inconsistent" in refused.json()["error"]["message"]


def test_a_good_checkpoint_after_the_weights_were_lost_brings_the_engine_back(checkpoints, tmp_path):
    """The trainer writes every step over the directory the engine serves. A diverged step (a NaN
    weight) is refused midway, and the directory it failed to load held the served weights, so nothing
    is restored from it: the engine is weights-lost (503s; `/pd/info` says so too, which the router
    reads). The next good step loaded
    every tensor, answered 200 and still left every request a 503 until a restart (a review of weight
    updates); now it clears the state and serves exactly what an engine loaded from it does."""
    a, b, _ = checkpoints
    served = shutil.copytree(a, tmp_path / "latest")
    engine = LLMEngine(EngineConfig.create(str(served), dtype="float32", **KW))
    tensors = load_file(str(served / "model.safetensors"))
    last = max(n for n in tensors if n.startswith("model.layers.") and n.endswith("mlp.down_proj.weight"))
    tensors[last][0, 0] = float("nan")

    async def scenario(c):
        save_file(tensors, str(served / "model.safetensors"), metadata={"format": "pt"})
        lost = await c.post("/update_weights_from_disk", json={"model_path": str(served)})
        info = (await c.get("/pd/info")).json()
        refused = await completion(c)
        shutil.copy(f"{b}/model.safetensors", served / "model.safetensors")  # the next, good step
        recovered = await c.post("/update_weights_from_disk", json={"model_path": str(served)})
        after = await completion(c)
        health = await c.get("/health")
        return lost, info, refused, recovered, after, health, (await c.get("/pd/info")).json()

    lost, info, refused, recovered, after, health, info_after = run(engine, scenario)
    assert lost.status_code == 503 and refused.status_code == 503
    assert info["status"] == "weights lost" and "it held the served weights" in info["error"]
    assert recovered.status_code == 200, recovered.text
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == greedy_ref(b)
    assert health.status_code == 200 and info_after["status"] == "ok" and engine.weights_lost is None


def test_sglangs_own_update_fields_are_taken_as_sglang_means_them(checkpoints):
    """RL frameworks built on SGLang send its fields (a review of weight updates: each was a 400 and
    the old weights kept serving): `abort_all_requests` aborts what runs, `load_format` names the
    format (safetensors is what we read), `weight_version` labels the weights (reported by
    `/get_weight_version` and `/get_model_info`), `flush_cache` true (false is refused: old KV never
    meets new weights). A refusal carries SGLang's `success: false` and `message` too."""
    a, b, _ = checkpoints
    engine = LLMEngine(EngineConfig.create(a, dtype="float32", **KW))

    async def scenario(c):
        before = (await c.get("/get_weight_version")).json()
        long = asyncio.ensure_future(completion(c, n=600))
        for _ in range(500):
            if engine.requests:
                break
            await asyncio.sleep(0.01)
        body = {
            "model_path": b,
            "abort_all_requests": True,
            "load_format": "auto",
            "weight_version": "step-7",
            # (SGLang's own, at what SGLang clients send: each was a 400, "extra inputs")
            "is_async": False,
            "keep_pause": False,
            "torch_empty_cache": True,
            "recapture_cuda_graph": True,
        }
        updated = await c.post("/update_weights_from_disk", json=body)
        refused = [
            await c.post("/update_weights_from_disk", json={"model_path": a} | extra)
            for extra in (
                {"load_format": "pt"},
                {"flush_cache": False},
                {"weight_version": ""},
                {"is_async": True},
            )
        ]
        missing = await c.post(
            "/update_weights_from_disk", json={"model_path": "/no/such/dir", "load_format": None}
        )
        return (
            before,
            await long,
            updated,
            refused,
            missing,
            await c.get("/get_weight_version"),
            await c.get("/get_model_info"),
        )

    before, long, updated, refused, missing, version, info = run(engine, scenario)
    assert before == {"weight_version": "default"}
    assert updated.status_code == 200, updated.text
    assert updated.json()["num_requests_aborted"] == 1 and updated.json()["weight_version"] == "step-7"
    assert long.json()["choices"][0]["finish_reason"] == "abort"
    assert [r.status_code for r in refused] == [400] * 4
    assert "is_async" in refused[3].text  # (keep_pause: true is taken: tests/test_pause.py)
    assert "load_format 'pt'" in refused[0].text and "flush_cache" in refused[1].text
    assert missing.status_code == 400 and missing.json()["success"] is False
    assert missing.json()["message"] == missing.json()["error"]["message"]
    assert version.json() == {"weight_version": "step-7"} and info.json()["weight_version"] == "step-7"
    assert engine.weights_dir == b and engine.num_weight_updates == 1


def test_a_refused_update_body_carries_sglangs_success_false_and_message(checkpoints):
    """A body the request model refuses (an SGLang field's own check, a mistyped model_path) went
    through the app-wide validation answer, OpenAI's `error` alone: an SGLang client reading
    `["success"]` got a KeyError where other refusals carry it (a review of this session's changes)."""
    a = checkpoints[0]
    engine = LLMEngine(EngineConfig.create(a, dtype="float32", **KW))

    async def scenario(c):
        bodies = (
            {"model_path": a, "load_format": "pt"},
            {"model_path": a, "flush_cache": False},
            {"model_path": 3},
        )
        return [await c.post("/update_weights_from_disk", json=b) for b in bodies]

    answers = run(engine, scenario)
    assert [r.status_code for r in answers] == [400, 400, 400]
    for r in answers:
        assert r.json()["success"] is False and r.json()["message"] == r.json()["error"]["message"]


# ---- a review of the RL control routes (2026-12-04, evening) -------------------------------------------
def _lose_every_load(monkeypatch) -> None:
    """Every load fails midway, after zeroing a parameter: the update's restore fails too."""

    def broken(model, model_dir, cfg):
        next(model.parameters()).data.zero_()
        raise OSError("file changed while reading")

    monkeypatch.setattr(loader, "load_weights_into", broken)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_requests_kept_or_held_across_a_pause_never_run_on_lost_weights(checkpoints, monkeypatch, mode):
    """Paused in place (or retracted), an update fails and its restore too: the engine refused new
    requests (503) but the kept request and one held by the pause finished as 200s on the broken
    weights after /continue_generation. The kept one now ends as an abort, the held one a 503."""
    from tests.conftest import until

    a, b, _ = checkpoints
    engine = LLMEngine(EngineConfig.create(a, dtype="float32", **KW))

    async def scenario(c):
        kept = asyncio.ensure_future(completion(c, 200))
        await until(lambda: any(r.num_output_tokens >= 3 for r in engine.requests.values()))
        await c.post("/pause_generation", json={"mode": mode})
        held = asyncio.ensure_future(completion(c, 8))  # validated now, waits for the pause to end
        await until(lambda: c._transport.app.state.engine.num_held >= 1)
        _lose_every_load(monkeypatch)
        update = await c.post("/update_weights_from_disk", json={"model_path": b})
        await c.post("/continue_generation")
        return update, await kept, await held

    update, kept, held = run(engine, scenario)
    assert update.status_code == 503
    assert kept.status_code == 200 and kept.json()["choices"][0]["finish_reason"] == "abort"
    assert held.status_code == 503 and "inconsistent" in held.json()["error"]["message"]


def test_a_failed_load_of_the_served_directory_is_not_restored_from_it(checkpoints, tmp_path, monkeypatch):
    """A trainer that rewrites one directory each step: the load of its new files failed midway, and the
    restore read the same directory -- the new files -- then answered "the previous weights are back"
    while serving the new ones (no update counted). Now the weights are lost (503s) until an update
    succeeds."""
    a, b, _ = checkpoints
    served = shutil.copytree(a, tmp_path / "latest")
    engine = LLMEngine(EngineConfig.create(str(served), dtype="float32", **KW))
    real = loader.load_weights_into
    calls = []

    def fails_once(model, model_dir, cfg):
        calls.append(model_dir)
        if len(calls) == 1:
            next(model.parameters()).data.zero_()
            raise OSError("file changed while reading")
        real(model, model_dir, cfg)

    async def scenario(c):
        shutil.copy(f"{b}/model.safetensors", served / "model.safetensors")  # the trainer's next step
        monkeypatch.setattr(loader, "load_weights_into", fails_once)
        failed = await c.post("/update_weights_from_disk", json={"model_path": str(served)})
        refused = await completion(c)
        again = await c.post("/update_weights_from_disk", json={"model_path": str(served)})
        return failed, refused, again, (await completion(c)).json()["choices"][0]["text"]

    failed, refused, again, text = run(engine, scenario)
    assert failed.status_code == 503 and calls[0] == str(served) and len(calls) == 2  # (no restore)
    assert refused.status_code == 503
    assert again.status_code == 200 and text == greedy_ref(b)


def test_a_request_held_by_a_pause_reports_the_weights_it_ran_on(checkpoints):
    """Paused; a `/generate` arrives and waits; the weights are updated to "v2"; generation goes on.
    The request ran on the new weights but its `meta_info.weight_version` said "default": the label
    was read when the request came in, and set only after the update's route returned (a review,
    2026-12-05; slime reads it to tell how off-policy a sample is). Streamed alike."""
    a, b, _ = checkpoints
    engine = LLMEngine(EngineConfig.create(a, dtype="float32", **KW))
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}

    async def scenario(c):
        assert (await c.post("/pause_generation", json={})).status_code == 200
        held = asyncio.ensure_future(c.post("/generate", json=body))
        streamed = asyncio.ensure_future(c.post("/generate", json=body | {"stream": True}))
        for _ in range(500):
            if aengine_held(c) >= 2:
                break
            await asyncio.sleep(0.01)
        updated = await c.post("/update_weights_from_disk", json={"model_path": b, "weight_version": "v2"})
        assert updated.status_code == 200, updated.text
        assert (await c.post("/continue_generation", json={})).status_code == 200
        return await held, await streamed

    def aengine_held(c) -> int:
        return c._transport.app.state.engine.num_held  # (the AsyncEngine: requests waiting in a pause)

    held, streamed = run(engine, scenario)
    assert held.status_code == 200 and held.json()["meta_info"]["weight_version"] == "v2", held.text
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert chunks and all(ch["meta_info"]["weight_version"] == "v2" for ch in chunks)
