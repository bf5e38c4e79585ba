"""Idempotent producers: the table that makes a retried append harmless.

Each idempotent batch carries ``(producer_id, sequence)`` in its producer section. The
table remembers, per producer, the last ``WINDOW`` sequences and where they were stored.
It is rebuilt on open from the newest snapshot (written when a segment is sealed and at
shutdown) plus the batches after it, so it survives restarts without a write of its own
on the append path. A producer idle for longer than the log's ``producer_expiry_ms`` is
forgotten when the next snapshot is written (as Kafka expires producer ids), so writers
that use a fresh producer id per task, such as the Spark sink, do not grow it forever.
"""

from __future__ import annotations

import json
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headwater.errors import InvalidRequest
from headwater.storage.batch import Batch


def now_ms() -> int:
    return int(time.time() * 1000)


WINDOW = 64
SNAPSHOT_SUFFIX = ".producers"


@dataclass(frozen=True)
class ProducerEntry:
    sequence: int
    base_offset: int
    count: int
    timestamp_ms: int  # of the batch: when the producer was last heard from


class ProducerTable:
    def __init__(self) -> None:
        self.producers: dict[int, OrderedDict[int, ProducerEntry]] = {}

    def check(self, producer_id: int, sequence: int) -> ProducerEntry | None:
        """The stored entry when this is a retry, None when it is the next sequence;
        InvalidRequest for anything else."""
        history = self.producers.get(producer_id)
        if history is None:
            if sequence != 0:
                raise InvalidRequest(
                    f"producer {producer_id} is new: its first sequence must be 0, not {sequence}"
                )
            return None
        last = next(reversed(history))
        if sequence == last + 1:
            return None
        entry = history.get(sequence)
        if entry is not None:
            return entry
        if sequence <= last:
            raise InvalidRequest(
                f"producer {producer_id} sequence {sequence} is older than the last "
                f"{WINDOW} remembered (last applied {last})"
            )
        raise InvalidRequest(
            f"producer {producer_id} sequence {sequence} out of order: expected {last + 1}"
        )

    def record(
        self, producer_id: int, sequence: int, base_offset: int, count: int, timestamp_ms: int
    ) -> None:
        history = self.producers.setdefault(producer_id, OrderedDict())
        history[sequence] = ProducerEntry(sequence, base_offset, count, timestamp_ms)
        while len(history) > WINDOW:
            history.popitem(last=False)

    def observe(self, batch: Batch) -> None:
        if batch.producer is not None:
            producer_id, sequence = batch.producer
            self.record(
                producer_id, sequence, batch.base_offset, batch.count, batch.max_timestamp_ms
            )

    def expire(self, idle_before_ms: int) -> int:
        """Forget producers last heard from before ``idle_before_ms``; how many."""
        idle = [
            pid
            for pid, history in self.producers.items()
            if history[next(reversed(history))].timestamp_ms < idle_before_ms
        ]
        for pid in idle:
            del self.producers[pid]
        return len(idle)

    def to_json(self) -> dict[str, Any]:
        return {
            str(pid): [
                [e.sequence, e.base_offset, e.count, e.timestamp_ms] for e in history.values()
            ]
            for pid, history in self.producers.items()
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], loaded_ms: int) -> ProducerTable:
        """From :meth:`to_json`; entries written before timestamps were kept count as
        heard from at ``loaded_ms``."""
        table = cls()
        for pid, entries in data.items():
            for sequence, base_offset, count, *rest in entries:
                heard = int(rest[0]) if rest else loaded_ms
                table.record(int(pid), int(sequence), int(base_offset), int(count), heard)
        return table


def snapshot_path(directory: Path, offset: int) -> Path:
    return directory / f"{offset:020d}{SNAPSHOT_SUFFIX}"


def write_snapshot(directory: Path, offset: int, table: ProducerTable) -> None:
    """State as of ``offset`` (exclusive). No fsync: a lost snapshot only means a longer
    scan on open; the directory is fsynced with the next sync."""
    path = snapshot_path(directory, offset)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"offset": offset, "producers": table.to_json()}))
    os.replace(tmp, path)
    snapshots = sorted(directory.glob(f"*{SNAPSHOT_SUFFIX}"))
    for old in snapshots[:-2]:
        old.unlink(missing_ok=True)


def load_snapshot(directory: Path, end_offset: int) -> tuple[int, ProducerTable]:
    """The newest readable snapshot at or below ``end_offset`` (or an empty table at 0)."""
    for path in sorted(directory.glob(f"*{SNAPSHOT_SUFFIX}"), reverse=True):
        try:
            data = json.loads(path.read_text())
            offset = int(data["offset"])
            if offset <= end_offset:
                return offset, ProducerTable.from_json(data["producers"], now_ms())
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return 0, ProducerTable()
