"""The log the page-sized read tests share: ReadEvents' 8 MiB pages over 1 MB batches."""

from __future__ import annotations

from pathlib import Path

from headwater.storage.log import LogConfig, PartitionLog, SyncPolicy

MIB = 1 << 20


def megabyte_batches_log(
    path: Path, segment_bytes: int | None = None
) -> tuple[PartitionLog, list[bytes]]:
    """40 batches of 1,000 values of 1,000 bytes (40 MB; a page ends inside a batch),
    synced; returns the log and every value in order."""
    config = LogConfig(sync=SyncPolicy("fsync"))
    if segment_bytes is not None:
        config = LogConfig(sync=SyncPolicy("fsync"), segment_bytes=segment_bytes)
    plog = PartitionLog.open(path, config)
    values = [b"%07d" % i + bytes([65 + i % 26]) * 993 for i in range(1000)]
    for _ in range(40):
        plog.append(values, first_position=0, timestamp_ms=0)
    plog.sync()
    return plog, values * 40
