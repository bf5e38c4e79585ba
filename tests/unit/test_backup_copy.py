"""headwater.cli.backup step by step, with the server's moves in between that a live
backup races: a torn write at the tail when the backup begins, appends after it, a
segment deleted by retention, an index file that no longer matches its segment and a
stream deleted between the walk and the copy.
(tests/integration/test_backup.py runs the command against a real server.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from data_dirs import stream_log
from headwater.cli.backup import (
    BackupReport,
    PartitionPlan,
    copy_bytes,
    copy_metadata_and_plan,
    copy_partition,
    plan_partition,
)
from headwater.storage.check import check_data_dir, check_metadata
from headwater.storage.log import LogConfig, PartitionLog

SMALL_SEGMENTS = LogConfig(segment_bytes=1024)
TORN_WRITE = b"\x00\x01\x00\x00half a batch header"


def value(stream_id: int, i: int) -> bytes:
    return f"{stream_id}:{i}:".encode() * 10


def make_stream(data: Path, stream_id: int, batches: int) -> PartitionLog:
    """A stream of ``batches`` one-event batches in 1 KiB segments."""
    plog = stream_log(data, stream_id, SMALL_SEGMENTS)
    for i in range(batches):
        plog.append([value(stream_id, i)], first_position=stream_id * 1000 + i)
    plog.sync()
    return plog


def test_the_copy_is_the_log_as_it_was_when_its_newest_segment_was_sized(tmp_path: Path) -> None:
    data, staging = tmp_path / "data", tmp_path / "staging"
    kept = make_stream(data, 1, 40)
    gone = make_stream(data, 2, 5)
    assert len(kept.segments) > 3

    report = BackupReport(tmp_path / "dest")
    plans = copy_metadata_and_plan(data, staging, report)
    for meta in ("tenant.json", "streams/1/stream.json", "streams/2/stream.json"):
        assert (staging / "tenants" / "0" / meta).is_file()
    # Meanwhile the server: retention deletes the oldest segment, more is appended (the
    # copy holds it: it was written before the newest segment was sized), a write is
    # under way when the copy sizes the newest, a stream is deleted.
    oldest = kept.segments[0]
    oldest.log_path.unlink()
    # An index that no longer describes its .log (as if compaction had replaced the
    # segment between the two copies): recovery must rebuild it, not keep it.
    stale_index = kept.segments[2].index_path
    good_index = stale_index.read_bytes()
    stale_index.write_bytes(good_index[:-1] + bytes([good_index[-1] ^ 1]))
    untouched = kept.segments[1].time_index_path
    for i in range(40, 60):
        kept.append([value(1, i)], first_position=1000 + i)
    kept.sync()
    end_when_sized = kept.end_offset
    tail = kept.active.log_path
    with tail.open("ab") as f:
        f.write(TORN_WRITE)
    gone.close()
    stream_2 = data / "tenants" / "0" / "streams" / "2"
    stream_2.rename(stream_2.with_name(".deleted-2"))

    for plan in plans:
        copy_partition(data, staging, plan, report)
    with tail.open("r+b") as f:  # the write under way ends (here: taken back)
        f.truncate(tail.stat().st_size - len(TORN_WRITE))
    kept.append([value(1, 60)], first_position=1060)  # after the copy: not in it
    kept.close()

    assert report.vanished == [
        f"tenants/0/streams/1/partition-0/{oldest.log_path.name}: removed by retention meanwhile",
        "tenants/0/streams/2/partition-0: deleted during the backup, left out",
    ]
    assert report.cut_bytes == len(TORN_WRITE)
    assert not (staging / "tenants" / "0" / "streams" / "2").exists()
    assert check_metadata(staging) == []
    assert [r.path for r in check_data_dir(staging) if r.damaged] == []

    partition = staging / "tenants" / "0" / "streams" / "1" / "partition-0"
    assert (partition / stale_index.name).read_bytes() == good_index  # rebuilt
    assert (partition / untouched.name).read_bytes() == untouched.read_bytes()  # copied
    copied = PartitionLog.open(partition)
    try:
        assert copied.start_offset == kept.segments[1].base_offset > 0  # after the deleted
        assert copied.end_offset == end_when_sized
        assert [(e.offset, e.value) for e in copied.events(copied.start_offset)] == [
            (i, value(1, i)) for i in range(copied.start_offset, end_when_sized)
        ]
    finally:
        copied.close()


def test_retention_during_the_copy_leaves_no_hole(tmp_path: Path, monkeypatch: Any) -> None:
    """Retention deletes segments while the copy is past the oldest of them: the ones
    already copied go too (the server no longer holds them either), or the copy would
    be a log with a hole in its offsets."""
    data, staging = tmp_path / "data", tmp_path / "staging"
    plog = make_stream(data, 1, 40)
    bases = [seg.base_offset for seg in plog.segments]
    assert len(bases) > 4
    end_at_start = plog.end_offset
    report = BackupReport(tmp_path / "dest")
    plans = copy_metadata_and_plan(data, staging, report)
    copies: list[Path] = []

    def copy_then_retention(fd: int, path: Path, limit: int | None) -> int:
        copied = copy_bytes(fd, path, limit)
        copies.append(path)
        if len(copies) == 2:  # two segments copied: retention drops the oldest three
            for seg in plog.segments[:3]:
                seg.log_path.unlink()
                seg.index_path.unlink()
                seg.time_index_path.unlink()
        return copied

    monkeypatch.setattr("headwater.cli.backup.copy_bytes", copy_then_retention)
    for plan in plans:
        copy_partition(data, staging, plan, report)
    plog.close()

    name = [f"{base:020d}.log" for base in bases]
    where = "tenants/0/streams/1/partition-0"
    assert report.vanished == [
        f"{where}/{name[2]}: removed by retention meanwhile",
        f"{where}/{name[0]}: left out, removed by retention after it",
        f"{where}/{name[1]}: left out, removed by retention after it",
    ]
    partition = staging / where
    assert sorted(p.name for p in partition.glob("*.log")) == name[3:]
    assert [r.path for r in check_data_dir(staging) if r.damaged] == []
    copied = PartitionLog.open(partition)
    try:
        assert copied.start_offset == bases[3]
        assert [(e.offset, e.value) for e in copied.events(copied.start_offset)] == [
            (i, value(1, i)) for i in range(bases[3], end_at_start)
        ]
    finally:
        copied.close()


def test_every_noted_segment_removed_the_partition_is_listed_again(tmp_path: Path) -> None:
    """The log rolled and retention deleted every segment the walk noted, the newest
    too, before the copy reached them: the copy is the log as it is at that point."""
    data, staging = tmp_path / "data", tmp_path / "staging"
    plog = make_stream(data, 1, 10)
    report = BackupReport(tmp_path / "dest")
    plans = copy_metadata_and_plan(data, staging, report)
    noted = list(plog.segments)
    for i in range(10, 40):
        plog.append([value(1, i)], first_position=1000 + i)
    plog.sync()
    for seg in noted:
        seg.log_path.unlink()
    start, end = plog.segments[len(noted)].base_offset, plog.end_offset
    for plan in plans:
        copy_partition(data, staging, plan, report)
    plog.close()

    partition = staging / "tenants" / "0" / "streams" / "1" / "partition-0"
    copied = PartitionLog.open(partition)
    try:
        assert (copied.start_offset, copied.end_offset) == (start, end)
        assert [(e.offset, e.value) for e in copied.events(start)] == [
            (i, value(1, i)) for i in range(start, end)
        ]
    finally:
        copied.close()
    where = "tenants/0/streams/1/partition-0"
    assert report.vanished == [
        f"{where}/{seg.log_path.name}: removed by retention meanwhile" for seg in noted
    ]


def copied_log(staging: Path) -> list[tuple[int, bytes | None, bytes]]:
    copied = PartitionLog.open(staging / "tenants" / "0" / "streams" / "1" / "partition-0")
    try:
        return [(e.offset, e.key, e.value) for e in copied.events(copied.start_offset)]
    finally:
        copied.close()


def test_compaction_during_the_copy_keeps_a_value_of_every_key(tmp_path: Path) -> None:
    """A key written again after the backup began, and compaction dropping its old
    value from a sealed segment before the copy reaches it: the copy reaches the new
    value (the newest segment is sized after the sealed ones are copied)."""
    data, staging = tmp_path / "data", tmp_path / "staging"
    plog = stream_log(data, 1, LogConfig(segment_bytes=1024, cleanup_policy="compact"))
    plog.append([b"k = old " + b"." * 300], first_position=0, keys=[b"k"])
    for i in range(6):
        plog.append([b"filler %d " % i + b"." * 300], first_position=1 + i, keys=[b"f%d" % i])
    plog.sync()
    assert len(plog.segments) > 2
    report = BackupReport(tmp_path / "dest")
    plans = copy_metadata_and_plan(data, staging, report)
    plog.append([b"k = new " + b"." * 300], first_position=100, keys=[b"k"])
    plog.roll()
    plog.sync()
    assert plog.compact().events_removed == 1
    for plan in plans:
        copy_partition(data, staging, plan, report)
    plog.close()

    assert [value for _, key, value in copied_log(staging) if key == b"k"] == [
        b"k = new " + b"." * 300
    ]


def test_a_newest_segment_compressed_after_it_was_sized_is_copied_whole(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """The newest segment is sized, then sealed and compressed (a new file in its
    place) before its copy: its noted size says nothing of the new file, which is
    copied whole instead of cut to a torn prefix."""
    data, staging = tmp_path / "data", tmp_path / "staging"
    plog = stream_log(data, 1, LogConfig(segment_bytes=1 << 20, compression="zstd"))
    values = [b"%d:" % i + bytes(range(200)) for i in range(203)]
    for i in range(3):
        plog.append([values[i]], first_position=i)
    plog.sync()
    report = BackupReport(tmp_path / "dest")
    plans = copy_metadata_and_plan(data, staging, report)
    sized = plan_partition
    noted: list[PartitionPlan] = []

    def size_then_compress(
        source: Path, relative: Path, names: list[str] | None = None
    ) -> PartitionPlan:
        listing = sized(source, relative, names)
        if not noted:  # the server: more appends, a roll, compression of the sealed one
            noted.append(listing)
            for i in range(3, 203):
                plog.append([values[i]], first_position=i)
            plog.roll()
            plog.sync()
            assert plog.compress().segments_compressed == 1
        return listing

    monkeypatch.setattr("headwater.cli.backup.plan_partition", size_then_compress)
    for plan in plans:
        copy_partition(data, staging, plan, report)
    plog.close()

    assert noted[0].segments == [f"{0:020d}.log"]
    assert [(offset, value) for offset, _, value in copied_log(staging)] == list(enumerate(values))
    assert report.cut_bytes == 0
