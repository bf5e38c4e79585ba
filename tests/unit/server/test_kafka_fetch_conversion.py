"""The Kafka Fetch conversion of batches stored in headwater's form (another front
end's): a producer's batch keeps its producer id, epoch, sequence and transactional
flag, so a read_committed Kafka client can match it to the aborted-transactions list;
a batch without a producer carries Kafka's "no producer" values."""

from __future__ import annotations

from pathlib import Path

from headwater.protocols.kafka import split_batches
from headwater.protocols.kafka.records import NO_PRODUCER_EPOCH, NO_PRODUCER_ID, NO_SEQUENCE
from headwater.server.kafka.handlers import records_of
from headwater.storage.log import LogConfig, PartitionLog, SyncPolicy

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
