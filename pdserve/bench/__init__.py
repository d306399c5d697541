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
