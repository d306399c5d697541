"""Helpers of the chaos suite (tests/test_chaos.py): client calls judged against the issue-7 contract,
per-scenario tallies (and their JSON report lines), fault rules on running engines, idle checks.

The contract (issue 7, point 2): every client request either succeeds with tokens identical to the
colocated reference (greedy) or gets a clear error -- HTTP 4xx/5xx with an OpenAI error body, or an
in-band SSE error event -- and never hangs (a client timeout far above every deadline counts as hung);
afterwards every surviving engine holds zero pages and zero rooms and passes its integrity checks.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import httpx

from tests.conftest import wait_until  # noqa: F401  (the chaos suite's name for it)
from tests.test_pd_e2e import metrics

REPORT_ENV = "PDSERVE_CHAOS_REPORT"


@dataclass
class Outcome:
    """One client call, judged. kind: ok (tokens == reference), error (a clear error), hung (client
    timeout), wrong (other tokens, an unclear error, a truncated stream), broken (the connection itself
    broke: only acceptable on a direct call to an engine the test killed)."""

    kind: str
    detail: str = ""
    elapsed_s: float = 0.0
    url: str = ""
    token_ids: list[int] = field(default_factory=list)
    usage: dict = field(default_factory=dict)  # non-streamed answers: the response's usage


def _clear_error(status: int, text: str) -> tuple[bool, str]:
    try:
        err = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return False, f"HTTP {status} without a JSON body: {text[:200]!r}"
    if isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"]:
        return True, f"HTTP {status}: {err['message'][:200]}"
    return False, f"HTTP {status} without an OpenAI error body: {text[:200]!r}"


def complete(
    url: str,
    body: dict,
    expected: list[int] | None,
    timeout_s: float,
    stop_after_tokens: int | None = None,
) -> Outcome:
    """POST `body` to {url}/v1/completions (streamed if body["stream"]) and judge the answer against
    `expected` token ids (the body must ask for "return_token_ids"). `stop_after_tokens`: a client that
    disconnects after that many streamed tokens (its partial output must be a prefix of `expected`)."""
    t0 = time.monotonic()

    def done(kind: str, detail: str = "", ids=(), usage=None) -> Outcome:
        return Outcome(kind, detail, time.monotonic() - t0, url, list(ids), usage or {})

    try:
        with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0)) as client:
            if not body.get("stream"):
                r = client.post(url + "/v1/completions", json=body)
                if r.status_code != 200:
                    ok, why = _clear_error(r.status_code, r.text)
                    return done("error" if ok else "wrong", why)
                data = r.json()
                if "error" in data:
                    return done("wrong", f"HTTP 200 with an error body: {r.text[:200]}")
                ids = data["choices"][0]["token_ids"]
                if expected is not None and ids != expected:
                    return done("wrong", f"tokens {ids} != reference {expected}", ids)
                return done("ok", ids=ids, usage=data.get("usage"))
            ids: list[int] = []
            with client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    ok, why = _clear_error(r.status_code, r.text)
                    return done("error" if ok else "wrong", why)
                error = None
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        if error is not None:
                            return done("error", f"in-band: {error}", ids)
                        if expected is not None and ids != expected:
                            return done("wrong", f"streamed {ids} != reference {expected}", ids)
                        return done("ok", ids=ids)
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        err = chunk["error"]
                        if not (isinstance(err, dict) and err.get("message")):
                            return done("wrong", f"unclear in-band error {chunk}", ids)
                        error = err["message"][:200]
                        continue
                    for choice in chunk.get("choices", []):
                        ids += choice.get("token_ids") or []
                    if stop_after_tokens is not None and len(ids) >= stop_after_tokens:
                        if expected is not None and ids != expected[: len(ids)]:
                            return done("wrong", f"partial stream {ids} is no prefix of {expected}", ids)
                        return done("ok", "disconnected by the client", ids)
                if error is not None:  # the error event came, [DONE] did not: still a clear error
                    return done("error", f"in-band (no [DONE]): {error}", ids)
                return done("wrong", f"stream ended without [DONE] after {len(ids)} tokens", ids)
    except httpx.TimeoutException as e:
        return done("hung", repr(e))
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        return done("broken", repr(e))


class Background:
    """Client calls running on threads (one per call)."""

    def __init__(self, max_workers: int = 128) -> None:
        self.pool = ThreadPoolExecutor(max_workers=max_workers)
        self.futures = []

    def submit(self, fn, *args, **kw):
        f = self.pool.submit(fn, *args, **kw)
        self.futures.append(f)
        return f

    def wait(self, timeout_s: float) -> bool:
        """True once every call returned, False if some still run after `timeout_s`."""
        return not wait(self.futures, timeout_s).not_done

    def results(self, timeout_s: float) -> list:
        """Every call's result; a call still running after `timeout_s` is reported as hung."""
        deadline = time.monotonic() + timeout_s
        out = []
        for f in self.futures:
            try:
                out.append(f.result(max(0.1, deadline - time.monotonic())))
            except TimeoutError:
                out.append(Outcome("hung", "the client call never returned"))
        self.pool.shutdown(wait=False, cancel_futures=True)
        return out


class Tally:
    """Outcomes of one scenario, its leak check and its JSON report line."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.counts = {"sent": 0, "succeeded": 0, "clean_errors": 0, "hung": 0, "wrong": 0}
        self.problems: list[str] = []
        self.pages_leaked = 0
        self.rooms_leaked = 0
        self.max_elapsed_s = 0.0  # the slowest client answer (printed, not in the report line)
        self._lock = threading.Lock()

    def add(self, o: Outcome, *, killed: set[str] = frozenset(), what: str = "") -> Outcome:
        """Count one client request. A connection that broke counts as a clean error only when the call
        went straight to an engine the test killed (a router would answer 502 for it)."""
        kind = o.kind
        if kind == "broken":
            kind = "error" if o.url in killed else "wrong"
        key = {"ok": "succeeded", "error": "clean_errors", "hung": "hung", "wrong": "wrong"}[kind]
        with self._lock:
            self.counts["sent"] += 1
            self.counts[key] += 1
            self.max_elapsed_s = max(self.max_elapsed_s, o.elapsed_s)
            if key in ("hung", "wrong"):
                self.problems.append(f"{what or o.url}: {o.kind}: {o.detail} ({o.elapsed_s:.1f} s)")
        return o

    def settle(self, urls: list[str], timeout_s: float) -> None:
        """Wait until every engine in `urls` is idle (zero pages, rooms, running requests) and healthy
        (its idle integrity check passed); count what the others still hold as leaked."""
        pending = set(urls)
        deadline = time.monotonic() + timeout_s
        last: dict[str, str] = {}
        while pending and time.monotonic() < deadline:
            for url in sorted(pending):
                try:
                    m = metrics(url)
                    held = (m["pdserve_kv_pages_used"], m["pdserve_pd_rooms_held"])
                    if held == (0, 0) and m["pdserve_num_requests_running"] == 0:
                        status = httpx.get(url + "/health", timeout=5).status_code
                        if status == 200:
                            pending.discard(url)
                            continue
                        last[url] = f"unhealthy (HTTP {status}: integrity check failed?)"
                    else:
                        last[url] = f"holds {held[0]:.0f} pages, {held[1]:.0f} rooms"
                except httpx.HTTPError as e:
                    last[url] = f"unreachable: {e!r}"
            time.sleep(0.1)
        for url in sorted(pending):
            try:
                m = metrics(url)
                self.pages_leaked += int(m["pdserve_kv_pages_used"])
                self.rooms_leaked += int(m["pdserve_pd_rooms_held"])
            except httpx.HTTPError:
                pass
            self.problems.append(f"{url} not idle after {timeout_s:.0f} s: {last.get(url, '?')}")

    def report(self) -> dict:
        line = {"scenario": self.name, **self.counts}
        line |= {"pages_leaked": self.pages_leaked, "rooms_leaked": self.rooms_leaked}
        print(f"chaos: {json.dumps(line)} slowest answer {self.max_elapsed_s:.1f} s")
        path = os.environ.get(REPORT_ENV)
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")
        return line

    def check(self) -> None:
        """Write the report line, then assert the contract."""
        line = self.report()
        assert not self.problems, f"{self.name}: {line}\n  " + "\n  ".join(self.problems)
        assert line["hung"] == line["wrong"] == line["pages_leaked"] == line["rooms_leaked"] == 0, line


def set_faults(url: str, rules: list[dict], seed: int = 0) -> None:
    r = httpx.post(url + "/debug/faults", json={"rules": rules, "seed": seed}, timeout=10)
    assert r.status_code == 200, r.text


def fired(url: str) -> list[int]:
    """How often each current rule of the engine fired."""
    return [rule["fired"] for rule in httpx.get(url + "/debug/faults", timeout=10).json()["rules"]]


def rooms_by_state(url: str) -> dict[str, int]:
    m = metrics(url)
    out = {}
    for state in ("Bootstrapping", "WaitingForInput", "Transferring"):
        out[state] = int(m.get(f'pdserve_pd_rooms_by_state{{state="{state}"}}', 0))
    return out
