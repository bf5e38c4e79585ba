"""The ``headwater`` command."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.abc
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

import headwater
from headwater.cli.admin_cmds import add_admin_commands
from headwater.cli.backup_cmd import add_backup_command
from headwater.cli.client_cmds import add_client_commands, fail, stdout_console
from headwater.cli.cluster_cmds import add_cluster_commands
from headwater.cli.connection import ProfileError, resolve_connection
from headwater.cli.entity_cmds import add_entity_commands
from headwater.cli.kind_cmds import add_kind_commands
from headwater.cli.pipeline_cmds import add_pipeline_commands
from headwater.cli.profiles import add_profile_commands

if TYPE_CHECKING:
    from headwater.server.config import ServerConfig

err = Console(stderr=True)
out = stdout_console()


# Optional packages that libraries the server uses import on their own whenever they are
# installed, and that the server never needs: hidden from a server process, so that it
# runs the same wherever it is installed. kio registers hypothesis strategies for every
# Kafka type (0.35 s of each start); pyarrow imports pandas at its first conversion of a
# numpy array, in a projection's worker thread, whose 0.2-0.3 s of import held the GIL
# and stalled the event loop's appends for milliseconds at a time (and added to RssAnon).
NOT_IN_A_SERVER = frozenset({"hypothesis", "pandas"})


class _NotInAServer(importlib.abc.MetaPathFinder):
    """Makes an import of a :data:`NOT_IN_A_SERVER` package fail as if it were not
    installed (a None in sys.modules would not do: Cython modules such as pyarrow's
    take that None for the module)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> None:
        if fullname.partition(".")[0] in NOT_IN_A_SERVER:
            raise ModuleNotFoundError(f"{fullname} is not used by the server", name=fullname)
        return None


def cmd_serve(args: argparse.Namespace) -> int:
    if not NOT_IN_A_SERVER & sys.modules.keys():
        sys.meta_path.insert(0, _NotInAServer())
    from headwater.cluster.node import ClusterJoinError
    from headwater.errors import StorageError
    from headwater.server.app import ListenError
    from headwater.server.config import ConfigError, load_config
    from headwater.server.serve import serve
    from headwater.server.tls import server_context

    try:
        config = with_listen_overrides(load_config(args.config), args.listen or ())
        if config.tls is not None:
            # A certificate or key that does not load stops start-up here, in one line.
            server_context(config.tls)
    except ConfigError as exc:
        # escape: the message names sections as TOML does ("[limits]"), which rich would
        # take for markup and drop.
        err.print(f"[red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    try:
        args.data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file in the way, no permission, a read-only disk
        err.print(
            f"[red]error:[/] cannot use {escape(str(args.data_dir))} as the data directory:"
            f" {escape(exc.strerror or str(exc))}",
            highlight=False,
            soft_wrap=True,
        )
        return 2
    try:
        return serve(args.data_dir, config, args.ports_file)
    except StorageError as exc:
        # The data directory cannot be served (another server holds it, damaged
        # metadata): say so in one line, as for a bad config.
        err.print(f"[red]error:[/] {escape(exc.message)}", highlight=False, soft_wrap=True)
        return 1
    except (ListenError, ClusterJoinError) as exc:
        # A port in use (or not ours to bind), etcd unreachable or the node id taken:
        # one line that names the way out.
        sys.stderr.write(f"headwater: {exc}\n")
        return 2
    except OSError as exc:
        # The disk: a data directory not writable or full, a ports file's directory
        # missing. One line naming the file, not a traceback.
        where = f" ({exc.filename})" if exc.filename else ""
        err.print(
            f"[red]error:[/] {escape(exc.strerror or str(exc))}{escape(where)}",
            highlight=False,
            soft_wrap=True,
        )
        return 1


def parse_listen(text: str) -> tuple[str, str]:
    """``--listen NAME=HOST:PORT`` (``NAME=`` or ``NAME=off`` switches NAME off)."""
    from headwater.server.config import DEFAULT_LISTEN, ConfigError, parse_address

    name, sep, address = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected NAME=HOST:PORT, not {text!r}")
    if name not in DEFAULT_LISTEN:
        raise argparse.ArgumentTypeError(
            f"unknown listener {name!r} (one of {', '.join(DEFAULT_LISTEN)})"
        )
    if address in ("", "off"):
        return name, ""
    try:
        parse_address(address, name)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name, address


def with_listen_overrides(
    config: ServerConfig, overrides: Sequence[tuple[str, str]]
) -> ServerConfig:
    """``config`` with the ``--listen`` flags applied over its ``[listen]`` table."""
    if not overrides:
        return config
    return dataclasses.replace(config, listen={**config.listen, **dict(overrides)})


def cmd_check(args: argparse.Namespace) -> int:
    from headwater.errors import StorageError
    from headwater.storage.check import partition_dirs
    from headwater.storage.metadata import DataDirLock

    if not args.data_dir.is_dir():
        err.print(f"[red]error:[/] {escape(str(args.data_dir))} is not a directory", soft_wrap=True)
        return 2
    lock = DataDirLock(args.data_dir)
    marked = (args.data_dir / "tenants").is_dir() or lock.path.exists()
    if not marked and next(partition_dirs(args.data_dir), None) is None:
        # Neither a data directory nor a log's directory (check takes one alone): "all
        # ok" of an empty or unrelated directory (and --repair's lock file left in it)
        # would be a lie.
        err.print(
            f"[red]error:[/] {escape(str(args.data_dir))} is not a headwater data directory"
            " (no tenants/, no segment files)",
            soft_wrap=True,
        )
        return 2
    if args.repair:  # rebuilding files under a running server would race it
        try:
            lock.acquire()
        except StorageError as exc:
            err.print(f"[red]error:[/] --repair needs the server stopped: {exc.message}")
            return 2
    try:
        return _check(args)
    finally:
        lock.release()


def _check(args: argparse.Namespace) -> int:
    from headwater.sql.check import verify_projections
    from headwater.storage.check import check_data_dir, check_metadata

    metadata_problems = check_metadata(args.data_dir)
    reports = check_data_dir(args.data_dir)
    table = Table(title=f"headwater check {args.data_dir}")
    for column in ("partition", "segment", "batches", "events", "bytes", "status"):
        table.add_column(
            column, justify="right" if column in ("batches", "events", "bytes") else "left"
        )
    damaged = 0
    for report in reports:
        rel = report.path.relative_to(args.data_dir)
        for seg in report.segments:
            status = (
                Text("ok", style="green")
                if not seg.problems
                else Text("; ".join(seg.problems), style="red")
            )
            damaged += bool(seg.problems)
            table.add_row(
                str(rel), seg.path.name, str(seg.batches), str(seg.events), str(seg.bytes), status
            )
    out.print(table)
    segments = sum(len(r.segments) for r in reports)
    for report in reports:  # plain lines too, so a narrow terminal still names the file
        rel = report.path.relative_to(args.data_dir)
        for seg in report.segments:
            for problem in seg.problems:
                out.print(f"{rel}/{seg.path.name}: {problem}", soft_wrap=True, highlight=False)
    for found in metadata_problems:
        rel = found.path.relative_to(args.data_dir)
        out.print(f"{rel}: {found.problem}", soft_wrap=True, highlight=False, markup=False)
    # SQL projection files against the log (after the log and the metadata: a damaged
    # segment's events are not held against a file, and a stream whose stream.json is
    # unreadable has no columns to check them by).
    sound = not damaged and not metadata_problems
    projections = verify_projections(args.data_dir, repair=args.repair) if sound else []
    unrepaired = 0
    for projection in projections:
        rel = projection.stream_dir.relative_to(args.data_dir)
        where = f"{rel}/projection-{projection.partition}"
        for problem in projection.problems:
            out.print(f"{where}: {problem}", soft_wrap=True, highlight=False, markup=False)
        for fixed in projection.repaired:
            out.print(
                f"{where}: repaired: {fixed}",
                soft_wrap=True,
                highlight=False,
                markup=False,
            )
        unrepaired += bool(projection.problems) and not projection.repaired
    if damaged or metadata_problems or unrepaired:
        if damaged:
            out.print(f"[red]{damaged} of {segments} segments damaged[/]", markup=True)
        if metadata_problems:
            out.print(f"[red]{len(metadata_problems)} metadata problems[/]", markup=True)
        if unrepaired:
            out.print(
                f"[red]{unrepaired} stream partitions' SQL projection files do not match the "
                "log[/] "
                "(stop the server and run with --repair to rebuild them)",
                markup=True,
            )
        return 1
    files = sum(r.files for r in projections)
    out.print(
        f"[green]{segments} segments in {len(reports)} partitions: all CRCs and indexes ok; "
        f"metadata ok; {files} SQL projection files match the log[/]",
        markup=True,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="headwater", description="headwater event platform")
    parser.add_argument("--version", action="version", version=f"headwater {headwater.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the server")
    serve.add_argument(
        "--data-dir", type=Path, default=Path("./data"), help="where the data lives (./data)"
    )
    serve.add_argument("--config", type=Path, default=None, help="TOML configuration file")
    serve.add_argument("--ports-file", type=Path, default=None, help="write bound ports as JSON")
    serve.add_argument(
        "--listen",
        action="append",
        type=parse_listen,
        metavar="NAME=HOST:PORT",
        # The names are server.config.DEFAULT_LISTEN's, written out: importing the server's
        # config here would slow every command's start (test_cli_serve checks they agree).
        help="where listener NAME (http, kimberlite, convergedb, ripple, rivven, postgres, "
        "kafka) "
        "listens, over the config's [listen]; NAME=off (or NAME=) switches it off; port 0 picks a "
        "free port; repeat for more listeners",
    )
    serve.set_defaults(func=cmd_serve)

    check = sub.add_parser("check", help="verify every CRC and index of a data directory")
    check.add_argument("data_dir", type=Path)
    check.add_argument(
        "--repair",
        action="store_true",
        help="rebuild SQL projection files that do not match the log (server stopped)",
    )
    check.set_defaults(func=cmd_check)

    add_backup_command(sub)
    add_client_commands(sub)
    add_kind_commands(sub)
    add_entity_commands(sub)
    add_pipeline_commands(sub)
    add_admin_commands(sub)
    add_cluster_commands(sub)
    add_profile_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if hasattr(args, "connection"):
            resolve_connection(args)
        return int(args.func(args))
    except ProfileError as exc:
        # The profile file cannot be read, or has no such profile: for any command.
        return fail(str(exc), 2)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
