"""``headwater backup --data-dir DATA_DIR DEST``: a consistent copy of a data directory,
taken while a server runs on it (or not), that ``headwater serve`` starts from.

It reads the files only; the running server is not asked anything and keeps its lock.
What makes a live copy consistent is the storage format (docs/storage-format.md):

* Every metadata file (``tenant.json``, ``stream.json``, ``kinds.json``, ``groups.json``,
  producer snapshots, Ripple's tables) is replaced atomically by rename, so a read of it
  sees one whole version. They are all copied first, in one walk of the tree.
* Segment ``.log`` files are append-only: the walk also notes, per partition, its
  segments and the size of the newest one (the only one written to). An event is
  acknowledged only after the write that holds it completed, so every event
  acknowledged before the backup began lies inside those sizes; a group's committed
  position, read before its log's size, is inside them too. The segments are then
  copied, the newest up to its noted size, and each copied log is opened once with
  storage's recovery (:meth:`PartitionLog.open`): a batch that was being written at that
  moment is cut off at the last whole, CRC-checked batch, and a sealed segment's index
  files, copied beside it, are kept only if they vouch for the copied ``.log`` and
  rebuilt from it otherwise (indexes are derived data).
* A sealed segment that compaction replaces during the copy is read whole from one
  descriptor, old or new version (compaction renames; it keeps every surviving event's
  offset). One that retention deletes meanwhile is left out, as the server dropped it,
  and so are those copied before it (retention deletes the oldest first: they are gone
  too), so the copy is one run of offsets; when every noted segment went, the newest
  too, the partition is listed again and the copy made of what it holds then.
* Derived data is left out and rebuilt by the server that starts on the copy: the SQL
  projection files (``projection-0/``), the kinds' LMDB entity stores (``store/``, a
  checkpoint of the changelog, which is copied), DuckDB's spill files, and the lock.

The copy is built in a hidden directory beside ``DEST`` and renamed to ``DEST`` once
everything written is synced to disk, so a ``DEST`` that exists is whole; it is then
verified as ``headwater check`` does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from headwater.engine.kinds.store import STORE_DIR as KIND_STORE_DIRECTORY
from headwater.sql.sealed import DIRECTORY as PROJECTION_DIRECTORY
from headwater.sql.service import SPILL_DIRECTORY
from headwater.storage.check import MetadataProblem, PartitionReport, check_data_dir, check_metadata
from headwater.storage.files import FileCache
from headwater.storage.log import LogConfig, PartitionLog, fsync_directory
from headwater.storage.metadata import LOCK_FILE, TMP_SUFFIX

# Directories of a data dir the copy leaves out, derived data the server rebuilds: a
# stream's SQL projection files, a kind's LMDB entity store (a checkpoint of its
# changelog, which is copied; a missing store is rebuilt from the changelog).
SKIPPED_DIRECTORIES = (PROJECTION_DIRECTORY, KIND_STORE_DIRECTORY)
SKIPPED_TOP_LEVEL = (LOCK_FILE, SPILL_DIRECTORY)
UNFINISHED_PREFIXES = (".creating-", ".deleted-")  # stream directories the server removes
SEGMENT_SUFFIX = ".log"
INDEX_SUFFIXES = (".index", ".timeindex")
COPY_CHUNK = 8 << 20
PLAN_ATTEMPTS = 3  # plans of a partition tried when retention removes all its planned segments
OPEN_FILES = 64  # segment files open at once while the copied logs are recovered


class BackupError(Exception):
    """The backup cannot be taken (the message says why); nothing was written to DEST."""


@dataclass
class PartitionPlan:
    """One partition log to copy: its segments' names, oldest first, and the size the
    newest had when the backup began (the older ones are sealed and copied whole)."""

    relative: Path
    segments: list[str]
    tail_bytes: int


@dataclass
class BackupReport:
    destination: Path
    metadata_files: int = 0
    partitions: int = 0
    segments: int = 0
    bytes: int = 0
    # Bytes of a write under way at the start left out of a log's newest segment.
    cut_bytes: int = 0
    # What the server removed while the copy ran (retention, deleted streams).
    vanished: list[str] = field(default_factory=list)
    damaged: list[PartitionReport] = field(default_factory=list)
    metadata_problems: list[MetadataProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.damaged and not self.metadata_problems


def is_segment(name: str) -> bool:
    return name.endswith(SEGMENT_SUFFIX) and name[: -len(SEGMENT_SUFFIX)].isdigit()


def skipped(name: str, *, top_level: bool) -> bool:
    """Whether the file or directory ``name`` stays out of the copy."""
    if top_level and name in SKIPPED_TOP_LEVEL:
        return True
    if name.endswith(TMP_SUFFIX) or name.endswith(".cleaned"):
        return True  # a write or compaction under way: the original is whole beside it
    if name.startswith(UNFINISHED_PREFIXES) or name in SKIPPED_DIRECTORIES:
        return True
    return name.endswith(INDEX_SUFFIXES) and name.split(".", 1)[0].isdigit()


def backup(data_dir: Path, destination: Path) -> BackupReport:
    """Copy ``data_dir`` (served or not) to ``destination`` (absent or an empty
    directory); the copy is checked as ``headwater check`` does, see ``report.ok``."""
    source = data_dir.resolve()
    target = destination.resolve()
    if not (source / "tenants").is_dir():
        raise BackupError(f"{data_dir} is not a headwater data directory (no tenants/)")
    if target == source or source in target.parents or target in source.parents:
        raise BackupError(f"{destination} must be outside the data directory {data_dir}")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise BackupError(f"{destination} exists and is not an empty directory")
    if not target.parent.is_dir():
        raise BackupError(f"{target.parent} is not a directory")
    staging = target.with_name(f".{target.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    report = BackupReport(destination)
    try:
        plans = copy_metadata_and_plan(source, staging, report)
        for plan in plans:
            copy_partition(source, staging, plan, report)
        # One sync of everything written (a file's fsync each would cost a disk flush
        # per segment, most of a backup's time), before the copy takes its name.
        os.sync()
        os.replace(staging, target)  # over an empty directory too
        fsync_directory(target.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    report.metadata_problems = check_metadata(target)
    report.damaged = [r for r in check_data_dir(target) if r.damaged]
    return report


def copy_metadata_and_plan(
    source: Path, staging: Path, report: BackupReport
) -> list[PartitionPlan]:
    """The walk that fixes what the backup holds: every small file copied as it is now,
    and every partition's segments and newest size noted, a directory's files before
    the directories under it (a stream's groups.json before its log's size)."""
    plans: list[PartitionPlan] = []
    for root, dirs, files in os.walk(source):
        here = Path(root)
        relative = here.relative_to(source)
        top_level = here == source
        dirs[:] = sorted(d for d in dirs if not skipped(d, top_level=top_level))
        (staging / relative).mkdir(parents=True, exist_ok=True)
        segments = sorted(f for f in files if is_segment(f))
        for name in sorted(files):
            if name in segments or skipped(name, top_level=top_level):
                continue
            try:
                shutil.copyfile(here / name, staging / relative / name)
            except FileNotFoundError:
                continue  # replaced by rename between the listing and the copy: the new one
            report.metadata_files += 1
        if segments:
            try:
                tail_bytes = os.stat(here / segments[-1]).st_size
            except FileNotFoundError:
                tail_bytes = 0  # the stream went away; copy_partition reports it
            plans.append(PartitionPlan(relative, segments, tail_bytes))
    return plans


def copy_partition(source: Path, staging: Path, plan: PartitionPlan, report: BackupReport) -> None:
    """Copy one partition's planned segments. Retention deletes a log's oldest segments
    first, so a segment gone when its turn comes means every one before it is gone from
    the server too: those already copied are dropped with it, and the copy stays one run
    of offsets (a hole in the middle would be read as if it were not there)."""
    copied: list[str] = []
    for _attempt in range(PLAN_ATTEMPTS):
        for name in plan.segments:
            limit = plan.tail_bytes if name == plan.segments[-1] else None
            try:
                fd = os.open(source / plan.relative / name, os.O_RDONLY)
            except FileNotFoundError:
                if not (source / plan.relative).is_dir():
                    report.vanished.append(f"{plan.relative}: deleted during the backup, left out")
                    shutil.rmtree(staging / stream_directory(plan.relative), ignore_errors=True)
                    return
                report.vanished.append(f"{plan.relative / name}: removed by retention meanwhile")
                for earlier in copied:
                    remove_segment_files(staging / plan.relative, earlier)
                    report.vanished.append(
                        f"{plan.relative / earlier}: left out, removed by retention after it"
                    )
                copied.clear()
                continue
            try:
                report.bytes += copy_bytes(fd, staging / plan.relative / name, limit)
            finally:
                os.close(fd)
            if limit is None:
                copy_index_files(source / plan.relative, staging / plan.relative, name)
            copied.append(name)
        if copied:
            break
        # Every planned segment went, the newest too (sealed and deleted while the copy
        # ran): the log lives on in segments the walk did not see. Plan it again.
        replanned = plan_partition(source, plan.relative)
        if replanned is None:
            report.vanished.append(f"{plan.relative}: deleted during the backup, left out")
            shutil.rmtree(staging / stream_directory(plan.relative), ignore_errors=True)
            return
        plan = replanned
    else:
        raise BackupError(
            f"{plan.relative}: retention removed every segment {PLAN_ATTEMPTS} times while "
            "they were copied; run the backup again or slow retention down"
        )
    report.partitions += 1
    report.segments += len(copied)
    report.cut_bytes += recover(staging / plan.relative, plan.segments[-1])


def plan_partition(source: Path, relative: Path) -> PartitionPlan | None:
    """A partition's segments and newest size as they are now; None when it is gone."""
    try:
        names = sorted(f for f in os.listdir(source / relative) if is_segment(f))
        tail_bytes = os.stat(source / relative / names[-1]).st_size if names else 0
    except FileNotFoundError:
        return None
    return PartitionPlan(relative, names, tail_bytes) if names else None


def remove_segment_files(partition: Path, segment: str) -> None:
    base = segment[: -len(SEGMENT_SUFFIX)]
    for suffix in (SEGMENT_SUFFIX, *INDEX_SUFFIXES):
        (partition / f"{base}{suffix}").unlink(missing_ok=True)


def copy_index_files(source: Path, staging: Path, segment: str) -> None:
    """A sealed segment's index files, as they are: recovery keeps them only if their
    trailers vouch for the copied ``.log`` (its size, CRCs, the batches after the last
    entry) and rebuilds them otherwise (e.g. compaction replaced the segment between the
    two copies), so writing them anew, with an fsync each, is spared for the others."""
    base = segment[: -len(SEGMENT_SUFFIX)]
    for suffix in INDEX_SUFFIXES:
        with contextlib.suppress(FileNotFoundError):
            shutil.copyfile(source / f"{base}{suffix}", staging / f"{base}{suffix}")


def stream_directory(partition: Path) -> Path:
    """The directory a partition belongs to (a stream's, or a kind's changelog's)."""
    return partition.parent


def copy_bytes(fd: int, path: Path, limit: int | None) -> int:
    """Copy from ``fd`` (from its start, at most ``limit`` bytes) to a new file (synced
    with the rest of the copy before it is renamed into place)."""
    end = os.fstat(fd).st_size if limit is None else limit
    out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    position = 0
    try:
        while position < end:
            sent = os.sendfile(out, fd, position, min(COPY_CHUNK, end - position))
            if sent == 0:
                break  # shorter than noted: compaction's smaller version of the segment
            position += sent
    finally:
        os.close(out)
    return position


@contextmanager
def storage_quiet() -> Iterator[None]:
    """Recovery logs each cut tail as a warning about the server's own files; here the
    report counts it instead (a write under way when the backup began)."""
    segment_log = logging.getLogger("headwater.storage.segment")
    previous = segment_log.disabled
    segment_log.disabled = True
    try:
        yield
    finally:
        segment_log.disabled = previous


def recover(partition: Path, tail: str) -> int:
    """Open the copied log with storage's recovery (cutting a torn newest batch,
    rebuilding sealed segments' indexes) and close it; the bytes cut off."""
    tail_path = partition / tail
    before = tail_path.stat().st_size if tail_path.exists() else 0
    with storage_quiet():
        PartitionLog.open(partition, LogConfig(), FileCache(OPEN_FILES)).close()
    after = tail_path.stat().st_size if tail_path.exists() else 0
    return before - after
