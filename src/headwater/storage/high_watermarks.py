"""A cluster node's high watermarks: ``replication-offset-checkpoint`` in the data dir.

As Kafka's file of that name: the last high watermark this node knew for each partition
it holds, so a restarted node (or a follower that becomes leader before its followers'
first fetches) does not start it from zero and hide from consumers what every in-sync
replica already held. Text, a version and a count, then one ``tenant stream partition
high_watermark`` line per partition::

    0
    2
    1 orders 0 1200
    1 hw_consumer_offsets 0 35

Written whole (temp file, fsync, rename) whenever a high watermark moved since the last
write, at most once per cluster tick; stream names hold no spaces.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from headwater.errors import StorageError
from headwater.storage.metadata import write_bytes_atomic

FILE_NAME = "replication-offset-checkpoint"
VERSION = 0

# (tenant id, stream name, partition)
Partition = tuple[int, str, int]


def read_high_watermarks(data_dir: Path) -> dict[Partition, int]:
    """The checkpointed high watermarks (none when the file is absent)."""
    path = data_dir / FILE_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    lines = text.split("\n")
    found: dict[Partition, int] = {}
    try:
        if int(lines[0]) != VERSION:
            raise ValueError(f"version {lines[0]}")
        count = int(lines[1])
        for line in lines[2 : 2 + count]:
            tenant, stream, partition, hw = line.split()
            found[int(tenant), stream, int(partition)] = int(hw)
        if len(found) != count:
            raise ValueError(f"{count} entries announced, {len(found)} found")
    except (ValueError, IndexError) as exc:
        raise StorageError(f"{path} is damaged: {exc}") from None
    return found


def write_high_watermarks(data_dir: Path, high_watermarks: Mapping[Partition, int]) -> None:
    lines = [str(VERSION), str(len(high_watermarks))]
    lines += [f"{t} {s} {p} {hw}" for (t, s, p), hw in sorted(high_watermarks.items())]
    write_bytes_atomic(data_dir / FILE_NAME, ("\n".join(lines) + "\n").encode())
