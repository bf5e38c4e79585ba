"""Compressed frames: how a sealed segment is stored when its stream has ``compression``.

A frame holds whole record batches, laid end to end exactly as in a plain segment, and
compressed together: ``FRAME_BYTES`` of batches per frame, so a stream of one-event
appends compresses as well as one of large batches. Each batch inside keeps its own
header and its CRC-32C over its uncompressed bytes, and the frame carries a CRC-32C of
its compressed bytes, so corruption is caught before the decompressor sees it and again
after. The frame header is 64 bytes like a batch header, with ``base_offset`` and
``max_timestamp_ms`` at the same places, and its magic (2) tells it from a batch (1):
a reader walking a segment tells the two apart by that one byte.

| byte | type | field |
|---:|---|---|
| 0 | u32 | frame_length, header included |
| 4 | u32 | CRC-32C of bytes [8, frame_length) |
| 8 | u8 | magic = 2 |
| 9 | u8 | codec: 1 zstd, 2 lz4 (block) |
| 10 | u16 | reserved, 0 |
| 12 | u32 | batches in the frame |
| 16 | u64 | base_offset of the first batch |
| 24 | i64 | first_timestamp_ms of the first batch |
| 32 | i64 | max_timestamp_ms over the frame |
| 40 | u64 | next_offset after the last batch |
| 48 | u32 | raw_length: the batches' uncompressed bytes |
| 52 | u32 | events in the frame |
| 56 | u64 | reserved, 0 |
| 64 | | the compressed batches |
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Final

import crc32c
import lz4.block
import zstandard

from headwater.errors import CorruptBatchError
from headwater.storage.batch import Batch, iter_batches

FRAME = struct.Struct("<IIBBHIQqqQIIQ")
FRAME_SIZE = FRAME.size  # 64, as a batch header
FRAME_MAGIC: Final = 2
BATCH_MAGIC: Final = 1
MAGIC_AT: Final = 8
# Uncompressed bytes gathered into one frame: large enough that small batches compress as
# well as large ones, small enough that a read of one event decompresses little.
FRAME_BYTES = 256 << 10
ZSTD_LEVEL = 3

CODECS: Final = {"zstd": 1, "lz4": 2}
COMPRESSION_CHOICES: Final = ("none", *CODECS)
_CODEC_NAMES: Final = {code: name for name, code in CODECS.items()}


def check_compression(name: object) -> str:
    """``name`` if it is a known compression setting; ValueError otherwise."""
    if name not in COMPRESSION_CHOICES:
        choices = ", ".join(COMPRESSION_CHOICES)
        raise ValueError(f"compression must be one of {choices}, not {name!r}")
    return str(name)


def is_frame(buffer: bytes | bytearray | memoryview, pos: int = 0) -> bool:
    """Whether the unit (batch or frame) at ``pos`` is a compressed frame."""
    return len(buffer) > pos + MAGIC_AT and buffer[pos + MAGIC_AT] == FRAME_MAGIC


def _compress(codec: int, raw: bytes | bytearray) -> bytes:
    if codec == CODECS["zstd"]:
        # One compressor per call: zstandard's compressor objects are not thread-safe.
        return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)
    return bytes(lz4.block.compress(raw, store_size=False))


def _decompress(codec: int, data: memoryview, raw_length: int) -> bytes:
    try:
        if codec == CODECS["zstd"]:
            out = zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_length)
        elif codec == CODECS["lz4"]:
            out = lz4.block.decompress(data, uncompressed_size=raw_length)
        else:
            raise CorruptBatchError(f"unknown frame codec {codec}")
    except (zstandard.ZstdError, lz4.block.LZ4BlockError) as exc:
        raise CorruptBatchError(f"frame does not decompress: {exc}") from None
    if len(out) != raw_length:
        raise CorruptBatchError(f"frame holds {len(out)} bytes, its header says {raw_length}")
    return bytes(out)


def encode_frame(codec_name: str, batches: Sequence[Batch]) -> bytes:
    """One frame holding ``batches`` (consecutive, checked) compressed with ``codec_name``."""
    codec = CODECS[codec_name]
    raw = b"".join(batch.buffer for batch in batches)
    payload = _compress(codec, raw)
    first, last = batches[0], batches[-1]
    header = FRAME.pack(
        FRAME_SIZE + len(payload),
        0,
        FRAME_MAGIC,
        codec,
        0,
        len(batches),
        first.base_offset,
        first.first_timestamp_ms,
        max(batch.max_timestamp_ms for batch in batches),
        last.next_offset,
        len(raw),
        sum(batch.count for batch in batches),
        0,
    )
    crc = crc32c.crc32c(payload, crc32c.crc32c(header[8:]))
    return header[:4] + struct.pack("<I", crc) + header[8:] + payload


def decode_frame(buffer: memoryview, *, verify: bool = True) -> list[Batch]:
    """The batches of the frame that is exactly ``buffer``, each checked (its CRC when
    ``verify``) and in offset order; CorruptBatchError otherwise."""
    if len(buffer) <= FRAME_SIZE:
        raise CorruptBatchError("frame shorter than its header")
    fields = FRAME.unpack_from(buffer)
    length, crc, magic, codec, _reserved, count, base = fields[:7]
    next_offset, raw_length = fields[9], fields[10]
    if magic != FRAME_MAGIC or length != len(buffer):
        raise CorruptBatchError("not a whole frame")
    if verify and crc32c.crc32c(buffer[8:]) != crc:
        raise CorruptBatchError(f"CRC mismatch in the frame at offset {base}")
    raw = _decompress(codec, buffer[FRAME_SIZE:], raw_length)
    batches = list(iter_batches(memoryview(raw), verify=verify))
    if len(batches) != count or batches[0].base_offset != base:
        raise CorruptBatchError(f"frame at offset {base} does not hold what its header says")
    if batches[-1].next_offset != next_offset:
        raise CorruptBatchError(f"frame at offset {base} ends at another offset than it says")
    return batches


def codec_name(code: int) -> str:
    return _CODEC_NAMES.get(code, f"unknown({code})")
