"""Outputs of running requests: an O(1) view of the engine's growing lists, not a copy per step."""

from __future__ import annotations

import pytest

from pdserve.outputs import GrowingPrefix


def test_a_growing_prefix_sees_only_its_first_items():
    items = [10, 11, 12]
    view = GrowingPrefix(items)
    items += [13, 14]  # the engine appends after handing the view out
    assert len(view) == 3 and list(view) == [10, 11, 12] and view == [10, 11, 12] == view
    assert view[0] == 10 and view[-1] == 12 and view[1:] == [11, 12] and view[-2:] == [11, 12]
    assert view[::2] == [10, 12] and view[5:] == [] and view == (10, 11, 12) and view != [10, 11]
    assert view[::-1] == [12, 11, 10] and view[1::-1] == [11, 10] and view[::-2] == [12, 10]
    with pytest.raises(IndexError):
        view[3]
    with pytest.raises(IndexError):
        view[-4]
    assert repr(view) == "[10, 11, 12]" and GrowingPrefix(items, 5) == items


def test_running_outputs_are_views_of_that_step_and_finished_outputs_are_lists(demo_model_dir):
    from pdserve import SamplingParams
    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig.create(demo_model_dir, num_pages=64, max_model_len=512))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    engine.add(engine.make_request("def f(x):", params, "r"))
    running = []
    while engine.has_unfinished():
        (out,) = engine.step()
        o = out.outputs[0]
        if not out.finished:
            assert isinstance(o.token_ids, GrowingPrefix) and isinstance(o.logprobs, GrowingPrefix)
            running.append((o, list(o.token_ids)))
        else:
            assert type(o.token_ids) is list and type(o.logprobs) is list
    assert [len(o.token_ids) for o, _ in running] == [1, 2, 3, 4, 5]
    for o, seen in running:  # later steps appended to the engine's lists: each view still shows its step
        assert o.token_ids == seen and len(o.logprobs) == len(seen)
        assert o.token_ids == out.outputs[0].token_ids[: len(seen)]


def test_decode_page_tables_follow_growing_and_replaced_page_lists(demo_model_dir):
    """Each decoding request keeps its page ids as int64 across steps (converting every id of every
    row each step cost 7.8 ms at 64 x 32k tokens): a grown list is extended, a replaced one (pages
    freed, then allocated again) rebuilt."""
    from types import SimpleNamespace

    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    runner = LLMEngine(EngineConfig.create(demo_model_dir, num_pages=64, max_model_len=512)).runner
    ps = runner.page_size

    def req(rid, pages, tokens):
        return SimpleNamespace(request_id=rid, page_ids=pages, num_computed_tokens=tokens, page_id_row=None)

    def tables(reqs):
        groups = runner._decode_groups(reqs, list(range(len(reqs))))
        order = [int(i) for g in groups for i in g.rows]
        return {
            reqs[i].request_id: row.tolist() for g in groups for i, row in zip(order, g.pages, strict=True)
        }

    a, b, c = req("a", [5, 9], 2 * ps - 1), req("b", [7], ps - 1), req("c", [1, 2, 3], 3 * ps - 1)
    assert tables([a, b, c]) == {"a": [5, 9, 0], "b": [7, 0, 0], "c": [1, 2, 3]}
    a.page_ids.append(11)  # grew
    a.num_computed_tokens = 3 * ps - 1
    b.page_ids = [8, 4]  # freed and allocated again: a new list
    b.num_computed_tokens = 2 * ps - 1
    assert tables([a, b]) == {"a": [5, 9, 11], "b": [8, 4, 0]}
    assert a.page_id_row[1].tolist() == [5, 9, 11] and b.page_id_row[0] is b.page_ids  # kept, rebuilt
