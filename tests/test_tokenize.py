"""/tokenize and /detokenize: the engine's tokenizer and chat template, exactly as the generation
routes use them (a chat's count equals its completion's prompt_tokens), and bad input as 400s."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import post_in_process
from tests.test_tool_calls import HISTORY, TOOLS

MSGS = [{"role": "system", "content": "You are terse."}, *HISTORY]


def post_all(engine, requests: list[tuple[str, dict]]) -> list[httpx.Response]:
    return post_in_process(engine, requests, tool_call_parser="hermes")


def test_tokenize_equals_what_the_routes_compute(demo_engine):
    tok = demo_engine.tokenizer
    text = "def handler(request):\n    return request.body  # é"
    chat = {"messages": MSGS, "tools": TOOLS, "max_tokens": 1}
    plain, no_special, strs, msgs, msgs_no_gen, completion = post_all(
        demo_engine,
        [
            ("/tokenize", {"prompt": text}),
            ("/tokenize", {"prompt": text, "add_special_tokens": False}),
            ("/tokenize", {"prompt": text, "return_token_strs": True}),
            ("/tokenize", {"messages": MSGS, "tools": TOOLS}),
            ("/tokenize", {"messages": MSGS, "tools": TOOLS, "add_generation_prompt": False}),
            ("/v1/chat/completions", chat),
        ],
    )
    assert plain.json() == {
        "count": len(tok.encode(text)),
        "max_model_len": demo_engine.config.scheduler.max_model_len,
        "tokens": tok.encode(text),
    }
    assert no_special.json()["tokens"] == tok.encode(text, add_special_tokens=False)
    assert strs.json()["token_strs"] == [tok.decode([t], skip_special_tokens=False) for t in tok.encode(text)]
    # A chat's tokens are the prompt its completion computed (the agent's next turn extends these).
    assert msgs.json()["count"] == completion.json()["usage"]["prompt_tokens"]
    assert msgs_no_gen.json()["count"] < msgs.json()["count"]
    assert msgs.json()["tokens"][: msgs_no_gen.json()["count"]] == msgs_no_gen.json()["tokens"]
    (back,) = post_all(demo_engine, [("/detokenize", {"tokens": plain.json()["tokens"]})])
    assert back.json()["prompt"] == tok.decode(plain.json()["tokens"], skip_special_tokens=False)
    assert back.json()["prompt"].endswith(text)


@pytest.mark.parametrize(
    ("path", "body", "code", "word"),
    [
        ("/tokenize", {}, 400, "exactly one"),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "exactly one"),
        ("/tokenize", {"messages": []}, 400, "empty"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "bogus": 1}, 400, "bogus"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            400,
            "tool",
        ),
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "other"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "token ids"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
def test_bad_tokenize_requests_are_openai_errors(demo_engine, path, body, code, word):
    (r,) = post_all(demo_engine, [(path, body)])
    assert r.status_code == code, r.text
    err = r.json()["error"]
    assert word in err["message"] and err["code"] == code
