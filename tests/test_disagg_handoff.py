"""Handoff slots: exact byte layout, slot ids, the metadata gate, and rejection of bad rows."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from pdserve.disagg import handoff as h
from pdserve.disagg.handoff import BadHandoffRow, HandoffPool, HandoffRow, decode_row, encode_row, gate


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def test_layout_constants():
    assert h.SLOT_BYTES == 256 and h.SLOT_BYTES % 64 == 0
    assert (h.OFF_FIRST_TOKEN, h.OFF_CACHED_DEVICE, h.OFF_CACHED_HOST, h.OFF_CACHED_STORAGE) == (0, 4, 8, 12)
    assert (h.OFF_FLAGS, h.OFF_FIRST_LOGPROB, h.OFF_TOP_N, h.OFF_TOP_IDS, h.OFF_TOP_LOGPROBS) == (
        16,
        20,
        24,
        32,
        112,
    )
    assert (h.OFF_CRC, h.OFF_ROOM) == (240, 248) and h.OFF_ROOM + 8 == h.SLOT_BYTES  # room is last


def test_encode_exact_bytes():
    top = tuple((i * 7 + 1, _f32(-0.25 * (i + 1))) for i in range(3))
    row = HandoffRow(
        room=0x0123456789ABCDEF,
        first_token_id=42,
        cached_tokens_device=16,
        cached_tokens_host=32,
        cached_tokens_storage=48,
        first_logprob=-0.5,
        top_logprobs=top,
        first_logprob_rank=2,
    )
    data = encode_row(row)
    assert len(data) == 256
    assert struct.unpack_from("<iiiiIfii", data, 0) == (42, 16, 32, 48, 1, -0.5, 3, 2)
    assert struct.unpack_from("<20i", data, 32) == (1, 8, 15) + (0,) * 17
    assert struct.unpack_from("<20f", data, 112) == (-0.25, -0.5, -0.75) + (0.0,) * 17
    assert data[192:240] == b"\0" * 48 and data[244:248] == b"\0" * 4
    assert data[248:256] == bytes.fromhex("efcdab8967452301")  # little-endian uint64
    assert struct.unpack_from("<I", data, 240)[0] == zlib.crc32(data[248:], zlib.crc32(data[:240]))
    assert decode_row(data) == row
    assert decode_row(data).logprobs == (-0.5, list(top), 2)


def test_round_trip_variants():
    for row in (
        HandoffRow(room=1, first_token_id=0),  # no logprobs
        HandoffRow(room=2**63 - 1, first_token_id=2**31 - 1, first_logprob=_f32(-3.3)),  # logprobs=0
        HandoffRow(room=5, first_token_id=9, first_logprob=float("-inf"), top_logprobs=((9, float("-inf")),)),
        HandoffRow(
            room=7,
            first_token_id=3,
            first_logprob=_f32(-0.1),
            top_logprobs=tuple((t, _f32(-t / 10)) for t in range(20)),  # n = 20, the maximum
        ),
    ):
        back = decode_row(encode_row(row))
        assert back == row
    assert decode_row(encode_row(HandoffRow(room=1, first_token_id=0))).logprobs is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"room": 0},
        {"room": -1},
        {"room": 2**63},
        {"first_token_id": -1},
        {"first_token_id": 2**31},
        {"cached_tokens_host": -3},
        {"first_logprob": float("nan")},
        {"first_logprob": float("inf")},
        {"first_logprob": -1e300},  # beyond float32
        {"first_logprob": -1.0, "top_logprobs": tuple((i, -1.0) for i in range(21))},  # n = 21
        {"first_logprob": None, "top_logprobs": ((1, -1.0),)},  # top-n without the chosen logprob
        {"first_logprob": -1.0, "top_logprobs": ((-2, -1.0),)},
        {"first_logprob": -1.0, "first_logprob_rank": -1},
        {"first_logprob": None, "first_logprob_rank": 3},  # a rank without the chosen logprob
    ],
)
def test_encode_rejects_bad_rows(kwargs):
    with pytest.raises(BadHandoffRow):
        encode_row(HandoffRow(**{"room": 1, "first_token_id": 1, **kwargs}))


def test_decode_rejects_bad_bytes():
    good = bytearray(
        encode_row(HandoffRow(room=9, first_token_id=4, first_logprob=-1.0, top_logprobs=((4, -1.0),)))
    )

    def resealed(mutate) -> bytes:
        b = bytearray(good)
        mutate(b)
        struct.pack_into("<I", b, 240, zlib.crc32(b[248:], zlib.crc32(b[:240])))
        return bytes(b)

    with pytest.raises(BadHandoffRow, match="not landed"):
        decode_row(bytes(256))
    with pytest.raises(BadHandoffRow):
        decode_row(bytes(good[:255]))
    torn = bytearray(good)
    torn[0] ^= 0xFF  # any byte changed without the CRC -> torn
    with pytest.raises(BadHandoffRow, match="CRC"):
        decode_row(bytes(torn))
    stale_room = bytearray(good)
    stale_room[248:256] = struct.pack("<Q", 8)  # room from another write
    with pytest.raises(BadHandoffRow, match="CRC"):
        decode_row(bytes(stale_room))
    # Correct CRC but out-of-range fields.
    for mutate in (
        lambda b: struct.pack_into("<i", b, 24, 21),  # top_n 21
        lambda b: struct.pack_into("<i", b, 24, -1),
        lambda b: struct.pack_into("<I", b, 16, 2),  # unknown flag
        lambda b: struct.pack_into("<I", b, 16, 0),  # top_n > 0 without logprobs
        lambda b: struct.pack_into("<i", b, 0, -5),
        lambda b: struct.pack_into("<i", b, 28, -1),  # rank
        lambda b: (
            struct.pack_into("<I", b, 16, 0),
            struct.pack_into("<i", b, 24, 0),
            struct.pack_into("<i", b, 28, 1),
        ),
        lambda b: struct.pack_into("<f", b, 20, float("nan")),
        lambda b: struct.pack_into("<Q", b, 248, 2**63),
    ):
        with pytest.raises(BadHandoffRow):
            decode_row(resealed(mutate))


def test_gate():
    row = HandoffRow(room=77, first_token_id=1)
    assert gate(row, 77) is True
    assert gate(row, 78) is False
    assert gate(row, 0) is False
    assert gate(None, 77) is False


def test_pool_alloc_free_exact_ids():
    pool = HandoffPool(4)
    assert pool.buffer.dtype == np.uint8 and pool.buffer.shape == (4 * 256,)
    assert pool.base_addr % 4096 == 0 and pool.base_addr == pool.buffer.ctypes.data
    assert pool.buffer.flags["C_CONTIGUOUS"] and pool.slot_bytes == 256 and pool.nbytes == 1024
    assert [pool.alloc() for _ in range(4)] == [0, 1, 2, 3]
    assert pool.alloc() is None and pool.num_free == 0
    pool.free(2)
    pool.free(0)
    assert pool.alloc() == 0 and pool.alloc() == 2 and pool.alloc() is None
    with pytest.raises(ValueError):
        pool.free(9)
    pool.free(1)
    with pytest.raises(ValueError):
        pool.free(1)  # double free
    assert [pool.slot_addr(s) - pool.base_addr for s in range(4)] == [0, 256, 512, 768]
    with pytest.raises(ValueError):
        pool.slot_addr(4)
    pool.check_integrity()
    with pytest.raises(ValueError):
        HandoffPool(0)


def test_pool_write_read_free_zeroes():
    pool = HandoffPool(3)
    a, b = pool.alloc(), pool.alloc()
    row = HandoffRow(
        room=123, first_token_id=7, cached_tokens_device=16, first_logprob=-0.5, top_logprobs=((7, -0.5),)
    )
    pool.write_local(b, row)
    assert pool.raw(b) == encode_row(row)
    assert pool.buffer[b * 256 : (b + 1) * 256].tobytes() == encode_row(row)  # what the peer's write lands as
    assert pool.raw(a) == bytes(256)
    assert pool.read(b) == row and gate(pool.try_read(b), 123)
    assert pool.try_read(a) is None and not gate(pool.try_read(a), 123)  # not landed
    with pytest.raises(BadHandoffRow):
        pool.read(a)
    with pytest.raises(ValueError):
        pool.read(2)  # not allocated
    with pytest.raises(ValueError):
        pool.write_local(2, row)
    # A "remote" write into the buffer (what the transfer backend does), then the gate on it.
    pool.buffer[a * 256 : (a + 1) * 256] = np.frombuffer(
        encode_row(HandoffRow(room=5, first_token_id=1)), np.uint8
    )
    assert gate(pool.try_read(a), 5) and not gate(pool.try_read(a), 6)
    pool.free(b)
    assert pool.raw(b) == bytes(256)
    pool.check_integrity()
    pool.buffer[b * 256] = 1  # a write into a free slot is detected
    with pytest.raises(AssertionError):
        pool.check_integrity()
