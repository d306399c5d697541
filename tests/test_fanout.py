"""`n` > 1 merging (server/fanout.py) with hand-made children: exact merged bodies and streams, and
what happens to the other children when one fails (each failure path closes or cancels them)."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.responses import JSONResponse, StreamingResponse

from pdserve.server import fanout


def completion(i: int, text: str, completion_tokens: int) -> dict:
    return {
        "id": f"cmpl-{i}",
        "object": "text_completion",
        "created": 100 + i,
        "model": "m",
        "choices": [{"index": 0, "text": text, "finish_reason": "length", "logprobs": None}],
        "usage": {
            "prompt_tokens": 7,
            "completion_tokens": completion_tokens,
            "total_tokens": 7 + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": 4 if i == 0 else 0},
        },
    }


def test_merge_bodies_indexes_choices_and_counts_the_prompt_once():
    merged = fanout.merge_bodies([completion(0, "a", 3), completion(1, "b", 5)])
    assert merged["id"] == "cmpl-0" and merged["created"] == 100
    assert merged["choices"] == [
        {"index": 0, "text": "a", "finish_reason": "length", "logprobs": None},
        {"index": 1, "text": "b", "finish_reason": "length", "logprobs": None},
    ]
    assert merged["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 8,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_children_bodies_and_seeds():
    body = {"prompt": "x", "n": 3, "seed": 2**64 - 2, "temperature": 1.0}
    kids = fanout.child_bodies(body, 3)
    assert [k["seed"] for k in kids] == [2**64 - 2, 2**64 - 1, 0]  # wrapped into [-2**63, 2**64)
    assert all(k["n"] == 1 and k["prompt"] == "x" for k in kids)
    assert body["n"] == 3  # the client's body is not changed
    assert [k.get("seed") for k in fanout.child_bodies({"prompt": "x"}, 2)] == [None, None]
    assert fanout.child_seed("7", 1) == "7"  # refused by each child as by the parent
    for bad in (0, 65, True, "2", 1.0):
        with pytest.raises(ValueError, match="n must be"):
            fanout.num_choices(bad)
    assert fanout.num_choices(None) == 1 and fanout.num_choices(64) == 64


def test_a_prompt_lists_children_and_merged_usage_count_each_prompt_once():
    assert fanout.batch_of("x") is None and fanout.batch_of([1, 2]) is None and fanout.batch_of([]) is None
    assert fanout.batch_of(["x"]) is None and fanout.batch_of([[1, 2]]) is None  # (one prompt)
    assert fanout.batch_of(["x", "y"]) == ["x", "y"] and fanout.batch_of([[1], [2]]) == [[1], [2]]
    for bad in (["x", [1]], [[1], "x"], ["x", 1]):
        with pytest.raises(ValueError, match="every prompt of a list must be a string, or every one"):
            fanout.batch_of(bad)
    # (lists of one string each: the router's split made each a prompt an engine accepts, a 200 where
    # the engine and vLLM answer 400; found by a review of prompt lists)
    for bad in ([["hello"], ["world"]], [[5, 6], ["world"]], [[1], [True]], [[1], [2.0]]):
        with pytest.raises(ValueError, match="lists of integers only"):
            fanout.batch_of(bad)
    assert fanout.num_children(16, 64) == 1024 and fanout.num_children(1024, 1) == 1024
    with pytest.raises(ValueError, match="17 prompts x n=64: more than 1024"):
        fanout.num_children(17, 64)
    with pytest.raises(ValueError, match="1025 prompts: more than 1024"):
        fanout.num_children(1025, 1)
    assert fanout.parent_id("cmpl-x_3", 3) == "cmpl-x" and fanout.parent_id("cmpl-x_3") == "cmpl-x_3"
    assert fanout.base_request_id(None, "fresh") == "fresh" and fanout.base_request_id("job", "f") == "job"
    for bad in ("", 5, "x" * 252):
        with pytest.raises(ValueError, match="request_id of a request split"):
            fanout.base_request_id(bad, "fresh")
    assert fanout.base_request_id("x" * 251, "f") == "x" * 251  # (+ "_1023" = 256, the engines' limit)
    kids = fanout.child_bodies({"prompt": ["a", "b"], "n": 2, "seed": 5}, 2, ["a", "b"], "base")
    assert [k["request_id"] for k in kids] == ["base_0", "base_1", "base_2", "base_3"]
    assert [(k["prompt"], k["seed"], k["n"]) for k in kids] == [
        ("a", 5, 1),
        ("a", 6, 1),
        ("b", 5, 1),
        ("b", 6, 1),
    ]
    # Two prompts of 7 and 9 tokens, two choices each: the prompts count once each, details summed.
    parts = [completion(0, "a", 3), completion(1, "b", 5), completion(2, "c", 2), completion(3, "d", 1)]
    for p in parts[2:]:
        p["usage"] |= {"prompt_tokens": 9, "total_tokens": 9 + p["usage"]["completion_tokens"]}
        p["usage"]["prompt_tokens_details"] = {"cached_tokens": 8}
    merged = fanout.merge_bodies(parts, 2)
    assert [c["index"] for c in merged["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in merged["choices"]] == ["a", "b", "c", "d"]
    assert merged["usage"] == {
        "prompt_tokens": 16,
        "completion_tokens": 11,
        "total_tokens": 27,
        "prompt_tokens_details": {"cached_tokens": 12},
    }


def test_generate_children_in_sglangs_order_with_seeds_and_rids():
    """A /generate batch of two prompts with n = 2: child p·n + j is prompt p's sample j, n dropped,
    seed + j (per prompt's own params), `<rid>_<i>` or the client's rid list in order."""
    body = {"text": ["a", "b"], "sampling_params": [{"n": 2, "seed": 5}, {"n": 2, "top_k": 3}], "rid": "r"}
    n, children = fanout.generate_children(body | {"stream": True}, "fresh")
    assert n == 2
    assert [(c["text"], c["sampling_params"], c["rid"], c["stream"]) for c in children] == [
        ("a", {"seed": 5}, "r_0", True),
        ("a", {"seed": 6}, "r_1", True),
        ("b", {"top_k": 3}, "r_2", True),
        ("b", {"top_k": 3}, "r_3", True),
    ]
    n, children = fanout.generate_children({"input_ids": [[1], [2, 3]], "rid": ["x", "y"]}, "fresh")
    assert (n, [(c["input_ids"], c["rid"], c["sampling_params"]) for c in children]) == (
        1,
        [([1], "x", {}), ([2, 3], "y", {})],
    )
    n, children = fanout.generate_children({"input_ids": [7, 8], "sampling_params": {"n": 3}}, "fresh")
    assert n == 3 and [c["rid"] for c in children] == ["fresh_0", "fresh_1", "fresh_2"]
    assert all(c["input_ids"] == [7, 8] for c in children)


@pytest.mark.parametrize(
    "body",
    [{"text": "a"}, {"input_ids": [1, 2], "sampling_params": {"n": 1}}, {"text": "a", "input_ids": [1]},
     {}, {"text": "a", "sampling_params": "x"}, {"text": []}],
)  # fmt: skip
def test_one_prompt_one_sample_or_a_malformed_single_is_left_to_the_route(body):
    assert fanout.generate_children(body, "fresh") is None


@pytest.mark.parametrize(
    "body, param",
    [({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
     ({"text": "a", "sampling_params": [{}]}, "sampling_params"),
     ({"text": ["a", "b"], "sampling_params": [{}, 3]}, "sampling_params"),
     ({"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]}, "n"),
     ({"text": "a", "sampling_params": {"n": 65}}, "n"),
     ({"text": ["a"] * 1025}, "text"),
     ({"text": ["a", "b"], "rid": ["x"]}, "rid"),
     ({"text": ["a", "b"], "rid": ["x", "x"]}, "rid"),
     ({"text": ["a", "b"], "rid": ["x", 3]}, "rid"),
     ({"text": ["a", "b"], "rid": "x" * 252}, "rid")],
)  # fmt: skip
def test_a_split_that_cannot_be_made_names_its_field(body, param):
    with pytest.raises(fanout.BadSplit) as e:
        fanout.generate_children(body, "fresh")
    assert e.value.param == param


def test_the_start_gate_opens_when_every_child_passed_or_left():
    """Children wait at `validated()` until all have passed; one that ended without validating
    (left) does not hold them; outside a child `validated()` returns at once."""
    order: list[str] = []

    async def child(gate, name: str, validates: bool, delay_s: float):
        ticket = gate.ticket()
        fanout.CHILD_GATE.set(ticket)
        await asyncio.sleep(delay_s)
        if validates:
            await fanout.validated()
            order.append(f"{name} started")
        ticket.leave()  # (as the route does once its child answered)

    async def go():
        await fanout.validated()  # (no child here)
        gate = fanout.StartGate(3)
        tasks = [
            asyncio.ensure_future(child(gate, "a", True, 0.0)),
            asyncio.ensure_future(child(gate, "b", True, 0.05)),
            asyncio.ensure_future(child(gate, "c", False, 0.1)),  # returns early, never validates
        ]
        await asyncio.sleep(0.07)
        waiting = list(order)  # a and b passed, c not yet ended: nobody started
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        return waiting

    assert asyncio.run(go()) == [] and sorted(order) == ["a started", "b started"]


class Child:
    """A streamed child: yields `events` (SSE data payloads), with an optional pause; records whether
    its generator was closed before it finished (what aborts a request on its engine)."""

    def __init__(self, events: list, pause_s: float = 0.0) -> None:
        self.events, self.pause_s = events, pause_s
        self.closed_early = False
        self.finished = False

    async def gen(self):
        try:
            for e in self.events:
                await asyncio.sleep(self.pause_s)
                yield f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n"
            self.finished = True
        finally:
            self.closed_early = not self.finished

    async def response(self):
        return StreamingResponse(self.gen(), media_type="text/event-stream")


def chunk(i: int, text: str, finish=None) -> dict:
    return {"id": f"cmpl-{i}", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def usage_chunk(i: int, n: int) -> dict:
    return {"id": f"cmpl-{i}", "choices": [], "usage": completion(i, "", n)["usage"]}


async def collect(resp) -> list:
    out = []
    async for part in resp.body_iterator:
        out += [e[6:] for e in part.split("\n\n") if e.startswith("data: ")]
    return out


def test_streams_are_reindexed_with_one_id_one_usage_and_one_done():
    a = Child([chunk(0, "a1"), chunk(0, "a2", "length"), usage_chunk(0, 2), "[DONE]"])
    b = Child([chunk(1, "b1", "stop"), usage_chunk(1, 1), "[DONE]"])

    async def go():
        resp = await fanout.merged([a.response(), b.response()], stream=True, include_usage=True)
        return await collect(resp)

    events = asyncio.run(go())
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    objs = [json.loads(e) for e in events[:-1]]
    by_index: dict[int, str] = {}
    for o in objs[:-1]:
        (c,) = o["choices"]
        by_index[c["index"]] = by_index.get(c["index"], "") + c["text"]
    assert by_index == {0: "a1a2", 1: "b1"}
    assert {o["id"] for o in objs} == {objs[0]["id"]}
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 3
    assert objs[-1]["usage"]["total_tokens"] == 10
    assert a.finished and b.finished


def test_a_merged_stream_takes_the_parent_id_whichever_child_speaks_first():
    """Children `cmpl-x_<i>`: the stream's id is `cmpl-x` (what /abort_request takes for all of
    them), also when child 1's chunk comes first."""
    slow = Child([{"id": "cmpl-x_0", "choices": [{"index": 0, "text": "a"}]}, "[DONE]"], pause_s=0.05)
    fast = Child([{"id": "cmpl-x_1", "choices": [{"index": 0, "text": "b"}]}, "[DONE]"])

    async def go():
        resp = await fanout.merged([slow.response(), fast.response()], stream=True, include_usage=False)
        return await collect(resp)

    events = asyncio.run(go())
    objs = [json.loads(e) for e in events[:-1]]
    assert [o["choices"][0]["text"] for o in objs] == ["b", "a"] and {o["id"] for o in objs} == {"cmpl-x"}


def test_an_error_mid_stream_is_passed_on_and_closes_the_other_children():
    slow = Child([chunk(0, str(k)) for k in range(100)], pause_s=0.01)
    failing = Child([chunk(1, "x"), {"error": {"message": "decode stream broke", "code": 502}}, "[DONE]"])

    async def go():
        resp = await fanout.merged([slow.response(), failing.response()], stream=True, include_usage=True)
        return await collect(resp)

    events = asyncio.run(go())
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "decode stream broke"
    assert not any("usage" in json.loads(e) for e in events[:-1])
    assert slow.closed_early  # the other child was closed: its engine aborts it


def test_a_child_refused_up_front_fails_the_request_and_closes_the_rest():
    ok = Child([chunk(0, "a")] * 50, pause_s=0.01)

    async def refused():
        return JSONResponse({"error": {"message": "bad", "code": 400}}, 400)

    async def go():
        resp = await fanout.merged([ok.response(), refused()], stream=True, include_usage=False)
        return resp

    resp = asyncio.run(go())
    assert resp.status_code == 400 and json.loads(resp.body)["error"]["message"] == "bad"
    assert not ok.finished  # never read, and closed


def test_a_child_that_raises_cancels_the_others_and_the_error_propagates():
    cancelled = []

    async def slow():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def boom():
        await asyncio.sleep(0.01)
        raise RuntimeError("engine gone")

    async def go():
        await fanout.merged([slow(), boom()], stream=False, include_usage=False)

    with pytest.raises(RuntimeError, match="engine gone"):
        asyncio.run(go())
    assert cancelled == [True]


def test_non_streamed_children_relayed_as_streams_are_merged():
    async def relayed(i: int, n: int):
        async def body():
            yield json.dumps(completion(i, f"t{i}", n)).encode()

        return StreamingResponse(body(), media_type="application/json")

    async def go():
        return await fanout.merged([relayed(0, 2), relayed(1, 4)], stream=False, include_usage=False)

    resp = asyncio.run(go())
    data = json.loads(resp.body)
    assert [c["text"] for c in data["choices"]] == ["t0", "t1"] and data["usage"]["completion_tokens"] == 6
