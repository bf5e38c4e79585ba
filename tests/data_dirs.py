"""A data directory laid out as the engine lays it out, built by storage alone (for
tests of what reads data directories: backup, check)."""

from __future__ import annotations

from pathlib import Path

from headwater.storage.log import LogConfig, PartitionLog
from headwater.storage.metadata import write_json_atomic


def stream_log(data: Path, stream_id: int, config: LogConfig) -> PartitionLog:
    """Partition 0 of stream ``stream_id`` (named ``s<id>``) of tenant 0 in ``data``:
    tenant.json, stream.json, ``partition-0/``, opened with ``config``."""
    tenant = data / "tenants" / "0"
    tenant.mkdir(parents=True, exist_ok=True)
    write_json_atomic(tenant / "tenant.json", {"id": 0, "name": "default", "next_stream_id": 9})
    stream = tenant / "streams" / str(stream_id)
    stream.mkdir(parents=True)
    meta = {"id": stream_id, "name": f"s{stream_id}", "created_ns": 1, "partitions": 1}
    write_json_atomic(stream / "stream.json", {**meta, "settings": {}})
    return PartitionLog.open(stream / "partition-0", config)
