"""The Kafka Fetch conversion of batches stored in headwater's form (another front
end's): a producer's batch keeps its producer id, epoch, sequence and transactional
flag, so a read_committed Kafka client can match it to the aborted-transactions list;
a batch without a producer carries Kafka's "no producer" values. And batches stored in
Kafka form are sent as read, not copied into the answer."""

from __future__ import annotations

import os
from pathlib import Path

from headwater.protocols.kafka import split_batches
from headwater.protocols.kafka.frames import (
    PLACEHOLDER_BYTES,
    encode_response,
    encode_response_chunks,
)
from headwater.protocols.kafka.records import (
    NO_PRODUCER_EPOCH,
    NO_PRODUCER_ID,
    NO_SEQUENCE,
    Record,
    build_batch,
)
from headwater.server.kafka.handlers import records_of
from headwater.storage.log import LogConfig, PartitionLog, SyncPolicy
from kafka_answers import fetch_answer

PRODUCER_ID, EPOCH = (1 << 56) + 7, 3
SEQUENCE = 1  # the producer's second batch (Rivven's sequences count batches)


def test_a_headwater_form_batch_keeps_its_producer_in_kafka_form(tmp_path: Path) -> None:
    plog = PartitionLog.open(tmp_path, LogConfig(sync=SyncPolicy("none")))
    plog.append([b"plain"], first_position=0, timestamp_ms=1)
    for values in ([b"s0", b"s1"], [b"t0", b"t1", b"t2"]):
        plog.append(
            values,
            first_position=plog.end_offset,
            timestamp_ms=2,
            producer=(PRODUCER_ID, plog.end_offset // 2),  # sequences 0 and 1
            producer_epoch=EPOCH,
            transactional=True,
        )
    plain, _first, whole = split_batches(
        b"".join(records_of(plog.read(0, committed_only=False, kafka=True)))
    )
    assert (plain.header.producer_id, plain.header.producer_epoch) == (
        NO_PRODUCER_ID,
        NO_PRODUCER_EPOCH,
    )
    assert plain.header.base_sequence == NO_SEQUENCE and not plain.header.is_transactional
    header = whole.header
    assert (header.producer_id, header.producer_epoch, header.base_sequence) == (
        PRODUCER_ID,
        EPOCH,
        SEQUENCE,
    )
    assert header.is_transactional and not header.is_control
    assert whole.records().values == [b"t0", b"t1", b"t2"]
    # A batch read from its middle keeps its producer.
    [tail] = split_batches(b"".join(records_of(plog.read(4, committed_only=False, kafka=True))))
    assert (tail.header.base_offset, tail.header.producer_id) == (4, PRODUCER_ID)
    assert tail.header.is_transactional and tail.records().values == [b"t1", b"t2"]


def test_producer_ids_and_epochs_past_kafkas_fields_are_sent_as_their_bytes(
    tmp_path: Path,
) -> None:
    """Other protocols store producer ids up to 2**64 - 1 (Kimberlite's, the Spark
    sink's hashes) and epochs up to 65,535 (Rivven's). Kafka's fields are an int64 and
    an int16: such a batch made every Fetch of its partition fail (the connection
    dropped, the consumer read nothing, the other partitions of the Fetch included).
    They go out as the same low bytes, whatever the batch's size (record by record
    under 64 events, by columns from 64)."""
    plog = PartitionLog.open(tmp_path, LogConfig(sync=SyncPolicy("none")))
    big_id, big_epoch = (1 << 63) + 12_345, 40_000
    plog.append([b"before"], first_position=0, timestamp_ms=1)
    for sequence, count in enumerate((2, 70)):
        plog.append(
            [b"v%d" % i for i in range(count)],
            first_position=plog.end_offset,
            timestamp_ms=2,
            producer=(big_id, sequence),
            producer_epoch=big_epoch,
        )
    plog.append([b"after"], first_position=plog.end_offset, timestamp_ms=3)
    batches = split_batches(b"".join(records_of(plog.read(0, committed_only=False, kafka=True))))
    assert [len(b.records().values) for b in batches] == [1, 2, 70, 1]
    for batch in batches[1:3]:
        assert batch.header.producer_id == big_id - (1 << 64)  # the same 8 bytes
        assert batch.header.producer_epoch == big_epoch - (1 << 16)  # the same 2 bytes
    assert batches[3].records().values == [b"after"]


def test_a_fetch_answer_sends_the_kafka_form_batches_as_read(tmp_path: Path) -> None:
    # Batches stored as produced go out as views of the read, not copied: records_of
    # gives them as the read's own memoryviews and the answer's frame holds those same
    # objects (the bytes are the answer kio encodes with the records in place).
    plog = PartitionLog.open(tmp_path, LogConfig(sync=SyncPolicy("none")))
    for base in (0, 3):
        produced = build_batch(
            [Record(i, 0, None, b"v%d" % (base + i)) for i in range(3)], base_timestamp=1_000
        )
        [batch] = split_batches(produced)
        plog.append_encoded(
            batch.section,
            3,
            first_position=base,
            timestamp_ms=batch.header.max_timestamp,
            kafka=True,
        )
    records = records_of(plog.read(0, kafka=True))
    sections = [part for part in records if isinstance(part, memoryview)]
    assert len(sections) == 2
    placeholder = os.urandom(PLACEHOLDER_BYTES)
    frame = encode_response_chunks(7, fetch_answer(placeholder), {placeholder: records})
    assert all(any(chunk is section for chunk in frame) for section in sections)
    assert b"".join(frame) == encode_response(7, fetch_answer(b"".join(records)))
    fetched = split_batches(b"".join(records))
    assert [b.header.base_offset for b in fetched] == [0, 3]
    assert [v for b in fetched for v in b.records().values] == [b"v%d" % i for i in range(6)]
