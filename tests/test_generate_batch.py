"""`/generate` batches and `sampling_params.n` (SGLang's): one child request per prompt and sample,
answered as a list in order (child p·n + j), each exactly what a lone request for that prompt with
seed + j answers; streamed, each chunk carries its child's `index`. Bad input anywhere is a 400
before any child runs."""

from __future__ import annotations

import json

import pytest

from tests.conftest import post_in_process, run_in_process, until

TEXTS = ["def add(a, b):", "The capital of France is"]
SAMPLED = {"max_new_tokens": 6, "temperature": 1.0, "seed": 11}


def strip_ids(answer: dict) -> dict:
    """An answer without its request id (a child's and a lone request's ids differ)."""
    return {**answer, "meta_info": {k: v for k, v in answer["meta_info"].items() if k != "id"}}


def test_a_batch_with_n_samples_answers_each_as_a_lone_seeded_request(demo_engine):
    """2 prompts x n = 2, seeded: element p·2 + j equals /generate of prompt p alone with seed + j."""
    batch = {"text": TEXTS, "sampling_params": SAMPLED | {"n": 2}, "rid": "job"}
    lone = [
        {"text": t, "sampling_params": SAMPLED | {"seed": SAMPLED["seed"] + j}}
        for t in TEXTS
        for j in range(2)
    ]
    answers = post_in_process(demo_engine, [("/generate", batch)] + [("/generate", b) for b in lone])
    assert [a.status_code for a in answers] == [200] * 5
    merged, singles = answers[0].json(), [a.json() for a in answers[1:]]
    assert isinstance(merged, list) and len(merged) == 4
    assert [m["meta_info"]["id"] for m in merged] == ["job_0", "job_1", "job_2", "job_3"]
    assert [strip_ids(m) for m in merged] == [strip_ids(s) for s in singles]
    assert merged[0]["output_ids"] != merged[1]["output_ids"]  # (two seeds: two samples)


def test_per_prompt_sampling_params_token_ids_and_one_prompt_with_n(demo_engine):
    ids = demo_engine.tokenizer.encode(TEXTS[0])
    per_prompt = {
        "input_ids": [ids, ids[:3]],
        "sampling_params": [{"max_new_tokens": 2, "temperature": 0}, {"max_new_tokens": 5, "temperature": 0}],
    }
    one_prompt_n = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0, "n": 3}}
    a, b = post_in_process(demo_engine, [("/generate", per_prompt), ("/generate", one_prompt_n)])
    assert [m["meta_info"]["completion_tokens"] for m in a.json()] == [2, 5]
    assert [m["meta_info"]["prompt_tokens"] for m in a.json()] == [len(ids), 3]
    assert len(b.json()) == 3 and len({tuple(m["output_ids"]) for m in b.json()}) == 1  # (greedy)
    assert all(m["meta_info"]["id"].startswith("gen-") for m in b.json())  # (one base id: one abort)


def test_a_streamed_batch_tags_chunks_with_their_index_and_ends_as_the_whole_answer(demo_engine):
    body = {"text": TEXTS, "sampling_params": SAMPLED | {"n": 2}, "rid": "s"}

    async def scenario(c):
        whole = (await c.post("/generate", json=body)).json()
        events = []
        async with c.stream("POST", "/generate", json=body | {"stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        return whole, events

    whole, events = run_in_process(demo_engine, scenario)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["index"] for c in chunks} == {0, 1, 2, 3}
    last = {c["index"]: c for c in chunks}  # (each index's final chunk: the whole output)
    assert [{k: v for k, v in last[i].items() if k != "index"} for i in range(4)] == whole


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input_ids": [[5, 6], [5, 10**9]]}, "token ids"),
        ({"text": TEXTS, "sampling_params": [{"max_new_tokens": 2}]}, "one per prompt"),
        ({"text": "x", "sampling_params": [{"max_new_tokens": 2}]}, "one per prompt"),
        ({"text": TEXTS, "sampling_params": [{"n": 2}, {"n": 3}]}, "n must be the same"),
        ({"text": TEXTS, "sampling_params": [{"n": 1}, {"n": True}]}, "n must be an integer"),
        ({"text": TEXTS, "sampling_params": [{"n": 2}, {"n": 2.0}]}, "n must be an integer"),
        ({"text": TEXTS, "rid": ["", "b"]}, "each rid must have"),
        ({"text": "x", "sampling_params": {"n": 0}}, "n must be"),
        ({"text": TEXTS, "rid": ["a", "b", "c"]}, "2 distinct ids"),
        ({"text": TEXTS, "rid": ["a", "a"]}, "2 distinct ids"),
        ({"text": []}, "empty list"),
        ({"text": TEXTS, "sampling_params": [{"max_new_tokens": 2}, {"temperature": -1}]}, "temperature"),
    ],
)
def test_bad_input_anywhere_in_a_batch_is_a_400_before_any_child_runs(demo_engine, body, message):
    """(A child whose prompt is fine waits at the start gate until every sibling was checked: none
    reaches the engine, so no request finishes, not even as aborted.)"""

    def finished(metrics_text: str) -> float:
        rows = [
            line.split() for line in metrics_text.splitlines() if line.startswith("pdserve_requests_finished")
        ]
        return sum(float(row[-1]) for row in rows)

    async def scenario(c):
        before = finished((await c.get("/metrics")).text)
        r = await c.post("/generate", json=body)
        return r, before, finished((await c.get("/metrics")).text)

    r, before, after = run_in_process(demo_engine, scenario)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert after == before
    assert not demo_engine.requests and demo_engine.kv.pool.num_used_pages == 0


def test_a_batch_that_names_n_once_or_not_at_all_alike_and_an_empty_rid_as_none(demo_engine):
    body = {
        "text": TEXTS,
        "sampling_params": [{"n": 1, "max_new_tokens": 2}, {"max_new_tokens": 2}],
        "rid": "",
    }
    (r,) = post_in_process(demo_engine, [("/generate", body)])
    assert r.status_code == 200 and len(r.json()) == 2
    assert r.json()[0]["meta_info"]["id"].startswith("gen-")


def test_two_batches_with_one_rid_at_once_never_both_run_and_the_loser_gets_a_409(demo_engine):
    """The children of a batch hold their ids while they wait for their siblings' checks: a batch
    sent at the same time with the same rid is refused with a 409 (one or both), never a 400."""
    body = {"text": TEXTS * 8, "sampling_params": {"max_new_tokens": 2}, "rid": "twin"}

    async def scenario(c):
        import asyncio

        answers = await asyncio.gather(c.post("/generate", json=body), c.post("/generate", json=body))
        # A batch refused after some children started cancels them; their aborts reach the engine
        # thread a moment after the answer (before run_in_process stops it, or they would be lost).
        await until(lambda: not demo_engine.requests and demo_engine.kv.pool.num_used_pages == 0, 5.0)
        return answers

    answers = run_in_process(demo_engine, scenario)
    statuses = sorted(a.status_code for a in answers)
    assert statuses in ([200, 409], [409, 409]), [a.text for a in answers]
    assert not demo_engine.requests and demo_engine.kv.pool.num_used_pages == 0
