"""The layerwise PD prefill and the DualPath read paths (PE and DE) at their edges (a review,
2026-12-02, fourth session; each test failed before its fix): the layerwise lane keeps the decode's
pool finite, and a request id used again still gets its blocks written back."""

from __future__ import annotations

import math
import threading

import pytest
import torch

import tests.test_pd_roles as pd_roles
from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig
from pdserve.disagg.state import new_room
from pdserve.engine.llm_engine import LLMEngine
from tests.test_hf_equivalence import _overflowing_checkpoint
from tests.test_pd_roles import Pair, _submit_read_path, _with_store

pytestmark = pytest.mark.timeout(120)

OVERFLOW_TOKEN = 7  # layer-0 V of this token overflows to inf in float16 (tests/test_hf_equivalence)


def _fp16_engine(ckpt, num_pages=64, budget=64, page_size=4):
    return LLMEngine(
        EngineConfig.create(
            ckpt, dtype="float16", device="cpu", page_size=page_size, num_pages=num_pages,
            max_model_len=256, max_num_batched_tokens=budget,
        )
    )  # fmt: skip


@pytest.mark.parametrize("read_path", ["pe", "de"])
def test_layerwise_lane_never_puts_non_finite_kv_into_the_decode_pool(tmp_path, monkeypatch, read_path):
    """The paged path writes `nan_to_num(k/v)` into the pool (model/attention.py: the pool holds
    finite values only, else SDPA's 0 weight x inf = NaN leaks into OTHER requests' decode steps).
    The layerwise lane (pd_layerwise.py `emit` -> `_send_layer`) sent the miss tokens' raw K/V to the
    decode, so a request whose fp16 activations overflowed leaves inf in the decode's pool (and in
    the store, by write-back). A later, unrelated request that reuses one of those pages as its
    growth page then decodes token 0 with NaN logprobs. Through the ordinary PD path (read_path
    none) the same sequence gives the colocated engine's tokens."""
    model = tmp_path / "model"
    _overflowing_checkpoint(model, OVERFLOW_TOKEN)
    monkeypatch.setattr(pd_roles, "make_engine", _fp16_engine)
    p = Pair(str(model), copy_bytes=True)
    store = _with_store(p, tmp_path / "store")
    try:
        g = torch.Generator().manual_seed(0)
        context = [t for t in torch.randint(0, 256, (80,), generator=g).tolist() if t != OVERFLOW_TOKEN][:40]
        other = [t for t in torch.randint(0, 256, (80,), generator=g).tolist() if t != OVERFLOW_TOKEN][:40]
        # Turn 1 stores the 40-token context (5 blocks of 8 tokens).
        p.submit_both(context, 1, "seed")
        p.drive(lambda: p.idle())
        p.de_role.store.flush()
        p.de_engine.kv.pool.reset_prefix_cache()
        p.pe_engine.kv.pool.reset_prefix_cache()
        # Turn 2: the stored context + 8 new tokens (the overflowing one among them) via the layerwise lane.
        pages_sent = p.pe_role.num_pages_sent
        _submit_read_path(p, context + [1, OVERFLOW_TOKEN] * 4, 1, "r1", read_path)
        p.drive(lambda: p.idle())
        assert p.pe_role.layerwise.num_runs == 1
        # (the pages it wrote counted as sent, as the paged lane counts them: the metric missed them;
        # all 12 on the PE path, the 2 past the 10 the decode read itself on the DE path)
        assert p.pe_role.num_pages_sent == pages_sent + (12 if read_path == "pe" else 2)
        p.de_engine.kv.pool.reset_prefix_cache()  # (its pages are free for the next request)
        kv = p.de_engine.runner.kv_cache
        finite = all(bool(torch.isfinite(t).all()) for t in (*kv.k, *kv.v))
        # An unrelated request: its growth page (page 10) is one that r1's miss tokens were written into.
        sp = SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True)
        p.submit_both(other, 6, "r2", logprobs=0)
        p.drive(lambda: p.idle())
        out = p.de_sink.final("r2").outputs[0]
        ref = LLM(str(model), dtype="float16", page_size=4, num_pages=64, max_model_len=256)
        ref_out = ref.generate({"prompt_token_ids": other}, sp)[0].outputs[0]
        assert finite, "the decode's KV pool holds inf/NaN written by the layerwise lane"
        assert all(math.isfinite(t.logprob) for t in out.logprobs), [t.logprob for t in out.logprobs]
        assert out.token_ids == ref_out.token_ids
    finally:
        store.close()
        p.close()


def test_a_request_id_used_again_gets_its_blocks_written_back(hf_checkpoints, tmp_path):
    """The count of blocks already queued for write-back was a table by request id (StoreConnector.
    persisted), cleared only by the decode's step hook for ids no longer in the engine. A request that ends at its
    first token (max_tokens 1, or EOS / a stop at token 1) is released in `_commit` without a step,
    so its entry stays; the next request under the same id (SGLang `/generate` `rid`, which the
    engines take as their request id) then counts its first blocks as already persisted and never
    writes them back: its next turn finds nothing in the store and recomputes the whole context."""
    p = Pair(hf_checkpoints["llama"][0], copy_bytes=True)
    store = _with_store(p, tmp_path)
    try:
        first, second = pd_roles.prompt(40, start=3), pd_roles.prompt(40, start=50)
        p.submit_both(first, 1, "rid-1")
        p.drive(lambda: p.idle())
        p.submit_both(second, 1, "rid-1")  # the same id, once the first one has ended
        p.drive(lambda: p.idle())
        assert p.de_role.store.flush()
        probe = p.de_engine.make_request(second, SamplingParams(max_tokens=1), "probe")
        stored = store.lookup_keys(p.de_role.store.keys_for(probe, 5))
        assert stored == 5, f"{stored} of the second prompt's 5 full blocks were written back"
    finally:
        store.close()
        p.close()


def _hold_reads(store, gate: threading.Event) -> None:
    """The store's reads wait for `gate`: the requests of one prompt all ask before the first read
    ends, as the n choices that arrive together do."""
    read_blocks = store.read_blocks

    def slow_read(*args):  # (the real read, once the gate opens)
        assert gate.wait(10)
        return read_blocks(*args)

    store.read_blocks = slow_read


def _submit_joined(p, role, ids, read_path, rids=("c0", "c1", "c2")) -> list[str]:
    """`rids` for the stored prompt `ids` (5 blocks), until all but the first joined the first's read
    (the decode reads once it admitted a request: a few turns)."""
    for rid in rids:
        _submit_read_path(p, ids, 3, rid, read_path)
    p.drive(lambda: role.store.reads.num_blocks_joined == (len(rids) - 1) * 5, timeout_s=5)
    return list(rids)


def _assert_colocated_tokens(p, hf_checkpoints, ids, rids, cached_tokens_storage: int) -> None:
    """Each of `rids` answered the colocated engine's greedy tokens, with that many stored tokens."""
    ref = LLM(hf_checkpoints["llama"][0], dtype="float32", page_size=pd_roles.PAGE_SIZE, num_pages=64)
    want = ref.generate(
        {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    )
    for rid in rids:
        out = p.de_sink.final(rid)
        assert out.outputs[0].token_ids == want[0].outputs[0].token_ids, rid
        assert out.metrics["cached_tokens_storage"] == cached_tokens_storage, rid


@pytest.mark.parametrize("read_path", ["pe", "de"])
def test_requests_of_one_prompt_read_its_stored_blocks_once(hf_checkpoints, tmp_path, read_path):
    """The `n` choices of one prompt reach one prefill together (router/app.Siblings), each in its own
    room. On the PE path each read the prompt's stored blocks again (n times the bytes over the
    node's storage NIC, the resource DualPath balances); on the DE path two requests of one prompt
    on one decode did too. A read of blocks that a read in flight covers now joins it: one read,
    the same buffer, every request the colocated engine's tokens, its stored tokens reported."""
    p = Pair(hf_checkpoints["llama"][0], copy_bytes=True)
    store = _with_store(p, tmp_path)
    role = p.pe_role if read_path == "pe" else p.de_role
    try:
        ids = pd_roles._stored_turn(p, store, "seed")  # 47 tokens: 5 stored blocks of 8
        gate = threading.Event()
        _hold_reads(store, gate)
        before = store.stats().read_ok_blocks
        rids = _submit_joined(p, role, ids, read_path)
        assert role.store.reads.num_in_flight == 1
        gate.set()
        # (the read's entries go when its future's callback ran, just after the engine saw it done)
        p.drive(lambda: p.idle() and role.store.reads.num_in_flight == 0)
        assert store.stats().read_ok_blocks - before == 5  # (it was 15: three reads of 5)
        _assert_colocated_tokens(p, hf_checkpoints, ids, rids, cached_tokens_storage=40)
        if read_path == "pe":
            assert p.pe_role.layerwise.num_runs == 3
        assert p.pe_role.store.reads.num_blocks_bad == p.de_role.store.reads.num_blocks_bad == 0
        p.assert_clean()
    finally:
        store.close()
        p.close()


def test_a_choice_that_arrives_after_the_first_choices_read_ended_joins_it(hf_checkpoints, tmp_path):
    """PE path: the prefill starts a request's store read when the request arrives, before the decode's
    KVRequest; the read can end, and the first choice wait for that KVRequest, before the other
    choices of its prompt reach the engine thread (after a long step). They read the stored blocks
    again: the ended read had left the index, and the first choice kept only its buffer. It keeps
    its read until its layerwise run takes the buffer, and a later choice joins it: one read, the
    colocated engine's tokens for both, each with its stored tokens."""
    p = Pair(hf_checkpoints["llama"][0], copy_bytes=True)
    store = _with_store(p, tmp_path)
    try:
        ids = pd_roles._stored_turn(p, store, "seed")  # 47 tokens: 5 stored blocks of 8
        before = store.stats().read_ok_blocks
        rooms = {rid: new_room() for rid in ("c0", "c1")}
        halves = {rid: p.requests(ids, 3, rid, room) for rid, room in rooms.items()}
        for preq, dreq in halves.values():
            preq.read_path = dreq.read_path = "pe"
        p.pe_role.add(halves["c0"][0], None)  # (its decode half waits: no KVRequest yet)
        first = p.pe_role.by_room[rooms["c0"]]
        p.drive(lambda: first.store_hit is not None, decode=False)  # (its read ended, and was seen)
        assert p.pe_role.store.reads.num_in_flight == 0
        p.pe_role.add(halves["c1"][0], None)
        assert p.pe_role.store.reads.num_blocks_joined == 5
        for _, dreq in halves.values():
            p.de_role.add(dreq, None)
        p.drive(lambda: p.idle())
        assert store.stats().read_ok_blocks - before == 5  # (it was 10: the second read them again)
        _assert_colocated_tokens(p, hf_checkpoints, ids, ["c0", "c1"], cached_tokens_storage=40)
        p.assert_clean()
    finally:
        store.close()
        p.close()


@pytest.mark.parametrize("read_path", ["pe", "de"])
def test_joined_store_reads_count_once_in_the_engines_read_queue(hf_checkpoints, tmp_path, read_path):
    """The load report's `read_queue_tokens` (what DualPath placement balances the storage NICs by)
    summed every room's read, joined ones too: three requests of one prompt showed three times the
    tokens the one read moves (found by a review)."""
    from pdserve.engine.pd_load import load_report

    p = Pair(hf_checkpoints["llama"][0], copy_bytes=True)
    store = _with_store(p, tmp_path)
    role = p.pe_role if read_path == "pe" else p.de_role
    gate = threading.Event()
    try:
        ids = pd_roles._stored_turn(p, store, "seed")  # 5 stored blocks of 8 tokens
        _hold_reads(store, gate)
        _submit_joined(p, role, ids, read_path)
        assert role.store.reads.num_in_flight == 1
        report = load_report(role, "n0")
        assert report.read_queue_tokens == 5 * 8  # (it was 120)
        if read_path == "pe":
            # Tokens to compute: each room's prompt less the 40 being read (the scheduler books a
            # request's new tokens only; the report counted the hit too until it was loaded).
            assert (report.num_seqs, report.num_tokens) == (3, 3 * (len(ids) - 40))
        gate.set()
        p.drive(lambda: p.idle())
        assert load_report(role, "n0").read_queue_tokens == 0
        p.assert_clean()
    finally:
        gate.set()
        store.close()
        p.close()


@pytest.mark.parametrize("read_path", ["pe", "de"])
def test_a_bad_block_in_a_joined_read_is_counted_once_and_each_request_recomputes_from_it(
    hf_checkpoints, tmp_path, read_path
):
    """Three requests of one prompt share one read whose 4th block file was truncated: each takes the
    3 good leading blocks and recomputes the rest (the colocated engine's tokens), and the bad
    block is counted once, by the connector when the read ends (the roles counted it per request,
    and not at all for a read whose room was gone by then)."""
    from pdserve.store.block_store import block_path

    p = Pair(hf_checkpoints["llama"][0], copy_bytes=True)
    store = _with_store(p, tmp_path)
    role = p.pe_role if read_path == "pe" else p.de_role
    gate = threading.Event()
    try:
        ids = pd_roles._stored_turn(p, store, "seed")  # 5 stored blocks of 8 tokens
        probe = p.de_engine.make_request(ids, SamplingParams(max_tokens=1), "probe")
        with open(block_path(store.dir, role.store.keys_for(probe, 5)[3]), "r+b") as f:
            f.truncate(100)
        _hold_reads(store, gate)
        rids = _submit_joined(p, role, ids, read_path)
        gate.set()
        p.drive(lambda: p.idle() and role.store.reads.num_in_flight == 0)
        assert role.store.reads.num_blocks_bad == 1
        _assert_colocated_tokens(p, hf_checkpoints, ids, rids, cached_tokens_storage=3 * 8)
        p.assert_clean()
    finally:
        gate.set()
        store.close()
        p.close()


def test_no_tensor_outlives_its_requests_in_a_reference_cycle(hf_checkpoints, tmp_path):
    """Stored-prompt requests on both read paths and plain ones, with the cyclic GC off: once they end,
    nothing they used is cyclic garbage. A store read's future referred to the read through its
    done-callback, and the read to its future: every ended read kept its host buffer (the size of
    the request's stored hit) until the GC's next pass, which for objects that reached the oldest
    generation can be long (a probe of these roles found one buffer per read)."""
    import gc

    from pdserve.store.joined_reads import PendingRead

    p = Pair(hf_checkpoints["llama"][0], copy_bytes=True)
    store = _with_store(p, tmp_path)
    was_enabled = gc.isenabled()
    try:
        ids = pd_roles._stored_turn(p, store, "seed")
        p.drive(lambda: p.idle())
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)  # (what a collection finds is kept in gc.garbage to look at)
        for i, read_path in enumerate(["pe", "de", "pe", "de"]):
            _submit_read_path(p, ids, 3, f"r{i}", read_path)
            p.drive(lambda: p.idle())
        p.submit_both(list(range(5, 60)), 4, "plain")
        p.drive(lambda: p.idle())
        gc.collect()
        cyclic = [o for o in gc.garbage if isinstance(o, torch.Tensor | PendingRead)]
        assert cyclic == [], [type(o).__name__ for o in cyclic]
        p.assert_clean()
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()
        store.close()
        p.close()


@pytest.mark.parametrize("read_path", ["pe", "de"])
def test_a_stuck_store_read_is_left_behind_and_its_prompt_computed(hf_checkpoints, tmp_path, read_path):
    """A store read that hangs (a stuck disk or mount, not an error) held its request until the room's
    state deadline failed it (a 503: "prefill failed: deadline in WaitingForInput" on the PE path;
    the prefill's Bootstrapping deadline on the DE path), and the router's retry joined the same
    hung read and failed the same way (a review, 2026-12-04 late). Past `store_read_budget_s` the
    read is left behind and the prompt computed (the decode asks the prefill for all of it); a
    later request of that prompt reads anew rather than join the stuck read. Both answer the
    colocated tokens, and once the disk wakes up nothing is left held."""
    p = Pair(hf_checkpoints["llama"][0], copy_bytes=True, fake_clocks=True)
    store = _with_store(p, tmp_path)
    role = p.pe_role if read_path == "pe" else p.de_role
    gate = threading.Event()
    try:
        ids = pd_roles._stored_turn(p, store, "seed")  # 47 tokens: 5 stored blocks of 8
        _hold_reads(store, gate)
        held = store.read_blocks
        num_reads = [0]

        def counted(*args):
            num_reads[0] += 1
            return held(*args)

        store.read_blocks = counted
        budget_s = role.config.store_read_budget_s
        assert budget_s == pd_roles.DEADLINE_S / 2
        for n, rid in enumerate(("a", "b"), start=1):
            # (only the store holds the prompt: "a"'s computed pages are in neither prefix cache, once
            # both halves have let them go)
            p.drive(lambda: p.idle())
            p.pe_engine.kv.pool.reset_prefix_cache()
            p.de_engine.kv.pool.reset_prefix_cache()
            _submit_read_path(p, ids, 3, rid, read_path)
            p.drive(lambda n=n: num_reads[0] == n)  # ("b" reads anew: it did not join "a"'s stuck read)
            assert role.store.reads.num_blocks_joined == 0
            p.settle(0.05)
            assert not any(o.finished for o in p.de_sink.outputs(rid))  # (waiting for the read)
            p.pe_clock.advance(budget_s + 0.01)
            p.de_clock.advance(budget_s + 0.01)
            p.drive(lambda rid=rid: any(o.finished for o in p.de_sink.outputs(rid)))
            assert p.pe_sink.errors(rid) == [] and p.de_sink.errors(rid) == []
            assert role.num_store_reads_left == n
        _assert_colocated_tokens(p, hf_checkpoints, ids, ["a", "b"], cached_tokens_storage=0)
        gate.set()  # (the disk wakes up: the reads left behind end, their buffers go)
        p.drive(lambda: p.idle() and role.store.reads.num_in_flight == 0)
        p.assert_clean()
    finally:
        gate.set()
        store.close()
        p.close()
