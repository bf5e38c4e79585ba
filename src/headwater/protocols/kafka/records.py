"""Kafka record batches, format v2 (magic 2): the unit a producer sends, a partition
stores and a fetch returns.

Layout (big-endian), 61 bytes of header then the records (compressed as a whole when the
codec is not none)::

    0  base offset        int64   rewritten by the broker on append (not under the CRC)
    8  batch length       int32   bytes after this field
   12  partition leader   int32   rewritten by the broker (not under the CRC)
       epoch
   16  magic              int8    2
   17  crc                uint32  CRC-32C of every byte from offset 21 to the end
   21  attributes         int16   bits 0-2 codec, 3 LogAppendTime, 4 transactional,
                                  5 control, 6 delete horizon set
   23  last offset delta  int32
   27  base timestamp     int64
   35  max timestamp      int64
   43  producer id        int64   -1 without idempotence
   51  producer epoch     int16
   53  base sequence      int32
   57  records count      int32

Each record: varint length, int8 attributes, varlong timestamp delta, varint offset
delta, varint key length (-1 null) and key, varint value length (-1 null) and value,
varint header count, each header a varint-length UTF-8 key and a varint-length value.

What the engine needs from this module, batch at a time:

- :func:`split_batches` cuts a Produce's records field into :class:`RecordBatch` views
  (refusing magic 0/1, which Produce v3+ may not carry, as Kafka does with
  INVALID_RECORD; a torn batch is CORRUPT_MESSAGE) and :meth:`RecordBatch.check_crc`
  checks the CRC-32C without decompressing;
- :meth:`RecordBatch.validate_for_append` decompresses once and checks what Kafka's log
  validator checks (record count, offset deltas 0..n-1, lengths), returning the records as
  columns (:class:`RecordColumns`) should the engine need keys, timestamps or headers;
- :meth:`RecordBatch.check_for_append` checks the same in one walk over the records
  that decodes none of them; the batch is then stored as it came, from its CRC on
  (:attr:`RecordBatch.section`, headwater's Kafka form: storage/kafka_batch.py), the
  header giving the producer id, epoch and base sequence for idempotence and the
  transactional flag; :func:`stamp` is what a broker writes over a batch (base
  offset, partition leader epoch, and for LogAppendTime the append time, CRC
  recomputed);
- a fetch returns stored batches' bytes with their 17-byte prefix put back;
  :func:`control_batch` builds the commit/abort markers a transaction ends with, and
  :func:`build_batch` a batch from records the engine holds in its own form.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import TypedDict, Unpack

import cramjam
import lz4.frame
import zstandard
from crc32c import crc32c
from kio.schema.errors import ErrorCode

from headwater.engine.kinds.reader import Buffer
from headwater.errors import ProtocolError
from headwater.storage import kafka_batch
from headwater.storage.kafka_batch import KafkaRecordsError

HEADER = struct.Struct(">qiibIhiqqqhii")
HEADER_SIZE = HEADER.size  # 61
LENGTH_OFFSET = 8
EPOCH_OFFSET = 12
MAGIC_OFFSET = 16
CRC_OFFSET = 17
ATTRIBUTES_OFFSET = 21
MAX_TIMESTAMP_OFFSET = 35
LOG_OVERHEAD = 12  # base offset and batch length precede what the length counts
# The magic and attribute bits are the stored Kafka form's (one definition of the layout).
MAGIC = kafka_batch.MAGIC
ATTR_CODEC = kafka_batch.ATTR_CODEC
ATTR_LOG_APPEND_TIME = kafka_batch.ATTR_LOG_APPEND_TIME
ATTR_TRANSACTIONAL = kafka_batch.ATTR_TRANSACTIONAL
ATTR_CONTROL = kafka_batch.ATTR_CONTROL
ATTR_DELETE_HORIZON = 0x40

NO_PRODUCER_ID = -1
NO_PRODUCER_EPOCH = -1
NO_SEQUENCE = -1


def wire_producer_id(producer_id: int) -> int:
    """A stored producer id (u64: other protocols' ids reach 2**64 - 1) as Kafka's
    int64 field carries it: the same 8 bytes, so an id at or past 2**63 reads as
    negative, and a read_committed client still matches a batch to its aborted
    transaction. Kafka's own producers' ids are below 2**63 and pass unchanged."""
    return producer_id - (1 << 64) if producer_id >= 1 << 63 else producer_id


def wire_producer_epoch(epoch: int) -> int:
    """A stored producer epoch (u32; Rivven's reach 65,535) as Kafka's int16 field
    carries it: its low 16 bits. A consumer does not check the epoch of what it reads."""
    epoch &= 0xFFFF
    return epoch - (1 << 16) if epoch >= 1 << 15 else epoch


MAX_DECOMPRESSED = kafka_batch.MAX_DECOMPRESSED
"""Default bound on one batch's decompressed records: past it the batch is refused
(MESSAGE_TOO_LARGE) before more is inflated, so a small batch cannot claim gigabytes."""


class Compression(IntEnum):
    """The codec in a batch's attributes (bits 0-2)."""

    NONE = 0
    GZIP = 1
    SNAPPY = 2
    LZ4 = 3
    ZSTD = 4


class TimestampType(IntEnum):
    CREATE_TIME = 0
    LOG_APPEND_TIME = 1


class ControlType(IntEnum):
    """A control record's type (its key's second int16)."""

    ABORT = 0
    COMMIT = 1


class RecordBatchError(ProtocolError):
    """A batch the broker must refuse, with the Kafka error code its partition gets
    (CORRUPT_MESSAGE, INVALID_RECORD, MESSAGE_TOO_LARGE...). It concerns that batch's
    partition alone: the connection goes on."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _corrupt(message: str) -> RecordBatchError:
    return RecordBatchError(ErrorCode.corrupt_message, message)


_REASON_CODES = {
    "corrupt": ErrorCode.corrupt_message,
    "invalid": ErrorCode.invalid_record,
    "too_large": ErrorCode.message_too_large,
    "codec": ErrorCode.unsupported_compression_type,
}


@dataclass(frozen=True, slots=True)
class BatchHeader(kafka_batch.SectionHeader):
    """A whole batch's header: the fields of the section headwater stores (from the CRC
    on: :class:`~headwater.storage.kafka_batch.SectionHeader`) and those of the 17-byte
    prefix before it, which the broker rewrites."""

    base_offset: int
    batch_length: int
    partition_leader_epoch: int
    magic: int

    @property
    def compression(self) -> int:
        """The codec number (a :class:`Compression` value when known)."""
        return self.attributes & ATTR_CODEC

    @property
    def timestamp_type(self) -> TimestampType:
        return TimestampType((self.attributes & ATTR_LOG_APPEND_TIME) >> 3)

    @property
    def is_transactional(self) -> bool:
        return bool(self.attributes & ATTR_TRANSACTIONAL)

    @property
    def is_control(self) -> bool:
        return bool(self.attributes & ATTR_CONTROL)

    @property
    def last_offset(self) -> int:
        return self.base_offset + self.last_offset_delta


@dataclass(frozen=True, slots=True)
class Record:
    """One record as a producer gives it: offsets and timestamps relative to the batch."""

    offset_delta: int
    timestamp_delta: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...] = ()


@dataclass(frozen=True, slots=True)
class RecordColumns:
    """A batch's records as columns, one list per field, in record order."""

    offset_deltas: list[int]
    timestamp_deltas: list[int]
    keys: list[bytes | None]
    values: list[bytes | None]
    headers: list[tuple[tuple[str, bytes | None], ...]]

    def __len__(self) -> int:
        return len(self.offset_deltas)

    def rows(self) -> list[Record]:
        return [
            Record(*row)
            for row in zip(
                self.offset_deltas,
                self.timestamp_deltas,
                self.keys,
                self.values,
                self.headers,
                strict=True,
            )
        ]


@dataclass(frozen=True, slots=True)
class RecordBatch:
    """One batch: its parsed header and all its bytes (header included)."""

    header: BatchHeader
    data: bytes | memoryview  # a view of a Produce's (immutable) bytes

    def check_crc(self) -> None:
        """Raise CORRUPT_MESSAGE when the CRC-32C does not match the bytes."""
        actual = crc32c(memoryview(self.data)[ATTRIBUTES_OFFSET:])
        if actual != self.header.crc:
            raise _corrupt(
                f"record batch CRC-32C is {actual:#010x}, its header says {self.header.crc:#010x}"
            )

    @property
    def section(self) -> memoryview:
        """What headwater stores of this batch (its Kafka form): the bytes from the CRC
        on, which the CRC covers but for itself."""
        return memoryview(self.data)[CRC_OFFSET:]

    def check_for_append(self, max_decompressed: int = MAX_DECOMPRESSED) -> None:
        """What Kafka checks of a produced batch before storing it: the CRC, a known
        codec, the records decoding to exactly ``records_count`` records with offset
        deltas 0..n-1, and ``last_offset_delta`` n-1; one walk over the records, with
        nothing decoded (:func:`headwater.storage.kafka_batch.check_section`)."""
        try:
            kafka_batch.check_section(self.section, max_decompressed, self.data, header=self.header)
        except KafkaRecordsError as exc:
            raise _records_error(exc) from None

    def keyless(self) -> bool:
        """Whether a record of this (checked) batch has no key: one read of its records
        by aiokafka's compiled reader (what a compacted topic refuses)."""
        return None in kafka_batch.decode_section(self.section)[1]

    def records(self, max_decompressed: int = MAX_DECOMPRESSED) -> RecordColumns:
        """The records, decompressed once and parsed to columns."""
        body = decompress(
            self.header.compression, memoryview(self.data)[HEADER_SIZE:], max_decompressed
        )
        return parse_records(body, self.header.records_count)

    def validate_for_append(self, max_decompressed: int = MAX_DECOMPRESSED) -> RecordColumns:
        """What Kafka checks of a produced batch before storing it: the CRC, a known
        codec, the records decoding to exactly ``records_count`` records with offset
        deltas 0..n-1, and ``last_offset_delta`` n-1. Returns the records."""
        header = self.header
        self.check_crc()
        if header.records_count <= 0:
            raise RecordBatchError(ErrorCode.invalid_record, "record batch has no records")
        columns = self.records(max_decompressed)
        count = len(columns)
        if header.last_offset_delta != count - 1:
            raise RecordBatchError(
                ErrorCode.invalid_record,
                f"last offset delta {header.last_offset_delta} for {count} records",
            )
        if columns.offset_deltas != list(range(count)):
            raise RecordBatchError(
                ErrorCode.invalid_record, "record offset deltas are not 0, 1, 2, ..."
            )
        return columns


def parse_header(data: Buffer, offset: int = 0) -> BatchHeader:
    """The header of the batch at ``offset`` (at least 61 bytes must be there)."""
    return BatchHeader(
        *kafka_batch.SECTION_HEADER.unpack_from(data, offset + CRC_OFFSET),
        *kafka_batch.PREFIX.unpack_from(data, offset),
    )


def split_batches(data: Buffer) -> list[RecordBatch]:
    """The v2 batches of a Produce's records field, in order. A torn or short batch is
    CORRUPT_MESSAGE; a batch of magic 0 or 1 is INVALID_RECORD (Produce v3 and later
    carry magic 2 only)."""
    view = memoryview(data)
    total = view.nbytes
    batches: list[RecordBatch] = []
    offset = 0
    while offset < total:
        if total - offset < HEADER_SIZE:
            raise _corrupt(f"{total - offset} bytes after the last batch are not a batch")
        magic = view[offset + MAGIC_OFFSET]
        if magic != MAGIC:
            raise RecordBatchError(
                ErrorCode.invalid_record, f"record batch of magic {magic}: only magic 2"
            )
        header = parse_header(view, offset)
        size = LOG_OVERHEAD + header.batch_length
        if header.batch_length < HEADER_SIZE - LOG_OVERHEAD or size > total - offset:
            raise _corrupt(
                f"record batch length {header.batch_length} does not fit "
                f"{total - offset - LOG_OVERHEAD} bytes"
            )
        whole: bytes | memoryview
        if size == total and isinstance(data, bytes):
            whole = data  # one batch, kept without a copy
        elif view.readonly:  # a view of a request's bytes (schema._records): no copy
            whole = view[offset : offset + size]
        else:
            whole = bytes(view[offset : offset + size])
        batches.append(RecordBatch(header, whole))
        offset += size
    return batches


def checked_together(
    batches: Sequence[RecordBatch], max_decompressed: int = MAX_DECOMPRESSED
) -> list[bool]:
    """Which of a Produce's batches pass :meth:`RecordBatch.check_for_append`, checked
    together (:func:`headwater.storage.kafka_batch.sections_pass`: the long uncompressed
    ones, one numpy pass per record layout over all of them): True for one that passes;
    False for one ``check_for_append`` must judge, which raises its error if any."""
    return kafka_batch.sections_pass(
        [(memoryview(b.data)[CRC_OFFSET:], b.header) for b in batches], max_decompressed
    )


# ---- records ---------------------------------------------------------------------------


def _records_error(exc: KafkaRecordsError) -> RecordBatchError:
    return RecordBatchError(_REASON_CODES[exc.reason], str(exc))


def parse_records(body: Buffer, count: int) -> RecordColumns:
    """``count`` records from a batch's (decompressed) records bytes, to columns
    (:func:`headwater.storage.kafka_batch.parse_records`, errors as Kafka codes)."""
    try:
        return RecordColumns(*kafka_batch.parse_records(bytes(body), count))
    except KafkaRecordsError as exc:
        raise _records_error(exc) from None


def _put_varint(out: bytearray, value: int) -> None:
    raw = (value << 1) ^ (value >> 63)
    while raw >= 0x80:
        out.append((raw & 0x7F) | 0x80)
        raw >>= 7
    out.append(raw)


def _put_bytes(out: bytearray, value: bytes | None) -> None:
    if value is None:
        out.append(1)  # zigzag(-1)
        return
    _put_varint(out, len(value))
    out += value


def encode_records(records: Sequence[Record]) -> bytes:
    """The records part of a batch (before compression)."""
    out = bytearray()
    body = bytearray()
    for record in records:
        body.clear()
        body.append(0)
        _put_varint(body, record.timestamp_delta)
        _put_varint(body, record.offset_delta)
        _put_bytes(body, record.key)
        _put_bytes(body, record.value)
        _put_varint(body, len(record.headers))
        for name, header_value in record.headers:
            _put_bytes(body, name.encode())
            _put_bytes(body, header_value)
        _put_varint(out, len(body))
        out += body
    return bytes(out)


class BatchOptions(TypedDict, total=False):
    """What a batch's header says beyond its offsets and timestamps; what is not given
    takes :func:`batch_around`'s default (the one place they are written)."""

    compression: Compression
    timestamp_type: TimestampType
    producer_id: int
    producer_epoch: int
    base_sequence: int
    transactional: bool
    control: bool
    partition_leader_epoch: int


def build_batch(
    records: Sequence[Record],
    *,
    base_offset: int = 0,
    base_timestamp: int,
    max_timestamp: int | None = None,
    **options: Unpack[BatchOptions],
) -> bytes:
    """A whole batch (header, CRC and records compressed with ``compression``)."""
    if not records:
        raise ValueError("a record batch holds at least one record")
    if max_timestamp is None:
        max_timestamp = base_timestamp + max(record.timestamp_delta for record in records)
    return batch_around(
        encode_records(records),
        len(records),
        max(record.offset_delta for record in records),
        base_offset=base_offset,
        base_timestamp=base_timestamp,
        max_timestamp=max_timestamp,
        **options,
    )


def batch_around(
    records: bytes,
    count: int,
    last_offset_delta: int,
    *,
    base_offset: int,
    base_timestamp: int,
    max_timestamp: int,
    compression: Compression = Compression.NONE,
    timestamp_type: TimestampType = TimestampType.CREATE_TIME,
    producer_id: int = NO_PRODUCER_ID,
    producer_epoch: int = NO_PRODUCER_EPOCH,
    base_sequence: int = NO_SEQUENCE,
    transactional: bool = False,
    control: bool = False,
    partition_leader_epoch: int = -1,
) -> bytes:
    """A whole batch of ``count`` encoded ``records`` (uncompressed: compressed here
    with ``compression``), its header and CRC."""
    body = compress(compression, records)
    attributes = int(compression) | (int(timestamp_type) << 3)
    if transactional:
        attributes |= ATTR_TRANSACTIONAL
    if control:
        attributes |= ATTR_CONTROL
    header = bytearray(
        HEADER.pack(
            base_offset,
            HEADER_SIZE - LOG_OVERHEAD + len(body),
            partition_leader_epoch,
            MAGIC,
            0,
            attributes,
            last_offset_delta,
            base_timestamp,
            max_timestamp,
            producer_id,
            producer_epoch,
            base_sequence,
            count,
        )
    )
    batch = header + body
    struct.pack_into(">I", batch, CRC_OFFSET, crc32c(memoryview(batch)[ATTRIBUTES_OFFSET:]))
    return bytes(batch)


def stamp(
    batch: Buffer,
    base_offset: int,
    partition_leader_epoch: int = 0,
    log_append_time: int | None = None,
) -> bytearray:
    """``batch`` as the log stores it: its base offset and partition leader epoch set
    (outside the CRC). With ``log_append_time`` (a LogAppendTime stream) the max
    timestamp becomes it and the attribute says so, and the CRC is recomputed."""
    stamped = bytearray(batch)
    struct.pack_into(">q", stamped, 0, base_offset)
    struct.pack_into(">i", stamped, EPOCH_OFFSET, partition_leader_epoch)
    if log_append_time is not None:
        section = memoryview(stamped)[CRC_OFFSET:]
        stamped[CRC_OFFSET:] = kafka_batch.stamp_log_append_time(section, log_append_time)
    return stamped


# ---- transaction markers ---------------------------------------------------------------

_CONTROL_KEY = struct.Struct(">hh")  # version 0, type
_CONTROL_VALUE = struct.Struct(">hi")  # version 0, coordinator epoch


def control_batch(
    control_type: ControlType,
    *,
    producer_id: int,
    producer_epoch: int,
    coordinator_epoch: int,
    base_offset: int,
    timestamp: int,
    partition_leader_epoch: int = 0,
) -> bytes:
    """The commit or abort marker a transaction writes to each partition it touched: a
    transactional control batch of one record (key: version, type; value: version,
    coordinator epoch)."""
    record = Record(
        offset_delta=0,
        timestamp_delta=0,
        key=_CONTROL_KEY.pack(0, int(control_type)),
        value=_CONTROL_VALUE.pack(0, coordinator_epoch),
    )
    return build_batch(
        [record],
        base_offset=base_offset,
        base_timestamp=timestamp,
        producer_id=producer_id,
        producer_epoch=producer_epoch,
        transactional=True,
        control=True,
        partition_leader_epoch=partition_leader_epoch,
    )


def control_type(batch: RecordBatch) -> ControlType:
    """The marker type of a control batch (from its one record's key)."""
    if not batch.header.is_control:
        raise ValueError("not a control batch")
    columns = batch.records()
    key = columns.keys[0] if len(columns) else None
    if key is None or len(key) < _CONTROL_KEY.size:
        raise _corrupt("control record without its key")
    _, kind = _CONTROL_KEY.unpack_from(key)
    if kind not in (ControlType.ABORT, ControlType.COMMIT):
        raise _corrupt(f"control record type {kind}")
    return ControlType(kind)


# ---- compression -----------------------------------------------------------------------

_XERIAL_MAGIC = kafka_batch.XERIAL_MAGIC
_XERIAL_HEADER = kafka_batch.XERIAL_HEADER
_XERIAL_BLOCK = 32 * 1024  # snappy-java's default block size
_CHUNK = struct.Struct(">i")


def compress(codec: Compression, data: bytes) -> bytes:
    """``data`` compressed as Kafka's producers do for ``codec``: gzip; snappy in the
    xerial framing of Kafka's Java client (snappy-java), which every consumer reads;
    lz4 as an LZ4 frame of independent 64 KiB blocks (KafkaLZ4BlockOutputStream);
    zstd as one frame."""
    if codec == Compression.NONE:
        return data
    if codec == Compression.GZIP:
        compressor = zlib.compressobj(wbits=31)  # 16 + 15: the gzip wrapper
        return compressor.compress(data) + compressor.flush()
    if codec == Compression.SNAPPY:
        out = bytearray(_XERIAL_HEADER.pack(_XERIAL_MAGIC, 1, 1))
        for start in range(0, len(data), _XERIAL_BLOCK):
            block = bytes(cramjam.snappy.compress_raw(data[start : start + _XERIAL_BLOCK]))
            out += _CHUNK.pack(len(block))
            out += block
        return bytes(out)
    if codec == Compression.LZ4:
        return bytes(
            lz4.frame.compress(
                data,
                block_size=lz4.frame.BLOCKSIZE_MAX64KB,
                block_linked=False,
                content_checksum=False,
                store_size=False,
            )
        )
    if codec == Compression.ZSTD:
        return zstandard.ZstdCompressor().compress(data)
    raise ValueError(f"unknown codec {codec}")


def decompress(codec: int, data: Buffer, max_bytes: int = MAX_DECOMPRESSED) -> bytes:
    """The records bytes of a batch compressed with ``codec``, never inflating more than
    ``max_bytes`` (MESSAGE_TOO_LARGE past it); bad compressed bytes are CORRUPT_MESSAGE,
    an unknown codec is UNSUPPORTED_COMPRESSION_TYPE."""
    try:
        return kafka_batch.decompress(codec, memoryview(data), max_bytes)
    except KafkaRecordsError as exc:
        raise _records_error(exc) from None
