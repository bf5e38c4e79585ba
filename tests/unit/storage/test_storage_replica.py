"""What a follower does to its partition log: append the leader's stored batches byte
for byte (PartitionLog.append_stored), cut a divergent tail (truncate_to), and keep
leader epochs in leader-epoch-checkpoint (LeaderEpochs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from headwater.errors import CorruptBatchError, OutOfOrderSequence, StorageError, UsageError
from headwater.storage.leader_epochs import FILE_NAME, UNKNOWN, LeaderEpochs
from headwater.storage.log import LogConfig, PartitionLog, SyncPolicy
from headwater.storage.producers import ProducerTable, now_ms
from headwater.storage.segment import segment_name

NONE = SyncPolicy("none")


def open_log(path: Path, segment_bytes: int = 1 << 20) -> PartitionLog:
    return PartitionLog.open(path, LogConfig(sync=NONE, segment_bytes=segment_bytes))


def stored_bytes(plog: PartitionLog, start: int = 0) -> bytes:
    return b"".join(bytes(batch.buffer) for batch in plog.batches(start))


def fill(plog: PartitionLog, batches: int, size: int = 3) -> None:
    for i in range(batches):
        values = [f"v{i}-{j}".encode() * 5 for j in range(size)]
        plog.append(values, first_position=100 + plog.end_offset, timestamp_ms=1000 + i)


def files_of(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.glob("*.log"))}


def test_a_follower_copies_the_leader_byte_for_byte(tmp_path: Path) -> None:
    leader = open_log(tmp_path / "leader", segment_bytes=600)
    fill(leader, 6)
    # Now: an old timestamp would make the producer expire at close.
    leader.append([b"once"], first_position=7, timestamp_ms=now_ms(), producer=(42, 0))
    follower = open_log(tmp_path / "follower", segment_bytes=600)
    # Fetched in two runs, as a follower does.
    head = b"".join(bytes(b.buffer) for b in leader.batches(0, 9))
    assert follower.append_stored(head) == 9
    assert follower.append_stored(stored_bytes(leader, 9)) == leader.end_offset == 19
    leader.close()
    follower.close()
    assert files_of(tmp_path / "follower") == files_of(tmp_path / "leader")
    assert len(files_of(tmp_path / "leader")) > 1  # rolled: the copy rolled alike
    reopened = open_log(tmp_path / "follower", segment_bytes=600)
    # The producer's sequence came with the copy: a retry is found, not stored twice.
    entry = reopened.check_producer(42, 0)
    assert entry is not None and entry.base_offset == 18


def test_a_bad_run_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    leader = open_log(tmp_path / "leader")
    fill(leader, 3)
    data = bytearray(stored_bytes(leader))
    follower = open_log(tmp_path / "follower")
    data[-1] ^= 0xFF  # the last batch's CRC no longer matches
    with pytest.raises(CorruptBatchError):
        follower.append_stored(bytes(data))
    with pytest.raises(CorruptBatchError):
        follower.append_stored(bytes(data[:-5]))  # cut inside a batch
    with pytest.raises(UsageError, match="starts at 3, not at 0"):
        follower.append_stored(stored_bytes(leader, 3))  # a gap
    assert follower.end_offset == 0 and follower.active.size == 0


def test_truncation_cuts_at_a_batch_and_survives_a_reopen(tmp_path: Path) -> None:
    plog = open_log(tmp_path / "p", segment_bytes=600)
    fill(plog, 8)  # batches of 3: [0,3) [3,6) ... [21,24), over several segments
    segments_before = len(plog.segments)
    assert plog.truncate_to(9) == 9
    assert plog.truncate_to(7) == 6  # inside [6,9): the whole batch goes
    assert len(plog.segments) < segments_before
    assert [e.offset for e in plog.events()] == list(range(6))
    info = plog.append([b"new"], first_position=0, timestamp_ms=1)
    assert info.base_offset == 6
    plog.close()
    reopened = open_log(tmp_path / "p", segment_bytes=600)
    assert reopened.end_offset == 7
    assert [e.value for e in reopened.events(6)] == [b"new"]
    assert reopened.truncate_to(100) == 7  # past the end: nothing to cut


def test_truncation_forgets_the_producers_of_the_cut_tail(tmp_path: Path) -> None:
    plog = open_log(tmp_path / "p", segment_bytes=600)
    fill(plog, 4)
    plog.roll()  # a producer snapshot at 12, above the cut
    plog.append([b"x"], first_position=0, timestamp_ms=now_ms(), producer=(7, 0))
    assert plog.check_producer(7, 0) is not None
    plog.truncate_to(6)
    assert plog.check_producer(7, 0) is None
    plog.close()
    assert open_log(tmp_path / "p").check_producer(7, 0) is None
    assert not [p for p in (tmp_path / "p").glob("*.producers") if int(p.name[:20]) > 6]
    assert not (tmp_path / "p" / segment_name(12, ".log")).exists()


def test_leader_epochs_answer_where_an_epoch_ended(tmp_path: Path) -> None:
    epochs = LeaderEpochs(tmp_path)
    assert epochs.latest == UNKNOWN and epochs.end_offset_for(3, 0) == (UNKNOWN, UNKNOWN)
    epochs.assign(1, 0)
    epochs.assign(3, 120)
    epochs.assign(2, 50)  # older than the latest: ignored
    epochs.assign(5, 300)
    assert (tmp_path / FILE_NAME).read_text() == "0\n3\n1 0\n3 120\n5 300\n"
    assert epochs.end_offset_for(1, 400) == (1, 120)
    assert epochs.end_offset_for(2, 400) == (1, 120)  # unknown here: the one below it
    assert epochs.end_offset_for(4, 400) == (3, 300)
    assert epochs.end_offset_for(9, 400) == (5, 400)  # the latest ends at the log end
    assert epochs.end_offset_for(0, 400) == (UNKNOWN, UNKNOWN)
    epochs.truncate_from(300)
    assert LeaderEpochs(tmp_path).entries == [(1, 0), (3, 120)]
    epochs.assign(6, 120)  # epoch 3 wrote nothing before 6 began: only 6 is kept there
    assert LeaderEpochs(tmp_path).entries == [(1, 0), (6, 120)]


def test_a_damaged_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / FILE_NAME).write_text("0\n2\n1 0\n")
    with pytest.raises(StorageError, match="damaged"):
        LeaderEpochs(tmp_path)


def test_kafka_batches_advance_the_sequence_by_their_record_count() -> None:
    # Kafka numbers records (the next base sequence is this batch's + its count);
    # headwater's appends number appends (+1). Both survive a snapshot.
    table = ProducerTable()
    table.record(9, 0, base_offset=0, count=5, timestamp_ms=now_ms(), epoch=0, step=5)
    assert table.check(9, 5, 0) is None
    assert table.check(9, 0, 0) is not None  # a retry of the first batch
    with pytest.raises(OutOfOrderSequence):
        table.check(9, 1, 0)
    table.record(8, 0, base_offset=5, count=5, timestamp_ms=now_ms())
    assert table.check(8, 1) is None
    again = ProducerTable.from_json(table.to_json(), now_ms())
    assert again.check(9, 5, 0) is None and again.check(8, 1) is None
