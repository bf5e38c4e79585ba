"""Record batch v2 round trips: any records, every codec, any producer fields, built,
split, CRC-checked and parsed back to the same records; stamping keeps a batch valid;
a damaged byte under the CRC is always caught; decompression stops at its bound; the
projection's batch-at-a-time read of stored sections reads what the reference decoder
reads."""

from __future__ import annotations

import itertools
from unittest.mock import patch

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka_strategies import records, uniform_records
from kio.schema.errors import ErrorCode

from headwater.protocols.kafka.records import (
    CRC_OFFSET,
    HEADER_SIZE,
    Compression,
    Record,
    RecordBatchError,
    TimestampType,
    build_batch,
    compress,
    split_batches,
    stamp,
)
from headwater.storage import kafka_batch

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CODECS = st.sampled_from(list(Compression))
INT64 = st.integers(-(2**63), 2**63 - 1)


@SETTINGS
@given(
    batch_records=records(),
    codec=CODECS,
    base_offset=st.integers(0, 2**62),
    base_timestamp=st.integers(0, 2**42),
    producer_id=st.integers(-1, 2**62),
    producer_epoch=st.integers(-1, 2**15 - 1),
    base_sequence=st.integers(-1, 2**31 - 1),
    transactional=st.booleans(),
    timestamp_type=st.sampled_from(list(TimestampType)),
)
def test_batch_round_trips(
    batch_records: list[Record],
    codec: Compression,
    base_offset: int,
    base_timestamp: int,
    producer_id: int,
    producer_epoch: int,
    base_sequence: int,
    transactional: bool,
    timestamp_type: TimestampType,
) -> None:
    data = build_batch(
        batch_records,
        base_offset=base_offset,
        base_timestamp=base_timestamp,
        compression=codec,
        producer_id=producer_id,
        producer_epoch=producer_epoch,
        base_sequence=base_sequence,
        transactional=transactional,
        timestamp_type=timestamp_type,
    )
    [batch] = split_batches(data)
    header = batch.header
    assert batch.data == data
    assert header.compression == codec
    assert header.timestamp_type == timestamp_type
    assert header.is_transactional == transactional
    assert not header.is_control
    assert (header.base_offset, header.base_timestamp) == (base_offset, base_timestamp)
    assert (header.producer_id, header.producer_epoch, header.base_sequence) == (
        producer_id,
        producer_epoch,
        base_sequence,
    )
    assert header.records_count == len(batch_records)
    assert header.last_offset == base_offset + len(batch_records) - 1
    assert header.max_timestamp == base_timestamp + max(r.timestamp_delta for r in batch_records)
    assert batch.validate_for_append().rows() == batch_records


@SETTINGS
@given(batches=st.lists(st.tuples(records(max_records=4), CODECS), min_size=1, max_size=4))
def test_concatenated_batches_split_back(batches: list[tuple[list[Record], Compression]]) -> None:
    built = [build_batch(rs, base_timestamp=0, compression=codec) for rs, codec in batches]
    split = split_batches(b"".join(built))
    assert [batch.data for batch in split] == built
    assert [batch.records().rows() for batch in split] == [rs for rs, _ in batches]


@SETTINGS
@given(
    batch_records=records(max_records=4),
    codec=CODECS,
    base_offset=st.integers(0, 2**62),
    epoch=st.integers(0, 2**31 - 1),
    append_time=st.none() | st.integers(0, 2**42),
)
def test_stamped_batches_stay_valid(
    batch_records: list[Record],
    codec: Compression,
    base_offset: int,
    epoch: int,
    append_time: int | None,
) -> None:
    original = build_batch(batch_records, base_timestamp=5, compression=codec)
    [batch] = split_batches(bytes(stamp(original, base_offset, epoch, append_time)))
    batch.check_crc()
    assert (batch.header.base_offset, batch.header.partition_leader_epoch) == (base_offset, epoch)
    if append_time is not None:
        assert batch.header.timestamp_type is TimestampType.LOG_APPEND_TIME
        assert batch.header.max_timestamp == append_time
    assert batch.records().rows() == batch_records


@SETTINGS
@given(batch_records=records(max_records=4), codec=CODECS, data=st.data())
def test_any_damaged_byte_under_the_crc_is_caught(
    batch_records: list[Record], codec: Compression, data: st.DataObject
) -> None:
    built = bytearray(build_batch(batch_records, base_timestamp=0, compression=codec))
    position = data.draw(st.integers(21, len(built) - 1))
    built[position] ^= data.draw(st.integers(1, 255))
    try:
        [batch] = split_batches(bytes(built))
    except RecordBatchError as exc:  # the damage hit a length the split reads
        assert exc.code in (ErrorCode.corrupt_message, ErrorCode.invalid_record)
        return
    with pytest.raises(RecordBatchError) as raised:
        batch.validate_for_append()
    assert raised.value.code == ErrorCode.corrupt_message


@SETTINGS
@given(batch_records=records(max_records=6), codec=CODECS)
def test_decompression_stops_at_its_bound(batch_records: list[Record], codec: Compression) -> None:
    [batch] = split_batches(build_batch(batch_records, base_timestamp=0, compression=codec))
    size = len(_raw_records(batch_records))
    assert batch.records(max_decompressed=size).rows() == batch_records
    with pytest.raises(RecordBatchError) as raised:
        batch.records(max_decompressed=size - 1)
    assert raised.value.code == ErrorCode.message_too_large


def _raw_records(batch_records: list[Record]) -> bytes:
    return build_batch(batch_records, base_timestamp=0)[HEADER_SIZE:]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch_records=records(), data=st.data())
def test_the_produce_walk_accepts_exactly_what_the_decoder_reads(
    batch_records: list[Record], data: st.DataObject
) -> None:
    # A produced batch is checked by a walk that decodes nothing and stored; readers
    # decode it later, so the walk must never pass records the decoder refuses (nor
    # refuse what it reads).
    body = bytearray(build_batch(batch_records, base_timestamp=0)[HEADER_SIZE:])
    for _ in range(data.draw(st.integers(0, 3))):
        if body:
            body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        body = body[: data.draw(st.integers(0, len(body)))]
    count = len(batch_records)
    try:
        offsets = kafka_batch.parse_records(bytes(body), count)[0]
        read = offsets == list(range(count))
    except kafka_batch.KafkaRecordsError:
        read = False
    try:
        kafka_batch.walk_records(bytes(body), count)
        walked = True
    except kafka_batch.KafkaRecordsError:
        walked = False
    assert walked == read


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch_records=records(), codec=CODECS, data=st.data())
def test_a_stored_batch_reads_as_the_reference_decoder_reads_it(
    batch_records: list[Record], codec: Compression, data: st.DataObject
) -> None:
    # Readers decode a stored batch with aiokafka's Cython reader; on every batch the
    # produce check's walk passes (damaged ones too), it must read exactly what
    # parse_records reads.
    base = data.draw(st.integers(0, 2**41))
    built = build_batch(batch_records, base_timestamp=base)
    body = bytearray(built[HEADER_SIZE:])
    for _ in range(data.draw(st.integers(0, 2))):
        if body:
            body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    count = len(batch_records)
    try:
        kafka_batch.walk_records(bytes(body), count)
    except kafka_batch.KafkaRecordsError:
        return
    header = bytearray(built[CRC_OFFSET:HEADER_SIZE])  # the section's header, codec set
    header[4:6] = int(codec).to_bytes(2, "big")
    section = bytes(header) + compress(codec, bytes(body))
    _, ts_deltas, keys, values, headers = kafka_batch.parse_records(bytes(body), count)
    assert kafka_batch.decode_section(section) == (
        [base + delta for delta in ts_deltas],
        keys,
        values,
        [tuple((n.encode(), v or b"") for n, v in row) for row in headers],
    )


def damaged_body(
    batch_records: list[Record], data: st.DataObject
) -> tuple[bytes, bytes, kafka_batch.SectionHeader, bool]:
    """A batch's records section as built, the same with up to three bytes changed and
    perhaps cut short, its header, and whether the exact record walk passes it."""
    built = build_batch(batch_records, base_timestamp=0)[HEADER_SIZE:]
    body = bytearray(built)
    for _ in range(data.draw(st.integers(0, 3))):
        if body:
            body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        body = body[: data.draw(st.integers(0, len(body)))]
    count = len(batch_records)
    header, walked = walked_header(bytes(body), count)
    return bytes(built), bytes(body), header, walked


def walked_header(body: bytes, count: int) -> tuple[kafka_batch.SectionHeader, bool]:
    """A header claiming ``count`` records, and whether the exact walk passes ``body``
    as that many."""
    header = kafka_batch.SectionHeader(0, 0, count - 1, 0, 0, -1, -1, -1, count)
    try:
        kafka_batch.walk_records(body, count)
    except kafka_batch.KafkaRecordsError:
        return header, False
    return header, True


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch_records=records(), data=st.data())
def test_the_compiled_produce_check_passes_only_what_the_walk_passes(
    batch_records: list[Record], data: st.DataObject
) -> None:
    # The produce check reads a batch with aiokafka's compiled reader and sizes its
    # records with numpy, falling back to the walk only when that does not prove the
    # batch sound: it must never pass a damaged batch the walk refuses, and what it
    # passes must be every record, untouched.
    built, body, header, walked = damaged_body(batch_records, data)
    count = len(batch_records)
    reader_batch = kafka_batch._reader_batch(bytes(body), header)
    if kafka_batch._reads_canonically(len(body), header, reader_batch):
        assert walked
    elif body == built and all(r.timestamp_delta != -1 for r in batch_records):
        # A whole batch as a client encodes it takes the compiled path, not the walk
        # (aiokafka reads a -1 timestamp as none: with deltas over one byte, where the
        # timestamps are read, those go to the walk).
        raise AssertionError("a sound batch was not read by the compiled check")
    # The produced batch read in place: the reader adds the producer's base offset and
    # base timestamp (anything a client sends), which the check takes off again.
    base_offset = data.draw(st.integers(-(1 << 63), (1 << 63) - 1))
    base_timestamp = data.draw(st.sampled_from([0, 1_700_000_000_000, -(1 << 63), (1 << 63) - 1]))
    produced = (
        kafka_batch.fetch_prefix(base_offset, kafka_batch.SECTION_HEADER_SIZE + len(body))
        + kafka_batch.SECTION_HEADER.pack(0, 0, count - 1, base_timestamp, 0, -1, -1, -1, count)
        + bytes(body)
    )
    in_place = kafka_batch._reads_canonically(len(body), header, produced)
    if in_place:
        assert walked
    elif body == built and all(
        r.timestamp_delta != -1 and base_timestamp + r.timestamp_delta != -1 for r in batch_records
    ):
        raise AssertionError("a sound produced batch was not read in place")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batches=st.lists(
        st.tuples(
            records() | uniform_records(),
            CODECS,
            st.booleans(),  # LogAppendTime
            st.integers(0, 2**41),  # base timestamp
            st.integers(0, 2),  # damaged bytes
        ),
        min_size=1,
        max_size=5,
    ),
    data=st.data(),
)
def test_sections_read_together_read_as_the_reference_decoder_reads_them(
    batches: list[tuple[list[Record], Compression, bool, int, int]], data: st.DataObject
) -> None:
    # The SQL projection reads a round's stored sections together with numpy
    # (sections_values): on every section the produce walk passes, damaged ones too, its
    # values and timestamps must be parse_records', whether numpy read the section or,
    # not as predicted, the decoder did.
    sections: list[bytes] = []
    counts: list[int] = []
    values: list[bytes] = []
    stamps: list[int] = []
    for batch_records, codec, log_append, base, damaged in batches:
        built = build_batch(batch_records, base_timestamp=base)
        body = bytearray(built[HEADER_SIZE:])
        for _ in range(damaged):
            body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
        count = len(batch_records)
        try:
            kafka_batch.walk_records(bytes(body), count)
        except kafka_batch.KafkaRecordsError:
            continue  # never stored
        header = bytearray(built[CRC_OFFSET:HEADER_SIZE])
        header[4:6] = (int(codec) | (kafka_batch.ATTR_LOG_APPEND_TIME * log_append)).to_bytes(
            2, "big"
        )
        max_timestamp = data.draw(st.integers(0, 2**41))
        header[18:26] = max_timestamp.to_bytes(8, "big")
        sections.append(bytes(header) + compress(codec, bytes(body)))
        counts.append(count)
        _, ts_deltas, _, parsed, _ = kafka_batch.parse_records(bytes(body), count)
        values += [value or b"" for value in parsed]
        stamps += [max_timestamp] * count if log_append else [base + d for d in ts_deltas]
    if not sections:
        return
    given: list[bytes] | list[memoryview] = sections
    if data.draw(st.booleans()):
        # As the projection has them: views of one read buffer, a stored header between.
        laid = b"".join(b"h" * 64 + section for section in sections)
        at = list(itertools.accumulate(64 + len(section) for section in sections))
        given = [
            memoryview(laid)[end - len(section) : end]
            for end, section in zip(at, sections, strict=True)
        ]
    # Long batches are read run by run (_batch_runs), the others record by record:
    # drawn here for batches of any size, all one way or a round of both.
    runs_from = data.draw(st.sampled_from([1, 10**9]) | st.integers(2, 12))
    # The short ones a few records at a time, or all at once (BLOCK_RECORDS).
    block = data.draw(st.sampled_from([10**9]) | st.integers(1, 40))
    with (
        patch.object(kafka_batch, "RUNS_FROM", runs_from),
        patch.object(kafka_batch, "BLOCK_RECORDS", block),
    ):
        read = kafka_batch.sections_values(given)
    spans = zip(read.starts.tolist(), read.ends.tolist(), strict=True)
    assert [bytes(read.body[start:end]) for start, end in spans] == values
    assert read.timestamps.tolist() == stamps
    assert read.firsts == [0, *itertools.accumulate(counts)]
    assert (read.starts[1:] >= read.ends[:-1]).all()  # ascending, never overlapping


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch_records=records() | uniform_records(), data=st.data())
def test_the_numpy_produce_check_passes_only_what_the_walk_passes(
    batch_records: list[Record], data: st.DataObject
) -> None:
    # A long produced batch is checked by numpy reading every record's fields at once:
    # it must never pass a batch the walk refuses, and it must read a sound batch of
    # fixed-size values with short timestamp deltas (the usual long batch) itself.
    built, body, header, walked = damaged_body(batch_records, data)
    read = kafka_batch._reads_by_numpy(bytes(body), header)
    if read:
        assert walked
    elif (
        body == built
        and len({(r.key, len(r.value or b"")) for r in batch_records}) == 1
        and all(
            0 <= r.timestamp_delta < 64 and r.value is not None and not r.headers
            for r in batch_records
        )
    ):
        raise AssertionError("a sound batch of fixed-size records was not read by numpy")


def test_long_batches_of_one_read_buffer_are_read_where_they_lie() -> None:
    # The projection's sections come from one read of the log: uncompressed ones are
    # read in that buffer (no copy of them laid end to end), their values the same; a
    # short batch among long ones (read record by record, they run by run) too.
    sections, values = [], []
    for batch, count in enumerate((kafka_batch.RUNS_FROM + 300, 7, kafka_batch.RUNS_FROM)):
        records = [
            Record(
                offset_delta=i, timestamp_delta=i // 100, key=None, value=b"%d-%04d" % (batch, i)
            )
            for i in range(count)
        ]
        sections.append(build_batch(records, base_timestamp=1_000)[CRC_OFFSET:])
        values += [record.value for record in records]
    laid = b"".join(b"h" * 64 + section for section in sections)
    ends = itertools.accumulate(64 + len(section) for section in sections)
    views = [memoryview(laid)[end - len(s) : end] for end, s in zip(ends, sections, strict=True)]
    read = kafka_batch.sections_values(views)
    assert isinstance(read.body, memoryview) and read.body.obj is laid
    spans = zip(read.starts.tolist(), read.ends.tolist(), strict=True)
    assert [bytes(read.body[start:end]) for start, end in spans] == values


def _varint(value: int, pad: int = 0) -> bytes:
    """A zigzag varint, with ``pad`` needless bytes (Kafka's readers take them: a
    producer may spell 0 as ``80 00``)."""
    out = bytearray()
    raw = (value << 1) ^ (value >> 63)
    while raw >= 0x80:
        out.append((raw & 0x7F) | 0x80)
        raw >>= 7
    out.append(raw)
    if pad:
        out[-1] |= 0x80
        out += b"\x80" * (pad - 1) + b"\x00"
    return bytes(out)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    count=st.integers(2, 40),
    key=st.none() | st.binary(max_size=12),
    value_size=st.integers(-1, 30),
    timestamp_delta=st.integers(-5, 2**40),
    pads=st.tuples(*[st.integers(0, 2)] * 3),
    data=st.data(),
)
def test_the_numpy_produce_check_passes_only_what_the_walk_passes_over_long_varints(
    count: int,
    key: bytes | None,
    value_size: int,
    timestamp_delta: int,
    pads: tuple[int, int, int],
    data: st.DataObject,
) -> None:
    # Records whose key length, value length and header count are spelt with needless
    # varint bytes (as the walk and Kafka's readers accept), then a few bytes changed
    # near a record's start: numpy's check, reading a run of records by their first
    # bytes, must never pass what the walk refuses (a first record's header count 0
    # spelt 80 00 once let a later 01 00, a count of -1, through).
    key_pad, value_pad, headers_pad = pads
    records = []
    for index in range(count):
        body = b"\x00" + _varint(timestamp_delta) + _varint(index)
        body += _varint(-1 if key is None else len(key), key_pad) + (key or b"")
        body += _varint(value_size, value_pad) + b"v" * max(value_size, 0)
        body += _varint(0, headers_pad)
        records.append(_varint(len(body)) + body)
    ends = list(itertools.accumulate(len(r) for r in records))
    body = bytearray(b"".join(records))
    for _ in range(data.draw(st.integers(1, 3))):
        # A byte among a record's first ten or last three (its leading varints, or
        # its value's end and header count).
        k = data.draw(st.integers(1, count - 1))
        start, end = ends[k - 1], ends[k]
        at = data.draw(st.integers(start, min(start + 9, end - 1)) | st.integers(end - 3, end - 1))
        body[max(at, start)] = data.draw(
            st.sampled_from([0, 1, 2, 0x7F, 0x80, 0x81, 0xFF]) | st.integers(0, 255)
        )
    claimed = count + data.draw(st.sampled_from([0, 0, 0, -1, 1]))
    header, walked = walked_header(bytes(body), claimed)
    read = kafka_batch._reads_by_numpy(bytes(body), header)
    assert walked or not read


@st.composite
def producer_records(draw: st.DrawFn) -> list[Record]:
    """A long batch as librdkafka sends it: one key, values of one size, timestamp
    deltas of one byte, no headers; often past 64 records (offset deltas of 2 bytes)."""
    count = draw(st.integers(1, 200))
    size = draw(st.integers(1, 120))
    key = draw(st.none() | st.binary(max_size=8))
    return [
        Record(index, draw(st.integers(0, 63)), key, bytes([index % 256]) * size)
        for index in range(count)
    ]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batches=st.lists(
        st.tuples(
            producer_records() | producer_records() | uniform_records() | records(),
            st.sampled_from([Compression.NONE] * 4 + list(Compression)),
            st.sampled_from([0, 0, 1, 1, 2]),  # bytes of the records changed
            st.sampled_from([0] * 8 + [-1, 1]),  # records claimed past the true count
            st.sampled_from([""] * 8 + ["crc", "last offset delta"]),  # header damage
        ),
        min_size=1,
        max_size=5,
    ),
    data=st.data(),
)
def test_batches_checked_together_pass_only_what_each_check_passes(
    batches: list[tuple[list[Record], Compression, int, int, str]], data: st.DataObject
) -> None:
    # A Produce's batches are checked together, runs of one record layout across them
    # at once (sections_pass): a batch it passes must pass the check of it alone and
    # the exact walk, damaged, miscounted and compressed ones among them; and a sound
    # batch of fixed-size records (the usual one) passes, whatever its neighbours.
    sections: list[tuple[memoryview, kafka_batch.SectionHeader]] = []
    alone: list[bool] = []
    usual: list[bool] = []
    for batch_records, codec, damaged, miscount, bad_header in batches:
        built = build_batch(batch_records, base_timestamp=1_700_000_000_000)
        section = bytearray(built[CRC_OFFSET:])
        if codec:
            header = bytearray(section[: kafka_batch.SECTION_HEADER_SIZE])
            header[4:6] = int(codec).to_bytes(2, "big")
            body = compress(codec, bytes(section[kafka_batch.SECTION_HEADER_SIZE :]))
            section = header + body
        bounds = _record_bounds(section) if not codec else []
        for _ in range(damaged if bounds else 0):
            # A byte among a later record's first ten or last three (its varints, where
            # a run's rows are compared with its first, or its value's end and header
            # count), often by one or by its top bit: a varint that still reads.
            index = data.draw(st.integers(min(1, len(bounds) - 1), len(bounds) - 1))
            start, end = bounds[index]
            near = st.integers(start, min(start + 9, end - 1)) | st.integers(end - 3, end - 1)
            layout = kafka_batch._record_layout(bytes(section), start, end, index)
            if layout is not None:  # often one of its fields' bytes, aimed at
                fields = [0, layout.timestamp_at - 1, layout.timestamp_at, layout.offset_at]
                fields += [layout.offset_at + layout.offset_size, layout.value_length_at]
                fields += [layout.value_at - 1, layout.size - 1]
                near = st.sampled_from([start + f for f in fields]) | near
            at = max(start, data.draw(near))
            was = section[at]
            section[at] = data.draw(
                st.sampled_from([(was + 1) % 256, (was - 1) % 256, was ^ 0x80, 0, 0x7F, 0xFF])
                | st.integers(0, 255)
            )
        count = max(len(batch_records) + miscount, 1)
        section[40:44] = count.to_bytes(4, "big")
        section[6:10] = (count - 1 + (bad_header == "last offset delta")).to_bytes(4, "big")
        crc = kafka_batch.crc32c(bytes(section[4:])) ^ (bad_header == "crc")
        section[0:4] = crc.to_bytes(4, "big")
        view = memoryview(bytes(section))
        sections.append((view, kafka_batch.section_header(view)))
        try:
            kafka_batch.check_section(view, kafka_batch.MAX_DECOMPRESSED)
        except kafka_batch.KafkaRecordsError:
            alone.append(False)
        else:
            alone.append(True)
        usual.append(
            not codec
            and not (damaged and bounds)
            and not miscount
            and not bad_header
            and len({(r.key, len(r.value or b"")) for r in batch_records}) == 1
            and all(
                0 <= r.timestamp_delta < 64 and r.value is not None and not r.headers
                for r in batch_records
            )
            # Records of 8 bytes or more: their first 8 bytes are read as one word.
            and len(batch_records[0].key or b"") + len(batch_records[0].value or b"") > 0
        )
    # Every batch long enough for numpy (the property's batches are short).
    with patch.object(kafka_batch, "NUMPY_CHECK_RECORDS", 1):
        together = kafka_batch.sections_pass(sections, kafka_batch.MAX_DECOMPRESSED)
    for (view, header), passed, passes_alone, sound in zip(
        sections, together, alone, usual, strict=True
    ):
        if passed:
            assert passes_alone
            body = bytes(view[kafka_batch.SECTION_HEADER_SIZE :])
            kafka_batch.walk_records(body, header.records_count)
        elif sound:
            raise AssertionError("a sound batch of fixed-size records did not pass together")


def _record_bounds(section: bytes | bytearray) -> list[tuple[int, int]]:
    """Where each record of an uncompressed, undamaged section lies: (start, end)."""
    bounds = []
    pos = kafka_batch.SECTION_HEADER_SIZE
    while pos < len(section):
        length, at = kafka_batch._varint(bytes(section), pos)
        bounds.append((pos, at + length))
        pos = at + length
    return bounds
