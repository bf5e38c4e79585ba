"""Offline verification of a data directory (``headwater check DATA_DIR``).

Reads every segment without changing anything: each batch's CRC and structure, offsets
increasing across batches and segments, and both index files against what the ``.log``
actually holds. Then the metadata (:func:`check_metadata`): every ``tenant.json`` and
``stream.json`` parses and agrees with its directory, every stream directory has its
metadata and its partition, and no two streams of a tenant share a name.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from headwater.storage.files import FileCache
from headwater.storage.metadata import read_json
from headwater.storage.segment import Segment


@dataclass
class SegmentReport:
    path: Path
    batches: int = 0
    events: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)


@dataclass
class PartitionReport:
    path: Path
    segments: list[SegmentReport] = field(default_factory=list)

    @property
    def damaged(self) -> bool:
        return any(s.problems for s in self.segments)


def partition_dirs(data_dir: Path) -> Iterator[Path]:
    """Every directory under ``data_dir`` that holds segment files."""
    for root, _dirs, files in sorted(os.walk(data_dir)):
        if any(f.endswith(".log") and f[:-4].isdigit() for f in files):
            yield Path(root)


def check_partition(
    directory: Path, index_interval_bytes: int = 4096, *, compacted: bool = True
) -> PartitionReport:
    """``compacted``: the log may lack offsets between segments (compaction keeps a
    segment's base offset, not its last events); otherwise such a hole is damage, as
    retention removes only the oldest segments."""
    report = PartitionReport(directory)
    bases = sorted(int(p.name[:-4]) for p in directory.glob("*.log") if p.name[:-4].isdigit())
    prev_next: int | None = None
    files = FileCache(1, read_only=True)  # one segment at a time; a read-only dir is checked
    for base in bases:
        seg = Segment(directory, base, index_interval_bytes, files)
        try:
            scan = seg._scan(verify=True, stop_at_error=False)
        finally:
            seg.close()
        sreport = SegmentReport(seg.log_path, scan.batches, scan.events, scan.file_bytes)
        sreport.problems.extend(scan.errors)
        if prev_next is not None and base < prev_next:
            sreport.problems.append(f"base offset {base} overlaps the previous segment")
        elif prev_next is not None and base > prev_next and not compacted:
            sreport.problems.append(
                f"offsets {prev_next}..{base - 1} before it are in no segment (one removed?)"
            )
        prev_next = seg.next_offset
        report.segments.append(sreport)
        if base == bases[-1]:
            continue  # the active segment's indexes live in memory, rebuilt on every open
        expected_index, expected_time = seg.index_bytes()
        for path, expected in (
            (seg.index_path, expected_index),
            (seg.time_index_path, expected_time),
        ):
            if not path.exists():
                sreport.problems.append(f"{path.name} is missing (rebuilt on next open)")
            elif path.read_bytes() != expected:
                sreport.problems.append(
                    f"{path.name} does not match the log (rebuilt on next open)"
                )
    return report


def check_data_dir(data_dir: Path) -> list[PartitionReport]:
    return [check_partition(d, compacted=may_be_compacted(d)) for d in partition_dirs(data_dir)]


def may_be_compacted(partition: Path) -> bool:
    """Whether a partition's log may have been compacted: a stream's whose settings
    say so, or any other (a kind's changelog; a stream whose metadata is unreadable,
    reported on its own)."""
    try:
        meta = read_json(partition.parent / STREAM_META)
        settings = meta.get("settings") or {}
        return bool(settings.get("cleanup_policy", "delete") != "delete")
    except (OSError, ValueError, AttributeError):
        return True


# The names the engine gives its metadata files (engine/engine.py reads them).
TENANT_META = "tenant.json"
STREAM_META = "stream.json"


@dataclass(frozen=True)
class MetadataProblem:
    path: Path
    problem: str


def _load_object(path: Path, problems: list[MetadataProblem]) -> dict[str, object] | None:
    try:
        data = read_json(path)
    except (OSError, ValueError) as exc:
        problems.append(MetadataProblem(path, f"unparsable: {exc}"))
        return None
    if not isinstance(data, dict):
        problems.append(MetadataProblem(path, "not a JSON object"))
        return None
    return data


def _int_field(
    data: dict[str, object], key: str, path: Path, problems: list[MetadataProblem]
) -> int | None:
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        problems.append(MetadataProblem(path, f"{key!r} is {value!r}, not an integer"))
        return None
    return value


def check_metadata(data_dir: Path) -> list[MetadataProblem]:
    """What is wrong with the tenants' and streams' metadata under ``data_dir`` (nothing
    to check without a ``tenants/`` directory: a bare partition has segments only)."""
    problems: list[MetadataProblem] = []
    tenants_dir = data_dir / "tenants"
    if not tenants_dir.is_dir():
        return problems
    for tenant_dir in sorted(tenants_dir.iterdir()):
        if tenant_dir.is_dir() and tenant_dir.name.isdigit():
            _check_tenant(tenant_dir, problems)
    return problems


def _check_tenant(tenant_dir: Path, problems: list[MetadataProblem]) -> None:
    meta_path = tenant_dir / TENANT_META
    if not meta_path.exists():
        problems.append(MetadataProblem(meta_path, "missing"))
    elif (meta := _load_object(meta_path, problems)) is not None:
        tenant_id = _int_field(meta, "id", meta_path, problems)
        if tenant_id is not None and str(tenant_id) != tenant_dir.name:
            problems.append(
                MetadataProblem(meta_path, f"says tenant {tenant_id}, in {tenant_dir.name}/")
            )
        if not isinstance(meta.get("name"), str):
            problems.append(MetadataProblem(meta_path, "has no name"))
        _int_field(meta, "next_stream_id", meta_path, problems)
    streams_dir = tenant_dir / "streams"
    if not streams_dir.is_dir():
        return
    holders: dict[str, list[int]] = defaultdict(list)
    for stream_dir in sorted(streams_dir.iterdir()):
        if not (stream_dir.is_dir() and stream_dir.name.isdigit()):
            continue  # .creating-/.deleted- leftovers: the server removes them on start
        stream_meta = stream_dir / STREAM_META
        if not stream_meta.exists():
            problems.append(
                MetadataProblem(
                    stream_dir,
                    f"stream directory without {STREAM_META}: the server ignores its data",
                )
            )
            continue
        meta = _load_object(stream_meta, problems)
        if meta is None:
            continue
        stream_id = _int_field(meta, "id", stream_meta, problems)
        if stream_id is not None and str(stream_id) != stream_dir.name:
            problems.append(
                MetadataProblem(stream_meta, f"says stream {stream_id}, in {stream_dir.name}/")
            )
        name = meta.get("name")
        if not isinstance(name, str) or not name:
            problems.append(MetadataProblem(stream_meta, f"name is {name!r}, not a name"))
        else:
            holders[name].append(int(stream_dir.name))
        _int_field(meta, "created_ns", stream_meta, problems)
        # Written before partitions existed: no count, one partition.
        count = meta.get("partitions", 1)
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            problems.append(MetadataProblem(stream_meta, f"partitions is {count!r}, not >= 1"))
            count = 1
        for n in range(count):
            if not (stream_dir / f"partition-{n}").is_dir():
                problems.append(
                    MetadataProblem(
                        stream_meta, f"metadata without its partition-{n}/ directory (no data)"
                    )
                )
    for name, ids in sorted(holders.items()):
        if len(ids) > 1:
            listed = ", ".join(str(i) for i in sorted(ids))
            problems.append(
                MetadataProblem(streams_dir, f"streams {listed} share the name {name!r}")
            )
