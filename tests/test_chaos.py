"""Chaos suite (issue 7, point 2): one PD cluster under kills, pauses, restarts, control-message faults,
forged messages, duplicate rooms, damaged or full stores, client disconnects and a burst of 10x its
capacity.

One cluster serves every scenario (router + 2 prefills + 2 decodes: real processes on loopback, NIXL,
a shared DualPath store, fault injection on, 2 s deadlines in every PD state, a 7 s abort lease);
scenarios switch fault rules on the running engines (`POST /debug/faults`) and reset them afterwards,
and an engine the suite kills is restarted on the same ports. Every scenario asserts the contract:

* every client request either succeeds with tokens identical to a colocated `pdserve.LLM` on the same
  checkpoint (greedy) or gets a clear error (HTTP 4xx/5xx with an OpenAI error body, or an in-band SSE
  error); a client timeout (60 s, far above every deadline) counts as hung, which fails the scenario;
* afterwards every surviving engine holds zero pages and zero rooms and passes its integrity checks;
* the survivors keep serving: new requests succeed with the reference tokens.

To pin a room in a given state on a given pair of engines, some requests go straight to a prefill and
a decode (what the router does, with a room of our own): "Bootstrapping" = the decode's KVRequest is
dropped (prefill side) or its DE store read is slow (decode side); "WaitingForInput" = the prefill's PE
store read is slow (prefill side) or every page write stalls (decode side); "Transferring" = every write
stalls (prefill side) or the third one does (decode side: two writes landed). A direct call to an engine
the suite killed can only see its connection break; that counts as a clean error (a router answers 502).
Register and RegisterAck go out once per (decode, prefill) pair, so their faults are injected when a
killed engine is restarted (the restarted one gets its rules from $PDSERVE_FAULTS).

With $PDSERVE_CHAOS_REPORT naming a file, one JSON line per scenario is appended to it:
{"scenario", "sent", "succeeded", "clean_errors", "hung", "wrong", "pages_leaked", "rooms_leaked"}.
For client disconnects, "succeeded" means everything the client got before leaving was correct.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
import zmq

from pdserve import LLM, SamplingParams
from pdserve.disagg import messages
from pdserve.disagg.control import curve_client
from pdserve.engine.pd_common import new_room
from pdserve.transfer.nixl_backend import nixl_available
from tests.chaos_helpers import (
    Background,
    Outcome,
    Tally,
    complete,
    fired,
    rooms_by_state,
    set_faults,
    wait_until,
)
from tests.test_pd_e2e import metrics

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed"),
]

SECRET = "chaos-suite-cluster-secret-0123456789"
DEADLINE_S = 2.0  # every PD state, both roles
LEASE_S = 7.0  # >= state.min_lease_s: the prefill's three deadlines + 1 s
CLIENT_TIMEOUT_S = 60.0  # a client still waiting after this is hung
SETTLE_S = 3 * DEADLINE_S + LEASE_S + 5.0  # the longest legitimate cleanup, plus slack
STOP_S = DEADLINE_S + 1.5  # SIGSTOP long enough for the peers to give up on the paused engine
# A live prefill answers the router within its three state deadlines; the router gives up on one that
# does not (paused, wedged) after 3 deadlines + 5 s and retries elsewhere. A paused prefill stays paused
# longer than that: the clients the router sent to it must be answered while it is still paused.
PREFILL_STOP_S = 3 * DEADLINE_S + 5.0 + 4.0  # + time for the retry on the other prefill
GEN = 8  # tokens per request
PAGES = 64  # KV pages per engine (16 tokens each)
STEP_TOKENS = 32  # prefill chunk: a 150-token prompt goes out in 5 writes
BLOCK = 32  # stored block (tokens)
MAX_MODEL_LEN = 1024
ENGINES = ("prefill0", "prefill1", "decode0", "decode1")
STATES = ("Bootstrapping", "WaitingForInput", "Transferring")
BASE = "def handler(request, context):\n    result = process(request.body, context.user)\n"


class Chaos:
    """The shared cluster, the reference engine and the suite's client helpers."""

    def __init__(self, cluster, llm: LLM, store_root) -> None:
        self.cluster = cluster
        self.llm = llm
        self.tok = llm.get_tokenizer()
        self.store_root = store_root
        self._ref: dict[tuple, list[int]] = {}
        self._bootstrap: dict[str, str] = {}
        self._checks = 0

    # ---- cluster ------------------------------------------------------------------------------------
    @property
    def router(self) -> str:
        return self.cluster.router_url

    def url(self, name: str) -> str:
        return self.cluster.url(name)

    def urls(self, names=ENGINES) -> list[str]:
        return [self.url(n) for n in names]

    def pid(self, name: str) -> int:
        return self.cluster.proc(name).pid

    def bootstrap(self, prefill: str) -> str:
        if prefill not in self._bootstrap:
            info = httpx.get(self.url(prefill) + "/pd/info", timeout=10).json()
            self._bootstrap[prefill] = info["bootstrap_url"]
        return self._bootstrap[prefill]

    def faults(self, name: str, rules: list[dict], seed: int = 0) -> None:
        set_faults(self.url(name), rules, seed)

    def clear_faults(self, names=ENGINES) -> None:
        for name in names:
            try:
                set_faults(self.url(name), [])
            except (httpx.HTTPError, AssertionError):
                pass  # a dead engine has no rules left

    def router_health(self) -> dict[str, bool]:
        engines = httpx.get(self.router + "/health", timeout=10).json()["engines"]
        return {url: e["healthy"] for url, e in engines.items()}

    def wait_router_sees(self, healthy: dict[str, bool], timeout_s: float = 15.0) -> None:
        wait_until(
            lambda: all(self.router_health()[self.url(n)] == h for n, h in healthy.items()),
            timeout_s,
            f"the router to see {healthy}",
        )

    def block_file(self, ids: list[int], k: int):
        """The store's file of block k of `ids` (the keys every engine computes for these tokens)."""
        from pdserve.server.pd_context import model_identity
        from pdserve.store.index import block_path
        from pdserve.store.keys import block_keys
        from pdserve.store.layout import BlockLayout

        engine = self.llm.engine  # same checkpoint and dtype as the cluster's engines
        layout = BlockLayout.from_kv_layout(
            engine.runner.kv_cache.layout, BLOCK, model=model_identity(engine)
        )
        (store_dir,) = [p for p in self.store_root.iterdir() if p.is_dir()]
        return block_path(store_dir, block_keys(ids, BLOCK, layout.fingerprint)[k])

    # ---- prompts and references ----------------------------------------------------------------------
    def ids(self, tag: str, n: int) -> list[int]:
        ids = self.tok.encode(f"# {tag}\n" + BASE * (n // 10 + 2))
        assert len(ids) >= n
        return ids[:n]

    def suffix(self, tag: str) -> list[int]:
        return self.tok.encode(f"\n# {tag}\n", add_special_tokens=False)

    def ref(self, ids: list[int], n: int = GEN) -> list[int]:
        """Greedy tokens of the colocated reference (main thread only: LLM is not thread-safe)."""
        key = (tuple(ids), n)
        if key not in self._ref:
            sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            out = self.llm.generate({"prompt_token_ids": list(ids)}, sp)[0]
            self._ref[key] = list(out.outputs[0].token_ids)
        return self._ref[key]

    @staticmethod
    def body(ids: list[int], n: int = GEN, stream: bool = False, **extra) -> dict:
        return {
            "model": "demo",
            "prompt": ids,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": stream,
        } | extra

    # ---- client calls (any thread) -------------------------------------------------------------------
    def call(self, ids, expected, stream=False, read_path=None, timeout_s=CLIENT_TIMEOUT_S) -> Outcome:
        """One request through the router."""
        extra = {"read_path": read_path} if read_path else {}
        return complete(self.router, self.body(ids, len(expected), stream, **extra), expected, timeout_s)

    def pair(
        self, prefill: str, decode: str, ids, expected, read_path="none", room=None, decode_timeout_s=None
    ) -> tuple[Outcome, Outcome]:
        """One request placed by hand on (prefill, decode), as the router would: (decode leg = what the
        client sees, prefill leg)."""
        room = room or new_room()
        n = len(expected)
        pe_body = self.body(ids, n, pd={"room": room, "read_path": read_path})
        de_body = self.body(
            ids, n, pd={"room": room, "bootstrap_url": self.bootstrap(prefill), "read_path": read_path}
        )
        legs = Background(1)
        legs.submit(complete, self.url(prefill), pe_body, expected[:1], CLIENT_TIMEOUT_S)
        de = complete(self.url(decode), de_body, expected, decode_timeout_s or CLIENT_TIMEOUT_S)
        return de, legs.results(CLIENT_TIMEOUT_S + 5)[0]

    # ---- after every scenario ------------------------------------------------------------------------
    def serve_check(self, tally: Tally, n: int = 1, tag: str = "") -> list[Outcome]:
        """n concurrent requests through the router must all succeed with the reference tokens."""
        self._checks += 1
        prompts = [self.ids(f"serve check {self._checks} {tag} {i}", 20 + 7 * i) for i in range(n)]
        expected = [self.ref(p) for p in prompts]
        bg = Background(n)
        for i, (p, e) in enumerate(zip(prompts, expected, strict=True)):
            bg.submit(self.call, p, e, stream=i % 2 == 1)
        outs = bg.results(CLIENT_TIMEOUT_S + 5)
        for o in outs:
            tally.add(o, what="serve check")
            if o.kind != "ok":
                tally.problems.append(f"serve check after the scenario: {o.kind}: {o.detail}")
        return outs


def add_pair(tally: Tally, legs: tuple[Outcome, Outcome], killed: set[str], what: str) -> None:
    """The decode leg is the client's answer; the prefill leg (the router's) must resolve cleanly too."""
    de, pe = legs
    tally.add(de, killed=killed, what=f"{what} (decode leg)")
    if pe.kind in ("hung", "wrong") or (pe.kind == "broken" and pe.url not in killed):
        tally.problems.append(f"{what} (prefill leg): {pe.kind}: {pe.detail}")


@pytest.fixture(scope="module")
def chaos(demo_model_dir, tmp_path_factory):
    os.environ.setdefault("UCX_MODULES", "^ib*")
    from pdserve.launch import cluster_args, start_cluster

    store_root = tmp_path_factory.mktemp("chaos-kvstore")
    args = cluster_args(
        demo_model_dir,
        num_pages=PAGES,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=STEP_TOKENS,
        max_num_seqs=4,
        served_model_name="demo",
        no_prefix_caching=True,  # the store is the only cache: read paths always read it
        pd_deadline_s=DEADLINE_S,
        pd_abort_lease_s=LEASE_S,
        kv_store=str(store_root),
        kv_block_size=BLOCK,
        enable_fault_injection=True,
    )
    llm = LLM(
        demo_model_dir,
        max_model_len=MAX_MODEL_LEN,
        num_pages=256,
        max_num_batched_tokens=STEP_TOKENS,
        enable_prefix_caching=False,
    )
    cluster = start_cluster(args, 2, 2, secret=SECRET)
    try:
        yield Chaos(cluster, llm, store_root)
    finally:
        for _name, proc in cluster.procs:  # never leave a paused process behind
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        cluster.stop()


@pytest.fixture(scope="module")
def stored(chaos) -> list[int]:
    """A 200-token prompt whose 6 full blocks are in the store (the read-path holds extend it)."""
    ids = chaos.ids("stored context", 200)
    o = chaos.call(ids, chaos.ref(ids))
    assert o.kind == "ok", o
    files = [chaos.block_file(ids, k) for k in range(len(ids) // BLOCK)]
    wait_until(lambda: all(f.exists() for f in files), 10, "the write-back")
    return ids


# ---- 3. control messages: drop / delay / duplicate / reorder of each kind ----------------------------
# register and register_ack go out once per (decode, prefill) pair: they are exercised when a killed
# engine is restarted (test_kill_or_pause_engine_holding_rooms_in_every_state, KILL cases).
CONTROL_CASES = [
    (kind, action)
    for kind in ("kv_request", "status", "abort", "abort_ack")
    for action in ("drop", "delay", "duplicate", "reorder")
]


@pytest.mark.parametrize("kind,action", CONTROL_CASES, ids=[f"{k}-{a}" for k, a in CONTROL_CASES])
def test_control_message_faults(chaos, kind, action):
    tally = Tally(f"control message {kind}: {action}")
    rule = {"point": "control.send", "action": action, "kind": kind}
    rule |= {"drop": {"count": 1}, "delay": {"delay_s": 0.5}}.get(action, {})
    prompts = [chaos.ids(f"control {kind} {action} {i}", 30 + 40 * i) for i in range(4)]
    expected = [chaos.ref(p) for p in prompts]
    bg = Background()
    try:
        for name in ENGINES:
            chaos.faults(name, [rule])
        trigger = None
        if kind in ("abort", "abort_ack"):
            # Aborts only follow a failure: a client that leaves while its KV is stuck (the prefill's
            # first write stalls) makes the decode abort after asking for KV -> Abort, AbortAck.
            chaos.faults("prefill0", [rule, {"point": "transfer.submit", "action": "stall", "count": 1}])
            ids = chaos.ids(f"abort trigger {kind} {action}", 40)
            trigger = Background(1)
            trigger.submit(chaos.pair, "prefill0", "decode0", ids, chaos.ref(ids), decode_timeout_s=1.0)
            wait_until(lambda: fired(chaos.url("prefill0"))[1] == 1, 10, "the stalled write")
        for i, (p, e) in enumerate(zip(prompts, expected, strict=True)):
            bg.submit(chaos.call, p, e, stream=i % 2 == 1)
        for o in bg.results(CLIENT_TIMEOUT_S + 10):
            tally.add(o)
        if trigger is not None:
            de, pe = trigger.results(CLIENT_TIMEOUT_S + 10)[0]
            assert de.kind == "hung" and "Timeout" in de.detail, de  # our client left at 1 s, by design
            if pe.kind not in ("ok", "error"):
                tally.problems.append(f"abort trigger (prefill leg): {pe.kind}: {pe.detail}")
        total_fired = sum(sum(fired(u)) for u in chaos.urls())
        assert total_fired >= 1, f"no {kind} message was {action}ped"
    finally:
        chaos.clear_faults()
    # A dropped Abort is answered by the prefill's own Status(Failed) at its deadline; the decode must
    # take that as the ack and free its pages then, not only when the lease runs out.
    tally.settle(chaos.urls(), LEASE_S - 1.0 if (kind, action) == ("abort", "drop") else SETTLE_S)
    chaos.serve_check(tally, tag=f"{kind} {action}")
    tally.check()


# ---- 4. duplicate rooms; forged, malformed and wrong-version control messages ------------------------
def test_forged_messages_and_duplicate_rooms(chaos):
    tally = Tally("duplicate room; forged (wrong HMAC), malformed and wrong-version messages")
    p0, d0 = chaos.url("prefill0"), chaos.url("decode0")
    room = new_room()
    ids = chaos.ids("duplicate room", 40)
    expected = chaos.ref(ids)
    bg = Background()
    try:
        # Hold the room open on both sides for a second: the decode's KVRequest is delayed.
        chaos.faults(
            "decode0", [{"point": "control.send", "action": "delay", "kind": "kv_request", "delay_s": 1.0}]
        )
        original = bg.submit(chaos.pair, "prefill0", "decode0", ids, expected, room=room)
        wait_until(
            lambda: sum(rooms_by_state(p0).values()) >= 1 and sum(rooms_by_state(d0).values()) >= 1,
            5,
            "the room on both engines",
        )
        # The same room again, on each side, while it is active: 400, and the first one is untouched.
        pe_dup = Chaos.body(ids, GEN, pd={"room": room, "read_path": "none"})
        de_dup = Chaos.body(ids, GEN, pd={"room": room, "bootstrap_url": chaos.bootstrap("prefill0")})
        for url, body in ((p0, pe_dup), (d0, de_dup)):
            o = tally.add(complete(url, body, expected, CLIENT_TIMEOUT_S), what=f"duplicate room on {url}")
            assert o.kind == "error" and "already active" in o.detail, o
        # A client may not pick a room through the router.
        o = tally.add(complete(chaos.router, Chaos.body(ids, pd={"room": room}), expected, 30))
        assert o.kind == "error" and "reserved" in o.detail, o
        # Forged messages about that very room to both engines' control channels.
        before = {u: metrics(u) for u in (p0, d0)}
        ctx = zmq.Context.instance()
        for url in (p0, d0):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            # With the transport's keys (without, nothing even connects: test_disagg_control), so
            # the message layer's checks are what is tested here.
            curve_client(sock, SECRET.encode())
            sock.connect(httpx.get(url + "/pd/info", timeout=10).json()["control_addr"])
            for body in (messages.Abort(reason="forged"), messages.Status(state=0, error="forged")):
                sock.send_multipart(messages.encode(body, room, "mallory", b"not-the-cluster-secret"))
            sock.send_multipart([b"\x00garbage"])  # one frame: malformed before any MAC check
            header = messages._encoder.encode(messages._Header(99, "abort", room, "mallory"))
            abort = messages._encoder.encode(messages.Abort(reason="from the future"))
            sock.send_multipart(messages.seal([header, abort], SECRET.encode()))
            sock.close()

        def counted(url: str) -> bool:
            m, b = metrics(url), before[url]
            key = 'pdserve_pd_control_dropped_total{{why="{}"}}'.format
            return (
                m[key("forged")] >= b[key("forged")] + 2
                and m[key("malformed")] > b[key("malformed")]
                and m[key("wrong_version")] > b[key("wrong_version")]
            )

        wait_until(lambda: counted(p0) and counted(d0), 10, "the forged messages to be dropped and counted")
        add_pair(tally, original.result(CLIENT_TIMEOUT_S + 10), set(), "the original request")
        assert tally.counts["succeeded"] == 1, tally.problems  # the original, untouched
    finally:
        chaos.clear_faults()
    tally.settle(chaos.urls(), SETTLE_S)
    chaos.serve_check(tally, tag="forged")
    tally.check()


# ---- 6. client disconnects ------------------------------------------------------------------------------
def leave_after(url: str, body: dict, seconds: float) -> Outcome:
    """A client that gives up after `seconds` (mid-prefill): everything it got must be correct."""
    t0 = time.monotonic()
    try:
        with httpx.Client(timeout=httpx.Timeout(seconds, connect=10.0)) as client:
            with client.stream("POST", url + "/v1/completions", json=body) as r:
                for _ in r.iter_lines():
                    pass
    except httpx.TimeoutException:
        return Outcome("ok", "left before the answer", time.monotonic() - t0, url)
    return Outcome("ok", "answered before the client left", time.monotonic() - t0, url)


def test_client_disconnects(chaos):
    tally = Tally("client disconnect: mid-stream, before the first token, non-streamed")
    urls = chaos.urls()
    gen_before = sum(metrics(u)["pdserve_generation_tokens_total"] for u in urls)
    bg = Background()
    for i in range(3):  # mid-stream, after 1, 3 and 5 tokens of 200
        ids = chaos.ids(f"disconnect mid-stream {i}", 40 + 20 * i)
        bg.submit(
            complete,
            chaos.router,
            Chaos.body(ids, 200, stream=True),
            chaos.ref(ids, 200),
            CLIENT_TIMEOUT_S,
            stop_after_tokens=1 + 2 * i,
        )
    long_ids = chaos.ids("disconnect during the prefill", 600)
    bg.submit(leave_after, chaos.router, Chaos.body(long_ids, 200, stream=True), 0.3)
    bg.submit(leave_after, chaos.router, Chaos.body(long_ids, 200, stream=False), 0.5)
    for o in bg.results(CLIENT_TIMEOUT_S + 10):
        tally.add(o, what="disconnect")
    tally.settle(urls, SETTLE_S)
    gen = sum(metrics(u)["pdserve_generation_tokens_total"] for u in urls) - gen_before
    assert gen < 5 * 200 / 2, f"{gen} tokens generated: the engines kept decoding for clients that left"
    chaos.serve_check(tally, tag="disconnect")
    tally.check()


# ---- 5. the store: damaged blocks on both read paths, a full disk ----------------------------------------
@pytest.mark.parametrize("read_path", ["pe", "de"])
@pytest.mark.parametrize("damage", ["corrupt", "truncated", "missing"])
def test_damaged_store_block_is_recomputed(chaos, damage, read_path):
    tally = Tally(f"store: {damage} block, read path {read_path}")
    ids = chaos.ids(f"conversation {damage} {read_path}", 300)
    full_blocks = (len(ids) + GEN) // BLOCK  # what turn 1 leaves in the store: 9 blocks of the prompt
    tally.add(chaos.call(ids, chaos.ref(ids), read_path=read_path), what="turn 1")
    files = [chaos.block_file(ids, k) for k in range(full_blocks)]
    wait_until(lambda: all(f.exists() for f in files), 10, "the write-back")
    damaged = full_blocks // 2
    victim = files[damaged]
    data = bytearray(victim.read_bytes())
    if damage == "corrupt":
        data[4096 + 1000] ^= 0xFF  # a payload byte (the header is the first 4 KiB)
        victim.write_bytes(bytes(data))
    elif damage == "truncated":
        victim.write_bytes(bytes(data[: len(data) // 2]))
    else:
        victim.unlink()
    readers = chaos.urls(["prefill0", "prefill1"] if read_path == "pe" else ["decode0", "decode1"])
    bad_before = sum(metrics(u)["pdserve_store_blocks_bad_total"] for u in readers)
    context = ids + chaos.ref(ids) + chaos.suffix(f"next turn {damage} {read_path}")
    o = tally.add(chaos.call(context, chaos.ref(context), read_path=read_path), what="turn 2")
    tally.settle(chaos.urls(), SETTLE_S)
    if o.kind == "ok":
        storage = o.usage["prompt_tokens_details"]["cached_tokens_storage"]
        # The read path took the good blocks before the damaged one and recomputed the rest.
        assert storage == damaged * BLOCK, (storage, damaged)
        bad = sum(metrics(u)["pdserve_store_blocks_bad_total"] for u in readers) - bad_before
        if damage == "corrupt":  # a corrupt block has the right size: it is read, checked and dropped
            assert bad == 1, bad
    chaos.serve_check(tally, tag=f"{damage} {read_path}")
    tally.check()


def test_store_disk_full(chaos):
    tally = Tally("store: disk full (every write-back fails)")
    decodes = chaos.urls(["decode0", "decode1"])
    # (the first block of a chain fails; the store then refuses the rest, whose parent is missing)
    ops = (
        'pdserve_store_ops_total{op="num_write_failures"}',
        'pdserve_store_ops_total{op="num_put_orphans"}',
    )

    def not_written() -> float:
        return sum(metrics(u).get(op, 0.0) for u in decodes for op in ops)

    failed_before = not_written()
    try:
        for name in ("decode0", "decode1"):
            chaos.faults(name, [{"point": "store.write", "action": "full"}])
        ids = chaos.ids("conversation on a full disk", 300)
        tally.add(chaos.call(ids, chaos.ref(ids), read_path="pe"), what="turn 1")
        wait_until(
            lambda: not_written() >= failed_before + 300 // BLOCK,
            10,
            "the write-backs to fail",
        )
        context = ids + chaos.ref(ids) + chaos.suffix("next turn on a full disk")
        for read_path in ("pe", "de"):  # nothing was stored: both read paths recompute everything
            tally.add(
                chaos.call(context, chaos.ref(context), read_path=read_path), what=f"turn 2 {read_path}"
            )
    finally:
        chaos.clear_faults()
    tally.settle(chaos.urls(), SETTLE_S)
    chaos.serve_check(tally, tag="disk full")
    tally.check()


# ---- 7. a burst of 10x the cluster's capacity -------------------------------------------------------------
def test_burst_of_ten_times_capacity(chaos):
    prompt_len = 200
    pages_per_request = -(-prompt_len // 16) + -(-GEN // 16)  # the decode admits prompt + growth pages
    capacity = 2 * (PAGES // pages_per_request)  # requests both decodes hold at once
    n = 10 * capacity
    tally = Tally(f"burst: {n} concurrent requests, 10x the decodes' capacity of {capacity}")
    prompts = [chaos.ids(f"burst {i}", prompt_len - i) for i in range(8)]
    expected = [chaos.ref(p) for p in prompts]
    bg = Background(n)
    for i in range(n):
        bg.submit(chaos.call, prompts[i % 8], expected[i % 8], stream=i % 2 == 1)
    errors: dict[str, int] = {}
    for o in bg.results(CLIENT_TIMEOUT_S + 30):
        tally.add(o, what="burst")
        if o.kind == "error":
            # Overload is shed as "try again" (5xx / 429, or in-band on a stream), never as a 4xx that
            # blames the request.
            if not o.detail.startswith(("HTTP 5", "HTTP 429", "in-band")):
                tally.problems.append(f"burst request refused with {o.detail}")
            errors[o.detail[:80]] = errors.get(o.detail[:80], 0) + 1
    print(f"burst errors: {errors}")
    assert tally.counts["succeeded"] >= capacity, tally.counts  # overload sheds load, it does not stall
    tally.settle(chaos.urls(), SETTLE_S)
    chaos.serve_check(tally, n=4, tag="burst")
    tally.check()


# ---- 1 + 2. kill -9 / SIGSTOP of an engine holding rooms in every state; restart ------------------------
def holds_for(chaos, role: str, sig: str, stored: list[int]):
    """(fault rules by engine, [(state on the victim, prefill, decode, prompt, read path)])."""
    tag = f"{role} {sig}"
    stored_plus = stored + chaos.suffix(f"hold stored {tag}")
    stall = {"point": "transfer.submit", "action": "stall"}
    slow_read = {"point": "store.read", "action": "slow", "delay_s": 4.0, "count": 1}
    if role == "prefill":  # victim prefill0
        drop_kv_request = {"point": "control.send", "action": "drop", "kind": "kv_request"}
        rules = {"prefill0": [slow_read, stall], "decode0": [drop_kv_request]}
        holds = [
            ("Bootstrapping", "prefill0", "decode0", chaos.ids(f"hold boot {tag}", 40), "none"),
            ("WaitingForInput", "prefill0", "decode1", stored_plus, "pe"),
            ("Transferring", "prefill0", "decode1", chaos.ids(f"hold xfer {tag}", 50), "none"),
        ]
    else:  # victim decode0; prefill1's stall draws (seed 0) pass, pass, stall: two writes land
        rules = {"decode0": [slow_read], "prefill0": [stall], "prefill1": [stall | {"prob": 0.5}]}
        holds = [
            ("Bootstrapping", "prefill0", "decode0", stored_plus, "de"),
            ("WaitingForInput", "prefill0", "decode0", chaos.ids(f"hold wait {tag}", 40), "none"),
            ("Transferring", "prefill1", "decode0", chaos.ids(f"hold xfer {tag}", 150), "none"),
        ]
    return rules, holds


# Faults on the registrations a restart causes (a restarted engine is new to every peer): every action
# on register and register_ack, split over the two restarts. {engine: rules}; the restarted engine gets
# its rules from $PDSERVE_FAULTS, so they are in force before it sends or answers anything.
def _reg(kind: str, action: str) -> dict:
    return {
        "point": "control.send",
        "kind": kind,
        "action": action,
        "count": 1,
        "delay_s": 0.5 * (action == "delay"),
    }


RESTART_FAULTS = {
    "prefill0": {
        "decode0": [_reg("register", "drop")],
        "decode1": [_reg("register", "delay")],
        "prefill0": [_reg("register_ack", "duplicate"), _reg("register_ack", "reorder")],
    },
    "decode0": {
        "decode0": [_reg("register", "duplicate"), _reg("register", "reorder")],
        "prefill0": [_reg("register_ack", "drop")],
        "prefill1": [_reg("register_ack", "delay")],
    },
}

EVENTS = [("prefill", "SIGSTOP"), ("prefill", "SIGKILL"), ("decode", "SIGSTOP"), ("decode", "SIGKILL")]


@pytest.mark.parametrize("role,sig", EVENTS, ids=[f"{r}-{s}" for r, s in EVENTS])
def test_kill_or_pause_engine_holding_rooms_in_every_state(chaos, stored, role, sig):
    victim = f"{role}0"
    victim_url = chaos.url(victim)
    survivors = [n for n in ENGINES if n != victim]
    stop_s = PREFILL_STOP_S if role == "prefill" else STOP_S
    what = "kill -9" if sig == "SIGKILL" else f"SIGSTOP {stop_s:.1f} s + SIGCONT"
    tally = Tally(f"{what} {victim} holding rooms in {', '.join(STATES)}")
    rules, holds = holds_for(chaos, role, sig, stored)
    expected = [chaos.ref(h[3]) for h in holds]
    router_prompts = [chaos.ids(f"during {victim} {sig} {i}", 30 + 30 * i) for i in range(2)]
    router_expected = [chaos.ref(p) for p in router_prompts]
    others_pids = {n: chaos.pid(n) for n in survivors}
    bg, router_bg = Background(), Background()
    killed: set[str] = set()
    paused = False
    observed: dict[str, int] = {}
    try:
        for name, r in rules.items():
            chaos.faults(name, r, seed=0)
        for (_state, pe, de, ids, read_path), exp in zip(holds, expected, strict=True):
            bg.submit(chaos.pair, pe, de, ids, exp, read_path)

        def all_held() -> bool:
            observed.update(rooms_by_state(victim_url))
            return all(observed[s] >= 1 for s in STATES)

        # Each hold lasts DEADLINE_S from when its room enters its state, and a loaded machine may take
        # a while to get the three there: wait for one snapshot that shows all three held at once.
        try:
            wait_until(all_held, DEADLINE_S + 8.0, "rooms in every state", interval_s=0.02)
        except AssertionError:
            pass
        for p, e in zip(router_prompts, router_expected, strict=True):
            router_bg.submit(chaos.call, p, e)
        os.kill(chaos.pid(victim), getattr(signal, sig))
        if sig == "SIGKILL":
            killed = {victim_url}
        else:
            paused = True
        chaos.clear_faults(survivors)
        if paused:
            t_stop = time.monotonic()
            answered = router_bg.wait(stop_s)  # the router requests, while the victim is paused
            time.sleep(max(0.0, stop_s - (time.monotonic() - t_stop)))
            if role == "prefill" and not answered:  # (a paused decode still holds its clients)
                tally.problems.append(
                    f"router requests still waiting after {stop_s:.1f} s on paused {victim}"
                )
            os.kill(chaos.pid(victim), signal.SIGCONT)
            paused = False
            chaos.clear_faults([victim])
        for h, legs in zip(holds, bg.results(CLIENT_TIMEOUT_S + 10), strict=True):
            add_pair(tally, legs, killed, f"hold {h[0]} on {h[1]}->{h[2]}")
        for o in router_bg.results(CLIENT_TIMEOUT_S + 10):
            tally.add(o, what="router request during the event")
    finally:
        if paused:
            os.kill(chaos.pid(victim), signal.SIGCONT)
        chaos.clear_faults(survivors if killed else ENGINES)
    try:
        if not all(observed.get(s, 0) >= 1 for s in STATES):
            tally.problems.append(f"{victim} did not hold a room in every state when hit: {observed}")
        if killed:
            # The survivors serve without the victim once the router has seen it die.
            chaos.wait_router_sees({victim: False})
            tally.settle(chaos.urls(survivors), SETTLE_S)
            chaos.serve_check(tally, n=2, tag=f"without {victim}")
        else:
            tally.settle(chaos.urls(), SETTLE_S)  # the paused engine too, once it resumed
            chaos.wait_router_sees(dict.fromkeys(ENGINES, True))
            chaos.serve_check(tally, n=4, tag=f"after {victim} resumed")
        if {n: chaos.pid(n) for n in survivors} != others_pids:
            tally.problems.append("a survivor was restarted")
        tally.check()
    finally:
        if killed:  # scenario 2; the later scenarios need the whole cluster again
            restart_and_rejoin(chaos, victim)


def restart_and_rejoin(chaos, victim: str) -> None:
    """Restart a killed engine with the same command (same ports), the others untouched: the router
    routes to it again and requests through it succeed -- while its registrations meet faults."""
    faults = RESTART_FAULTS[victim]
    desc = ", ".join(f"{r['kind']} {r['action']}" for rules in faults.values() for r in rules)
    tally = Tally(f"restart {victim} after kill -9 (registration faults: {desc})")
    others = [n for n in ENGINES if n != victim]
    others_pids = {n: chaos.pid(n) for n in others}
    url = chaos.url(victim)
    served = (
        "pdserve_pd_pages_sent_total" if victim.startswith("prefill") else "pdserve_generation_tokens_total"
    )
    try:
        for name, rules in faults.items():
            if name != victim:
                chaos.faults(name, rules)
        chaos.cluster.restart(victim, extra_env={"PDSERVE_FAULTS": json.dumps(faults[victim])})
        chaos.wait_router_sees({victim: True})
        for attempt in range(5):  # round robin / fewest in flight: a few concurrent requests reach it
            chaos.serve_check(tally, n=3, tag=f"rejoin {victim} {attempt}")
            if metrics(url)[served] > 0:
                break
        assert metrics(url)[served] > 0, f"the router never used the restarted {victim}"
        # Every pair the restarted engine is part of registers (and meets its fault) and serves.
        peers = ("decode0", "decode1") if victim.startswith("prefill") else ("prefill0", "prefill1")
        for peer in peers:
            pe, de = (victim, peer) if victim.startswith("prefill") else (peer, victim)
            ids = chaos.ids(f"rejoin pair {pe} {de}", 45)
            legs = chaos.pair(pe, de, ids, chaos.ref(ids))
            add_pair(tally, legs, set(), f"{pe}->{de} after the restart")
            if legs[0].kind != "ok":
                tally.problems.append(f"{pe}->{de} after the restart: {legs[0].kind}: {legs[0].detail}")
        for name in faults:
            assert all(n >= 1 for n in fired(chaos.url(name))), f"{name}: {fired(chaos.url(name))}"
    finally:
        chaos.clear_faults()
    assert {n: chaos.pid(n) for n in others} == others_pids, "another engine was restarted"
    tally.settle(chaos.urls(), SETTLE_S)
    tally.check()


def test_report_lines_are_written(tmp_path, monkeypatch):
    """The JSON report: one line per scenario, the fields docs/reliability.md's table is built from."""
    path = tmp_path / "chaos.jsonl"
    monkeypatch.setenv("PDSERVE_CHAOS_REPORT", str(path))
    t = Tally("unit")
    t.add(Outcome("ok"))
    t.add(Outcome("error", "HTTP 503"))
    t.add(Outcome("broken", url="http://x"), killed={"http://x"})
    t.check()
    line = json.loads(path.read_text())
    assert line == {
        "scenario": "unit",
        "sent": 3,
        "succeeded": 1,
        "clean_errors": 2,
        "hung": 0,
        "wrong": 0,
        "pages_leaked": 0,
        "rooms_leaked": 0,
    }
