"""Typed, versioned, authenticated control-plane messages between a prefill and a decode engine.

Who uses it: `control.ControlChannel` calls `encode` on the sending engine's scheduler thread (inside
`send`) and `decode` on its own I/O thread for every received message; tests call both directly.
Nothing here does I/O, keeps state or imports torch.

Wire format (one ZMQ multipart message = three frames):

    frame 0  header  msgpack array [version: int, kind: str, room: int, sender: str]
    frame 1  body    msgpack map of the message struct, tagged with its kind ({"type": kind, ...})
    frame 2  mac     HMAC-SHA256(secret, DOMAIN || u32be(len(header)) || header || u32be(len(body)) || body)

Decoding order (each step only runs on input the previous one accepted):
    1. 2 or 3 frames, each a bytes-like buffer, else BadMessage; all frames together at most `max_bytes`
       (default MAX_MESSAGE_BYTES), else OversizedMessage -- both before any hashing, so a flood of huge
       or many-frame messages costs no HMAC work; the last frame is the MAC
    2. MAC compared in constant time over the length-prefixed content frames -> ForgedMessage when it is
       missing, has the wrong size or does not match (a truncated or reordered message fails here too:
       the MAC binds every byte and every frame boundary). Nothing unauthenticated is ever parsed.
    3. exactly 2 content frames, header parses and is well typed -> else BadMessage
    4. header version == PROTOCOL_VERSION -> else WrongVersion (checked before the kind, so a newer peer
       with new kinds gets a version error, not "unknown kind")
    5. kind is known, body parses into that kind's struct with every field constraint, body tag == kind
       -> else BadMessage

Every rejection is a `MessageRejected` (ForgedMessage, BadMessage and its OversizedMessage, WrongVersion);
`decode` raises nothing else on any input (tests/test_fuzz_messages.py fuzzes it).

Never pickle: both content frames are plain msgpack; decoding unknown bytes can only yield the structs
below. Rooms are 63-bit non-negative ints (0 is reserved for per-peer messages such as Register).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Annotated, Any, NamedTuple

import msgspec
from msgspec import Meta

# 2: Register announces its pool size (kv_num_pages), RegisterAck the prefill's room life.
# 3: Abort and Status carry `client_abort` (the room ends because its request was aborted on purpose).
# Peers of different versions drop each other's messages as WrongVersion (counted), never half-parse them.
PROTOCOL_VERSION = 4  # 4: RegisterAck.peer_idle_s
MAC_BYTES = 32
# Largest message (all frames together) `decode` accepts unless told otherwise. ControlChannel passes its
# own `max_msg_bytes`, which also caps each frame inside ZMQ (MAXMSGSIZE). The biggest legitimate
# messages are a Register (transfer agent metadata, kilobytes) and a KVRequest of a very long prompt
# (a few bytes per page id): far below this.
MAX_MESSAGE_BYTES = 64 << 20
_MAX_FRAMES = 3
MAX_ROOM = 2**63 - 1
_DOMAIN = b"pdserve-control\x00"  # domain-separates these MACs from any other use of the secret

NonNeg = Annotated[int, Meta(ge=0)]
U64 = Annotated[int, Meta(ge=0)]  # msgpack carries up to 2**64 - 1
Positive = Annotated[int, Meta(gt=0)]
ShortStr = Annotated[str, Meta(max_length=256)]
# A peer's reply address: a ZMQ tcp:// or ipc:// endpoint, never anything a connect could misread or
# refuse. tcp: a host name or IPv4 address (labels start and end alphanumeric) or a bracketed IPv6
# address, and a port; ipc: a path within the kernel's 107 bytes. \Z, not $ (which also matches
# before a trailing newline).
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9_\-]*[A-Za-z0-9])?"
TCP_ADDR = rf"tcp://({_LABEL}(\.{_LABEL})*|\[[0-9A-Fa-f:.]+\]):[0-9]{{1,5}}"
IPC_ADDR = r"ipc://[^\s]{1,107}"
ZmqAddr = Annotated[str, Meta(pattern=rf"^({TCP_ADDR}|{IPC_ADDR})\Z", max_length=256)]


class MessageRejected(Exception):
    """Base of every rejection `decode` raises: the message is dropped (and counted by the channel)."""


class ForgedMessage(MessageRejected):
    """The MAC is missing or wrong: the message is not from a holder of the cluster secret."""


class BadMessage(MessageRejected):
    """Malformed: wrong frame count or frame types, or authentic framing with malformed content (bad
    header, unknown kind, invalid body)."""


class OversizedMessage(BadMessage):
    """More bytes (all frames together) than the receiver accepts; rejected before the MAC is computed."""


class WrongVersion(MessageRejected):
    """Authentic message from a peer speaking another protocol version."""


class Register(msgspec.Struct, tag="register", forbid_unknown_fields=True):
    """decode -> prefill, once per (decode, prefill) pair, room 0. Describes where the prefill may write.

    Regions are ordered K0, V0, K1, V1, ...; page p of region r lives at kv_base_addrs[r] + p *
    kv_bytes_per_page[r], for p < kv_num_pages. The prefill writes nothing outside these bounds (pages,
    handoff slots, staging bytes): it checks every KVRequest against them. A prefill whose own
    fingerprint, region table or handoff slot size differs answers RegisterAck(ok=False)."""

    agent_name: ShortStr
    agent_metadata: bytes
    kv_base_addrs: list[U64]
    kv_bytes_per_page: list[Positive]
    handoff_base_addr: U64
    handoff_slot_bytes: Positive
    num_handoff_slots: Positive
    staging_base_addr: U64
    staging_bytes: NonNeg
    layout_fingerprint: ShortStr
    reply_addr: ZmqAddr
    kv_num_pages: Positive  # pages of each KV region

    def __post_init__(self) -> None:
        # Raised during decode; `decode` turns it into BadMessage.
        if len(self.kv_base_addrs) != len(self.kv_bytes_per_page):
            raise ValueError("kv_base_addrs and kv_bytes_per_page differ in length")


class RegisterAck(msgspec.Struct, tag="register_ack", forbid_unknown_fields=True):
    """prefill -> decode, answer to Register (room 0). On ok, carries the prefill's transfer agent,
    `room_life_s`, the longest a room can live on the prefill (its three state deadlines): the decode
    holds an aborted room's pages at least that long, whatever its own deadlines; and `peer_idle_s`,
    how long the prefill keeps a silent decode's registration: the decode renews within a quarter of
    it, whatever its own (0: not said, the decode goes by its own)."""

    ok: bool
    error: str = ""
    agent_name: ShortStr = ""
    agent_metadata: bytes = b""
    room_life_s: Annotated[float, Meta(ge=0.0, le=1e6)] = 0.0
    peer_idle_s: Annotated[float, Meta(ge=0.0, le=1e9)] = 0.0


class KVRequest(msgspec.Struct, tag="kv_request", forbid_unknown_fields=True):
    """decode -> prefill, once per room: the destination pages (for prompt tokens from
    decode_prefix_len on), the handoff slot, and where in the staging buffer to write (-1: direct)."""

    dst_page_ids: list[NonNeg]
    handoff_slot: NonNeg
    decode_prefix_len: NonNeg  # tokens the decode already holds (its prefix cache); multiple of page_size
    staging_offset: Annotated[int, Meta(ge=-1)] = -1
    # DualPath DE read path: the decode read the first decode_prefix_len tokens from the store into
    # these pages; the prefill pulls them (a data-plane read) instead of recomputing or reading itself.
    hit_page_ids: list[NonNeg] = []


class Status(msgspec.Struct, tag="status", forbid_unknown_fields=True):
    """Either direction: a room's KVState (as int). prefill -> decode Failed carries the same promise as
    an AbortAck (no write for this room is in flight or will be issued); decode -> prefill Success is
    the ack that lets the prefill free its source pages."""

    state: Annotated[int, Meta(ge=0, le=4)]
    error: str = ""
    # Failed because the request was aborted on purpose (/abort_request), not by a fault: the other
    # half ends its request with finish_reason "abort", as an answer, instead of an error.
    client_abort: bool = False


class Abort(msgspec.Struct, tag="abort", forbid_unknown_fields=True):
    """Either direction: stop working on this room. The receiver answers AbortAck once it has stopped
    and none of its writes to the room is in flight (see state.AbortTracker)."""

    reason: str
    client_abort: bool = False  # as in Status: the request was aborted on purpose, not failed


class AbortAck(msgspec.Struct, tag="abort_ack", forbid_unknown_fields=True):
    """Answer to Abort: the sender has stopped and has no write to this room in flight."""


Message = Register | RegisterAck | KVRequest | Status | Abort | AbortAck
KINDS: dict[str, type] = {
    cls.__struct_config__.tag: cls for cls in (Register, RegisterAck, KVRequest, Status, Abort, AbortAck)
}


_KIND_OF: dict[type, str] = {cls: kind for kind, cls in KINDS.items()}


class Envelope(NamedTuple):
    """One authenticated message as `decode` returns it; `kind` equals the body's tag."""

    version: int
    kind: str
    room: int
    sender: str
    body: Any  # one of the Message structs


class _Header(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    version: int
    kind: ShortStr
    room: Annotated[int, Meta(ge=0, le=MAX_ROOM)]
    sender: ShortStr


_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(_Header)
_body_decoders = {kind: msgspec.msgpack.Decoder(cls) for kind, cls in KINDS.items()}


def _mac(secret: bytes, content: list[bytes]) -> bytes:
    h = hmac.new(secret, _DOMAIN, hashlib.sha256)
    for frame in content:
        h.update(struct.pack(">I", len(frame)))
        h.update(frame)
    return h.digest()


def _check_secret(secret: bytes) -> None:
    if not isinstance(secret, bytes | bytearray) or len(secret) == 0:
        raise ValueError("the cluster secret must be non-empty bytes")


def seal(content: list[bytes], secret: bytes) -> list[bytes]:
    """Append the MAC to arbitrary content frames. `encode` uses it; tests use it to build authentic
    but malformed messages."""
    _check_secret(secret)
    return [*content, _mac(secret, content)]


def encode(body: Message, room: int, sender: str, secret: bytes) -> list[bytes]:
    """Frames for one message. Raises TypeError / ValueError on a caller bug (unknown body type, room
    out of range, sender too long, empty secret); never on valid input."""
    if type(body) not in _KIND_OF:
        raise TypeError(f"not a control message: {type(body).__name__}")
    if not isinstance(room, int) or not 0 <= room <= MAX_ROOM:
        raise ValueError(f"room must be an int in [0, 2**63): {room!r}")
    if not isinstance(sender, str) or len(sender) > 256:
        raise ValueError("sender must be a str of at most 256 characters")
    header = _encoder.encode(_Header(PROTOCOL_VERSION, _KIND_OF[type(body)], room, sender))
    return seal([header, _encoder.encode(body)], secret)


def decode(frames: list[bytes], secret: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> Envelope:
    """Verify and parse one received multipart message (see the module docstring for the order).
    Raises ForgedMessage, BadMessage (OversizedMessage) or WrongVersion -- all MessageRejected -- and
    never anything else on any input (ValueError only for an empty `secret`, a caller bug)."""
    _check_secret(secret)
    if not isinstance(frames, list | tuple) or not 2 <= len(frames) <= _MAX_FRAMES:
        raise BadMessage("expected header, body and MAC frames")
    try:
        # memoryview, not bytes(): bytes(n) of an int would allocate n zero bytes.
        views = [memoryview(f) for f in frames]
    except TypeError as e:
        raise BadMessage(f"frames are not bytes: {e}") from None
    size = sum(v.nbytes for v in views)
    if size > max_bytes:
        raise OversizedMessage(f"message of {size} bytes exceeds the limit of {max_bytes}")
    content = [v.tobytes() for v in views[:-1]]
    mac = views[-1].tobytes()
    if len(mac) != MAC_BYTES or not hmac.compare_digest(mac, _mac(secret, content)):
        raise ForgedMessage("missing or invalid HMAC")
    if len(content) != 2:
        raise BadMessage(f"expected 2 content frames, got {len(content)}")
    try:
        header = _header_decoder.decode(content[0])
    except Exception as e:  # any parse failure of authentic bytes is BadMessage, whatever raised it
        raise BadMessage(f"bad header: {e}") from None
    if header.version != PROTOCOL_VERSION:
        raise WrongVersion(f"peer speaks version {header.version}, we speak {PROTOCOL_VERSION}")
    body_decoder = _body_decoders.get(header.kind)
    if body_decoder is None:
        raise BadMessage(f"unknown kind {header.kind!r}")
    try:
        body = body_decoder.decode(content[1])
    except Exception as e:  # DecodeError/ValidationError (incl. a wrong tag) or __post_init__'s ValueError
        raise BadMessage(f"bad {header.kind} body: {e}") from None
    return Envelope(header.version, header.kind, header.room, header.sender, body)
