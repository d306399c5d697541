"""Control messages: exact round trips, and every kind of bad input maps to its typed exception."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.disagg import messages as m
from pdserve.disagg.messages import (
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    BadMessage,
    ForgedMessage,
    KVRequest,
    Register,
    RegisterAck,
    Status,
    WrongVersion,
    decode,
    encode,
)

SECRET = b"s" * 32
ROOM = 2**63 - 1


def _register() -> Register:
    return Register(
        agent_name="decode-0",
        agent_metadata=b"\x00\x01agent-blob\xff",
        kv_base_addrs=[0x7F0000000000, 0x7F0000100000, 2**64 - 1, 0],
        kv_bytes_per_page=[4096, 4096, 8192, 1],
        handoff_base_addr=0x7F1000000000,
        handoff_slot_bytes=256,
        num_handoff_slots=64,
        staging_base_addr=0x7F2000000000,
        staging_bytes=1 << 20,
        layout_fingerprint="llama/bf16/p16/L2",
        reply_addr="tcp://127.0.0.1:5555",
        kv_num_pages=4096,
    )


ALL_BODIES = [
    _register(),
    msgspec.structs.replace(_register(), kv_num_pages=12345),
    RegisterAck(ok=True, agent_name="prefill-0", agent_metadata=b"meta", room_life_s=90.0),
    RegisterAck(ok=False, error="layout mismatch: a != b"),
    KVRequest(dst_page_ids=[3, 4, 5, 9], handoff_slot=7, decode_prefix_len=32),
    KVRequest(dst_page_ids=[], handoff_slot=0, decode_prefix_len=0, staging_offset=4096),
    Status(state=4),
    Status(state=0, error="deadline in Transferring"),
    Abort(reason="client disconnected"),
    AbortAck(),
]


@pytest.mark.parametrize("body", ALL_BODIES, ids=lambda b: type(b).__name__)
def test_round_trip_every_kind(body):
    frames = encode(body, ROOM, "decode-0", SECRET)
    assert len(frames) == 3 and len(frames[2]) == m.MAC_BYTES
    env = decode(frames, SECRET)
    assert env == (PROTOCOL_VERSION, type(body).__struct_config__.tag, ROOM, "decode-0", body)
    assert env.body == body and type(env.body) is type(body)
    # Plain msgpack, never pickle: both content frames decode with a schema-less msgpack decoder.
    header = msgspec.msgpack.decode(frames[0])
    assert header == [PROTOCOL_VERSION, env.kind, ROOM, "decode-0"]
    assert msgspec.msgpack.decode(frames[1])["type"] == env.kind
    # msgpack fixarray(4) and a non-empty fixmap; pickle (protocol >= 2) would start with 0x80.
    assert frames[0][0] == 0x94 and 0x81 <= frames[1][0] <= 0x8F


def test_no_pickle_in_the_wire_code():
    import inspect

    from pdserve.disagg import control

    for mod in (m, control):
        assert "pickle" not in inspect.getsource(mod).replace("never pickle", "").replace("Never pickle", "")


def test_kinds_are_exactly_the_six():
    assert set(m.KINDS) == {"register", "register_ack", "kv_request", "status", "abort", "abort_ack"}


def test_forged_and_wrong_secret():
    frames = encode(Abort("x"), 5, "d", SECRET)
    with pytest.raises(ForgedMessage):
        decode(frames, b"another secret")
    bad_mac = bytes([frames[2][0] ^ 1]) + frames[2][1:]
    with pytest.raises(ForgedMessage):
        decode([frames[0], frames[1], bad_mac], SECRET)
    # Body tampered (room moved from 5 to 6 in the header) with the old MAC.
    tampered = msgspec.msgpack.encode([PROTOCOL_VERSION, "abort", 6, "d"])
    with pytest.raises(ForgedMessage):
        decode([tampered, frames[1], frames[2]], SECRET)
    # The MAC binds frame boundaries: moving a byte from one frame to the other fails.
    with pytest.raises(ForgedMessage):
        decode([frames[0] + frames[1][:1], frames[1][1:], frames[2]], SECRET)


def test_truncated_frames():
    frames = encode(KVRequest([1, 2], 0, 0), 5, "d", SECRET)
    with pytest.raises(ForgedMessage):  # MAC frame dropped: the body frame is taken as the MAC
        decode(frames[:2], SECRET)
    with pytest.raises(ForgedMessage):  # MAC cut short
        decode([frames[0], frames[1], frames[2][:16]], SECRET)
    with pytest.raises(ForgedMessage):  # body cut short
        decode([frames[0], frames[1][:-3], frames[2]], SECRET)
    with pytest.raises(BadMessage):
        decode(frames[:1], SECRET)
    with pytest.raises(BadMessage):
        decode([], SECRET)


def test_garbage():
    with pytest.raises(ForgedMessage):
        decode([b"\xff" * 10, b"garbage", b"\x00" * 32], SECRET)
    with pytest.raises(BadMessage):
        decode("not frames", SECRET)  # type: ignore[arg-type]
    # Authentic (correct MAC) but malformed content -> BadMessage, at every layer.
    sealed_garbage = [
        [b"\xc1", b"\x80"],  # invalid msgpack header
        [msgspec.msgpack.encode([PROTOCOL_VERSION, "abort"]), b""],  # short header
        [
            msgspec.msgpack.encode([PROTOCOL_VERSION, "abort", -1, "d"]),
            msgspec.msgpack.encode({"type": "abort", "reason": "x"}),
        ],
        [
            msgspec.msgpack.encode([PROTOCOL_VERSION, "abort", 2**63, "d"]),
            msgspec.msgpack.encode({"type": "abort", "reason": "x"}),
        ],
        [msgspec.msgpack.encode([PROTOCOL_VERSION, "abort", 1, "d"]), b"\xc1"],  # body not msgpack
        [
            msgspec.msgpack.encode([PROTOCOL_VERSION, "abort", 1, "d"]),
            msgspec.msgpack.encode({"type": "abort"}),
        ],  # missing field
        [
            msgspec.msgpack.encode([PROTOCOL_VERSION, "abort", 1, "d"]),
            msgspec.msgpack.encode({"type": "abort_ack"}),
        ],  # tag != kind
        [
            msgspec.msgpack.encode([PROTOCOL_VERSION, "status", 1, "d"]),
            msgspec.msgpack.encode({"type": "status", "state": 5}),
        ],
        [
            msgspec.msgpack.encode([PROTOCOL_VERSION, "kv_request", 1, "d"]),
            msgspec.msgpack.encode(
                {"type": "kv_request", "dst_page_ids": [-1], "handoff_slot": 0, "decode_prefix_len": 0}
            ),
        ],
        [
            msgspec.msgpack.encode([PROTOCOL_VERSION, "abort", 1, "d"]),
            msgspec.msgpack.encode({"type": "abort", "reason": "x", "extra": 1}),  # unknown field
        ],
        [
            msgspec.msgpack.encode([PROTOCOL_VERSION, "abort", 1, "d"]),
            msgspec.msgpack.encode({"type": "abort", "reason": "x"}),
            b"",
        ],
    ]
    for content in sealed_garbage:
        with pytest.raises(BadMessage):
            decode(m.seal(content, SECRET), SECRET)


def test_register_validation():
    reg = msgspec.to_builtins(_register(), builtin_types=(bytes,))  # bytes stay bytes on the wire
    header = msgspec.msgpack.encode([PROTOCOL_VERSION, "register", 0, "d"])
    body = msgspec.msgpack.encode({**reg, "type": "register"})
    assert decode(m.seal([header, body], SECRET), SECRET).body == _register()  # each case below alone is bad
    for bad in (
        {"kv_bytes_per_page": [4096]},  # lengths differ from kv_base_addrs
        {"kv_bytes_per_page": [0, 1, 1, 1]},
        {"reply_addr": "http://evil"},
        {"reply_addr": "tcp://h:1; rm -rf"},
        {"reply_addr": "tcp://-:5"},  # libzmq refuses it at connect
        {"reply_addr": "tcp://h:1\n"},  # "$" matched before a trailing newline
        {"reply_addr": "ipc:///" + "a" * 110},  # past the kernel's socket path length
        {"num_handoff_slots": 0},
    ):
        body = msgspec.msgpack.encode({**reg, **bad, "type": "register"})
        with pytest.raises(BadMessage):
            decode(m.seal([header, body], SECRET), SECRET)


def test_unknown_kind_and_wrong_version():
    body = msgspec.msgpack.encode({"type": "abort", "reason": "x"})
    with pytest.raises(BadMessage, match="unknown kind"):
        decode(
            m.seal([msgspec.msgpack.encode([PROTOCOL_VERSION, "steal_pages", 1, "d"]), body], SECRET), SECRET
        )
    for version in (0, PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, 99):
        with pytest.raises(WrongVersion):
            decode(m.seal([msgspec.msgpack.encode([version, "abort", 1, "d"]), body], SECRET), SECRET)
    # A newer peer's new kind is a version error, not "unknown kind".
    with pytest.raises(WrongVersion):
        decode(
            m.seal([msgspec.msgpack.encode([PROTOCOL_VERSION + 1, "future_kind", 1, "d"]), body], SECRET),
            SECRET,
        )
    # Version is only trusted once authenticated: a forged wrong-version message is ForgedMessage.
    with pytest.raises(ForgedMessage):
        decode([msgspec.msgpack.encode([PROTOCOL_VERSION + 1, "abort", 1, "d"]), body, b"\x00" * 32], SECRET)


def test_encode_rejects_caller_bugs():
    with pytest.raises(TypeError):
        encode({"type": "abort"}, 1, "d", SECRET)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        encode(Abort("x"), -1, "d", SECRET)
    with pytest.raises(ValueError):
        encode(Abort("x"), 2**63, "d", SECRET)
    with pytest.raises(ValueError):
        encode(Abort("x"), 1, "d", b"")
    with pytest.raises(ValueError):
        decode(encode(Abort("x"), 1, "d", SECRET), b"")
    with pytest.raises(ValueError):
        Register(**{**msgspec.structs.asdict(_register()), "kv_bytes_per_page": [1]})


def test_register_needs_its_pool_size_and_the_ack_a_sane_room_life():
    """Version 2 made the decode's pool size part of Register (the prefill bounds every KVRequest's page
    ids by it) and the prefill's room life part of RegisterAck (the decode's abort lease waits it out)."""
    fields = msgspec.structs.asdict(_register())
    header = msgspec.msgpack.encode([PROTOCOL_VERSION, "register", 0, "decode-0"])
    for bad in ({"kv_num_pages": None}, {"kv_num_pages": 0}, {"kv_num_pages": -1}):
        body = {"type": "register", **fields, **bad}
        if bad["kv_num_pages"] is None:
            del body["kv_num_pages"]
        with pytest.raises(BadMessage):
            decode(m.seal([header, msgspec.msgpack.encode(body)], SECRET), SECRET)
    ack_header = msgspec.msgpack.encode([PROTOCOL_VERSION, "register_ack", 0, "prefill-0"])
    for life in (-1.0, float("nan"), float("inf"), 1e9):
        body = msgspec.msgpack.encode({"type": "register_ack", "ok": True, "room_life_s": life})
        with pytest.raises(BadMessage):
            decode(m.seal([ack_header, body], SECRET), SECRET)
