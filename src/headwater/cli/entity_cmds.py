"""``headwater entity get|list|watch``: read entities of a kind (ConvergeDB, read-only).

The kind's schema comes from the catalog (HTTP API, ``--http``); the entities from
ConvergeDB (``--server``). ``watch`` shows a live table in a terminal (rich.live) and
one line per change otherwise; Ctrl-C ends it at once.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime as _dt
import json
import sys
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from headwater.cli.client_cmds import (
    client_command,
    details_table,
    err,
    fail,
    out,
    positive,
    say,
)
from headwater.cli.kind_cmds import connect_entities, describe, entity_options

if TYPE_CHECKING:
    from headwater.entities import Entity, EntityClient, EntitySubscription, Kind

EXIT_NOT_FOUND = 1


def format_field(value: object) -> str:
    if isinstance(value, _dt.datetime):
        return value.isoformat(timespec="microseconds")
    if isinstance(value, bytes):
        return "0x" + value.hex()
    if isinstance(value, float):
        return repr(value)
    return str(value)


def json_field(value: object) -> Any:
    if isinstance(value, _dt.datetime):
        return value.isoformat(timespec="microseconds")
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    return value


def entity_json(entity: Entity[dict[str, Any]]) -> dict[str, Any]:
    value = entity.value
    return {
        "key": entity.key,
        "entity_id": entity.entity_id.hex(),
        "version": entity.version,
        "change": entity.change,
        "sources": entity.sources,
        "fields": None if value is None else {k: json_field(v) for k, v in value.items()},
    }


def _open_kind(
    args: argparse.Namespace, *, reconnect: bool = False
) -> tuple[EntityClient, Kind[dict[str, Any]]]:
    described = describe(args, args.kind)
    client = connect_entities(args, read_only=True, reconnect=reconnect)
    try:
        kind = client.kind_from_schema(described.name, described.specs)
    except BaseException:
        client.close(flush=False)
        raise
    return client, kind


@client_command
def cmd_entity_get(args: argparse.Namespace) -> int:
    from headwater.entities.schema import parse_key
    from headwater.errors import ErrorName

    client, kind = _open_kind(args)
    with client:
        entity = client.get(kind, parse_key(args.id))
    if entity is None:
        return fail(
            f"{ErrorName.ENTITY_NOT_FOUND}: kind {args.kind} has no entity {args.id!r}",
            EXIT_NOT_FOUND,
        )
    if args.json:
        sys.stdout.write(json.dumps(entity_json(entity)) + "\n")
        return 0
    assert entity.value is not None
    rows = [(name, format_field(value)) for name, value in entity.value.items()]
    out.print(details_table(f"{args.kind} {entity.key}", rows))
    say(
        f"version {entity.version}, asserted by source(s) "
        f"{', '.join(map(str, entity.sources)) or '-'}"
    )
    return 0


# The HTTP API answers at most this many entities in one page.
MAX_LIST_ENTITIES = 10_000


@client_command
def cmd_entity_list(args: argparse.Namespace) -> int:
    from urllib.parse import quote

    from headwater.cli.connection import HttpApi
    from headwater.entities.schema import key_text
    from headwater.errors import TableNotFound

    path = f"/api/kinds/{quote(args.kind, safe='')}/entities?limit={args.limit}"
    try:
        data = HttpApi.at(args, args.http).request("GET", path)
    except TableNotFound:  # kinds are SQL tables to the HTTP API; named as `kind` does
        return fail(f"KindNotFound: no entity kind {args.kind!r}", EXIT_NOT_FOUND)
    entities = data["entities"]
    for entity in entities:
        entity["key"] = key_text(bytes.fromhex(entity["entity_id"]))
    if args.json:
        for entity in entities:
            sys.stdout.write(json.dumps(entity) + "\n")
        return 0
    names = [f["name"] for f in data.get("fields", [])]
    table = Table(title=f"{args.kind}: {len(entities):,} of {data['total']:,} entities")
    table.add_column("key", no_wrap=True)
    table.add_column("version", justify="right")
    for name in names:
        table.add_column(name)
    for entity in entities:
        fields = entity["fields"]
        table.add_row(
            entity["key"],
            str(entity["version"]),
            *("NULL" if fields.get(n) is None else str(fields[n]) for n in names),
        )
    out.print(table)
    if data["total"] > len(entities):
        out.print(
            f"{data['total'] - len(entities):,} more (ordered by entity id; --limit up to "
            f"{MAX_LIST_ENTITIES:,})",
            markup=False,
        )
    return 0


def list_limit(text: str) -> int:
    value = positive(text)
    if value > MAX_LIST_ENTITIES:
        raise argparse.ArgumentTypeError(f"at most {MAX_LIST_ENTITIES}")
    return value


def _watch_table(
    kind: Kind[dict[str, Any]], sub: EntitySubscription[dict[str, Any]], rows: int, changes: int
) -> Table:
    names = [f.name for f in kind.fields]
    entities = sorted(sub.view.values(), key=lambda e: e.version, reverse=True)
    state = "live" if sub.bootstrapped else "bootstrapping"
    table = Table(
        title=f"{kind.name}: {len(sub.view):,} entities, {changes:,} changes ({state})",
        caption="most recently changed first; Ctrl-C to stop",
    )
    table.add_column("key", no_wrap=True)
    table.add_column("version", justify="right")
    for name in names:
        table.add_column(name)
    for entity in entities[:rows]:
        value = entity.value or {}
        table.add_row(entity.key, str(entity.version), *(format_field(value.get(n)) for n in names))
    return table


def _watch_line(entity: Entity[dict[str, Any]]) -> str:
    if entity.value is None:
        fields = "-"
    else:
        fields = json.dumps({k: json_field(v) for k, v in entity.value.items()})
    return f"{entity.change}\t{entity.key}\t{entity.version}\t{fields}\n"


@client_command
def cmd_entity_watch(args: argparse.Namespace) -> int:
    from headwater.entities import ResubscribeMode

    client, kind = _open_kind(args, reconnect=True)
    as_table = args.format == "table" or (args.format == "auto" and sys.stdout.isatty())
    changes = 0
    try:
        sub = client.subscribe(
            kind,
            bootstrap=not args.live_only,
            resubscribe=ResubscribeMode.LIVE_ONLY if args.live_only else ResubscribeMode.FULL,
        ).start()
        if not args.live_only:
            # "watching" promises the current state is in: a Ctrl-C right after it must
            # still print the entities that were there (the table is drawn from the view).
            sub.wait_bootstrapped()
        say(f"watching {kind.name} (Ctrl-C to stop)", err)
        if as_table:
            # Keys and fields are data: not read as markup (a "[/k]" key crashed it).
            console = Console(force_terminal=args.format == "table" or None, markup=False)
            with Live(
                _watch_table(kind, sub, args.rows, changes),
                console=console,
                refresh_per_second=4,
                transient=False,
            ) as live:
                while not sub.closed:
                    batch = sub.next_batch(timeout=0.25)  # short: Ctrl-C lands at once
                    if batch:
                        changes += len(batch)
                        live.update(_watch_table(kind, sub, args.rows, changes))
        else:
            stdout = sys.stdout
            while not sub.closed:
                for entity in sub.next_batch(timeout=0.25):
                    stdout.write(_watch_line(entity))
                stdout.flush()
    except KeyboardInterrupt:
        pass
    finally:
        # Bounded: closing the connection ends the subscription on the server too.
        with contextlib.suppress(KeyboardInterrupt, Exception):
            client.close(flush=False)
    return 0


def add_entity_commands(sub: Any) -> None:
    conn = entity_options()
    entity = sub.add_parser("entity", help="read and watch entities of a kind (ConvergeDB)")
    entity_sub = entity.add_subparsers(dest="entity_command", required=True)
    p = entity_sub.add_parser("get", parents=[conn], help="show one entity's current state")
    p.add_argument("kind")
    p.add_argument("id", help="the entity's key (text), or 0x and 64 hex digits for a raw id")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_entity_get)
    p = entity_sub.add_parser(
        "list",
        parents=[conn],
        help="list a kind's entities (from the HTTP API, ordered by entity id)",
    )
    p.add_argument("kind")
    p.add_argument(
        "--limit",
        type=list_limit,
        default=100,
        help=f"at most this many (default 100, up to {MAX_LIST_ENTITIES:,})",
    )
    p.add_argument(
        "--json", action="store_true", help="one JSON object per entity per line instead of a table"
    )
    p.set_defaults(func=cmd_entity_list)
    p = entity_sub.add_parser(
        "watch",
        parents=[conn],
        help="follow a kind live: a table in a terminal, one line per change otherwise",
    )
    p.add_argument("kind")
    p.add_argument(
        "--format",
        choices=("auto", "table", "lines"),
        default="auto",
        help="table (rich live view), lines (change<TAB>key<TAB>version<TAB>JSON); "
        "auto: table on a terminal",
    )
    p.add_argument("--rows", type=positive, default=40, help="table rows (default 40)")
    p.add_argument(
        "--live-only",
        action="store_true",
        help="no bootstrap: only changes from now on (and none missed during a reconnect "
        "are recovered)",
    )
    p.set_defaults(func=cmd_entity_watch)
