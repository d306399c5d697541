"""On-disk format of one block file: a 4096-byte header, then the block payload.

Who: `KVBlockStore.put` encodes (`encode_header`), the read paths decode and verify
(`decode_header`, `payload_checksum`). Nothing here touches files.

Header (little endian, fixed 4096 bytes so the payload starts page aligned -- `O_DIRECT`-ready):
  magic "PDKVBLK\\0" | version u32 | header_nbytes u32 | checksum_algo u32 | reserved u32
  | payload_nbytes u64 | checksum 16 B | num_layers u32 | block_size u32 | bytes_per_token_layer u64
  | key_len u16 | fingerprint_len u16 | key | fingerprint (utf-8) | zeros ... | header_crc32 u32 (last 4 B)
The header carries its own crc32, so a damaged header is told apart from a damaged payload.

Payload checksum -- chosen: "psum64" (default), kept: "crc32".
  psum64 = (S1, S2) mod 2^64 where p_i is the wrapping sum of the little-endian u64 words of 4 KiB
  page i (a short tail is zero-padded), S1 = sum_i p_i and S2 = sum_i (i+1) * p_i (Fletcher-style over
  pages). It detects any change confined to one u64 word (a flipped bit or byte), zeroed or truncated
  pages (the length is checked too) and swapped or misplaced pages (S2 is position weighted); it can
  miss two changes that cancel inside one page. Why: it runs at memory speed in numpy, which releases
  the GIL, so verification runs in parallel in the I/O threads. Measured here (2 loaded cores): psum64
  8-21 GB/s per thread (load dependent), zlib.crc32 2.25 GB/s, blake2b 0.6 GB/s, while a page-cache read
  moves 5.5-6 GB/s. In `pdserve bench store` full psum64 verification takes a warm read from ~5.6 to
  ~3.5 GB/s on this host; crc32 in its place would give ~1.6 GB/s (1 / (1/5.6 + 1/2.25)). Use
  checksum="crc32" where a stronger burst-error check matters more than read speed; the
  algorithm is recorded per file, so both kinds verify whatever the store's current setting is.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

from pdserve.store.layout import BlockLayout

MAGIC = b"PDKVBLK\0"
VERSION = 1
HEADER_NBYTES = 4096
CHECKSUM_ALGOS = {"psum64": 1, "crc32": 2}
_ALGO_NAMES = {v: k for k, v in CHECKSUM_ALGOS.items()}
_FIXED = struct.Struct("<8sIIIIQ16sIIQHH")
_PAGE_WORDS = 512  # 4 KiB pages of u64 words
MAX_KEY_NBYTES = 64
MAX_FINGERPRINT_NBYTES = HEADER_NBYTES - _FIXED.size - MAX_KEY_NBYTES - 4


class BlockFormatError(ValueError):
    """A block file's header is damaged or does not belong to this store (reason in the message)."""


@dataclass(frozen=True)
class BlockHeader:
    checksum_algo: str
    payload_nbytes: int
    checksum: bytes  # 16 bytes
    num_layers: int
    block_size: int
    bytes_per_token_layer: int
    key: bytes
    fingerprint: str


def _as_u8(data) -> np.ndarray:
    """A flat uint8 numpy view of bytes / memoryview / numpy array / CPU torch tensor (no copy)."""
    if hasattr(data, "numpy") and hasattr(data, "is_contiguous"):  # torch.Tensor, CPU only
        if not data.is_contiguous():
            raise ValueError("block payload tensor must be contiguous")
        data = data.detach().numpy()
    arr = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    if not arr.flags.c_contiguous:
        raise ValueError("block payload array must be C-contiguous")
    return arr.reshape(-1).view(np.uint8)


def payload_checksum(payload, algo: str = "psum64") -> bytes:
    """16-byte checksum of a payload (any buffer `_as_u8` accepts); pure function, no I/O."""
    arr = _as_u8(payload)
    if algo == "crc32":
        return struct.pack("<IIQ", zlib.crc32(memoryview(arr)), 0, 0)
    if algo != "psum64":
        raise ValueError(f"unknown checksum algorithm {algo!r}")
    page_nbytes = _PAGE_WORDS * 8
    num_full_pages = arr.size // page_nbytes
    page_sums = np.zeros(num_full_pages + 1, dtype=np.uint64)
    if num_full_pages:
        words = arr[: num_full_pages * page_nbytes].view(np.uint64).reshape(num_full_pages, _PAGE_WORDS)
        np.sum(words, axis=1, dtype=np.uint64, out=page_sums[:num_full_pages])
    tail = arr[num_full_pages * page_nbytes :]
    if tail.size:
        padded = np.zeros(-(-tail.size // 8) * 8, dtype=np.uint8)
        padded[: tail.size] = tail
        page_sums[num_full_pages] = padded.view(np.uint64).sum(dtype=np.uint64)
    weights = np.arange(1, page_sums.size + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        s1 = page_sums.sum(dtype=np.uint64)
        s2 = (page_sums * weights).sum(dtype=np.uint64)
    return struct.pack("<QQ", int(s1), int(s2))


def encode_header(layout: BlockLayout, key: bytes, checksum: bytes, algo: str) -> bytes:
    """The 4096-byte header of a block file of `layout` holding `key`'s payload."""
    fp = layout.fingerprint.encode()
    if len(key) > MAX_KEY_NBYTES or len(fp) > MAX_FINGERPRINT_NBYTES:
        raise ValueError("block key or fingerprint too long for the header")
    fixed = _FIXED.pack(
        MAGIC,
        VERSION,
        HEADER_NBYTES,
        CHECKSUM_ALGOS[algo],
        0,
        layout.block_nbytes,
        checksum,
        layout.num_layers,
        layout.block_size,
        layout.bytes_per_token_layer,
        len(key),
        len(fp),
    )
    body = (fixed + key + fp).ljust(HEADER_NBYTES - 4, b"\0")
    return body + struct.pack("<I", zlib.crc32(body))


def decode_header(raw) -> BlockHeader:
    """Parse and self-check a header; raise BlockFormatError (reason in the message) if unusable."""
    raw = bytes(raw[:HEADER_NBYTES])
    if len(raw) < HEADER_NBYTES:
        raise BlockFormatError("truncated header")
    (stored_crc,) = struct.unpack_from("<I", raw, HEADER_NBYTES - 4)
    if zlib.crc32(raw[: HEADER_NBYTES - 4]) != stored_crc:
        raise BlockFormatError("header checksum mismatch")
    magic, version, header_nbytes, algo_id, _, payload_nbytes, checksum, nl, bs, bptl, klen, flen = (
        _FIXED.unpack_from(raw)
    )
    if magic != MAGIC or version != VERSION or header_nbytes != HEADER_NBYTES or algo_id not in _ALGO_NAMES:
        raise BlockFormatError(f"bad magic/version/algorithm ({magic!r}, v{version}, algo {algo_id})")
    # A header with a valid crc but lengths no writer produces (a foreign or buggy writer) is damaged too.
    if klen > MAX_KEY_NBYTES or flen > MAX_FINGERPRINT_NBYTES:
        raise BlockFormatError(f"key or fingerprint length out of range ({klen}, {flen})")
    key = raw[_FIXED.size : _FIXED.size + klen]
    try:
        fp = raw[_FIXED.size + klen : _FIXED.size + klen + flen].decode()
    except UnicodeDecodeError:
        raise BlockFormatError("fingerprint is not utf-8") from None
    return BlockHeader(_ALGO_NAMES[algo_id], payload_nbytes, checksum, nl, bs, bptl, key, fp)


def check_header(header: BlockHeader, layout: BlockLayout, key: bytes) -> str | None:
    """None if `header` describes `key`'s block of `layout`, else the status word for the read result."""
    if header.fingerprint != layout.fingerprint or (
        header.num_layers,
        header.block_size,
        header.bytes_per_token_layer,
    ) != (layout.num_layers, layout.block_size, layout.bytes_per_token_layer):
        return "fingerprint"
    if header.key != key or header.payload_nbytes != layout.block_nbytes:
        return "corrupt"
    return None
