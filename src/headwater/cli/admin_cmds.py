"""``headwater info``, ``ping`` and ``group list|describe|reset-offsets``.

Kimberlite has no request for server details or consumer groups, so these read the HTTP
API; its port is the one the Kimberlite Handshake advertises (``http:<port>``), so
``--server`` alone (or a profile) finds it, over HTTPS when the connection uses TLS.
``ping`` times Kimberlite round trips itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any
from urllib.parse import quote

from rich.table import Table

from headwater.cli.client_cmds import (
    EXIT_SERVER_ERROR,
    client_command,
    details_table,
    fail,
    out,
    positive,
    print_counted,
    say,
)
from headwater.cli.connection import (
    HttpApi,
    connect,
    connection_options,
    http_api,
    non_negative,
)

# ---- info / ping ---------------------------------------------------------------------------


def format_uptime(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    return (f"{days}d " if days else "") + f"{hours:02d}:{minutes:02d}:{secs:02d}"


@client_command
def cmd_info(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    hw, api = http_api(args)
    with hw:
        connect_ms = (time.perf_counter() - started) * 1000
        info = api.request("GET", "/api/info")
        protocol_version = hw.aio.server_version
    if args.json:
        sys.stdout.write(json.dumps(info) + "\n")
        return 0
    tenant = info.get("tenant", {})
    listeners = info.get("listeners", {})
    host = api.host
    rows = [
        ("server", f"{info.get('server', 'headwater')} {info.get('version', '?')}"),
        ("protocol", f"Kimberlite v{protocol_version}"),
        ("uptime", format_uptime(float(info.get("uptime_seconds", 0)))),
        ("listeners", ", ".join(f"{n} {host}:{p}" for n, p in sorted(listeners.items()))),
        ("auth required", "yes" if info.get("auth_required") else "no"),
        ("tenant", f"{tenant.get('id')} ({tenant.get('name') or '-'})"),
        ("streams", f"{tenant.get('streams', 0):,}"),
        ("log position", f"{tenant.get('log_position', 0):,}"),
        (
            "connections",
            ", ".join(f"{n} {c}" for n, c in sorted(info.get("connections", {}).items())) or "-",
        ),
        ("connect time", f"{connect_ms:.1f} ms (connect and Kimberlite Handshake)"),
    ]
    out.print(details_table(f"headwater at {args.server}", rows))
    return 0


@client_command
def cmd_ping(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    with connect(args) as hw:
        connect_ms = (time.perf_counter() - started) * 1000
        say(
            f"connected to {hw.address} in {connect_ms:.1f} ms: Kimberlite v"
            f"{hw.aio.server_version}, {'authenticated' if hw.authenticated else 'no token'}"
        )
        times = []
        for seq in range(args.count):
            began = time.perf_counter()
            hw.list_streams()  # a round trip through the server's request path
            elapsed = (time.perf_counter() - began) * 1000
            times.append(elapsed)
            out.print(f"reply from {hw.address}: seq={seq} time={elapsed:.2f} ms", markup=False)
            if args.interval and seq + 1 < args.count:
                time.sleep(args.interval)  # the pace the user asked for
    out.print(
        f"{len(times)} round trips: min {min(times):.2f} / avg {statistics.fmean(times):.2f} / "
        f"max {max(times):.2f} ms",
        markup=False,
    )
    return 0


# ---- group -----------------------------------------------------------------------------------


def _groups(api: HttpApi) -> list[dict[str, Any]]:
    """The resume groups of push subscriptions (one row per stream) and the partitioned
    groups of Kafka, Rivven and SDK consumers (one row per committed partition, with
    ``partition``; membership is not in these rows)."""
    answer = api.request("GET", "/api/consumer-groups")
    groups: list[dict[str, Any]] = answer["groups"] + answer.get("partition_groups", [])
    return groups


def _group_table(title: str, groups: list[dict[str, Any]]) -> Table:
    table = Table(title=title)
    table.add_column("group", no_wrap=True)
    table.add_column("stream", no_wrap=True)
    table.add_column("partition", justify="right")
    for column in ("committed offset", "end offset", "lag"):
        table.add_column(column, justify="right")
    table.add_column("consuming")
    table.add_column("waiting", justify="right")
    for g in sorted(groups, key=lambda g: (g["group"], g["stream"], g.get("partition", -1))):
        partitioned = "partition" in g
        table.add_row(
            g["group"],
            g["stream"],
            str(g["partition"]) if partitioned else "-",
            f"{g['committed_offset']:,}",
            f"{g['end_offset']:,}",
            f"{g['lag']:,}",
            "-" if partitioned else ("yes" if g["active"] else "no"),
            "-" if partitioned else str(g["waiting"]),
        )
    return table


@client_command
def cmd_group_list(args: argparse.Namespace) -> int:
    hw, api = http_api(args)
    with hw:
        groups = _groups(api)
    if args.stream is not None:
        groups = [g for g in groups if g["stream"] == args.stream]
    if args.json:
        sys.stdout.write(json.dumps(groups) + "\n")
        return 0
    names = {g["group"] for g in groups}
    print_counted(
        _group_table(f"consumer groups of tenant {args.tenant}", groups), len(names), "group"
    )
    return 0


@client_command
def cmd_group_describe(args: argparse.Namespace) -> int:
    hw, api = http_api(args)
    with hw:
        groups = [g for g in _groups(api) if g["group"] == args.group]
    if not groups:
        return fail(
            f"GroupNotFound: tenant {args.tenant} has no consumer group {args.group!r}",
            EXIT_SERVER_ERROR,
        )
    if args.json:
        sys.stdout.write(json.dumps(groups) + "\n")
        return 0
    table = _group_table(f"consumer group {args.group}", groups)
    out.print(table)
    total = sum(g["lag"] for g in groups)
    streams = len({g["stream"] for g in groups})
    out.print(f"{streams} stream{'s' if streams != 1 else ''}, total lag {total:,}")
    return 0


@client_command
def cmd_group_reset_offsets(args: argparse.Namespace) -> int:
    if args.to_offset is not None:
        target: dict[str, object] = {"offset": args.to_offset}
    elif args.to_timestamp is not None:
        target = {"timestamp_ms": args.to_timestamp}
    else:
        target = {"to": "earliest" if args.to_earliest else "latest"}
    hw, api = http_api(args)
    with hw:
        path = (
            f"/api/consumer-groups/{quote(args.stream, safe='')}/{quote(args.group, safe='')}/reset"
        )
        group = api.request("POST", path, target)
    say(
        f"consumer group {group['group']} of {group['stream']} now at offset "
        f"{group['committed_offset']:,} (end {group['end_offset']:,}, lag {group['lag']:,})"
    )
    return 0


def add_admin_commands(sub: Any) -> None:
    conn = connection_options()

    p = sub.add_parser(
        "info",
        parents=[conn],
        help="server version, uptime, listeners, the tenant's streams and log position",
    )
    p.add_argument("--json", action="store_true", help="print /api/info's JSON")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser(
        "ping", parents=[conn], help="connect and time round trips (as redis-cli ping)"
    )
    p.add_argument("--count", "-c", type=positive, default=3, help="round trips (default 3)")
    p.add_argument(
        "--interval",
        "-i",
        type=float,
        default=0.0,
        help="seconds between round trips (default 0)",
    )
    p.set_defaults(func=cmd_ping)

    group = sub.add_parser(
        "group",
        help="consumer groups: list, describe, reset offsets (kafka-consumer-groups, rpk group)",
    )
    group_sub = group.add_subparsers(dest="group_command", required=True)
    p = group_sub.add_parser(
        "list", parents=[conn], help="every consumer group of the tenant, per stream, with lag"
    )
    p.add_argument("--stream", default=None, help="only the groups of this stream")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_group_list)
    p = group_sub.add_parser(
        "describe", parents=[conn], help="one group: its position and lag on each stream"
    )
    p.add_argument("group")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_group_describe)
    p = group_sub.add_parser(
        "reset-offsets",
        parents=[conn],
        help="move a group's position on a stream (no member may be consuming)",
        description="Move consumer group GROUP on stream --stream to the first retained "
        "offset, the end, an offset or a time; the group's next consumer resumes there. "
        "Refused while a member of the group is consuming that stream.",
    )
    p.add_argument("group")
    p.add_argument("--stream", required=True, help="the stream whose position moves")
    to = p.add_mutually_exclusive_group(required=True)
    to.add_argument("--to-earliest", action="store_true", help="the first retained offset")
    to.add_argument("--to-latest", action="store_true", help="the end: skip everything so far")
    to.add_argument("--to-offset", type=non_negative, default=None, metavar="N", help="offset N")
    to.add_argument(
        "--to-timestamp",
        type=non_negative,
        default=None,
        metavar="MS",
        help="the first event stored at or after this time (ms since the epoch)",
    )
    p.set_defaults(func=cmd_group_reset_offsets)
