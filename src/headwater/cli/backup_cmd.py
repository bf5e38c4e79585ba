"""``headwater backup --data-dir DATA_DIR DEST``: the command around
:mod:`headwater.cli.backup` (imported when the command runs: it loads the SQL layer's
names, which the other commands need not pay for)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

err = Console(stderr=True)
out = Console()


def cmd_backup(args: argparse.Namespace) -> int:
    from headwater.cli.backup import BackupError, backup

    try:
        report = backup(args.data_dir, args.destination)
    except BackupError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    except OSError as exc:  # a full disk, a read-only or vanished destination
        # What it wrote is removed again (backup's staging directory).
        err.print(f"[red]error:[/] no backup taken: {escape(str(exc))}", soft_wrap=True)
        return 2
    for note in report.vanished + report.settled:
        out.print(note, highlight=False, soft_wrap=True, markup=False)
    cut = f", {report.cut_bytes} bytes of writes under way left out" if report.cut_bytes else ""
    out.print(
        f"backup of {args.data_dir} in {report.destination}: {report.partitions} logs, "
        f"{report.segments} segments, {report.bytes} bytes, "
        f"{report.metadata_files} metadata files{cut}",
        highlight=False,
        soft_wrap=True,
    )
    if not report.ok:
        for partition in report.damaged:
            for segment in partition.segments:
                for problem in segment.problems:
                    out.print(f"{segment.path}: {problem}", highlight=False, markup=False)
        for found in report.metadata_problems:
            out.print(f"{found.path}: {found.problem}", highlight=False, markup=False)
        out.print(f"[red]the copy does not pass headwater check {report.destination}[/]")
        return 1
    out.print(f"[green]headwater check {report.destination}: ok[/]", highlight=False)
    return 0


def add_backup_command(sub: Any) -> None:
    backup = sub.add_parser(
        "backup",
        help="copy a data directory, also while a server runs on it, for restoring",
        description="Copies every event acknowledged before the command started, with the "
        "tenants', streams', kinds' and consumer groups' metadata, into DEST (absent or "
        "empty; built beside it and renamed into place when whole). Derived files (SQL "
        "projections, entity stores, indexes) are rebuilt by the server that starts on "
        "the copy. Restore: stop the server and start `headwater serve --data-dir DEST` "
        "(or move DEST to the data directory's place). Exit 0: the copy passed "
        "`headwater check`; 1: it did not; 2: no backup taken.",
    )
    backup.add_argument(
        "--data-dir", type=Path, default=Path("./data"), help="the data directory to copy"
    )
    backup.add_argument("destination", type=Path, metavar="DEST", help="where the copy goes")
    backup.set_defaults(func=cmd_backup)
