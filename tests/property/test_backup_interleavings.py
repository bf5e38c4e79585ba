"""``headwater backup`` of one log against any interleaving of the server's moves
(appends, rolls, retention of the oldest segments) before the copy and between any
two of its segment copies: the copy is one run of offsets, each event as written,
reaching what was written before the backup began (or the server's start, when
retention passed it), never an empty log starting again at offset 0.
(tests/unit/test_backup_copy.py has the named cases: compaction, compression.)"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from unittest import mock

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data_dirs import stream_log
from headwater.cli import backup
from headwater.storage.log import LogConfig, PartitionLog, SyncPolicy

MOVE = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 12)),
    st.tuples(st.just("roll"), st.just(0)),
    st.tuples(st.just("retain"), st.integers(1, 6)),
)
SMALL_SEGMENTS = LogConfig(segment_bytes=600, sync=SyncPolicy("none"))


def value(offset: int) -> bytes:
    return b"%d:" % offset + b"." * 50


def retain_oldest(plog: PartitionLog, segments: int) -> None:
    """What enforce_retention does to the oldest segments, whatever their size."""
    with plog._lock:
        for _ in range(min(segments, len(plog.segments) - 1)):
            oldest = plog.segments.pop(0)
            oldest.retire()
            oldest.delete_files()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    initial=st.integers(1, 40),
    moves=st.lists(st.lists(MOVE, max_size=4), max_size=12),
)
def test_any_interleaving_copies_one_run_of_offsets(
    initial: int, moves: list[list[tuple[str, int]]]
) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="hw-backup-"))
    try:
        data, staging = tmp / "data", tmp / "staging"
        plog = stream_log(data, 1, SMALL_SEGMENTS)
        for i in range(initial):
            plog.append([value(i)], first_position=i)
        end_at_start = plog.end_offset
        report = backup.BackupReport(tmp / "dest")
        plans = backup.copy_metadata_and_plan(data, staging, report)
        pending = list(moves)

        def server_moves() -> None:
            for kind, n in pending.pop(0) if pending else []:
                if kind == "append":
                    for _ in range(n):
                        plog.append([value(plog.end_offset)], first_position=plog.end_offset)
                elif kind == "roll":
                    plog.roll()
                else:
                    retain_oldest(plog, n)

        copy_bytes = backup.copy_bytes

        def copy_then_move(fd: int, path: Path, limit: int | None) -> int:
            copied = copy_bytes(fd, path, limit)
            server_moves()
            return copied

        server_moves()  # before the first copy
        with mock.patch.object(backup, "copy_bytes", copy_then_move):
            for plan in plans:
                backup.copy_partition(data, staging, plan, report)
        server_start = plog.start_offset
        plog.close()

        copied = PartitionLog.open(staging / "tenants/0/streams/1/partition-0", SMALL_SEGMENTS)
        try:
            events = [(e.offset, e.value) for e in copied.events(copied.start_offset)]
            start, end = copied.start_offset, copied.end_offset
        finally:
            copied.close()
        assert [offset for offset, _ in events] == list(range(start, end))
        assert all(v == value(offset) for offset, v in events)
        assert end >= min(end_at_start, server_start) and end > 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
