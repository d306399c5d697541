"""Text that a stream shows and then takes back, found by a review of text output (2026-12-02, sixth
session); each test failed before its fix. With a byte-fallback vocabulary (Llama 2, Mistral),
tokenizers' ByteFallback decoder renders an open run of byte tokens as one U+FFFD per byte, complete
characters earlier in the run included ("ok😀" + the first byte of "😁" decodes to "ok" + 5 x U+FFFD),
so the decoder's text is not monotonic; the engine's shown text is (`LLMEngine._shown_text`). Also the
hold-back of a stop string's start before a partial character, and chat logprobs' `bytes` of
byte-level tokens. The tests reuse the scripted sampler and the Llama-2-style tokenizer fixture of
tests/test_text_semantics.py, and the demo model's byte-level BPE."""

from __future__ import annotations

import json

from tests import test_text_semantics
from tests.conftest import post_in_process
from tests.test_text_semantics import ScriptedIds, byte_tokens, make_engine, sse

# (that module's fixtures, used here by name)
llama2_dir = test_text_semantics.llama2_dir
demo_dir = test_text_semantics.demo_dir


def _enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def whole_and_streamed(engine, body: dict, ids: list[int]) -> tuple[dict, str]:
    """The completion `body` asks for (the sampler drawing `ids`), whole and streamed: the whole
    answer's choice, and the stream's deltas joined."""
    whole, stream = post_in_process(
        engine,
        [("/v1/completions", body), ("/v1/completions", body | {"stream": True})],
        sampler=ScriptedIds(ids),
    )
    streamed = "".join(x["choices"][0]["text"] for x in sse(stream) if x.get("choices"))
    return whole.json()["choices"][0], streamed


# ---- 1 ----------------------------------------------------------------------------------------------
def test_generate_stream_never_takes_back_text_it_showed(llama2_dir):
    """SGLang's /generate stream is cumulative: every chunk's text extends the previous one, and
    SGLang's own client examples print `text[len(prev):]` per chunk. While the bytes of '😁' arrive
    after a complete '😀', the chunks go ' ok😀' -> ' ok' -> ... -> ' ok😀😁': the text shrinks
    (native_stream.CumulativeChunks re-encodes a text that no longer extends the last one), and such
    a client prints '😀' twice."""
    engine = make_engine(llama2_dir)
    tok = engine.tokenizer
    ids = _enc(tok, "ok") + byte_tokens(tok, "😀😁") + _enc(tok, " x")
    body = {
        "text": "def f",
        "sampling_params": {"max_new_tokens": len(ids), "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    (r,) = post_in_process(engine, [("/generate", body)], sampler=ScriptedIds(ids))
    texts = [c["text"] for c in sse(r)]
    printed, prev = "", 0
    for t in texts:  # (SGLang's documented streaming client)
        printed += t[prev:]
        prev = len(t)
    shrinks = [(a, b) for a, b in zip(texts, texts[1:], strict=False) if not b.startswith(a)]
    assert not shrinks and printed == texts[-1], (shrinks, printed, texts[-1])


# ---- 2 ----------------------------------------------------------------------------------------------
def test_min_tokens_text_inside_a_byte_fallback_run_does_not_count_as_new_text(llama2_dir):
    """min_tokens = 8 ends inside the bytes of '😁', after '😀' was complete (at token 6). vLLM checks
    stop strings only in text added after min_tokens, so stop '😀' never matches: the answer runs to
    max_tokens. pdserve re-measures the min_tokens text at every step below min_tokens as
    len(text.rstrip('\\ufffd')), and at token 8 the open run hides '😀' ('ok�����' -> 2 chars), so
    `num_min_text_chars` shrinks from 3 to 2 (LLMEngine.check_stop). When '😁' completes, '😀' at
    char 2 counts as a new match: the request stops with stop_reason '😀', and its text is cut
    before '😀' -- which the stream had already sent (stream ' ok😀', final ' ok')."""
    engine = make_engine(llama2_dir)
    tok = engine.tokenizer
    ok = _enc(tok, "ok")
    ids = ok + byte_tokens(tok, "😀😁") + _enc(tok, " x y")
    body = {
        "prompt": "def f",
        "max_tokens": len(ids),
        "temperature": 0,
        "ignore_eos": True,
        "stop": ["😀"],
        "min_tokens": len(ok) + 6,  # (2 of the 4 bytes of '😁')
    }
    c, streamed = whole_and_streamed(engine, body, ids)
    assert streamed == c["text"], (streamed, c["text"])
    assert (c["finish_reason"], c["stop_reason"]) == ("length", None), c
    assert c["text"].startswith(" ok😀😁"), c["text"]


# ---- 3 ----------------------------------------------------------------------------------------------
def test_completion_stream_deltas_add_up_to_the_final_text_after_an_invalid_byte_run(llama2_dir):
    """A sampler draws '😀' as 4 byte tokens, then a stray continuation byte <0x80>, then ' x'. The
    stream sends '😀' when it is complete; the stray byte then turns the whole run into 5 U+FFFD and
    the finished output (the full decode) says ' ok�����  x'. The stream's deltas, sliced from the
    new text at the old offsets (api.py `stream`), add up to ' ok😀����  x': the concatenation of
    the deltas is not the final text (vLLM's is, by construction), and a client that streams sees a
    different answer than one that does not."""
    engine = make_engine(llama2_dir)
    tok = engine.tokenizer
    ids = _enc(tok, "ok") + byte_tokens(tok, "😀") + [tok.token_id("<0x80>")] + _enc(tok, " x")
    body = {"prompt": "def f", "max_tokens": len(ids), "temperature": 0, "ignore_eos": True}
    choice, streamed = whole_and_streamed(engine, body, ids)
    final = choice["text"]
    assert streamed == final, (streamed, final)


# ---- 4 ----------------------------------------------------------------------------------------------
def test_chat_logprob_bytes_are_the_tokens_utf8_bytes(demo_dir):
    """OpenAI's chat logprobs `bytes`: the token's UTF-8 bytes, "useful where characters are
    represented by multiple tokens and their byte representations must be combined". The demo's
    byte-level BPE writes '中文' as 6 one-byte tokens; pdserve gives each the bytes of its decoded
    text, U+FFFD ([239, 191, 189]), so the bytes never combine into the answer
    (api.py chat_logprobs: list(token_str(t).encode())). (vLLM does the same; OpenAI does not.)"""
    engine = make_engine(demo_dir)
    tok = engine.tokenizer
    ids = _enc(tok, "x 中文")
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": len(ids),
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 1,
    }
    (r,) = post_in_process(engine, [("/v1/chat/completions", body)], sampler=ScriptedIds(ids))
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "x 中文"
    joined = b"".join(bytes(e["bytes"]) for e in choice["logprobs"]["content"])
    assert joined == "x 中文".encode(), joined


# ---- 5 ----------------------------------------------------------------------------------------------
def test_stream_holds_back_the_start_of_a_stop_string_before_a_partial_character(demo_dir):
    """Byte-level BPE (Llama 3, Qwen): 'ö' is two tokens, so while its first byte is in, the text ends
    in one U+FFFD. LLMEngine.output holds back max(len(stop)) - 1 = 3 chars of a running request's text
    so a stream never shows the start of a stop string -- but it counts the U+FFFD as one of them:
    'héllo w\ufffd' is cut to 'héllo', which already holds the 'o' of stop 'o wö'. The stream sends
    'héllo', then the final text is cut to 'héll' (stream and non-stream disagree; /generate's
    cumulative text shrinks). Any stop string with a multi-byte character after its first one
    (Chinese stops such as '\n用户', ' ✓') can leak this way."""
    engine = make_engine(demo_dir)
    tok = engine.tokenizer
    ids = _enc(tok, "héllo wörld")
    body = {"prompt": "def f", "max_tokens": len(ids), "temperature": 0, "ignore_eos": True, "stop": ["o wö"]}
    choice, streamed = whole_and_streamed(engine, body, ids)
    final = choice["text"]
    assert final == "héll"
    assert streamed == final, (streamed, final)


# ---- 6 ----------------------------------------------------------------------------------------------
def test_stream_with_logprobs_never_repeats_text(llama2_dir):
    """Byte-fallback vocabulary, stop 'd ✓ 中文' (hold-back 6 chars), stream with logprobs (or
    return_token_ids). While the bytes of 'ö' arrive the text is ' héllo w' + 2 U+FFFD, cut by the
    hold-back to ' héllo wö'... shorter than the ' héllo wör' already sent at the step before. The
    stream makes a chunk for the new token anyway (logprobs) and sets its sent offset to the shorter
    length (api.py `stream`: `sent_text = upto`, which may go backwards), so the next delta repeats
    'r': the client gets ' héllo wörrldd ✓ ' while the answer is ' héllo wörl'."""
    engine = make_engine(llama2_dir)
    tok = engine.tokenizer
    ids = _enc(tok, "héllo wörld ✓ 中文 ok")
    body = {
        "prompt": "def f",
        "max_tokens": len(ids),
        "temperature": 0,
        "ignore_eos": True,
        "stop": ["d ✓ 中文"],
        "logprobs": 1,
    }
    choice, streamed = whole_and_streamed(engine, body, ids)
    final = choice["text"]
    assert final == " héllo wörl"
    assert "rr" not in streamed and "dd" not in streamed, streamed
    assert streamed == final, (streamed, final)


if __name__ == "__main__":  # (quick look without pytest)
    print(json.dumps("see the docstrings"))
