"""Handoff slots: the small fixed-layout row the prefill writes into the decode's memory after the last
KV page, carrying token 1, cached-token counts, its logprobs and the room.

Who uses it: each engine owns one `HandoffPool` (scheduler thread only; no locks). The decode registers
`.buffer` with its transfer backend, `alloc`s a slot per request and sends its index in KVRequest; the
prefill fills a slot of its own pool with `write_local` and has the backend copy those `SLOT_BYTES` to
`Register.handoff_base_addr + slot * handoff_slot_bytes` with the request's last write. On the transfer
notification the decode `read`s the slot and commits only if `gate(row, room)` holds (the metadata
gate): every copy done AND the row is intact AND its room is the request's room. A mismatch means a slot
collision or a stale/torn row and fails the request. `free` zeroes the slot so a stale row can never
pass the gate of a later request.

Slot layout (little-endian, SLOT_BYTES = 256, a multiple of 64 so every slot is cache-line aligned):

    off  size  field
      0     4  first_token_id           int32 >= 0
      4     4  cached_tokens_device     int32 >= 0
      8     4  cached_tokens_host       int32 >= 0
     12     4  cached_tokens_storage    int32 >= 0
     16     4  flags                    uint32; bit 0: logprobs present
     20     4  first_logprob            float32 (0.0 when absent)
     24     4  top_n                    int32 in [0, 20] (0 when absent)
     28     4  first_logprob_rank       int32 >= 0: token 1's rank (0 when absent)
     32    80  top_ids[20]              int32, first top_n used, rest zero
    112    80  top_logprobs[20]         float32, first top_n used, rest zero
    192    48  (zero)
    240     4  crc32                    zlib.crc32 of bytes [0, 240) followed by bytes [248, 256)
    244     4  (zero)
    248     8  room                     uint64 > 0; LAST in the slot
A zeroed slot (room 0) is "not landed". The room sits last so an in-order write that was cut short
leaves it zero or stale; the CRC catches any other torn or mixed row. Float32 is exact for the
sampler's logprobs (they are float32 log-softmax values).
"""

from __future__ import annotations

import heapq
import math
import struct
import zlib
from dataclasses import dataclass

import numpy as np

SLOT_BYTES = 256
MAX_TOP_N = 20
MAX_ROOM = 2**63 - 1
_INT32_MAX = 2**31 - 1

OFF_FIRST_TOKEN = 0
OFF_CACHED_DEVICE = 4
OFF_CACHED_HOST = 8
OFF_CACHED_STORAGE = 12
OFF_FLAGS = 16
OFF_FIRST_LOGPROB = 20
OFF_TOP_N = 24
OFF_FIRST_RANK = 28
OFF_TOP_IDS = 32
OFF_TOP_LOGPROBS = OFF_TOP_IDS + 4 * MAX_TOP_N  # 112
OFF_CRC = 240
OFF_ROOM = SLOT_BYTES - 8  # 248
FLAG_LOGPROBS = 1
_ALIGN_BYTES = 4096  # buffer start alignment (page), friendlier to RDMA registration

_HEAD = struct.Struct("<iiiiIfii")  # first token, 3 counts, flags, first logprob, top_n, rank
_TOP_IDS = struct.Struct(f"<{MAX_TOP_N}i")
_TOP_LPS = struct.Struct(f"<{MAX_TOP_N}f")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class BadHandoffRow(ValueError):
    """A slot's bytes are not a valid row (not landed, torn, corrupted, or out-of-range fields)."""


@dataclass(frozen=True)
class HandoffRow:
    room: int
    first_token_id: int
    cached_tokens_device: int = 0
    cached_tokens_host: int = 0
    cached_tokens_storage: int = 0
    first_logprob: float | None = None  # None: logprobs were not requested
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), at most 20; () when absent
    first_logprob_rank: int = 0  # token 1's rank (1 + tokens likelier); 0 when absent

    @property
    def logprobs(self) -> tuple[float, list[tuple[int, float]], int] | None:
        """The sampler's per-row logprobs shape: (chosen logprob, [(id, logprob), ...], rank) or None."""
        if self.first_logprob is None:
            return None
        return (self.first_logprob, list(self.top_logprobs), self.first_logprob_rank)


def _crc(buf: bytes | bytearray) -> int:
    return zlib.crc32(buf[OFF_ROOM:SLOT_BYTES], zlib.crc32(buf[:OFF_CRC]))


def _check_int32(name: str, v: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= _INT32_MAX:
        raise BadHandoffRow(f"{name} must be an int in [0, 2**31): {v!r}")


def encode_row(row: HandoffRow) -> bytes:
    """SLOT_BYTES bytes for `row`; raises BadHandoffRow on an out-of-range field."""
    if not isinstance(row.room, int) or not 0 < row.room <= MAX_ROOM:
        raise BadHandoffRow(f"room must be an int in (0, 2**63): {row.room!r}")
    for name in (
        "first_token_id",
        "cached_tokens_device",
        "cached_tokens_host",
        "cached_tokens_storage",
        "first_logprob_rank",
    ):
        _check_int32(name, getattr(row, name))
    top = row.top_logprobs
    if len(top) > MAX_TOP_N:
        raise BadHandoffRow(f"at most {MAX_TOP_N} top logprobs, got {len(top)}")
    if row.first_logprob is None and (top or row.first_logprob_rank):
        raise BadHandoffRow("top_logprobs or a rank without first_logprob")
    ids = [0] * MAX_TOP_N
    lps = [0.0] * MAX_TOP_N
    for i, (tok, lp) in enumerate(top):
        _check_int32("top logprob token id", tok)
        ids[i], lps[i] = tok, float(lp)
    for lp in [row.first_logprob or 0.0, *lps]:
        if math.isnan(lp) or lp == math.inf:  # -inf is a legal logprob; rounding may give tiny > 0
            raise BadHandoffRow(f"a logprob must not be NaN or +inf: {lp!r}")
    flags = FLAG_LOGPROBS if row.first_logprob is not None else 0
    buf = bytearray(SLOT_BYTES)
    head = (row.first_token_id, row.cached_tokens_device, row.cached_tokens_host, row.cached_tokens_storage)
    try:
        _HEAD.pack_into(
            buf, 0, *head, flags, float(row.first_logprob or 0.0), len(top), row.first_logprob_rank
        )
        _TOP_LPS.pack_into(buf, OFF_TOP_LOGPROBS, *lps)
    except OverflowError as e:  # a finite double beyond float32's range
        raise BadHandoffRow(f"logprob out of float32 range: {e}") from None
    _TOP_IDS.pack_into(buf, OFF_TOP_IDS, *ids)
    _U64.pack_into(buf, OFF_ROOM, row.room)
    _U32.pack_into(buf, OFF_CRC, _crc(buf))
    return bytes(buf)


def decode_row(data: bytes | bytearray | memoryview) -> HandoffRow:
    """Parse and validate one slot's bytes; raises BadHandoffRow when not landed (room 0), torn (CRC),
    or any field is out of range."""
    buf = bytes(data)
    if len(buf) != SLOT_BYTES:
        raise BadHandoffRow(f"a row is {SLOT_BYTES} bytes, got {len(buf)}")
    (room,) = _U64.unpack_from(buf, OFF_ROOM)
    if room == 0:
        raise BadHandoffRow("room is 0: the row has not landed")
    if _U32.unpack_from(buf, OFF_CRC)[0] != _crc(buf):
        raise BadHandoffRow("CRC mismatch: torn or corrupted row")
    tok, dev, host, storage, flags, first_lp, top_n, rank = _HEAD.unpack_from(buf, 0)
    if room > MAX_ROOM or min(tok, dev, host, storage, rank) < 0 or flags & ~FLAG_LOGPROBS:
        raise BadHandoffRow("field out of range")
    has_lp = bool(flags & FLAG_LOGPROBS)
    if rank and not has_lp:
        raise BadHandoffRow("a rank without logprobs")
    if not 0 <= top_n <= MAX_TOP_N or (top_n and not has_lp):
        raise BadHandoffRow(f"top_n out of range: {top_n}")
    ids = _TOP_IDS.unpack_from(buf, OFF_TOP_IDS)
    lps = _TOP_LPS.unpack_from(buf, OFF_TOP_LOGPROBS)
    if min(ids) < 0 or any(math.isnan(v) or v == math.inf for v in (first_lp, *lps)):
        raise BadHandoffRow("bad logprob entries")
    return HandoffRow(
        room=room,
        first_token_id=tok,
        cached_tokens_device=dev,
        cached_tokens_host=host,
        cached_tokens_storage=storage,
        first_logprob=first_lp if has_lp else None,
        top_logprobs=tuple(zip(ids[:top_n], lps[:top_n], strict=True)),
        first_logprob_rank=rank,
    )


def gate(row: HandoffRow | None, expected_room: int) -> bool:
    """The decode's metadata gate: commit only a valid row whose room is the request's (non-zero) room."""
    return row is not None and expected_room != 0 and row.room == expected_room


class HandoffPool:
    """`num_slots` slots of SLOT_BYTES in one contiguous, page-aligned, zero-filled uint8 numpy buffer
    whose address never changes (it is registered with the transfer backend)."""

    def __init__(self, num_slots: int) -> None:
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError("num_slots must be an int >= 1")
        self.num_slots = num_slots
        self.slot_bytes = SLOT_BYTES
        raw = np.zeros(num_slots * SLOT_BYTES + _ALIGN_BYTES, dtype=np.uint8)
        start = (-raw.ctypes.data) % _ALIGN_BYTES
        self._raw = raw  # keeps the allocation alive; `buffer` is an aligned view into it
        self.buffer: np.ndarray = raw[start : start + num_slots * SLOT_BYTES]
        self.base_addr: int = self.buffer.ctypes.data
        self._free: list[int] = list(range(num_slots))  # min-heap: alloc hands out the lowest id
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return self.num_slots * SLOT_BYTES

    def alloc(self) -> int | None:
        """Lowest free slot id, or None when all are in use."""
        if not self._free:
            return None
        slot = heapq.heappop(self._free)
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """Zero the slot and return it. Freeing a slot not in use is a caller bug (ValueError)."""
        self._check_used(slot)
        self._view(slot)[:] = 0
        self._used.remove(slot)
        heapq.heappush(self._free, slot)

    def slot_addr(self, slot: int) -> int:
        if not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot out of range: {slot!r}")
        return self.base_addr + slot * SLOT_BYTES

    def raw(self, slot: int) -> bytes:
        """The slot's current bytes (used or not)."""
        self.slot_addr(slot)
        return self._view(slot).tobytes()

    def read(self, slot: int) -> HandoffRow:
        """Decode an in-use slot; raises BadHandoffRow when it has not landed or is invalid."""
        self._check_used(slot)
        return decode_row(self._view(slot).tobytes())

    def try_read(self, slot: int) -> HandoffRow | None:
        """`read`, but None instead of BadHandoffRow (for `gate(pool.try_read(slot), room)`)."""
        try:
            return self.read(slot)
        except BadHandoffRow:
            return None

    def write_local(self, slot: int, row: HandoffRow) -> None:
        """Write a row into an in-use slot of this process's buffer (prefill source slot, tests)."""
        self._check_used(slot)
        data = encode_row(row)
        view = self._view(slot)
        view[:OFF_ROOM] = np.frombuffer(data, dtype=np.uint8, count=OFF_ROOM)
        view[OFF_ROOM:] = np.frombuffer(data, dtype=np.uint8, offset=OFF_ROOM)  # room last

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a slot is free twice"
        assert not free & self._used, "a slot is both free and used"
        assert free | self._used == set(range(self.num_slots)), "a slot is lost"
        assert self.buffer.ctypes.data == self.base_addr, "buffer moved"
        if free:
            rows = self.buffer.reshape(self.num_slots, SLOT_BYTES)[sorted(free)]
            assert not rows.any(), "a free slot is not zeroed"

    def _view(self, slot: int) -> np.ndarray:
        return self.buffer[slot * SLOT_BYTES : (slot + 1) * SLOT_BYTES]

    def _check_used(self, slot: int) -> None:
        self.slot_addr(slot)
        if slot not in self._used:
            raise ValueError(f"slot {slot} is not in use")
