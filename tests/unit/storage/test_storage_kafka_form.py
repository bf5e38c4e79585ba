"""Batches stored in Kafka form (docs/storage-format.md): a produced Kafka record batch
kept verbatim from its CRC on, read back as the same bytes by a Kafka fetch and as
events (keys, headers, a timestamp per record) by every other reader; damage is found;
compaction keeps the latest value per key; headwater-form files written before the
Kafka form existed still read."""

from __future__ import annotations

import struct
from dataclasses import astuple
from pathlib import Path

import pytest
from crc32c import crc32c

from headwater.errors import CorruptBatchError, UsageError
from headwater.protocols.kafka.records import Compression, Record, build_batch
from headwater.storage import kafka_batch as kafka_batch_module
from headwater.storage.batch import ATTR_KAFKA, Batch, KafkaBatch
from headwater.storage.batch import build_batch as build_stored
from headwater.storage.check import check_partition
from headwater.storage.kafka_batch import (
    PREFIX_SIZE,
    SECTION_HEADER_SIZE,
    KafkaRecordsError,
    check_section,
    fetch_prefix,
    section_header,
)
from headwater.storage.log import LogConfig, PartitionLog, SyncPolicy
from headwater.storage.segment import segment_name

BASE_TS = 1_700_000_000_000
RECORDS = [
    Record(0, 0, b"key-0", b"value-0", (("trace", b"abc"),)),
    Record(1, 7, None, b"value-1 without a key"),
    Record(2, 3, b"key-2", None),  # a tombstone
    Record(3, 20, b"key-3", b"x" * 300, (("a", b"1"), ("b", None))),
    Record(4, 5, b"key-0", b"value-4 replaces key-0"),
]


def kafka_batch(codec: Compression = Compression.NONE, records: list[Record] = RECORDS) -> bytes:
    return build_batch(records, base_timestamp=BASE_TS, compression=codec)


def open_log(path: Path, **config: object) -> PartitionLog:
    config.setdefault("sync", SyncPolicy("none"))
    return PartitionLog.open(path, LogConfig(**config))  # type: ignore[arg-type]


def append_kafka(plog: PartitionLog, data: bytes, *, log_append_time: bool = False) -> int:
    section = data[PREFIX_SIZE:]
    header = check_section(section, 1 << 20)
    info = plog.append_encoded(
        section,
        header.records_count,
        first_position=plog.end_offset,
        timestamp_ms=None if log_append_time else header.max_timestamp,
        kafka=True,
    )
    return info.base_offset


@pytest.mark.parametrize("codec", list(Compression))
def test_a_kafka_batch_is_stored_and_read_back_byte_for_byte(
    tmp_path: Path, codec: Compression
) -> None:
    plog = open_log(tmp_path)
    plog.append([b"headwater-form"], first_position=0, timestamp_ms=1)
    data = kafka_batch(codec)
    assert append_kafka(plog, data) == 1
    result = plog.read(1, kafka=True)
    [span] = result.spans
    assert isinstance(span.batch, KafkaBatch) and span.batch.buffer[9] & ATTR_KAFKA
    section = span.batch.kafka_section
    assert bytes(section) == data[PREFIX_SIZE:]
    # The prefix put back is Kafka's: the stored offset, the batch length, magic 2.
    fetched = fetch_prefix(span.batch.base_offset, len(section)) + bytes(section)
    assert (
        fetched[8:]
        == build_batch(
            RECORDS,
            base_offset=1,
            base_timestamp=BASE_TS,
            compression=codec,
            partition_leader_epoch=0,
        )[8:]
    )
    assert struct.unpack_from(">q", fetched)[0] == 1
    # A fetch never decodes the records.
    assert span.batch._decoded is None
    plog.close()


@pytest.mark.parametrize("codec", [Compression.NONE, Compression.ZSTD])
def test_other_readers_see_events_with_keys_headers_and_record_timestamps(
    tmp_path: Path, codec: Compression
) -> None:
    plog = open_log(tmp_path)
    append_kafka(plog, kafka_batch(codec))
    events = list(plog.events(0))
    assert [e.offset for e in events] == [0, 1, 2, 3, 4]
    assert [e.position for e in events] == [0, 1, 2, 3, 4]
    assert [e.key for e in events] == [r.key for r in RECORDS]
    assert [e.value for e in events] == [r.value or b"" for r in RECORDS]
    assert [e.tombstone for e in events] == [False, False, True, False, False]
    assert [e.timestamp_ms for e in events] == [BASE_TS + r.timestamp_delta for r in RECORDS]
    assert events[0].headers == ((b"trace", b"abc"),)
    assert events[3].headers == ((b"a", b"1"), (b"b", b""))
    # A read cut by bytes (a Kimberlite reader's) cuts the decoded values.
    cut = plog.read(1, max_bytes=30)
    assert [e.value for e in cut.events()] == [b"value-1 without a key", b""]
    assert bytes(cut.values_chunks()[0]) == b"".join(
        struct.pack("<Q", len(v)) + v for v in (b"value-1 without a key", b"")
    )
    [span] = plog.read(0).spans
    assert span.batch.timestamps() == [BASE_TS + r.timestamp_delta for r in RECORDS]
    plog.close()


def test_log_append_time_is_stamped_into_the_batch_with_its_crc(tmp_path: Path) -> None:
    plog = open_log(tmp_path)
    append_kafka(plog, kafka_batch(Compression.GZIP), log_append_time=True)
    [span] = plog.read(0, kafka=True).spans
    header = check_section(span.batch.kafka_section, 1 << 20)  # the CRC holds
    assert header.log_append_time and header.max_timestamp > BASE_TS
    assert header.base_timestamp == BASE_TS  # Kafka keeps the producer's base
    events = list(plog.events(0))
    assert {e.timestamp_ms for e in events} == {header.max_timestamp}
    assert span.batch.first_timestamp_ms == span.batch.max_timestamp_ms == header.max_timestamp
    plog.close()


def test_a_kafka_form_batch_survives_a_reopen(tmp_path: Path) -> None:
    plog = open_log(tmp_path)
    data = kafka_batch(Compression.LZ4)
    append_kafka(plog, data)
    plog.close()
    plog = open_log(tmp_path)
    [span] = plog.read(0, kafka=True).spans
    assert bytes(span.batch.kafka_section) == data[PREFIX_SIZE:]
    assert plog.end_offset == len(RECORDS)
    plog.close()


def test_damage_in_a_stored_kafka_batch_is_found_by_check_and_on_read(tmp_path: Path) -> None:
    plog = open_log(tmp_path, segment_bytes=600)
    for _ in range(3):  # three segments: the first two sealed
        append_kafka(plog, kafka_batch())
    assert len(plog.segments) == 3
    plog.close()
    assert not check_partition(tmp_path).damaged
    log_file = tmp_path / segment_name(0, ".log")
    data = bytearray(log_file.read_bytes())
    data[200] ^= 0x01  # a byte of a record's value, inside the Kafka section
    log_file.write_bytes(bytes(data))
    report = check_partition(tmp_path)
    assert report.damaged
    assert "CRC" in " ".join(report.segments[0].problems)
    plog = open_log(tmp_path)
    with pytest.raises(CorruptBatchError):
        plog.read(0, kafka=True)
    with pytest.raises(CorruptBatchError):
        list(plog.events(0))
    assert [e.offset for e in plog.events(5)][:1] == [5]  # the next segment still reads
    plog.close()


def test_a_section_that_disagrees_with_its_header_is_corrupt() -> None:
    plog_bytes = bytearray(
        _stored_batch(kafka_batch())  # a whole stored batch, then its count changed
    )
    struct.pack_into("<I", plog_bytes, 12, 4)
    struct.pack_into("<I", plog_bytes, 4, crc32c(bytes(plog_bytes[8:])))
    with pytest.raises(CorruptBatchError, match="holds 5 records"):
        Batch(memoryview(bytes(plog_bytes)))


def _stored_batch(data: bytes) -> bytes:
    return build_stored(
        data[PREFIX_SIZE:],
        len(RECORDS),
        base_offset=0,
        first_position=0,
        timestamp_ms=BASE_TS,
        kafka=True,
    )


def test_kafka_form_carries_no_sections_of_its_own() -> None:
    with pytest.raises(UsageError):
        build_stored(
            kafka_batch()[PREFIX_SIZE:],
            5,
            base_offset=0,
            first_position=0,
            timestamp_ms=0,
            keys=[b"k"] * 5,
            kafka=True,
        )


def test_the_produce_check_refuses_what_kafka_refuses() -> None:
    good = kafka_batch()[PREFIX_SIZE:]
    check_section(good, 1 << 20)
    flipped = bytearray(good)
    flipped[-1] ^= 1
    with pytest.raises(KafkaRecordsError) as raised:
        check_section(bytes(flipped), 1 << 20)
    assert raised.value.reason == "corrupt"
    gapped = build_batch(
        [Record(0, 0, None, b"a"), Record(2, 0, None, b"b")], base_timestamp=BASE_TS
    )
    # last offset delta 2 for two records: refused before the records are walked
    with pytest.raises(KafkaRecordsError) as raised:
        check_section(gapped[PREFIX_SIZE:], 1 << 20)
    assert raised.value.reason == "invalid"
    with pytest.raises(KafkaRecordsError) as raised:
        check_section(kafka_batch(Compression.GZIP)[PREFIX_SIZE:], 100)
    assert raised.value.reason == "too_large"
    assert section_header(good).records_count == len(RECORDS)


def _section_of(records_bytes: bytes, count: int) -> bytes:
    """A section (CRC on) holding ``records_bytes`` as ``count`` records, its CRC right:
    a producer that encodes its records wrongly but checksums them."""
    header = bytearray(kafka_batch()[PREFIX_SIZE : PREFIX_SIZE + 44])
    struct.pack_into(">i", header, 6, count - 1)  # last offset delta
    struct.pack_into(">i", header, 40, count)  # records count
    body = bytes(header[4:]) + records_bytes
    return struct.pack(">I", crc32c(body)) + body


def one_record(offset_delta: int) -> bytes:
    """Length 7, attributes 0, timestamp delta 0, ``offset_delta`` (below 64), key null
    (-1), a one-byte value "v", no headers; varints zigzag-encoded."""
    return bytes([0x0E, 0x00, 0x00, offset_delta << 1, 0x01, 0x02, ord("v"), 0x00])


THREE_RECORDS = one_record(0) + one_record(1) + one_record(2)


def test_the_produce_check_refuses_a_batch_whose_records_lie_about_their_count() -> None:
    check_section(_section_of(THREE_RECORDS, 3), 1 << 20)
    for claimed in (2, 4):  # CRC right, header and records disagree
        with pytest.raises(KafkaRecordsError) as raised:
            check_section(_section_of(THREE_RECORDS, claimed), 1 << 20)
        assert raised.value.reason == "corrupt"
    torn = _section_of(THREE_RECORDS, 3)[:-1]  # CRC of the whole, one byte gone
    with pytest.raises(KafkaRecordsError) as raised:
        check_section(torn, 1 << 20)
    assert raised.value.reason == "corrupt"


def test_the_produce_check_refuses_record_attributes_other_readers_misread() -> None:
    # attributes 0x80: one byte to Kafka's readers, a two-byte varint to aiokafka's; the
    # record's length fits aiokafka's reading (0x80 0x00 read as attributes 0).
    record = bytes([0x10, 0x80, 0x00, 0x00, 0x00, 0x01, 0x02, ord("v"), 0x00])
    with pytest.raises(KafkaRecordsError) as raised:
        check_section(_section_of(record, 1), 1 << 20)
    assert raised.value.reason == "corrupt"


def test_the_produce_check_takes_records_with_longer_varints_than_needed() -> None:
    # The value's length 1 as a two-byte varint (0x82 0x00): Kafka reads it, and so
    # does the check's walk once the compiled reader's sizes do not add up.
    record = bytes([0x10, 0x00, 0x00, 0x00, 0x01, 0x82, 0x00, ord("v"), 0x00])
    check_section(_section_of(record, 1), 1 << 20)
    offsets_gapped = one_record(0) + one_record(2)
    with pytest.raises(KafkaRecordsError) as raised:
        check_section(_section_of(offsets_gapped, 2), 1 << 20)
    assert raised.value.reason == "invalid"


def test_compaction_keeps_the_latest_value_per_key_of_kafka_batches(tmp_path: Path) -> None:
    plog = open_log(tmp_path, segment_bytes=700, cleanup_policy="compact")
    append_kafka(plog, kafka_batch())  # offsets 0-4: key-0 at 0 and 4
    append_kafka(plog, kafka_batch(records=[Record(0, 9, b"key-3", b"newer key-3")]))  # 5
    plog.roll()
    append_kafka(plog, kafka_batch(records=[Record(0, 0, None, b"tail")]))
    result = plog.compact(now_ms=BASE_TS)
    assert result.events_removed == 2  # key-0 at 0, key-3 at 3
    events = [(e.offset, e.key, e.value, e.timestamp_ms) for e in plog.events(0)]
    assert events[:4] == [
        (1, None, b"value-1 without a key", BASE_TS),  # a compacted batch: one timestamp
        (2, b"key-2", b"", BASE_TS),
        (4, b"key-0", b"value-4 replaces key-0", BASE_TS),
        (5, b"key-3", b"newer key-3", BASE_TS + 9),  # kept whole: still Kafka form
    ]
    plog.close()


# A segment written before the Kafka form existed (headwater's form, keys and headers):
# the same bytes read as they always did.
# Written by headwater's batch.py as of c94dc5c~1.
OLD_BATCH = bytes.fromhex(
    "72000000dfc41a030103000002000000000000000000000000806e8774010000"
    "00806e87740100000000000000000000140000000c0000001200000000000000"
    "020000000000000076300200000000000000763101020000006b300000000000"
    "010000000100000068010000003100000000"
)


def test_a_segment_of_the_previous_format_still_reads(tmp_path: Path) -> None:
    (tmp_path / segment_name(0, ".log")).write_bytes(OLD_BATCH)
    plog = open_log(tmp_path)
    events = list(plog.events(0))
    assert [(e.offset, e.key, e.value, e.headers, e.timestamp_ms) for e in events] == [
        (0, b"k0", b"v0", ((b"h", b"1"),), 1_600_000_000_000),
        (1, None, b"v1", (), 1_600_000_000_000),
    ]
    plog.close()


def test_keys_and_headers_of_records_without_them(tmp_path: Path) -> None:
    # Records with neither keys nor headers: the decoded batch has no such sections,
    # and a reader asking for them per event gets none (SQL's records read asks).
    plog = open_log(tmp_path)
    append_kafka(plog, kafka_batch(records=[Record(0, 0, None, b"a"), Record(1, 1, None, b"b")]))
    [span] = plog.read(0).spans
    assert span.batch.headers() == [(), ()]
    assert span.batch._keys() == [(None, False), (None, False)]
    plog.close()


def test_offset_for_timestamp_finds_the_record_in_a_kafka_batch(tmp_path: Path) -> None:
    # Record timestamps BASE_TS + 0, 7, 3, 20, 5: the first at or after +4 is offset 1,
    # after +8 offset 3 (Kafka's ListOffsets by timestamp); past the max, none.
    plog = open_log(tmp_path)
    append_kafka(plog, kafka_batch())
    assert plog.offset_for_timestamp(BASE_TS + 4) == 1
    assert plog.offset_for_timestamp(BASE_TS + 8) == 3
    assert plog.offset_for_timestamp(BASE_TS) == 0
    assert plog.offset_for_timestamp(BASE_TS + 21) is None
    plog.close()


@pytest.mark.parametrize("key", [None, b"k" * 12])
def test_long_produced_batches_are_checked_by_numpy_run_by_run(key: bytes | None) -> None:
    # librdkafka's long batches: offset deltas of one, two and three bytes (runs from
    # records 64 and 8192), timestamp deltas of one and two; read by numpy (no walk), and
    # a record whose offset delta is not its index in any of those runs is refused.
    count = 9_000
    records = [Record(i, i * 100 // count, key, b"v" * 100) for i in range(count)]
    data = bytearray(kafka_batch(records=records))
    section = bytes(data[PREFIX_SIZE:])
    header = section_header(section)
    body = section[SECTION_HEADER_SIZE:]
    assert kafka_batch_module._reads_by_numpy(body, header)
    check_section(section, 1 << 30)
    for index in (5, 100, 8_500):
        wrong = records.copy()
        wrong[index] = Record(index + 1, *astuple(records[index])[1:])
        section = kafka_batch(records=wrong)[PREFIX_SIZE:]
        assert not kafka_batch_module._reads_by_numpy(
            section[SECTION_HEADER_SIZE:], section_header(section)
        )
        with pytest.raises(KafkaRecordsError) as raised:
            check_section(section, 1 << 30)
        assert raised.value.reason == "invalid"


def test_a_produced_batch_of_a_few_hundred_records_is_read_run_by_run() -> None:
    # 300 fixed-size records (a Java producer's 16 KiB-64 KiB batches hold 150-600):
    # one run, one layout read; before, batches under 512 were predicted record by
    # record, 4x the cost.
    records = [Record(i, i // 10, None, b"v" * 100) for i in range(300)]
    section = kafka_batch(records=records)[PREFIX_SIZE:]
    layouts = _layouts_read(section)
    assert layouts == 2  # records 0 and 64 (the offset delta's second byte)


def test_a_batch_of_varying_sizes_is_given_up_after_its_first_run() -> None:
    # Values of 80-120 bytes in no order: each run would be a record or two, each a
    # pass over the rest of the batch; numpy gives up once it has read the layout of
    # the record that ended the first run, and the record reader decides (the batch is
    # sound, so it is stored).
    sizes = [80 + (i * 37) % 41 for i in range(1_000)]
    records = [Record(i, 0, None, b"v" * size) for i, size in enumerate(sizes)]
    section = kafka_batch(records=records)[PREFIX_SIZE:]
    assert _layouts_read(section) == 2
    check_section(section, 1 << 30)


def test_a_short_run_ended_by_a_wider_timestamp_delta_is_read_on() -> None:
    # Fixed-size values whose timestamp delta passes 63 ms two records after the offset
    # delta takes its second byte (at 64): a run of two records between two long ones,
    # which is not values of varying sizes. Numpy reads all three runs (before, it gave
    # up at the short one and every such batch went to the record reader).
    records = [Record(i, 0 if i < 66 else 70, None, b"v" * 100) for i in range(600)]
    section = kafka_batch(records=records)[PREFIX_SIZE:]
    assert kafka_batch_module._reads_by_numpy(
        section[SECTION_HEADER_SIZE:], section_header(section)
    )
    assert _layouts_read(section) == 3
    check_section(section, 1 << 30)


def _layouts_read(section: bytes) -> int:
    """How many records' layouts the numpy check read before its verdict."""
    calls = 0
    layout = kafka_batch_module._record_layout

    def counted(*args: object) -> object:
        nonlocal calls
        calls += 1
        return layout(*args)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kafka_batch_module, "_record_layout", counted)
        kafka_batch_module._reads_by_numpy(section[SECTION_HEADER_SIZE:], section_header(section))
    return calls


def _zigzag(value: int) -> bytes:
    raw = (value << 1) ^ (value >> 63)
    out = bytearray()
    while raw >> 7:
        out.append(raw & 0x7F | 0x80)
        raw >>= 7
    return bytes(out) + bytes([raw])


@pytest.mark.parametrize(
    ("timestamp_delta", "value"),
    [(0, b"v"), (0, b"v" * 20), (1 << 60, b"v" * 20)],  # the last: past the 8-byte word
)
def test_a_long_batch_whose_header_count_spells_another_count_is_refused(
    timestamp_delta: int, value: bytes
) -> None:
    # The first record spells its header count 0 in two bytes (80 00, as a reader takes
    # it); a later record's 01 00 is a count of -1 there, which the walk refuses: a run
    # compared only the count's last byte, so numpy took that batch as sound.
    count = 600

    def record(index: int, header_count: bytes) -> bytes:
        body = b"\x00" + _zigzag(timestamp_delta) + _zigzag(index) + _zigzag(-1)
        body += _zigzag(len(value)) + value + header_count
        return _zigzag(len(body)) + body

    def section_of(records: list[bytes]) -> bytes:
        after = struct.pack(">hiqqqhii", 0, count - 1, BASE_TS, BASE_TS, -1, -1, -1, count)
        after += b"".join(records)
        return struct.pack(">I", crc32c(after)) + after

    records = [record(i, b"\x80\x00") for i in range(count)]
    section = section_of(records)
    assert kafka_batch_module._reads_by_numpy(
        section[SECTION_HEADER_SIZE:], section_header(section)
    )
    check_section(section, 1 << 30)
    for index in (1, 5, 300, count - 1):
        wrong = records.copy()
        wrong[index] = record(index, b"\x01\x00")
        section = section_of(wrong)
        assert not kafka_batch_module._reads_by_numpy(
            section[SECTION_HEADER_SIZE:], section_header(section)
        )
        with pytest.raises(KafkaRecordsError, match="record headers claimed"):
            check_section(section, 1 << 30)


def test_no_sections_have_no_values() -> None:
    read = kafka_batch_module.sections_values([])
    assert (len(read.starts), len(read.ends), len(read.timestamps), read.firsts) == (0, 0, 0, [0])
