"""Hypothesis fuzzing of the control-message decoder (`disagg/messages.py`) and of `ControlChannel`'s
receive path (`disagg/control.py`).

Decoder: on random, truncated, bit-flipped, extended, reordered, re-signed, oversized, wrong-version and
authentic-but-malformed frames, `decode` raises only its typed rejections (`MessageRejected`: forged /
malformed / oversized / wrong version, each exactly where the documented decoding order puts it) and
never touches its input. Channel: the same bad messages sent over a real ZMQ socket are each dropped
and counted exactly once, in the counter the decoder's verdict names, and nothing reaches `poll`.

Example counts are printed (pytest -s); PDSERVE_FUZZ_SCALE multiplies them.
"""

from __future__ import annotations

import time
from collections import Counter

import msgspec
import pytest
import zmq
from hypothesis import assume, given
from hypothesis import strategies as st

from pdserve.disagg import messages as m
from pdserve.disagg.control import ControlChannel, curve_client
from pdserve.disagg.messages import (
    MAX_ROOM,
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    BadMessage,
    ForgedMessage,
    KVRequest,
    MessageRejected,
    OversizedMessage,
    Register,
    RegisterAck,
    Status,
    WrongVersion,
    decode,
    encode,
)
from tests.fuzz_helpers import fuzz_settings

SECRET = b"fuzz-cluster-secret-0123456789ab"
OTHER = b"another-secret-of-the-same-size!"
COUNTS: Counter[str] = Counter()


# ---- strategies ----------------------------------------------------------------------------------
u64 = st.integers(0, 2**64 - 1)
nonneg = st.integers(0, 2**63)
short = st.text(max_size=40)
addr = st.from_regex(rf"\A{m.TCP_ADDR}\Z").filter(lambda a: len(a) <= 256) | st.from_regex(
    r"\Aipc://[a-z/]{1,20}\Z"
)


@st.composite
def registers(draw):
    n = draw(st.integers(0, 6))
    return Register(
        agent_name=draw(short),
        agent_metadata=draw(st.binary(max_size=64)),
        kv_base_addrs=draw(st.lists(u64, min_size=n, max_size=n)),
        kv_bytes_per_page=draw(st.lists(st.integers(1, 2**64 - 1), min_size=n, max_size=n)),
        handoff_base_addr=draw(u64),
        handoff_slot_bytes=draw(st.integers(1, 2**20)),
        num_handoff_slots=draw(st.integers(1, 2**20)),
        staging_base_addr=draw(u64),
        staging_bytes=draw(nonneg),
        layout_fingerprint=draw(short),
        reply_addr=draw(addr),
        kv_num_pages=draw(st.integers(1, 2**40)),
    )


bodies = st.one_of(
    registers(),
    st.builds(
        RegisterAck, ok=st.booleans(), error=short, agent_name=short, agent_metadata=st.binary(max_size=32)
    ),
    st.builds(
        KVRequest,
        dst_page_ids=st.lists(nonneg, max_size=20),
        handoff_slot=nonneg,
        decode_prefix_len=nonneg,
        staging_offset=st.integers(-1, 2**40),
        hit_page_ids=st.lists(nonneg, max_size=8),
    ),
    st.builds(Status, state=st.integers(0, 4), error=short),
    st.builds(Abort, reason=short),
    st.just(AbortAck()),
)
rooms = st.integers(0, MAX_ROOM)
senders = st.text(max_size=256)


@st.composite
def valid_frames(draw) -> list[bytes]:
    return encode(draw(bodies), draw(rooms), draw(senders), SECRET)


@st.composite
def mutated(draw) -> tuple[str, list[bytes]]:
    """A valid message changed in one way; (what changed, frames)."""
    frames = draw(valid_frames())
    kind = draw(st.sampled_from(["flip", "truncate", "extend", "drop", "swap", "duplicate", "mac", "resign"]))
    out = list(frames)
    if kind == "flip":
        i = draw(st.integers(0, len(out) - 1))
        assume(len(out[i]) > 0)
        j = draw(st.integers(0, len(out[i]) - 1))
        bit = draw(st.integers(0, 7))
        b = bytearray(out[i])
        b[j] ^= 1 << bit
        out[i] = bytes(b)
    elif kind == "truncate":
        i = draw(st.integers(0, len(out) - 1))
        assume(len(out[i]) > 0)
        out[i] = out[i][: draw(st.integers(0, len(out[i]) - 1))]
    elif kind == "extend":
        i = draw(st.integers(0, len(out) - 1))
        out[i] = out[i] + draw(st.binary(min_size=1, max_size=16))
    elif kind == "drop":
        del out[draw(st.integers(0, len(out) - 1))]
    elif kind == "swap":
        i, j = draw(st.sampled_from([(0, 1), (0, 2), (1, 2)]))
        out[i], out[j] = out[j], out[i]
    elif kind == "duplicate":
        i = draw(st.integers(0, len(out) - 1))
        out.insert(i, out[i])
    elif kind == "mac":
        out[-1] = draw(st.binary(min_size=m.MAC_BYTES, max_size=m.MAC_BYTES))
    else:  # the same content signed with another key (a replay by a holder of another secret)
        out = m.seal(out[:-1], OTHER)
    assume(out != frames)
    return kind, out


# Authentic (correctly signed) content of every shape: random bytes, random msgpack, and near-valid
# headers / bodies whose fields are individually wrong.
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
kinds = st.sampled_from(sorted(m.KINDS)) | st.text(max_size=12)


@st.composite
def near_headers(draw) -> bytes:
    fields = [
        draw(st.just(PROTOCOL_VERSION) | st.integers(-5, 5) | msgpack_values),
        draw(kinds | msgpack_values),
        draw(rooms | st.integers(-(2**63), 2**64 - 1) | msgpack_values),
        draw(senders | msgpack_values),
    ]
    if draw(st.booleans()):
        fields = fields[: draw(st.integers(0, 4))] + draw(st.lists(msgpack_values, max_size=2))
    return msgspec.msgpack.encode(fields)


@st.composite
def near_bodies(draw) -> bytes:
    base = msgspec.msgpack.decode(msgspec.msgpack.encode(draw(bodies)))  # a dict, bytes kept as bytes
    for _ in range(draw(st.integers(0, 3))):
        action = draw(st.sampled_from(["set", "delete", "tag"]))
        if action == "set":
            base[draw(st.sampled_from(sorted(base) or ["x"]) | st.text(max_size=8))] = draw(msgpack_values)
        elif action == "delete" and base:
            base.pop(draw(st.sampled_from(sorted(base))))
        else:
            base["type"] = draw(kinds)
    return msgspec.msgpack.encode(base)


authentic_content = st.one_of(
    st.lists(st.binary(max_size=64), min_size=0, max_size=3),
    st.lists(msgpack_values.map(msgspec.msgpack.encode), min_size=1, max_size=3),
    st.tuples(near_headers(), near_bodies()).map(list),
)


# ---- the decoder ---------------------------------------------------------------------------------
@fuzz_settings(150)
@given(body=bodies, room=rooms, sender=senders)
def test_round_trip(body, room, sender):
    COUNTS["decoder: round trip"] += 1
    env = decode(encode(body, room, sender, SECRET), SECRET)
    assert env == (PROTOCOL_VERSION, type(body).__struct_config__.tag, room, sender, body)


@fuzz_settings(300)
@given(
    frames=st.one_of(
        st.lists(st.binary(max_size=96), max_size=6),
        st.lists(st.binary(max_size=8) | st.integers() | st.text(max_size=4) | st.none(), max_size=4),
        st.integers() | st.text(max_size=8) | st.none() | st.binary(max_size=8),
    )
)
def test_random_input_is_a_typed_rejection(frames):
    COUNTS["decoder: random input"] += 1
    with pytest.raises(MessageRejected) as e:
        decode(frames, SECRET)
    is_frames = isinstance(frames, list) and 2 <= len(frames) <= 3
    if is_frames and all(isinstance(f, bytes) for f in frames):
        assert type(e.value) is ForgedMessage  # right shape, so the MAC is what refuses it
    else:
        assert type(e.value) is BadMessage


@fuzz_settings(400)
@given(case=mutated())
def test_tampered_message_is_forged(case):
    kind, frames = case
    COUNTS[f"decoder: tampered ({kind})"] += 1
    frozen = [bytes(f) for f in frames]
    with pytest.raises(MessageRejected) as e:
        decode(frames, SECRET)
    expected = BadMessage if len(frames) > 3 else ForgedMessage
    assert type(e.value) is expected, (kind, e.value)
    assert frames == frozen  # the decoder never changes its input


@fuzz_settings(400)
@given(content=authentic_content)
def test_authentic_garbage_is_bad_or_wrong_version(content):
    frames = m.seal(content, SECRET)
    try:
        env = decode(frames, SECRET)
    except (BadMessage, WrongVersion) as e:
        COUNTS[f"decoder: authentic garbage -> {type(e).__name__}"] += 1
        if len(content) != 2:
            assert type(e) is BadMessage
        return
    COUNTS["decoder: authentic garbage -> accepted"] += 1
    # Accepted: then it is a well-formed message in every respect.
    assert env.version == PROTOCOL_VERSION and 0 <= env.room <= MAX_ROOM
    assert type(env.body).__struct_config__.tag == env.kind
    assert decode(encode(env.body, env.room, env.sender, SECRET), SECRET) == env


@fuzz_settings(150)
@given(version=st.integers(-(2**63), 2**64 - 1), kind=kinds, body=bodies, room=rooms)
def test_wrong_version_is_refused_before_the_kind(version, kind, body, room):
    assume(version != PROTOCOL_VERSION)
    COUNTS["decoder: wrong version"] += 1
    header = msgspec.msgpack.encode([version, kind, room, "peer"])
    with pytest.raises(WrongVersion):
        decode(m.seal([header, msgspec.msgpack.encode(body)], SECRET), SECRET)
    # The version is trusted only once authenticated.
    with pytest.raises(ForgedMessage):
        decode(m.seal([header, msgspec.msgpack.encode(body)], OTHER), SECRET)


@fuzz_settings(150)
@given(frames=valid_frames(), data=st.data())
def test_oversized_is_refused_before_the_mac(frames, data):
    COUNTS["decoder: oversized"] += 1
    size = sum(len(f) for f in frames)
    limit = data.draw(st.integers(0, size - 1))
    with pytest.raises(OversizedMessage):
        decode(frames, SECRET, max_bytes=limit)
    forged = [*frames[:-1], b"\x00" * m.MAC_BYTES]  # size first: a forged oversized one is still "oversized"
    with pytest.raises(OversizedMessage):
        decode(forged, SECRET, max_bytes=limit)
    assert decode(frames, SECRET, max_bytes=size).body is not None


def test_default_size_limit_and_buffer_frames():
    big = KVRequest(dst_page_ids=[], handoff_slot=0, decode_prefix_len=0)
    frames = encode(big, 1, "d", SECRET)
    padded = [frames[0], frames[1] + b"\x00" * (m.MAX_MESSAGE_BYTES + 1 - sum(map(len, frames))), frames[2]]
    t0 = time.perf_counter()
    with pytest.raises(OversizedMessage):
        decode(padded, SECRET)
    assert time.perf_counter() - t0 < 0.5  # refused without hashing 64 MiB
    # Frames as ZMQ hands them over (buffers) decode like bytes; an int is not a frame (bytes(int) would
    # allocate that many zero bytes).
    assert decode([bytearray(f) for f in frames], SECRET).body == big
    assert decode([memoryview(f) for f in frames], SECRET).body == big
    with pytest.raises(BadMessage):
        decode([frames[0], 10**12, frames[2]], SECRET)


# ---- the channel: every bad message dropped and counted exactly once ----------------------------
MAX_MSG_BYTES = 32 << 10


@pytest.fixture(scope="module")
def channel():
    rx = ControlChannel("127.0.0.1", SECRET, "fuzz-rx", max_msg_bytes=MAX_MSG_BYTES)
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    curve_client(raw, SECRET)  # past the transport's handshake: the fuzzing is of the messages
    raw.connect(rx.address)
    yield rx, raw
    raw.close(0)
    rx.close()


_marker_room = iter(range(1, MAX_ROOM))


def _counters(ch: ControlChannel) -> dict[str, int]:
    return {k: v for k, v in ch.stats().items() if k != "num_sent"}


def _send_and_sync(rx: ControlChannel, raw: zmq.Socket, frames: list[bytes]) -> list[m.Envelope]:
    """Send `frames`, then a valid marker; once the marker is polled (one PUSH socket keeps order), the
    message before it was handled. Returns what `poll` delivered before the marker."""
    room = next(_marker_room)
    raw.send_multipart(frames)
    raw.send_multipart(encode(Status(state=4), room, "marker", SECRET))
    got: list[m.Envelope] = []
    deadline = time.monotonic() + 10
    while not any(e.sender == "marker" and e.room == room for e in got):
        assert time.monotonic() < deadline, "marker never arrived"
        got += rx.poll(timeout_s=0.05)
    assert got[-1].room == room and got[-1].sender == "marker"
    return got[:-1]


_VERDICT_COUNTER = {
    ForgedMessage: "num_forged",
    BadMessage: "num_malformed",
    WrongVersion: "num_wrong_version",
}
_VERDICT_COUNTER[OversizedMessage] = "num_malformed"

small_oversized = st.tuples(valid_frames(), st.integers(1, 1000)).map(
    # Three frames, each below the per-frame ZMQ limit, together above the channel's limit.
    lambda fp: [
        fp[0][0] + b"\x00" * (MAX_MSG_BYTES // 2),
        fp[0][1] + b"\x00" * (MAX_MSG_BYTES // 2 + fp[1]),
        fp[0][2],
    ]
)
bad_messages = st.one_of(
    st.lists(st.binary(max_size=96), min_size=1, max_size=6),
    mutated().map(lambda kf: kf[1]),
    authentic_content.map(lambda c: m.seal(c, SECRET)),
    st.tuples(st.integers(2, 1000), bodies).map(
        lambda vb: m.seal(
            [msgspec.msgpack.encode([vb[0], "abort", 1, "p"]), msgspec.msgpack.encode(vb[1])], SECRET
        )
    ),
    small_oversized,
)


@fuzz_settings(200)
@given(frames=bad_messages)
def test_channel_counts_each_bad_message_once(channel, frames):
    rx, raw = channel
    try:
        env = decode(frames, SECRET, MAX_MSG_BYTES)
        verdict = None
    except MessageRejected as e:
        verdict = type(e)
    COUNTS[f"channel: {verdict.__name__ if verdict else 'accepted'}"] += 1
    before = _counters(rx)
    delivered = _send_and_sync(rx, raw, frames)
    after = _counters(rx)
    delta = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    if verdict is None:  # authentic garbage that happens to be a valid message
        assert delivered == [env] and delta == {"num_received": 2}
    else:
        assert delivered == []
        assert delta == {_VERDICT_COUNTER[verdict]: 1, "num_received": 1}, (verdict, delta)  # +1: the marker
    assert rx.alive and rx.num_errors == 0


def test_channel_frame_over_zmq_limit_drops_connection_only(channel):
    """A single frame above max_msg_bytes never reaches the decoder: ZMQ drops the connection (not
    counted); the channel lives on and the sender's socket reconnects."""
    rx, raw = channel
    before = _counters(rx)
    raw.send_multipart([b"\x00" * (MAX_MSG_BYTES + 1), b"x", b"\x00" * 32])
    deadline = time.monotonic() + 10
    room = next(_marker_room)
    got: list[m.Envelope] = []
    while not got:  # until ZMQ has reconnected, markers wait in the sender's queue (or are lost)
        assert time.monotonic() < deadline
        raw.send_multipart(encode(Status(state=4), room, "marker", SECRET))
        got = rx.poll(timeout_s=0.2)
    while more := rx.poll(timeout_s=0.3):  # queued copies may still be on their way
        got += more
    assert {e.room for e in got} == {room} and rx.alive and rx.num_errors == 0
    after = _counters(rx)
    assert {k: after[k] - before[k] for k in after if after[k] != before[k]} == {"num_received": len(got)}


def test_zz_report_counts():
    print("\nfuzz examples run:", dict(sorted(COUNTS.items())))
    assert sum(COUNTS.values()) > 0
