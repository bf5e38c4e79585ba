"""``headwater backup --data-dir DATA_DIR DEST``: a consistent copy of a data directory,
taken while a server runs on it (or not), that ``headwater serve`` starts from.

It reads the files only; the running server is not asked anything and keeps its lock.
What makes a live copy consistent is the storage format (docs/storage-format.md):

* Every metadata file (``tenant.json``, ``stream.json``, ``kinds.json``, ``groups.json``,
  producer snapshots, Ripple's tables) is replaced atomically by rename, so a read of it
  sees one whole version. They are all copied first, in one walk of the tree.
* Segment ``.log`` files are append-only, and only a log's newest segment is written
  to. Each log's sealed segments are copied whole, oldest first; then the log is listed
  again, the segments sealed meanwhile are copied too, and the newest is copied up to
  the size it has at that last listing. An event is acknowledged only after the write
  that holds it completed, so the copy holds every event acknowledged before the backup
  began (and a group's committed position, copied before, is inside it). The newest is
  sized last because compaction may rewrite a sealed segment before its turn, dropping
  an event whose key was written again after the backup began: that later write came
  before the compaction, so before the last listing, and is in the copy. Each copied
  log is then opened once with storage's recovery (:meth:`PartitionLog.open`): a batch
  being written when the newest was sized is cut off at the last whole, CRC-checked
  batch, and a sealed segment's index files, copied beside it, are kept only if they
  vouch for the copied ``.log`` and rebuilt from it otherwise (indexes are derived).
* A sealed segment that compaction or compression replaces during the copy is read
  whole from one descriptor, old or new version (they rename; compaction keeps every
  surviving event's offset); a newest segment sealed and replaced after it was sized is
  copied whole too (its noted size no longer describes the file). One that retention
  deletes meanwhile is left out, as the server dropped it, and so are those copied
  before it (retention deletes the oldest first: they are gone too), so the copy is one
  run of offsets.
* Logs are copied in turn, so what happens on two of them while they are is in the
  copy of one and not the other: a tenant's group offsets (``hw_consumer_offsets``) are
  copied after every other log, its transaction coordinator's state
  (``hw_transaction_state``) last, and then each log lacking an offset committed on it
  or a marker that the copied state says an ended transaction wrote there is copied
  again and cut just after it (:func:`settle_logs`): a group's offset never points
  past the copied events, and every transaction in the copy is whole, or left to
  recovery, which finishes or aborts it in every log alike.
* Derived data is left out and rebuilt by the server that starts on the copy: the SQL
  projection files (``projection-0/``), the kinds' LMDB entity stores (``store/``, a
  checkpoint of the changelog, which is copied), DuckDB's spill files, and the lock.

The copy is built in a hidden directory beside ``DEST`` and renamed to ``DEST`` once
everything written is synced to disk, so a ``DEST`` that exists is whole; it is then
verified as ``headwater check`` does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from headwater.engine.groups.offsets import OFFSETS_STREAM, OffsetKey, decode_key, decode_value
from headwater.engine.kinds.store import STORE_DIR as KIND_STORE_DIRECTORY
from headwater.engine.transactions.coordinator import TXN_STATE_STREAM, TxnState
from headwater.sql.sealed import DIRECTORY as PROJECTION_DIRECTORY
from headwater.sql.service import SPILL_DIRECTORY
from headwater.storage.batch import Event
from headwater.storage.check import (
    STREAM_META,
    MetadataProblem,
    PartitionReport,
    check_data_dir,
    check_metadata,
)
from headwater.storage.files import FileCache
from headwater.storage.log import LogConfig, PartitionLog, fsync_directory
from headwater.storage.metadata import LOCK_FILE, TMP_SUFFIX, read_json

# Directories of a data dir the copy leaves out, derived data the server rebuilds: a
# stream's SQL projection files, a kind's LMDB entity store (a checkpoint of its
# changelog, which is copied; a missing store is rebuilt from the changelog).
SKIPPED_DIRECTORIES = (PROJECTION_DIRECTORY, KIND_STORE_DIRECTORY)
SKIPPED_TOP_LEVEL = (LOCK_FILE, SPILL_DIRECTORY)
UNFINISHED_PREFIXES = (".creating-", ".deleted-")  # stream directories the server removes
SEGMENT_SUFFIX = ".log"
INDEX_SUFFIXES = (".index", ".timeindex")
COPY_CHUNK = 8 << 20
# Listings of a log while its sealed segments are copied: each round copies the segments
# sealed during the one before, so only a log rolling faster than it is copied runs out.
MAX_LISTINGS = 1000
OPEN_FILES = 64  # segment files open at once while the copied logs are recovered


class BackupError(Exception):
    """The backup cannot be taken (the message says why); nothing was written to DEST."""


@dataclass
class PartitionPlan:
    """One partition log as listed: its segments' names, oldest first, and the size and
    inode the newest had then (the older ones are sealed)."""

    relative: Path
    segments: list[str]
    tail_bytes: int
    tail_inode: int


@dataclass
class BackupReport:
    destination: Path
    metadata_files: int = 0
    partitions: int = 0
    segments: int = 0
    bytes: int = 0
    # Bytes of a write under way when a log's newest segment was sized, left out.
    cut_bytes: int = 0
    # What the server removed while the copy ran (retention, deleted streams).
    vanished: list[str] = field(default_factory=list)
    # Logs copied again to the end of a transaction that ended while the copy ran.
    settled: list[str] = field(default_factory=list)
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
        for plan in sorted(plans, key=lambda plan: copy_turn(staging, plan)):
            copy_partition(source, staging, plan, report)
        late = plan_internal_logs_made_meanwhile(source, staging, report)
        for plan in sorted(late, key=lambda plan: copy_turn(staging, plan)):
            copy_partition(source, staging, plan, report)
        settle_logs(source, staging, plans + late, report)
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
    source: Path, staging: Path, report: BackupReport, under: Path | None = None
) -> list[PartitionPlan]:
    """The walk that fixes what the backup holds: every small file copied as it is now,
    and every partition's segments listed, a directory's files before the directories
    under it (a stream's groups.json before its log, which is sized later). ``under``:
    only that directory of ``source``."""
    plans: list[PartitionPlan] = []
    for root, dirs, files in os.walk(source if under is None else source / under):
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
            plans.append(plan_partition(source, relative, segments))
    return plans


def plan_internal_logs_made_meanwhile(
    source: Path, staging: Path, report: BackupReport
) -> list[PartitionPlan]:
    """A tenant's group offsets and transaction state logs made while the copy ran (its
    first committed offset, its first transaction): copied too, as they may be what
    the events copied after them need (a transaction committed in them, its input's
    offset). Streams made meanwhile by clients are not in the backup."""
    plans: list[PartitionPlan] = []
    for streams in sorted(source.glob("tenants/*/streams")):
        relative = streams.relative_to(source)
        if not (staging / relative).is_dir():
            continue  # a tenant made meanwhile
        for stream in sorted(streams.iterdir()):
            if (staging / relative / stream.name).exists() or skipped(stream.name, top_level=False):
                continue
            # (no name: not whole yet, or gone)
            if named_in(stream) in (OFFSETS_STREAM, TXN_STATE_STREAM):
                plans += copy_metadata_and_plan(source, staging, report, relative / stream.name)
    return plans


def copy_turn(staging: Path, plan: PartitionPlan) -> int:
    """When a partition log is copied: a tenant's committed group offsets after every
    other log, then its transaction coordinator's state, last; :func:`settle_logs` then
    copies again each log that ends before an offset committed on it or a marker the
    state says was written to it. So every transaction with batches in the copy has its
    record, and offsets and transactions agree with the events copied."""
    return {OFFSETS_STREAM: 1, TXN_STATE_STREAM: 2}.get(stream_name(staging, plan) or "", 0)


def stream_name(staging: Path, plan: PartitionPlan) -> str | None:
    """The name of the stream a copied partition log belongs to (None: a kind's
    changelog, or metadata that cannot be read)."""
    return named_in(staging / stream_directory(plan.relative))


def named_in(directory: Path) -> str | None:
    """The name in ``directory``'s stream.json (None: none, or unreadable)."""
    try:
        name = read_json(directory / STREAM_META).get("name")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


def settle_logs(
    source: Path, staging: Path, plans: list[PartitionPlan], report: BackupReport
) -> None:
    """Make the copy agree with its group offsets and its transactions. Logs are copied
    in turn, the offsets and the coordinator's state last: a group's offset committed
    on a log after that log was copied points past its copy, and a transaction that
    ended while the copy ran has its markers in the logs copied after its end, not in
    those copied before (open there, or not there at all). Each such log is copied
    again and cut just after the last offset or marker it lacked: all were written
    before the offsets and the state were copied, and nothing after them is kept, so
    the copy stays one moment of each log with every ended transaction whole; one
    still open or being decided then, recovery aborts or finishes in every log alike."""
    tenants: dict[str, list[tuple[PartitionPlan, str, int]]] = {}
    for plan in plans:
        parts = plan.relative.parts
        name = stream_name(staging, plan)
        if len(parts) != 5 or parts[0] != "tenants" or parts[2] != "streams" or name is None:
            continue  # a kind's changelog: neither in a group nor in a transaction
        tenants.setdefault(parts[1], []).append((plan, name, int(parts[4].split("-")[1])))
    for logs in tenants.values():
        needed: dict[tuple[str, int], int] = {}
        for plan, name, _ in logs:
            if name == OFFSETS_STREAM:
                needed = offsets_committed(staging / plan.relative)
        for plan, name, _ in logs:
            if name == TXN_STATE_STREAM:
                for key, marked in markers_written(staging / plan.relative).items():
                    needed[key] = max(needed.get(key, 0), marked)
        for plan, name, partition in logs:
            if (end := needed.get((name, partition))) is not None:
                settle_partition(source, staging, plan, end, report)


def internal_log_events(log: Path) -> Iterator[Event]:
    """The events of a copied internal log (compacted; markers left out)."""
    with storage_quiet():
        plog = PartitionLog.open(log, LogConfig(cleanup_policy="compact"), FileCache(4))
    try:
        for batch in plog.batches(plog.start_offset):
            if not batch.control:
                yield from batch.events(0)
    finally:
        plog.close()


def offsets_committed(offsets_log: Path) -> dict[tuple[str, int], int]:
    """From the copied group offsets, each (stream, partition)'s highest offset any
    group has committed (a group's latest commit; a deleted group's are gone)."""
    latest: dict[OffsetKey, int] = {}
    for event in internal_log_events(offsets_log):
        if event.key is None:
            continue
        try:
            key = decode_key(event.key)
            if event.tombstone:
                latest.pop(key, None)
            else:
                latest[key] = decode_value(event.value).offset
        except (ValueError, UnicodeDecodeError, struct.error):
            continue  # not a record of the store's
    needed: dict[tuple[str, int], int] = {}
    for key, offset in latest.items():
        where = (key.stream, key.partition)
        needed[where] = max(needed.get(where, 0), offset)
    return needed


def markers_written(state_log: Path) -> dict[tuple[str, int], int]:
    """From every record of the copied coordinator state (not only each transaction's
    last: several may have ended while the copy ran), each log's offset just after the
    last marker an ended transaction wrote there."""
    needed: dict[tuple[str, int], int] = {}
    for event in internal_log_events(state_log):
        try:
            txn = json.loads(event.value)["txn"]
            if txn["state"] not in _ENDED:
                continue
            for name, partition, offset in txn.get("markers", ()):
                key = (str(name), int(partition))
                needed[key] = max(needed.get(key, 0), int(offset) + 1)
        except (ValueError, KeyError, TypeError):
            continue  # the producer id counter's record, or not the coordinator's
    return needed


_ENDED = (TxnState.COMPLETE_COMMIT, TxnState.COMPLETE_ABORT)


def settle_partition(
    source: Path, staging: Path, plan: PartitionPlan, needed_end: int, report: BackupReport
) -> None:
    """Copy ``plan``'s log again and cut it at ``needed_end`` (just after an offset or
    a marker the copy lacks: see :func:`settle_logs`) when its copy ends before that."""
    there = staging / plan.relative
    with storage_quiet():
        plog = PartitionLog.open(there, LogConfig(), FileCache(OPEN_FILES))
    try:
        copied_end = plog.end_offset
    finally:
        plog.close()
    if copied_end >= needed_end:
        return
    again = staging.with_name(staging.name + ".settle")
    (again / plan.relative).mkdir(parents=True)
    try:
        copy_partition(source, again, plan_partition(source, plan.relative), BackupReport(again))
        with storage_quiet():
            plog = PartitionLog.open(again / plan.relative, LogConfig(), FileCache(OPEN_FILES))
        try:
            cut = plog.truncate_to(needed_end)
        finally:
            plog.close()
        if cut < needed_end:
            # Gone (the stream deleted meanwhile), or the marker shares a compressed
            # frame with what came after it: the server that starts on the copy aborts
            # the transaction there (a transaction no record ends).
            return
        shutil.rmtree(there)
        os.replace(again / plan.relative, there)
        report.settled.append(
            f"{plan.relative}: copied again up to offset {cut}, where a group's offset "
            "or a transaction's marker written while the backup ran is"
        )
    finally:
        shutil.rmtree(again, ignore_errors=True)


def copy_partition(source: Path, staging: Path, plan: PartitionPlan, report: BackupReport) -> None:
    """Copy one partition log: sealed segments whole, then the newest up to its size at
    the last listing (see the module's docstring for why in that order)."""
    here, there = source / plan.relative, staging / plan.relative
    copied: dict[str, int] = {}  # segment name -> bytes copied
    seen: set[str] = set()  # every segment any listing named
    gone: set[str] = set()  # ... of which the server removed before it was copied
    listing = plan
    for _listing in range(MAX_LISTINGS):
        seen.update(listing.segments)
        for name in listing.segments[:-1]:
            if name in copied or name in gone:
                continue
            size = copy_segment(here, there, name, None)
            if size is not None:
                copied[name] = size
            elif not here.is_dir():
                return stream_gone(staging, plan.relative, report)
        listing = plan_partition(source, plan.relative)
        if not listing.segments:
            return stream_gone(staging, plan.relative, report)
        present = set(listing.segments)
        removed = sorted(n for n in seen if n not in copied and n not in gone and n not in present)
        if removed:
            # Retention deletes the oldest first: what was copied before a removed
            # segment is gone from the server too, and would leave a hole behind it.
            gone.update(removed)
            report.vanished += [
                f"{plan.relative / n}: removed by retention meanwhile" for n in removed
            ]
            for name in sorted(n for n in copied if n < removed[-1]):
                remove_segment_files(there, name)
                del copied[name]
                report.vanished.append(
                    f"{plan.relative / name}: left out, removed by retention after it"
                )
        *sealed, newest = listing.segments
        if all(name in copied for name in sealed):
            size = copy_segment(here, there, newest, listing)
            if size is not None:
                copied[newest] = size
                break
        # Sealed meanwhile (or the newest sealed and removed): copy those, list again.
    else:
        raise BackupError(
            f"{plan.relative}: the log rolled to new segments faster than they were copied "
            f"({MAX_LISTINGS} listings); run the backup again when it is written less"
        )
    report.partitions += 1
    report.segments += len(copied)
    report.bytes += sum(copied.values())
    report.cut_bytes += recover(there, newest)


def copy_segment(here: Path, there: Path, name: str, tail: PartitionPlan | None) -> int | None:
    """Copy segment ``name``: whole, or as the newest of listing ``tail``, up to the
    size it had then (whole when it was replaced since: sealed, and compacted or
    compressed). The bytes copied; None when it is gone."""
    try:
        fd = os.open(here / name, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        replaced = tail is None or os.fstat(fd).st_ino != tail.tail_inode
        limit = None if replaced or tail is None else tail.tail_bytes
        size = copy_bytes(fd, there / name, limit)
    finally:
        os.close(fd)
    if limit is None:
        copy_index_files(here, there, name)
    return size


def stream_gone(staging: Path, partition: Path, report: BackupReport) -> None:
    report.vanished.append(f"{partition}: deleted during the backup, left out")
    shutil.rmtree(staging / stream_directory(partition), ignore_errors=True)


def plan_partition(source: Path, relative: Path, names: list[str] | None = None) -> PartitionPlan:
    """A partition's segments (``names``, else listed now) and its newest's size and
    inode now; no segments when the partition is gone."""
    try:
        if names is None:
            names = sorted(f for f in os.listdir(source / relative) if is_segment(f))
        if not names:
            return PartitionPlan(relative, [], 0, -1)
        stat = os.stat(source / relative / names[-1])
    except FileNotFoundError:
        # Gone (the stream deleted) or the newest sealed and removed by retention since
        # listed: copy_partition lists again, and tells the two apart.
        return PartitionPlan(relative, names or [], 0, -1)
    return PartitionPlan(relative, names, stat.st_size, stat.st_ino)


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
    report counts it instead (a write under way when the backup began), and the check
    of the copy names real damage (recovery, opening each copy as a log of the delete
    policy, would take a compacted log's missing offsets for it)."""
    loggers = [logging.getLogger(f"headwater.storage.{name}") for name in ("segment", "log")]
    previous = [logger.disabled for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        yield
    finally:
        for logger, was in zip(loggers, previous, strict=True):
            logger.disabled = was


def recover(partition: Path, tail: str) -> int:
    """Open the copied log with storage's recovery (cutting a torn newest batch,
    rebuilding sealed segments' indexes) and close it; the bytes cut off."""
    tail_path = partition / tail
    before = tail_path.stat().st_size if tail_path.exists() else 0
    with storage_quiet():
        PartitionLog.open(partition, LogConfig(), FileCache(OPEN_FILES)).close()
    after = tail_path.stat().st_size if tail_path.exists() else 0
    return before - after
