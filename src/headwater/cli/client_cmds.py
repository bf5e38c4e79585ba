"""Client commands of ``headwater``: stream, append, read, tail, sql, bench.

Every command talks to a running server through the SDK, with the connection options of
:mod:`headwater.cli.connection` (``--server``, ``--token``, ``--tenant``, TLS,
``--profile``). An unreachable server is one line on stderr and exit status 2; an error
answered by the server is one line and exit status 1. docs/cli.md is the reference.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import datetime as _dt
import functools
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import quote

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

from headwater.cli.connection import (
    MAX_INT64,
    HttpApi,
    connect,
    connection_options,
    http_api,
    non_negative,
    tls_options,
)

if TYPE_CHECKING:
    from headwater.client import AppendResult, AsyncClient, Client, QueryResult
    from headwater.client.arrow import HttpApi as ArrowApi

# Off a terminal (a pipe, a file), rich would cut tables at 80 columns; as wide as a
# row needs there instead ($COLUMNS still sets a width when given).
UNCUT_WIDTH = 1 << 15


def stdout_console() -> Console:
    """A console on stdout: the terminal's width on a terminal, else uncut. Nothing it
    prints is read as markup (a line of ours that wants it says markup=True): it prints
    data, where ``[/x]`` is a value, not a style (it crashed a table, or vanished)."""
    uncut = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(highlight=False, markup=False, width=UNCUT_WIDTH if uncut else None)


out = stdout_console()
err = Console(stderr=True, highlight=False)


def say(text: str, console: Console = out) -> None:
    """Print a line of plain text: not read as markup (a name may hold brackets) and not
    wrapped (a line stays one line for whatever reads the output)."""
    console.print(text, markup=False, soft_wrap=True)


EXIT_SERVER_ERROR = 1
EXIT_UNREACHABLE = 2
EXIT_USAGE = 2  # as argparse's

# Lines read from a file or stdin are sent in chunks this big (the SDK splits each chunk
# into protocol-sized, pipelined appends).
APPEND_CHUNK_EVENTS = 50_000
APPEND_CHUNK_BYTES = 8 << 20


def details_table(title: str, rows: list[tuple[str, str]], key: str = "field") -> Table:
    """A two-column table of one thing's details, its names in bold."""
    table = Table(show_header=False, title=title)
    table.add_column(key, style="bold")
    table.add_column("value")
    for row in rows:
        table.add_row(*row)
    return table


def print_counted(table: Table, count: int, noun: str) -> None:
    """``table``, then how many ``noun``s it lists."""
    out.print(table)
    out.print(f"{count} {noun}{'s' if count != 1 else ''}")


def fail(message: str, status: int) -> int:
    """One plain line on stderr (never wrapped, no markup), and the exit status. A
    message of several lines (DuckDB's parser errors point at the text) is joined."""
    message = " ".join(line.strip() for line in message.splitlines() if line.strip())
    sys.stderr.write(f"headwater: error: {message}\n")
    sys.stderr.flush()
    return status


def client_command(
    func: Callable[[argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """Turn SDK and server errors into one-line messages and exit statuses."""

    @functools.wraps(func)
    def run(args: argparse.Namespace) -> int:
        from headwater.client import ClientError
        from headwater.errors import HeadwaterError, UsageError

        try:
            return func(args)
        except ClientError as exc:  # ServerUnavailable, ConnectionLost, RequestTimeout ...
            return fail(str(exc), EXIT_UNREACHABLE)
        except HeadwaterError as exc:  # what the server answered
            return fail(_error_text(exc), EXIT_SERVER_ERROR)
        except UsageError as exc:  # a value the SDK could not send
            return fail(str(exc), EXIT_USAGE)
        except BrokenPipeError:
            # stdout closed early (`headwater read s | head`): not an error. Point stdout
            # at /dev/null so the interpreter's final flush does not complain again.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return 0

    return run


# ---- formatting ------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_created(ns: int) -> str:
    when = _dt.datetime.fromtimestamp(ns / 1e9, _dt.UTC).astimezone()
    return when.strftime("%Y-%m-%d %H:%M:%S")


_CONTROL = {c: f"\\x{c:02x}" for c in range(32)} | {
    ord("\n"): "\\n",
    ord("\r"): "\\r",
    ord("\t"): "\\t",
    0x7F: "\\x7f",
}


def format_value(value: bytes) -> str:
    """UTF-8 text as itself (control characters escaped), anything else as hex."""
    try:
        text = value.decode()
    except UnicodeDecodeError:
        return "0x" + value.hex()
    return text.translate(_CONTROL)


def format_cell(value: object) -> str:
    from headwater.client import Timestamp
    from headwater.client.results import timestamp_to_datetime

    if value is None:
        return "NULL"
    if isinstance(value, Timestamp):
        return timestamp_to_datetime(value).strftime("%Y-%m-%d %H:%M:%S.%f")
    return str(value)


def parse_param(text: str) -> object:
    """--param values: integers, true/false, null; anything else is text."""
    lowered = text.lower()
    if lowered == "null":
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        number = int(text)
    except ValueError:
        return text
    # Past BIGINT a number goes as its text, which DuckDB casts (`?::HUGEINT`).
    return number if -MAX_INT64 - 1 <= number <= MAX_INT64 else text


def parse_offset(text: str) -> int | str:
    if text in ("latest", "earliest", "resume"):
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an offset, 'earliest', 'latest' or 'resume', not {text!r}"
        ) from None
    if not 0 <= value <= MAX_INT64:
        raise argparse.ArgumentTypeError("offsets are from 0 to 2**63-1")
    return value


def positive(text: str) -> int:
    value = int(text)
    if not 0 < value <= MAX_INT64:
        raise argparse.ArgumentTypeError("must be from 1 to 2**63-1")
    return value


def credits(text: str) -> int:
    """A subscription's window: Kimberlite's credits are a u32."""
    from headwater.client.aio import MAX_CREDITS

    value = int(text)
    if not 0 < value <= MAX_CREDITS:
        raise argparse.ArgumentTypeError(f"must be from 1 to {MAX_CREDITS}")
    return value


# ---- stream -------------------------------------------------------------------------------


def sync_policy(text: str) -> str:
    if text in ("fsync", "none") or (
        text.startswith("interval:") and text.removeprefix("interval:").isdigit()
    ):
        return text
    raise argparse.ArgumentTypeError(f"expected fsync, none or interval:<ms>, not {text!r}")


# `stream create`'s settings: each the HTTP API's stream setting of that name
# (docs/http-api.md), given as the flag --<name with dashes>, with these add_argument
# options; one table, so a flag and the setting it sends cannot drift apart.
STREAM_SETTINGS: dict[str, dict[str, Any]] = {
    "sync": {
        "type": sync_policy,
        "help": "when an append is acknowledged: fsync (each append), interval:<ms> or none",
    },
    "retention_ms": {"type": positive, "help": "delete segments older than this"},
    "retention_bytes": {"type": positive, "help": "delete the oldest segments past this size"},
    "cleanup_policy": {
        "choices": ("delete", "compact"),
        "help": "delete (retention only) or compact (keep each key's latest event)",
    },
    "delete_retention_ms": {
        "type": non_negative,
        "help": "with compact: how long a tombstone is kept",
    },
    "compression": {
        "choices": ("none", "zstd", "lz4"),
        "help": "how sealed segments are compressed",
    },
    "segment_bytes": {"type": positive, "help": "roll a segment at this size"},
    "segment_ms": {"type": positive, "help": "roll a segment at this age"},
    "partitions": {
        "type": positive,
        "help": "partitions of the stream (default 1; more later with stream alter)",
    },
    "timestamp_type": {
        "choices": ("CreateTime", "LogAppendTime"),
        "help": "CreateTime: events keep their producer's timestamp (default); "
        "LogAppendTime: the server's clock",
    },
}


@client_command
def cmd_stream_create(args: argparse.Namespace) -> int:
    settings = {k: getattr(args, k) for k in STREAM_SETTINGS if getattr(args, k) is not None}
    if not settings:
        with connect(args) as hw:
            stream_id = hw.create_stream(args.name)
        say(f"created stream {args.name} (id {stream_id})")
        return 0
    # Kimberlite's CreateStream carries no settings; the HTTP API's create does.
    hw, api = http_api(args)
    with hw:
        stream = api.request("POST", "/api/streams", {"name": args.name, "settings": settings})
    shown_settings = dict(stream.get("settings", settings))
    if stream.get("partitions", 1) > 1:
        shown_settings["partitions"] = stream["partitions"]
    shown = ", ".join(f"{k}={v}" for k, v in sorted(shown_settings.items()))
    say(f"created stream {args.name} (id {stream['stream_id']}): {shown}")
    return 0


@client_command
def cmd_stream_list(args: argparse.Namespace) -> int:
    with connect(args) as hw:
        streams = hw.list_streams()
    if args.json:
        import json

        rows = [
            {
                "id": s.stream_id,
                "name": s.name,
                "next_offset": s.next_offset,
                "size_bytes": s.size_bytes,
                "created_ns": s.created_ns,
            }
            for s in streams
        ]
        sys.stdout.write(json.dumps(rows) + "\n")
        return 0
    table = Table(title=f"streams of tenant {args.tenant} at {args.server}")
    table.add_column("id", justify="right")
    table.add_column("name", no_wrap=True)
    table.add_column("next offset", justify="right")
    table.add_column("size", justify="right")
    table.add_column("created")
    for s in sorted(streams, key=lambda s: s.stream_id):
        table.add_row(
            str(s.stream_id),
            s.name,
            f"{s.next_offset:,}",
            human_bytes(s.size_bytes),
            format_created(s.created_ns),
        )
    print_counted(table, len(streams), "stream")
    return 0


def _stream_json(args: argparse.Namespace, hw: Client) -> dict[str, Any] | None:
    """The stream as the HTTP API shows it (settings, partitions: Kimberlite carries
    neither), or None when the server advertises no HTTP API."""
    from headwater.protocols.kimberlite.messages import http_port

    if http_port(hw.capabilities) is None:
        return None
    path = f"/api/streams/{quote(args.name, safe='')}"
    stream: dict[str, Any] = HttpApi.advertised(args, hw).request("GET", path)
    return stream


@client_command
def cmd_stream_describe(args: argparse.Namespace) -> int:
    with connect(args) as hw:
        info = hw.stream_info(args.name)
        described = _stream_json(args, hw)
        settings = None if described is None else described.get("settings", {})
        last = None
        if info.next_offset > 0:
            events = hw.read(info.stream_id, info.next_offset - 1, 1 << 16).events
            last = events[0] if events else None
    table = details_table(
        f"stream {info.name}",
        [
            ("id", str(info.stream_id)),
            ("name", info.name),
            ("next offset", f"{info.next_offset:,}"),
            ("size", f"{human_bytes(info.size_bytes)} ({info.size_bytes:,} bytes)"),
            ("created", format_created(info.created_ns)),
        ],
    )
    if settings is not None:
        shown = ", ".join(f"{k}={v}" for k, v in sorted(settings.items()))
        table.add_row("settings", shown or "the server's defaults")
    if described is not None and described.get("partitions", 1) > 1:
        ranges = ", ".join(
            f"{p['partition']}: {p['start_offset']:,}..{p['next_offset']:,}"
            for p in described["partition_offsets"]
        )
        table.add_row("partitions", f"{described['partitions']} ({ranges})")
    if last is not None:
        preview = format_value(last.value)
        if len(preview) > 120:
            preview = preview[:117] + "..."
        table.add_row("last event", f"{last.offset}: {preview}")
    out.print(table)
    return 0


@client_command
def cmd_stream_alter(args: argparse.Namespace) -> int:
    """Partitions are the one thing that changes after creation (added, never removed)."""
    hw, api = http_api(args)
    with hw:
        path = f"/api/streams/{quote(args.name, safe='')}"
        stream = api.request("PATCH", path, {"partitions": args.partitions})
    say(f"stream {args.name} has {stream['partitions']} partitions")
    return 0


@client_command
def cmd_stream_delete(args: argparse.Namespace) -> int:
    with connect(args) as hw:
        hw.delete_stream(args.name)
    say(f"deleted stream {args.name}")
    return 0


# ---- append / read / tail -------------------------------------------------------------------


def _chunks(source: IO[bytes], *, live: bool) -> Iterator[tuple[list[bytes], int]]:
    """(events, bytes consumed) chunks of the non-empty lines of ``source``.

    A chunk ends at APPEND_CHUNK_EVENTS / APPEND_CHUNK_BYTES; with ``live`` (a pipe or a
    terminal) also whenever the input pauses, so `producer | headwater append s` sends
    lines as they come instead of waiting for the end of the input.
    """
    read = getattr(source, "read1", source.read)
    chunk: list[bytes] = []
    size = consumed = 0
    partial = b""
    while True:
        data = read(1 << 20)
        if not data:
            break
        consumed += len(data)
        lines = (partial + data).split(b"\n")
        partial = lines.pop()
        for line in lines:
            event = line[:-1] if line.endswith(b"\r") else line  # a CRLF line end
            if event:
                chunk.append(event)
                size += len(event)
        if chunk and (live or len(chunk) >= APPEND_CHUNK_EVENTS or size >= APPEND_CHUNK_BYTES):
            yield chunk, consumed
            chunk, size, consumed = [], 0, 0
    event = partial[:-1] if partial.endswith(b"\r") else partial
    if event:
        chunk.append(event)
    if chunk or consumed:
        yield chunk, consumed


def _keyed(
    args: argparse.Namespace, lines: list[bytes]
) -> tuple[list[bytes], list[bytes | None] | None]:
    """The events' values and keys (None: no keys) from the command's key options."""
    if args.key_delimiter is not None:
        # As kcat -K: the key is what comes before the first delimiter; a line without
        # one is a value with no key.
        delimiter = args.key_delimiter.encode()
        keys: list[bytes | None] = []
        values = []
        for line in lines:
            key, found, value = line.partition(delimiter)
            keys.append(key if found else None)
            values.append(value if found else line)
        return values, keys
    if args.event_key is not None:
        return lines, [args.event_key.encode()] * len(lines)
    return lines, None


def _append_chunk(hw: Client, args: argparse.Namespace, lines: list[bytes]) -> AppendResult:
    """Append ``lines`` as events, with the command's key and headers (AppendRecords), to
    partition 0 (all Kimberlite knows)."""
    values, keys = _keyed(args, lines)
    headers = [args.header] * len(lines) if args.header else None
    return hw.append(args.stream, values, keys=keys, headers=headers)


def _append_placed(
    api: ArrowApi,
    args: argparse.Namespace,
    lines: list[bytes],
    partitions: int,
    wrote: Callable[[int, int, int], None],
) -> None:
    """Append ``lines`` to a stream of several partitions, each keyed event on its key's
    partition as the engine's partitioner (Kafka's murmur2) places it, each keyless one
    on partition 0 as before; each partition's events in their order, as Arrow appends
    (``POST /api/streams/{name}/arrow``). Each append's partition, first and last offset
    go to ``wrote``."""
    import numpy as np
    import pyarrow as pa

    from headwater.client.arrow import append_pieces, by_partition
    from headwater.engine.partitioner import Partitioner

    values, keys = _keyed(args, lines)
    assert keys is not None  # only keyed appends come here
    keyless_to_0 = [0 if key is None else None for key in keys]
    target = Partitioner().partition(keys, partitions, keyless_to_0)
    columns = {"value": pa.array(values, pa.binary()), "key": pa.array(keys, pa.binary())}
    if args.header:
        entry = [{"key": name, "value": value.encode()} for name, value in args.header]
        header = pa.struct([("key", pa.string()), ("value", pa.binary())])
        columns["headers"] = pa.array([entry] * len(values), pa.list_(header))
    for partition, rows in by_partition(pa.RecordBatch.from_pydict(columns), np.asarray(target)):
        for piece in append_pieces(rows):
            answer = api.append_arrow(args.stream, piece, partition=partition)
            wrote(partition, int(answer["base_offset"]), int(answer["next_offset"]) - 1)


def parse_header(text: str) -> tuple[str, str]:
    """``--header NAME=VALUE``."""
    name, found, value = text.partition("=")
    if not found or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, not {text!r}")
    return name, value


@client_command
def cmd_append(args: argparse.Namespace) -> int:
    from headwater.protocols.kimberlite.messages import MAX_APPEND_BYTES as MAX_EVENT_BYTES

    source: IO[bytes]
    total = None
    if args.file is not None:
        path = Path(args.file)
        try:
            source = path.open("rb")
        except OSError as exc:
            return fail(f"cannot read {path}: {exc.strerror}", 2)
        total = path.stat().st_size
    else:
        source = sys.stdin.buffer
    written: dict[int, tuple[int, int]] = {}  # partition: (first, last offset)

    def wrote(partition: int, first: int, last: int) -> None:
        written[partition] = (written.get(partition, (first, 0))[0], last)

    with connect(args) as hw, source, contextlib.ExitStack() as closing:
        hw.stream_id(args.stream)  # StreamNotFound before reading any input
        # Keyed events go to their key's partition; Kimberlite knows partition 0 only,
        # so on a stream of several partitions they go as Arrow appends over HTTP.
        api = None
        if args.event_key is not None or args.key_delimiter is not None:
            api = _placing_api(hw, args.stream)
            if api is not None:
                closing.callback(api[0].close)
        progress = _progress("bytes") if total is not None else None
        task = progress.add_task("appending", total=total) if progress else None
        sent = 0  # the input's events in the chunks appended before this one
        try:
            if progress is not None:
                progress.start()
            for chunk, consumed in _chunks(source, live=total is None):
                too_large = None
                if chunk and max(map(len, chunk)) > MAX_EVENT_BYTES:  # found in C; rare
                    too_large = next(i for i, e in enumerate(chunk) if len(e) > MAX_EVENT_BYTES)
                lines = chunk if too_large is None else chunk[:too_large]
                try:
                    if lines and api is not None:
                        _append_placed(api[0], args, lines, api[1], wrote)
                    elif lines:
                        result = _append_chunk(hw, args, lines)
                        wrote(0, result.first_offset, result.last_offset)
                except Exception as exc:
                    if not written:
                        raise  # nothing stored: the command's usual error
                    # What was stored must be told, or a rerun of the whole input would
                    # store it twice.
                    return fail(
                        f"{_error_text(exc)} (appending the input's events {sent + 1:,}.."
                        f"{sent + len(lines):,}). {_appended(args, written)}",
                        EXIT_SERVER_ERROR,
                    )
                if too_large is not None:  # every event before it is stored, none after
                    return fail(
                        f"the input's event {sent + too_large + 1:,} (counting non-empty lines)"
                        f" is {len(chunk[too_large]):,} bytes; one event may be at most"
                        f" {MAX_EVENT_BYTES:,} bytes (4 MiB). {_appended(args, written)}",
                        EXIT_USAGE,
                    )
                sent += len(chunk)
                if progress is not None and task is not None:
                    progress.update(task, advance=consumed)
        finally:
            if progress is not None:
                progress.stop()
    count = sum(last - first + 1 for first, last in written.values())
    if count == 0:
        say(f"no events appended to {args.stream} (the input had no lines)")
        return 0
    say(f"appended {count:,} event{'s' if count != 1 else ''} to {args.stream}: {_where(written)}")
    return 0


def _where(written: dict[int, tuple[int, int]]) -> str:
    """The offsets an append command stored, per partition."""
    if list(written) == [0]:
        return "offsets {}..{}".format(*written[0])
    return ", ".join(
        f"partition {p} offsets {first}..{last}" for p, (first, last) in sorted(written.items())
    )


def _appended(args: argparse.Namespace, written: dict[int, tuple[int, int]]) -> str:
    """What an append command that stopped part-way had stored."""
    count = sum(last - first + 1 for first, last in written.values())
    if count == 0:
        return "Nothing was appended."
    return (
        f"The {count:,} events before it were appended to {args.stream} ({_where(written)});"
        " none from there on."
    )


def _error_text(exc: BaseException) -> str:
    """An error as a command reports it: a server's answer with its name."""
    from headwater.errors import HeadwaterError

    return f"{exc.name}: {exc.message}" if isinstance(exc, HeadwaterError) else str(exc)


def _http_partitions(hw: Client, stream: str) -> tuple[ArrowApi, int] | str:
    """The HTTP API and the stream's partition count (Kimberlite knows partition 0
    only); why not, when the server advertises no HTTP API."""
    from headwater.client.errors import ServerUnavailable

    try:
        api = hw.http_api()
    except ServerUnavailable as exc:
        return str(exc)
    try:
        return api, int(api.stream(stream)["partitions"])
    except BaseException:
        api.close()
        raise


def _placing_api(hw: Client, stream: str) -> tuple[ArrowApi, int] | None:
    """The HTTP API and the stream's partition count when keyed events must be placed
    by key (a stream of several partitions); None when Kimberlite's partition 0 is the
    key's partition anyway (one partition), or when the server has no HTTP API (a
    warning says keys then go to partition 0)."""
    found = _http_partitions(hw, stream)
    if isinstance(found, str):
        say(f"headwater: warning: {found}; keyed events go to partition 0 over Kimberlite", err)
        return None
    api, partitions = found
    if partitions == 1:
        api.close()
        return None
    return found


def _note_partition_zero(hw: Client, stream: str, doing: str) -> None:
    """On a stream of several partitions, say on stderr that a Kimberlite read or tail
    (``doing``) covers partition 0 only: its other events are not missing. Said where
    the HTTP API tells the count; a failure to ask is no failure of the command."""
    from headwater.errors import HeadwaterError

    try:
        found = _http_partitions(hw, stream)
    except HeadwaterError:
        return
    if isinstance(found, str):
        return
    api, partitions = found
    api.close()
    if partitions > 1:
        say(
            f"headwater: note: {stream} has {partitions} partitions; {doing} partition 0"
            " only (read --partition N for the others)",
            err,
        )


class _EventRateColumn(ProgressColumn):
    """Events per second of a task counted in events."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("" if speed is None else f"{speed:,.0f} events/s", style="progress.data.speed")


def _progress(unit: str = "events") -> Progress:
    rate: ProgressColumn = TransferSpeedColumn() if unit == "bytes" else _EventRateColumn()
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        rate,
        TimeRemainingColumn(),
        console=err,
        transient=False,
    )


def _write_event(offset: int, value: bytes, stream: IO[str], fmt: str = "text") -> None:
    if fmt == "text":
        stream.write(f"{offset}\t{format_value(value)}\n")
        return
    import json

    record: dict[str, object] = {"offset": offset}
    try:
        record["value"] = value.decode()
    except UnicodeDecodeError:  # the exact bytes, as the HTTP API gives them
        record["value"] = None
        record["value_b64"] = base64.b64encode(value).decode()
    stream.write(json.dumps(record, ensure_ascii=False) + "\n")


def _write_record(event: dict[str, Any], stream: IO[str], fmt: str) -> None:
    """An event as the HTTP API gives it (partition, key, headers, timestamp): ``json``
    prints it as it came; ``text`` as partition, offset, timestamp (UTC), key and value,
    tab-separated (a missing key: empty)."""
    import json

    if fmt == "json":
        event.pop("position", None)
        stream.write(json.dumps(event, ensure_ascii=False) + "\n")
        return
    when = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(event["timestamp_ms"] / 1000))
    key = event.get("key_b64")
    key_text = "" if key is None else format_value(base64.b64decode(key))
    value = format_value(base64.b64decode(event["value_b64"]))
    stream.write(f"{event['partition']}\t{event['offset']}\t{when}Z\t{key_text}\t{value}\n")


def _read_partition(args: argparse.Namespace) -> None:
    """``read --partition N``: pages of the HTTP API's read, which carries partitions,
    keys, headers and timestamps (Kimberlite's ReadEvents carries values only)."""
    hw, api = http_api(args)
    with hw:
        path = f"/api/streams/{quote(args.stream, safe='')}/events"
        offset, left = args.from_offset, args.limit
        while left is None or left > 0:
            page_size = 1000 if left is None else min(1000, left)
            page = api.request(
                "GET", f"{path}?partition={args.partition}&from={offset}&limit={page_size}"
            )
            for event in page["events"]:
                _write_record(event, sys.stdout, args.format)
            if not page["events"]:
                break
            offset = page["next_offset"]
            left = None if left is None else left - len(page["events"])
    sys.stdout.flush()


@client_command
def cmd_read(args: argparse.Namespace) -> int:
    if args.partition is not None:
        _read_partition(args)
        return 0
    with connect(args) as hw:
        stdout = sys.stdout
        for event in hw.scan(args.stream, args.from_offset, limit=args.limit):
            _write_event(event.offset, event.value, stdout, args.format)
        stdout.flush()
        _note_partition_zero(hw, args.stream, "this read shows")
    return 0


@client_command
def cmd_tail(args: argparse.Namespace) -> int:
    hw = connect(args)
    stdout = sys.stdout
    try:
        sub = hw.subscribe(
            args.stream, args.from_offset, credits=args.credits, group=args.group
        ).start()
        say(f"tailing {args.stream} from offset {sub.start_offset} (Ctrl-C to stop)", err)
        _note_partition_zero(hw, args.stream, "tail follows")
        # Short waits keep the main thread where Ctrl-C lands at once.
        while not sub.closed:
            for event in sub.next_batch(timeout=0.5):
                _write_event(event.offset, event.value, stdout, args.format)
            stdout.flush()
    except KeyboardInterrupt:
        pass
    finally:
        # Bounded: cancels the subscription and closes the connection (the server ends
        # the subscription with it), rather than waiting on an Unsubscribe answer.
        with contextlib.suppress(KeyboardInterrupt):
            hw.close()
    return 0


# ---- sql --------------------------------------------------------------------------------------


@client_command
def cmd_sql(args: argparse.Namespace) -> int:
    params = [parse_param(p) for p in args.param or ()]
    with connect(args) as hw:
        if args.at is not None:
            result = hw.query_at(args.sql, args.at, *params)
        else:
            result = hw.query(args.sql, *params)
    if args.format == "table":
        _print_result(result)
    elif args.format == "csv":
        import csv

        writer = csv.writer(sys.stdout)
        writer.writerow(result.columns)
        for row in result.rows:
            writer.writerow(["" if v is None else format_cell(v) for v in row])
    else:
        import json

        names = unique_names(result.columns)
        records = [
            {
                c: (v if isinstance(v, int | str | bool) or v is None else format_cell(v))
                for c, v in zip(names, row, strict=True)
            }
            for row in result.rows
        ]
        if args.format == "json-array":
            sys.stdout.write(json.dumps(records) + "\n")
        else:
            for record in records:
                sys.stdout.write(json.dumps(record) + "\n")
    return 0


def unique_names(columns: Sequence[str]) -> list[str]:
    """Column names as JSON object keys: a name already taken gets ``_1``, ``_2``... (the
    first free), as DuckDB names them (``SELECT 'a' AS x, 'b' AS x`` printed only
    ``{"x": "b"}``: the first value was lost)."""
    taken = set(columns)  # a suffixed name must not take a later column's own
    used: set[str] = set()
    names: list[str] = []
    for column in columns:
        name, n = column, 0
        while name in used or (name != column and name in taken):
            n += 1
            name = f"{column}_{n}"
        used.add(name)
        names.append(name)
    return names


def _print_result(result: QueryResult) -> None:
    table = Table()
    for index, column in enumerate(result.columns):
        sample = next((row[index] for row in result.rows if row[index] is not None), None)
        numeric = isinstance(sample, int) and not isinstance(sample, bool)
        table.add_column(column, justify="right" if numeric else "left")
    for row in result.rows:
        table.add_row(*(format_cell(v) for v in row))
    out.print(table)
    n = len(result.rows)
    out.print(f"({n} row{'s' if n != 1 else ''})")


# ---- bench --------------------------------------------------------------------------------------


def _report(what: str, events: int, nbytes: int, seconds: float, extra: str = "") -> None:
    seconds = max(seconds, 1e-9)
    out.print(
        f"{what}: {events:,} events, {human_bytes(nbytes)} in {seconds:.2f} s: "
        f"[bold]{events / seconds:,.0f} events/s[/], "
        f"[bold]{nbytes / seconds / 1e6:,.1f} MB/s[/]{escape(extra)}",
        soft_wrap=True,
        markup=True,
    )


def bench_command(
    run: Callable[[AsyncClient, argparse.Namespace], Awaitable[None]],
) -> Callable[[argparse.Namespace], int]:
    """A ``bench`` command: ``run`` with an asyncio client of the command's connection."""

    async def main(args: argparse.Namespace) -> None:
        from headwater.client import connect_async

        client = await connect_async(
            args.server, token=args.token, tenant=args.tenant, **tls_options(args)
        )
        try:
            await run(client, args)
        finally:
            await client.close()

    @client_command
    def command(args: argparse.Namespace) -> int:
        asyncio.run(main(args))
        return 0

    return command


@bench_command
async def cmd_bench_produce(client: AsyncClient, args: argparse.Namespace) -> None:
    from headwater.errors import StreamAlreadyExists

    with contextlib.suppress(StreamAlreadyExists):
        await client.create_stream(args.stream)
    value = (b"x" * args.size)[: args.size]
    batch = [value] * args.batch
    batches = [batch] * (args.events // args.batch)
    if args.events % args.batch:
        batches.append([value] * (args.events % args.batch))
    latencies: list[float] = []
    slots = asyncio.Semaphore(args.concurrency)
    with _progress() as progress:
        task = progress.add_task("producing", total=args.events)

        async def one(events: list[bytes]) -> None:
            async with slots:
                began = time.perf_counter()
                await client.append(args.stream, events)
                latencies.append(time.perf_counter() - began)
            progress.update(task, advance=len(events))

        started = time.perf_counter()
        # Created in order, so the appends are sent in order; `slots` bounds how
        # many are in flight on the one connection.
        await asyncio.gather(*(one(b) for b in batches))
        elapsed = time.perf_counter() - started
    latencies.sort()
    p50 = latencies[len(latencies) // 2] * 1000 if latencies else 0.0
    p99 = (
        latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000 if latencies else 0.0
    )
    _report(
        "produce",
        args.events,
        args.events * args.size,
        elapsed,
        f" (batch {args.batch}, {args.concurrency} in flight; "
        f"append latency p50 {p50:.1f} ms, p99 {p99:.1f} ms)",
    )


@bench_command
async def cmd_bench_consume(client: AsyncClient, args: argparse.Namespace) -> None:
    info = await client.stream_info(args.stream)
    end = info.next_offset
    if args.events is not None:
        end = min(end, args.from_offset + args.events)
    total = max(0, end - args.from_offset)
    events = nbytes = 0
    with _progress() as progress:
        task = progress.add_task(f"consuming ({args.mode})", total=total)
        started = time.perf_counter()
        if args.mode == "read":
            offset = args.from_offset
            while offset < end:
                result = await client.read(info.stream_id, offset, args.max_bytes)
                got = result.events[: end - offset]
                if not got and result.at_end:
                    break
                if not got:  # from inside a hole in the offsets (compaction): past it
                    offset = result.next_offset
                    continue
                events += len(got)
                nbytes += sum(len(e.value) for e in got)
                offset = got[-1].offset + 1
                progress.update(task, advance=len(got))
        elif total:
            async with client.subscribe(
                info.stream_id, args.from_offset, credits=args.credits
            ) as sub:
                while events < total:
                    batch = await sub.next_batch(total - events)
                    if not batch:
                        break
                    events += len(batch)
                    nbytes += sum(len(e.value) for e in batch)
                    progress.update(task, advance=len(batch))
        elapsed = time.perf_counter() - started
    _report(f"consume ({args.mode})", events, nbytes, elapsed)


# ---- parser -------------------------------------------------------------------------------------


def add_client_commands(sub: Any) -> None:
    conn = connection_options()

    stream = sub.add_parser("stream", help="create, list, describe and delete streams")
    stream_sub = stream.add_subparsers(dest="stream_command", required=True)
    p = stream_sub.add_parser(
        "create",
        parents=[conn],
        help="create a stream (with settings: through the HTTP API the server advertises)",
    )
    p.add_argument("name")
    settings = p.add_argument_group("settings (the server's defaults when not given)")
    for name, options in STREAM_SETTINGS.items():
        settings.add_argument(f"--{name.replace('_', '-')}", default=None, **options)
    p.set_defaults(func=cmd_stream_create)
    p = stream_sub.add_parser(
        "alter", parents=[conn], help="add partitions to a stream (never fewer)"
    )
    p.add_argument("name")
    p.add_argument("--partitions", type=positive, required=True, help="the new partition count")
    p.set_defaults(func=cmd_stream_alter)
    p = stream_sub.add_parser("list", parents=[conn], help="list the tenant's streams")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_stream_list)
    p = stream_sub.add_parser("describe", parents=[conn], help="show one stream")
    p.add_argument("name")
    p.set_defaults(func=cmd_stream_describe)
    p = stream_sub.add_parser("delete", parents=[conn], help="delete a stream and its events")
    p.add_argument("name")
    p.set_defaults(func=cmd_stream_delete)

    p = sub.add_parser(
        "append",
        # --key is the events' key here (as rpk produce -k); the TLS key is --tls-key.
        parents=[connection_options(key_flag=False)],
        help="append lines (stdin or --file) as events, one per line",
    )
    p.add_argument("stream")
    p.add_argument("--file", "-f", default=None, help="read lines from this file (shows progress)")
    key = p.add_mutually_exclusive_group()
    key.add_argument(
        "--key", "-k", dest="event_key", default=None, help="the key of every event appended"
    )
    key.add_argument(
        "--key-delimiter",
        "-K",
        default=None,
        metavar="DELIM",
        help="each line is KEY DELIM VALUE (as kcat -K); a line without DELIM has no key",
    )
    p.add_argument(
        "--header",
        "-H",
        action="append",
        type=parse_header,
        default=None,
        metavar="NAME=VALUE",
        help="a header on every event appended; repeat for more",
    )
    p.set_defaults(func=cmd_append)

    event_format = {
        "choices": ("text", "json"),
        "default": "text",
        "help": "text: offset<TAB>value (default); json: one object per line, "
        '{"offset": N, "value": "..."} (not UTF-8: "value": null and "value_b64")',
    }
    p = sub.add_parser("read", parents=[conn], help="print events: offset<TAB>value per line")
    p.add_argument("stream")
    p.add_argument(
        "--from", dest="from_offset", type=non_negative, default=0, help="first offset (0)"
    )
    p.add_argument("--limit", type=non_negative, default=None, help="at most this many events")
    p.add_argument("--format", **event_format)
    p.add_argument(
        "--partition",
        type=non_negative,
        default=None,
        help="read this partition through the HTTP API, with keys, headers and timestamps: "
        "text is partition<TAB>offset<TAB>time<TAB>key<TAB>value",
    )
    p.set_defaults(func=cmd_read)

    p = sub.add_parser("tail", parents=[conn], help="follow a stream live (Ctrl-C to stop)")
    p.add_argument("stream")
    p.add_argument(
        "--from",
        dest="from_offset",
        type=parse_offset,
        default="latest",
        help="an offset, 'earliest', 'latest' (default) or 'resume' (with --group)",
    )
    p.add_argument("--group", default=None, help="consumer group (durable position)")
    p.add_argument("--credits", type=credits, default=1000, help="flow-control window")
    p.add_argument("--format", **event_format)
    p.set_defaults(func=cmd_tail)

    p = sub.add_parser("sql", parents=[conn], help="run a SQL query")
    p.add_argument("sql")
    p.add_argument("--at", type=non_negative, default=None, help="query as of a log position")
    p.add_argument(
        "--param",
        action="append",
        default=None,
        help="a parameter ($1, $2, ...): integers, true/false and null are typed, "
        "anything else is text; repeat for more",
    )
    p.add_argument(
        "--format",
        choices=("table", "csv", "json", "json-array"),
        default="table",
        help="table (default), csv (a header row), json (one object per row per line) "
        "or json-array (one array of row objects)",
    )
    p.set_defaults(func=cmd_sql)

    bench = sub.add_parser("bench", help="measure produce / consume throughput")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    p = bench_sub.add_parser("produce", parents=[conn], help="append synthetic events")
    p.add_argument("stream")
    p.add_argument("--events", type=positive, default=100_000, help="events to append")
    p.add_argument("--batch", type=positive, default=1000, help="events per append")
    p.add_argument("--size", type=non_negative, default=100, help="bytes per event")
    p.add_argument("--concurrency", type=positive, default=8, help="appends in flight")
    p.set_defaults(func=cmd_bench_produce)
    p = bench_sub.add_parser("consume", parents=[conn], help="read a stream as fast as possible")
    p.add_argument("stream")
    p.add_argument(
        "--from", dest="from_offset", type=non_negative, default=0, help="first offset (0)"
    )
    p.add_argument("--events", type=positive, default=None, help="stop after this many")
    p.add_argument(
        "--mode",
        choices=("read", "subscribe"),
        default="read",
        help="pull with ReadEvents (default) or take pushed events with credits",
    )
    p.add_argument("--max-bytes", type=positive, default=4 << 20, help="bytes per read")
    p.add_argument("--credits", type=credits, default=10_000, help="subscribe window")
    p.set_defaults(func=cmd_bench_consume)
