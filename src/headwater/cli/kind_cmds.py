"""``headwater kind create|list|describe``: entity kinds (ConvergeDB).

Kinds are created over ConvergeDB (``--server``, default 127.0.0.1:7402). ConvergeDB has
no request that lists kinds or returns their field names, so ``list`` and ``describe``
read the catalog from the HTTP API (``--http``, default 127.0.0.1:7400).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from rich.table import Table

from headwater.cli.client_cmds import client_command, details_table, fail, out, print_counted, say
from headwater.cli.connection import connection_options, tls_options
from headwater.json_fields import json_fields

if TYPE_CHECKING:
    from headwater.entities import EntityClient, KindDescription

# A CLI connection that writes takes a source slot; a short liveness deadline frees the
# slot soon after the command ends (the tenant has only 64).
CLI_LIVENESS_MS = 2000


def entity_options() -> argparse.ArgumentParser:
    return connection_options(
        "ConvergeDB",
        "HEADWATER_CONVERGEDB",
        "127.0.0.1:7402",
        http=True,
        tenant_help="tenant id for the catalog (default 0; $HEADWATER_TENANT; ConvergeDB "
        "picks the token's lowest tenant)",
        profile_key="convergedb",
    )


def connect_entities(
    args: argparse.Namespace, *, read_only: bool, reconnect: bool = False
) -> EntityClient:
    from headwater import entities

    return entities.connect(
        args.server,
        token=args.token,
        **tls_options(args),
        name="headwater-cli",
        read_only=read_only,
        liveness_ms=0 if read_only else CLI_LIVENESS_MS,
        reconnect=reconnect,
        timeout=30.0,
    )


def describe(args: argparse.Namespace, name: str) -> KindDescription:
    from headwater.entities import describe_kind

    return describe_kind(name, args.http, token=args.token, tenant=args.tenant, **tls_options(args))


def parse_field(text: str) -> tuple[str, int]:
    """``name:type`` (types: bool, u8..u64, i8..i64, f32, f64, string, bytes, timestamp)."""
    from headwater.entities.schema import parse_type
    from headwater.errors import UsageError

    name, sep, type_text = text.rpartition(":")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected name:type, not {text!r}")
    try:
        return name, int(parse_type(type_text))
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def fields_text(kind: KindDescription) -> str:
    from headwater.entities.schema import type_name

    return ", ".join(f"{f.name}:{type_name(f.type)}" for f in kind.fields)


@client_command
def cmd_kind_create(args: argparse.Namespace) -> int:
    if not args.fields:
        return fail("a kind needs at least one field: headwater kind create NAME name:type ...", 2)
    with connect_entities(args, read_only=False) as client:
        kind = client.kind_from_schema(
            args.name, args.fields, create=True, event_stream=args.event_stream
        )
    what = "event-stream kind" if args.event_stream else "kind"
    say(
        f"{what} {kind.name}: id {kind.kind_id}, schema version {kind.schema_version}, "
        f"{kind.field_count} field{'s' if kind.field_count != 1 else ''}"
    )
    return 0


def _kind_json(kind: KindDescription) -> dict[str, Any]:
    from headwater.entities.schema import type_name

    fields = [{"name": f.name, "type": type_name(f.type)} for f in kind.fields]
    return {**json_fields(kind), "fields": fields}  # "fields" keeps its place


@client_command
def cmd_kind_list(args: argparse.Namespace) -> int:
    from headwater.entities import list_kinds

    kinds = list_kinds(args.http, token=args.token, tenant=args.tenant, **tls_options(args))
    if not args.all:
        kinds = [k for k in kinds if not k.internal]
    if args.json:
        sys.stdout.write(json.dumps([_kind_json(k) for k in kinds]) + "\n")
        return 0
    table = Table(title=f"entity kinds of tenant {args.tenant}")
    table.add_column("id", justify="right")
    table.add_column("name", no_wrap=True)
    table.add_column("version", justify="right")
    table.add_column("fields")
    table.add_column("entities", justify="right")
    table.add_column("subscribers", justify="right")
    for kind in kinds:
        name = kind.name + (" (events)" if kind.event_stream else "")
        table.add_row(
            str(kind.kind_id),
            name,
            str(kind.schema_version),
            fields_text(kind),
            f"{kind.entities:,}",
            str(kind.subscribers),
        )
    print_counted(table, len(kinds), "kind")
    return 0


@client_command
def cmd_kind_describe(args: argparse.Namespace) -> int:
    from headwater.entities.schema import type_name

    kind = describe(args, args.name)
    if args.json:
        sys.stdout.write(json.dumps(_kind_json(kind)) + "\n")
        return 0
    info = [
        ("id", str(kind.kind_id)),
        ("schema version", str(kind.schema_version)),
        ("event stream", "yes" if kind.event_stream else "no"),
        ("entities", f"{kind.entities:,}"),
        ("subscribers", str(kind.subscribers)),
    ]
    out.print(details_table(f"kind {kind.name}", info, key="what"))
    fields = Table(title="fields")
    fields.add_column("#", justify="right")
    fields.add_column("name", no_wrap=True)
    fields.add_column("type")
    fields.add_column("code", justify="right")
    for index, spec in enumerate(kind.fields):
        fields.add_row(str(index), spec.name, type_name(spec.type), str(int(spec.type)))
    out.print(fields)
    return 0


def add_kind_commands(sub: Any) -> None:
    conn = entity_options()
    kind = sub.add_parser("kind", help="create, list and describe entity kinds (ConvergeDB)")
    kind_sub = kind.add_subparsers(dest="kind_command", required=True)
    p = kind_sub.add_parser(
        "create",
        parents=[conn],
        help="create a kind (or append fields to it): NAME name:type ...",
        description="Types: bool, u8, u16, u32, u64, i8, i16, i32, i64, f32, f64, string, "
        "bytes, timestamp. Creating a kind again with the same fields changes nothing; "
        "with fields appended it migrates the kind.",
    )
    p.add_argument("name")
    p.add_argument("fields", nargs="*", type=parse_field, metavar="name:type")
    p.add_argument("--event-stream", action="store_true", help="also deliver every op as EVENT")
    p.set_defaults(func=cmd_kind_create)
    p = kind_sub.add_parser("list", parents=[conn], help="list the tenant's kinds")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--all", action="store_true", help="include headwater's own kinds")
    p.set_defaults(func=cmd_kind_list)
    p = kind_sub.add_parser("describe", parents=[conn], help="show one kind and its fields")
    p.add_argument("name")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=cmd_kind_describe)
