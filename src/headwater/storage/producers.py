"""Producers of one partition: idempotence, epochs and transactions.

Each idempotent batch carries ``(producer_id, sequence)`` in its producer section, and
since transactions an epoch too. The table remembers, per producer, its epoch and the
last ``WINDOW`` sequences of that epoch and where they were stored: a retried batch is
answered from it (stored once), a sequence that skips ahead is refused
(OutOfOrderSequence) and an older epoch than the one known is a zombie (ProducerFenced).
A new epoch starts its sequences at 0 again. Producers without epochs (Kimberlite's
idempotent appends) keep the sequence rules alone.

Transactions: a producer's first transactional batch in this partition opens its
transaction here (``ongoing``: producer -> first offset); its control batch (the marker)
closes it. An aborted transaction's range ``[first_offset, marker offset]`` goes to the
aborted-transactions index (Kafka's ``.txnindex``), which read_committed readers consult
so they skip its batches without scanning; the least first offset of the open ones is
the partition's first unstable offset, where read_committed reads stop (the last stable
offset).

The whole table is rebuilt on open from the newest snapshot (written when a segment is
sealed and at shutdown) plus the batches after it, so it survives restarts without a
write of its own on the append path. A producer idle for longer than the log's
``producer_expiry_ms`` and without an open transaction is forgotten when the next
snapshot is written (as Kafka expires producer ids), so writers that use a fresh
producer id per task, such as the Spark sink, do not grow it forever.
"""

from __future__ import annotations

import json
import os
import time
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headwater.errors import InvalidRequest, OutOfOrderSequence, ProducerFenced
from headwater.storage.batch import Batch


def now_ms() -> int:
    return int(time.time() * 1000)


WINDOW = 64
# Kafka's sequence is an int32 that wraps to 0 past 2**31 - 1 (its producer's
# incrementSequence): the sequence after the limit is the wrapped one. Other protocols'
# sequences are u64 and go on past it; both are the next.
KAFKA_SEQUENCES = 1 << 31
_U64_MAX = (1 << 64) - 1
_U32_MAX = (1 << 32) - 1
SNAPSHOT_SUFFIX = ".producers"


@dataclass(frozen=True)
class ProducerEntry:
    sequence: int
    base_offset: int
    count: int
    timestamp_ms: int  # of the batch: when the producer was last heard from
    # Sequences the batch used: 1 for a headwater append (one sequence per append, as
    # Kimberlite's AppendIdempotent numbers them), its record count for a Kafka batch
    # (Kafka numbers records: the next batch's base sequence is this one's + count).
    step: int = 1


@dataclass(frozen=True)
class AbortedTxn:
    """An aborted transaction's batches lie in ``[first_offset, last_offset]`` (the
    abort marker's offset) among the producer's batches."""

    producer_id: int
    first_offset: int
    last_offset: int


class ProducerTable:
    def __init__(self) -> None:
        self.producers: dict[int, OrderedDict[int, ProducerEntry]] = {}
        self.epochs: dict[int, int] = {}
        self.heard_ms: dict[int, int] = {}
        self.ongoing: dict[int, int] = {}  # producer -> first offset of its open txn
        self.aborted: dict[int, list[AbortedTxn]] = {}  # per producer, by offset

    def check(
        self, producer_id: int, sequence: int, epoch: int | None = None
    ) -> ProducerEntry | None:
        """The stored entry when this is a retry, None when it is the next sequence;
        ProducerFenced for an epoch older than the known one, OutOfOrderSequence for a
        sequence that is neither. A producer with an epoch that this partition has never
        heard of (or has forgotten, its batches removed) starts at any sequence, as in
        Kafka: a topic deleted and made again under a live producer's feet, say.
        InvalidRequest for an id or sequence outside a u64, an epoch outside a u32 (what
        a stored batch holds)."""
        if not (0 <= producer_id <= _U64_MAX and 0 <= sequence <= _U64_MAX) or not (
            epoch is None or 0 <= epoch <= _U32_MAX
        ):
            raise InvalidRequest(
                f"producer {producer_id} epoch {epoch} sequence {sequence}: ids and sequences"
                " are 0..2**64 - 1, epochs 0..2**32 - 1"
            )
        if epoch is not None:
            known = self.epochs.get(producer_id)
            if known is not None and epoch < known:
                raise ProducerFenced(
                    f"producer {producer_id} epoch {epoch} is fenced: epoch {known} took over"
                )
            if known is None:
                return None
            if epoch > known:
                if sequence != 0:
                    raise OutOfOrderSequence(
                        f"producer {producer_id} epoch {epoch} is new here: its first "
                        f"sequence must be 0, not {sequence}"
                    )
                return None
        history = self.producers.get(producer_id)
        if not history:
            if sequence != 0:
                raise OutOfOrderSequence(
                    f"producer {producer_id} is new: its first sequence must be 0, not {sequence}"
                )
            return None
        last = next(reversed(history))
        expected = last + history[last].step
        if sequence == expected or sequence == expected - KAFKA_SEQUENCES:
            return None
        entry = history.get(sequence)
        if entry is not None:
            return entry
        if sequence <= last:
            raise OutOfOrderSequence(
                f"producer {producer_id} sequence {sequence} is older than the last "
                f"{WINDOW} remembered (last applied {last})"
            )
        raise OutOfOrderSequence(
            f"producer {producer_id} sequence {sequence} out of order: expected {expected}"
        )

    def _set_epoch(self, producer_id: int, epoch: int | None) -> None:
        if epoch is None:
            return
        if self.epochs.get(producer_id) != epoch:
            # A new epoch: the old one's sequences say nothing about the new one's.
            self.producers.pop(producer_id, None)
            self.epochs[producer_id] = max(epoch, self.epochs.get(producer_id, epoch))

    def record(
        self,
        producer_id: int,
        sequence: int,
        base_offset: int,
        count: int,
        timestamp_ms: int,
        epoch: int | None = None,
        step: int = 1,
    ) -> None:
        self._set_epoch(producer_id, epoch)
        history = self.producers.setdefault(producer_id, OrderedDict())
        history[sequence] = ProducerEntry(sequence, base_offset, count, timestamp_ms, step)
        while len(history) > WINDOW:
            history.popitem(last=False)
        self.heard_ms[producer_id] = timestamp_ms

    def begin(self, producer_id: int, offset: int) -> None:
        """A transactional batch at ``offset``: opens the producer's transaction here
        unless it is open already."""
        self.ongoing.setdefault(producer_id, offset)

    def end(
        self, producer_id: int, epoch: int, commit: bool, offset: int, timestamp_ms: int
    ) -> None:
        """The producer's marker at ``offset``: its open transaction here ends; an
        aborted one's range goes to the index. A marker may carry a newer epoch (the
        coordinator's abort of a timed-out transaction fences the producer)."""
        if epoch > self.epochs.get(producer_id, -1):
            self._set_epoch(producer_id, epoch)
        self.heard_ms[producer_id] = timestamp_ms
        first = self.ongoing.pop(producer_id, None)
        if first is not None and not commit:
            self.aborted.setdefault(producer_id, []).append(AbortedTxn(producer_id, first, offset))

    def observe(self, batch: Batch) -> None:
        """Replay one stored batch (on open, after the snapshot)."""
        if batch.producer is None:
            return
        producer_id, sequence = batch.producer
        if batch.control:
            epoch = batch.producer_epoch if batch.producer_epoch is not None else 0
            commit = batch.marker_commits()
            self.end(producer_id, epoch, commit, batch.base_offset, batch.max_timestamp_ms)
            return
        self.record(
            producer_id,
            sequence,
            batch.base_offset,
            batch.count,
            batch.max_timestamp_ms,
            batch.producer_epoch,
            batch.count if batch.kafka_section is not None else 1,
        )
        if batch.transactional:
            self.begin(producer_id, batch.base_offset)

    def first_unstable_offset(self) -> int | None:
        """The first offset of the oldest open transaction (None when none is open)."""
        return min(self.ongoing.values()) if self.ongoing else None

    def is_aborted(self, producer_id: int, offset: int) -> bool:
        """Whether a transactional batch of ``producer_id`` at ``offset`` belongs to an
        aborted transaction."""
        ranges = self.aborted.get(producer_id)
        if not ranges:
            return False
        i = bisect_right(ranges, offset, key=lambda r: r.first_offset) - 1
        return i >= 0 and ranges[i].first_offset <= offset <= ranges[i].last_offset

    def aborted_between(self, start: int, end: int) -> list[AbortedTxn]:
        """Aborted transactions overlapping ``[start, end)``, by first offset."""
        found = [
            r
            for ranges in self.aborted.values()
            for r in ranges
            if r.first_offset < end and r.last_offset >= start
        ]
        return sorted(found, key=lambda r: r.first_offset)

    def prune_aborted(self, start_offset: int) -> None:
        """Forget aborted ranges wholly below the log's start (retention removed them)."""
        for pid in list(self.aborted):
            kept = [r for r in self.aborted[pid] if r.last_offset >= start_offset]
            if kept:
                self.aborted[pid] = kept
            else:
                del self.aborted[pid]

    def expire(self, idle_before_ms: int) -> int:
        """Forget producers last heard from before ``idle_before_ms`` (unless they have
        a transaction open here); how many."""
        idle = [
            pid
            for pid, heard in self.heard_ms.items()
            if heard < idle_before_ms and pid not in self.ongoing
        ]
        for pid in idle:
            self.producers.pop(pid, None)
            self.epochs.pop(pid, None)
            del self.heard_ms[pid]
        return len(idle)

    def to_json(self) -> dict[str, Any]:
        return {
            "producers": {
                str(pid): [
                    [e.sequence, e.base_offset, e.count, e.timestamp_ms, e.step]
                    for e in history.values()
                ]
                for pid, history in self.producers.items()
            },
            "epochs": {str(pid): epoch for pid, epoch in self.epochs.items()},
            "heard": {str(pid): ms for pid, ms in self.heard_ms.items()},
            "ongoing": {str(pid): first for pid, first in self.ongoing.items()},
            "aborted": [
                [r.producer_id, r.first_offset, r.last_offset]
                for ranges in self.aborted.values()
                for r in ranges
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], loaded_ms: int) -> ProducerTable:
        """From :meth:`to_json` (or a snapshot's ``producers`` alone, as written before
        epochs); entries written before timestamps were kept count as heard from at
        ``loaded_ms``."""
        table = cls()
        for pid, epoch in data.get("epochs", {}).items():
            table.epochs[int(pid)] = int(epoch)
        for pid, entries in data["producers"].items():
            history = table.producers.setdefault(int(pid), OrderedDict())
            for sequence, base_offset, count, *rest in entries:
                heard = int(rest[0]) if rest else loaded_ms
                step = int(rest[1]) if len(rest) > 1 else 1
                history[int(sequence)] = ProducerEntry(
                    int(sequence), int(base_offset), int(count), heard, step
                )
                table.heard_ms[int(pid)] = heard
        for pid, ms in data.get("heard", {}).items():
            table.heard_ms[int(pid)] = int(ms)
        for pid, first in data.get("ongoing", {}).items():
            table.ongoing[int(pid)] = int(first)
        for pid, first, last in data.get("aborted", []):
            table.aborted.setdefault(int(pid), []).append(
                AbortedTxn(int(pid), int(first), int(last))
            )
        for ranges in table.aborted.values():
            ranges.sort(key=lambda r: r.first_offset)
        return table


def snapshot_path(directory: Path, offset: int) -> Path:
    return directory / f"{offset:020d}{SNAPSHOT_SUFFIX}"


def write_snapshot(directory: Path, offset: int, table: ProducerTable) -> None:
    """State as of ``offset`` (exclusive). No fsync: a lost snapshot only means a longer
    scan on open; the directory is fsynced with the next sync."""
    path = snapshot_path(directory, offset)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"offset": offset, **table.to_json()}))
    os.replace(tmp, path)
    snapshots = sorted(directory.glob(f"*{SNAPSHOT_SUFFIX}"))
    for old in snapshots[:-2]:
        old.unlink(missing_ok=True)


def remove_snapshots_from(directory: Path, offset: int) -> None:
    """Drop snapshots of states at or past ``offset`` (the log was cut there: they
    describe batches it no longer has)."""
    for path in directory.glob(f"*{SNAPSHOT_SUFFIX}"):
        if path.name[: -len(SNAPSHOT_SUFFIX)].isdigit() and int(path.name[:20]) > offset:
            path.unlink(missing_ok=True)


def load_snapshot(directory: Path, end_offset: int) -> tuple[int, ProducerTable]:
    """The newest readable snapshot at or below ``end_offset`` (or an empty table at 0)."""
    for path in sorted(directory.glob(f"*{SNAPSHOT_SUFFIX}"), reverse=True):
        try:
            data = json.loads(path.read_text())
            offset = int(data["offset"])
            if offset <= end_offset:
                return offset, ProducerTable.from_json(data, now_ms())
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return 0, ProducerTable()
