"""A partition replica's leader epochs: ``leader-epoch-checkpoint`` beside its log.

As Kafka's file of that name: for each leader epoch, the first offset written in it.
Text, one entry a line after a version and a count::

    0
    2
    1 0
    3 1200

(epoch 1 from offset 0, epoch 3 from offset 1200). A leader adds its epoch at its log
end when it starts leading; a follower copies the leader's entries below its own end.
It lets a replica find where its log parted from the leader's (Kafka's
OffsetForLeaderEpoch): :meth:`LeaderEpochs.end_offset_for` answers, for an epoch, the
largest known epoch at or below it and the offset where that epoch ended here, and a
follower truncates its log to that offset when its own log goes further in that epoch.
The segment format is untouched: the epochs live in this file only.
"""

from __future__ import annotations

from pathlib import Path

from headwater.errors import StorageError
from headwater.storage.metadata import write_bytes_atomic

FILE_NAME = "leader-epoch-checkpoint"
VERSION = 0
UNKNOWN = -1  # no epoch known (an empty checkpoint)


class LeaderEpochs:
    """The checkpoint of one partition directory, loaded at construction."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / FILE_NAME
        self.entries: list[tuple[int, int]] = []  # (epoch, start offset), both increasing
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return
        lines = text.split("\n")
        try:
            if int(lines[0]) != VERSION:
                raise ValueError(f"version {lines[0]}")
            count = int(lines[1])
            for line in lines[2 : 2 + count]:
                epoch, start = line.split()
                self.entries.append((int(epoch), int(start)))
        except (ValueError, IndexError) as exc:
            raise StorageError(f"{self.path} is damaged: {exc}") from None

    @property
    def latest(self) -> int:
        return self.entries[-1][0] if self.entries else UNKNOWN

    def _write(self) -> None:
        lines = [str(VERSION), str(len(self.entries))]
        lines += [f"{epoch} {start}" for epoch, start in self.entries]
        write_bytes_atomic(self.path, ("\n".join(lines) + "\n").encode())

    def assign(self, epoch: int, start_offset: int) -> None:
        """Epoch ``epoch`` starts at ``start_offset`` (an epoch already known, or older
        than the latest, changes nothing)."""
        if epoch <= self.latest:
            return
        # An epoch that wrote nothing ends where the next starts: only its start is kept.
        self.entries = [(e, s) for e, s in self.entries if s < start_offset]
        self.entries.append((epoch, start_offset))
        self._write()

    def end_offset_for(self, epoch: int, log_end: int) -> tuple[int, int]:
        """(the largest epoch at or below ``epoch`` known here, the offset where it
        ended: the next epoch's start, or ``log_end`` for the latest); (UNKNOWN,
        UNKNOWN) when every known epoch is newer (Kafka's OffsetForLeaderEpoch)."""
        found = UNKNOWN, UNKNOWN
        for i, (known, _start) in enumerate(self.entries):
            if known > epoch:
                break
            end = self.entries[i + 1][1] if i + 1 < len(self.entries) else log_end
            found = known, end
        return found

    def truncate_from(self, end_offset: int) -> None:
        """The log was cut at ``end_offset``: epochs that started at or after it go."""
        kept = [(e, s) for e, s in self.entries if s < end_offset]
        if kept != self.entries:
            self.entries = kept
            self._write()

    def replace(self, entries: list[tuple[int, int]]) -> None:
        """Take the leader's entries (a follower below the leader's first epoch)."""
        if entries != self.entries:
            self.entries = list(entries)
            self._write()
