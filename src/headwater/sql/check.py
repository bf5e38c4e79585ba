"""Offline verification of the SQL projections' sealed files (``headwater check``).

For every stream of a data directory it reads the log (read-only, every batch's CRC
checked, as :mod:`headwater.storage.check` does) once, in offset order, and holds each
sealed file (:mod:`headwater.sql.sealed`) against the events the log has in the file's
range, projected afresh: every logged event must be in the file with the same offset,
position, timestamp, bytes and JSON-ness. A file may hold events the log no longer has
only below the log's start (retention cut into it) or on a compacted stream (compaction
rewrites the log, never a sealed file). Events the log holds between two files with no
file of their own are a missing file. Events after the last file are the unsealed tail,
which the server replays at start.

With ``repair`` a damaged, misplaced or missing file is rebuilt from the log (or
deleted when the log has nothing left in its range); the server would do the same at
its next start, in the background.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from headwater.engine.names import RESERVED_PREFIXES
from headwater.sql.duck import Database
from headwater.sql.projection import SEAL_BYTES, SEAL_ROWS, ChunkBuilder, _Piece
from headwater.sql.sealed import (
    SealedFileError,
    list_sealed,
    open_sealed,
    projection_directory,
    write_sealed,
)
from headwater.storage.batch import Batch
from headwater.storage.files import FileCache
from headwater.storage.segment import Segment


@dataclass
class ProjectionReport:
    """One stream partition's projection files (``projection-<partition>/``): what was
    found wrong and what was repaired."""

    stream_dir: Path
    name: str
    partition: int = 0
    files: int = 0
    rows: int = 0
    problems: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)

    @property
    def damaged(self) -> bool:
        return bool(self.problems)


def stream_dirs(data_dir: Path) -> Iterator[tuple[Path, dict[str, object]]]:
    """Every stream directory with a projection (``streams/<id>`` holding
    ``stream.json``; headwater's own reserved-name streams have none) and its metadata."""
    for meta_path in sorted(data_dir.glob("tenants/*/streams/*/stream.json")):
        meta = json.loads(meta_path.read_text())
        if not str(meta.get("name", "")).startswith(RESERVED_PREFIXES):
            yield meta_path.parent, meta


class _LogCursor:
    """The events of a partition log in offset order, handed out by offset range."""

    def __init__(self, directory: Path) -> None:
        self.files = FileCache(1)
        bases = sorted(int(p.name[:-4]) for p in directory.glob("*.log") if p.name[:-4].isdigit())
        self.segments = [Segment(directory, base, 4096, self.files) for base in bases]
        for seg in self.segments:
            seg._scan(verify=True, stop_at_error=True)  # the valid prefix, as recovery keeps
            seg.drop_index()  # walked from the start only: no index held for the whole log
        self.start = self.segments[0].base_offset if self.segments else 0
        self.end = max((s.next_offset for s in self.segments), default=0)
        self._batches = self._walk()
        self._pending: Batch | None = None

    def _walk(self) -> Iterator[Batch]:
        for seg in self.segments:
            yield from seg.batches_from(0, seg.size)

    def pieces(self, lo: int, hi: int) -> list[_Piece]:
        """The events with offsets in [lo, hi); ranges must be asked in ascending order."""
        out: list[_Piece] = []
        while True:
            batch = self._pending or next(self._batches, None)
            self._pending = None
            if batch is None:
                return out
            if batch.base_offset >= hi:
                self._pending = batch
                return out
            start = batch.index_of(lo) if batch.base_offset < lo else 0
            stop = batch.index_of(hi) if batch.last_offset >= hi else batch.count
            if stop > start:
                out.append(_Piece(batch, start, stop))
            if batch.last_offset >= hi:
                self._pending = batch
                return out

    def close(self) -> None:
        for seg in self.segments:
            seg.close()


def _compare(
    stored: pa.RecordBatch, logged: pa.RecordBatch | None, log_start: int, compacted: bool
) -> str | None:
    """Why ``stored`` (a sealed file's rows) disagrees with ``logged`` (the log's events
    in its range, projected), or None."""
    if logged is not None and logged.num_rows:
        at = pc.index_in(logged.column(0), value_set=stored.column(0))
        if at.null_count:
            return f"{at.null_count} event(s) of the log are missing from the file"
        mine = stored.take(at)
        for i, column in enumerate(("offset", "position", "ts", "data")):
            if not mine.column(i).equals(logged.column(i)):
                return f"column {column} differs from the log"
        if not pc.is_valid(mine.column(4).storage).equals(pc.is_valid(logged.column(4).storage)):
            return "column json differs from the log"
    extra = stored.num_rows - (logged.num_rows if logged is not None else 0)
    if extra and not compacted:
        kept = pc.sum(pc.greater_equal(stored.column(0), pa.scalar(log_start, pa.int64())))
        if (kept.as_py() or 0) > (logged.num_rows if logged is not None else 0):
            return "the file holds events the log does not have"
    return None


def _write(directory: Path, builder: ChunkBuilder, pieces: list[_Piece]) -> list[str]:
    """Sealed files of ``pieces``, a seal's worth each; returns their names."""
    names: list[str] = []
    group: list[_Piece] = []
    rows = size = 0
    for piece in [*pieces, None]:
        if piece is not None:
            group.append(piece)
            rows += piece.stop - piece.start
            size += len(piece.batch.values_section())
        if group and (piece is None or rows >= SEAL_ROWS or size >= SEAL_BYTES):
            chunk = builder.build(group)
            names.append(write_sealed(directory, chunk.batch, chunk.meta).name)
            group, rows, size = [], 0, 0
    return names


def _verify_stream(
    stream_dir: Path,
    meta: dict[str, object],
    builder: ChunkBuilder,
    repair: bool,
    partition: int = 0,
) -> ProjectionReport:
    settings = meta.get("settings")
    compacted = isinstance(settings, dict) and settings.get("cleanup_policy") == "compact"
    report = ProjectionReport(stream_dir, str(meta.get("name")), partition)
    directory = projection_directory(stream_dir, partition)
    files = list_sealed(directory)
    if not files:
        return report
    log = _LogCursor(stream_dir / f"partition-{partition}")
    try:
        cursor = log.start

        def rebuild(lo: int, hi: int, what: str) -> None:
            pieces = log.pieces(lo, hi)
            if repair:
                names = _write(directory, builder, pieces) if pieces else []
                report.repaired.append(f"{what}: " + (", ".join(names) or "deleted"))

        for first, last, path in files:
            report.files += 1
            if last < log.start:
                report.problems.append(f"{path.name}: below the log's start (retention)")
                if repair:
                    path.unlink()
                    report.repaired.append(f"{path.name}: deleted")
                continue
            if first < cursor:
                report.problems.append(f"{path.name}: overlaps the file before it")
                if repair:
                    path.unlink()
                    report.repaired.append(f"{path.name}: deleted")
                continue
            gap = log.pieces(cursor, first)
            if gap:
                lo, hi = gap[0].batch.offsets()[gap[0].start], first - 1
                report.problems.append(f"offsets {lo}..{hi}: logged but in no file")
                if repair:
                    names = _write(directory, builder, gap)
                    report.repaired.append(f"offsets {lo}..{hi}: {', '.join(names)}")
            cursor = last + 1
            if last >= log.end:
                report.problems.append(f"{path.name}: beyond the log's end ({log.end})")
                if repair:
                    path.unlink()
                    rebuild(first, last + 1, path.name)
                continue
            try:
                stored, _ = open_sealed(path)
            except SealedFileError as exc:
                report.problems.append(str(exc))
                if repair:
                    path.unlink()
                    rebuild(first, last + 1, path.name)
                continue
            report.rows += stored.num_rows
            pieces = log.pieces(first, last + 1)
            logged = builder.build(pieces).batch if pieces else None
            problem = _compare(stored, logged, log.start, compacted)
            if problem is not None:
                report.problems.append(f"{path.name}: {problem}")
                if repair:
                    path.unlink()
                    names = _write(directory, builder, pieces) if pieces else []
                    report.repaired.append(f"{path.name}: " + (", ".join(names) or "deleted"))
    finally:
        log.close()
    return report


def _partition_count(meta: dict[str, object]) -> int:
    count = meta.get("partitions", 1)
    return count if isinstance(count, int) and count >= 1 else 1


def verify_projections(data_dir: Path, *, repair: bool = False) -> list[ProjectionReport]:
    """Check (and with ``repair``, rebuild) the sealed projection files of every
    partition of every stream: one report per stream partition."""
    db = Database()
    builder = ChunkBuilder(db)
    try:
        return [
            _verify_stream(stream_dir, meta, builder, repair, partition)
            for stream_dir, meta in stream_dirs(data_dir)
            for partition in range(_partition_count(meta))
        ]
    finally:
        builder.close()
        db.close()
