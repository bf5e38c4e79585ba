"""Offline verification of a data directory (``headwater check DATA_DIR``).

Reads every segment without changing anything: each batch's CRC and structure, offsets
increasing across batches and segments, and both index files against what the ``.log``
actually holds.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

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


def check_partition(directory: Path, index_interval_bytes: int = 4096) -> PartitionReport:
    report = PartitionReport(directory)
    bases = sorted(int(p.name[:-4]) for p in directory.glob("*.log") if p.name[:-4].isdigit())
    prev_next: int | None = None
    for base in bases:
        seg = Segment(directory, base, index_interval_bytes)
        seg.fd = os.open(seg.log_path, os.O_RDONLY)
        try:
            scan = seg._scan(verify=True, stop_at_error=False)
        finally:
            os.close(seg.fd)
            seg.fd = -1
        sreport = SegmentReport(seg.log_path, scan.batches, scan.events, scan.file_bytes)
        sreport.problems.extend(scan.errors)
        if prev_next is not None and base < prev_next:
            sreport.problems.append(f"base offset {base} overlaps the previous segment")
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
    return [check_partition(d) for d in partition_dirs(data_dir)]
