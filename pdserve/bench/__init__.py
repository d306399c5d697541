"""Benchmarks that measure a ratio side by side in one run (`pdserve bench ...`)."""

from __future__ import annotations


def served_model_card(url: str) -> dict:
    """The first model card `url`'s /v1/models lists (its `id`, and `max_model_len` where the server
    gives it), asked with $PDSERVE_API_KEY; ValueError with the answer if it lists none (a 401: the
    server wants the key)."""
    import httpx

    from pdserve.server.auth import client_headers

    r = httpx.get(url.rstrip("/") + "/v1/models", timeout=30, headers=client_headers())
    if r.status_code != 200 or not r.json().get("data"):
        raise ValueError(f"{url.rstrip('/')}/v1/models answered {r.status_code}: {r.text[:200]}")
    return r.json()["data"][0]


def short_answer(finish_reason: str | None, num_tokens: int, max_tokens: int) -> str:
    """Why an answer to a benchmark request (sent with `ignore_eos`) does not count: "" when it is
    whole (finished by its length with `max_tokens` tokens, or by a stop); else the reason. An
    answer the server aborted (an `/abort_request`, a weight update, a shutdown) comes back as a
    200 with `finish_reason` "abort" and fewer tokens: counted as a success, it made latencies and
    throughput those of cut-short answers."""
    if finish_reason == "abort":
        return f"aborted by the server after {num_tokens} of {max_tokens} tokens"
    if finish_reason not in ("length", "stop"):
        return f"no finish reason (finish_reason {finish_reason!r}, {num_tokens} of {max_tokens} tokens)"
    if finish_reason == "length" and num_tokens != max_tokens:
        return f"{num_tokens} of {max_tokens} tokens"
    return ""


def time_per_output_token(stamps: list[tuple[float, int]]) -> float | None:
    """TPOT (s) from a stream's chunks, each `(arrival time, tokens received so far)`: the time
    after the first chunk over the tokens that came after it. None when no token came after the
    first chunk. Why not `(last - first) / (tokens - 1)`: a chunk may carry several tokens (the
    server coalesces the outputs of steps its client has not read yet, as vLLM and SGLang do), and
    a first chunk of k tokens then divided the time of tokens - k tokens by tokens - 1: a TPOT
    understated by up to (k - 1) / (tokens - 1)."""
    if not stamps:
        return None
    (t_first, n_first), (t_last, n_last) = stamps[0], stamps[-1]
    return (t_last - t_first) / (n_last - n_first) if n_last > n_first else None
