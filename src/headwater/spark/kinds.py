"""Reading an entity kind in Spark: its current state, or its state as of a tenant log
position (option ``asOf``), through the kind's SQL table.

A kind's table is ``(entity_id, version, fields...)`` (docs/protocols/convergedb.md); a
Spark read of a kind has one more column, ``deleted``, after ``version``, so batch and
streaming reads share one schema (Spark asks for it before it knows which the read is).
The read is split by a hash of the entity id, so each Spark partition holds disjoint entities
and each answer stays well under the wire's 16 MiB frame: every partition asks the server
for its share itself. With ``asOf`` every partition reads exactly that position; without
it, each reads the kind's state when it runs (as a JDBC read of a live table does).

A streaming read delivers the kind's changelog, the SQL table ``hw_changes_<kind>``
(``entity_id, version, deleted, fields...``): its offsets are tenant log positions
(``{"position": N}``), a micro-batch is the changes with ``start <= version < end``, and
``end`` is one past the kind's last change when the trigger fires. Compaction keeps only
each entity's last change in sealed segments, so a reader that falls far behind sees
fewer intermediate changes, never a wrong final state (deletions stay
``delete_retention_ms``).
"""

from __future__ import annotations

import decimal
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from headwater.client import Client
from headwater.engine.names import changes_table_name
from headwater.errors import TableNotFound, UsageError

from .options import ConnectionOptions, _positive, check_stream_name

# Without rowsPerPartition a share is this many values (rows x columns): its answer must
# fit the server's [limits] sql_result_mib (32 MiB counts about 300,000 values).
VALUES_PER_PARTITION = 200_000

# DuckDB column types of a kind table -> Spark SQL types.
_SPARK_TYPES = {
    "BOOLEAN": "BOOLEAN",
    "TINYINT": "TINYINT",
    "SMALLINT": "SMALLINT",
    "INTEGER": "INT",
    "BIGINT": "BIGINT",
    "UTINYINT": "SMALLINT",
    "USMALLINT": "INT",
    "UINTEGER": "BIGINT",
    "UBIGINT": "DECIMAL(20,0)",
    "FLOAT": "FLOAT",
    "DOUBLE": "DOUBLE",
    "VARCHAR": "STRING",
    "BLOB": "BINARY",
}


def spark_type(duckdb_type: str) -> str:
    if duckdb_type.startswith("TIMESTAMP"):
        return "TIMESTAMP"
    try:
        return _SPARK_TYPES[duckdb_type]
    except KeyError:
        raise UsageError(f"a kind column of type {duckdb_type} has no Spark type") from None


EARLIEST = "earliest"
LATEST = "latest"


def _position(lowered: Mapping[str, str], key: str, name: str) -> int | None:
    text = lowered.get(key)
    if text is None:
        return None
    try:
        position = int(text)
    except ValueError:
        raise UsageError(f"option {name} must be a log position, not {text!r}") from None
    if position < 0:
        raise UsageError(f"option {name} must be a log position >= 0, not {text!r}")
    return position


@dataclass(frozen=True)
class KindReadOptions:
    connection: ConnectionOptions
    kind: str
    as_of: int | None
    rows_per_partition: int | None  # None: VALUES_PER_PARTITION over the columns
    starting: int | str = EARLIEST  # streaming: a position, EARLIEST or LATEST

    @classmethod
    def parse(cls, lowered: Mapping[str, str]) -> KindReadOptions:
        """From options with lower-cased keys (``kind`` is among them)."""
        for clash in ("stream", "streams", "startingoffsets", "endingoffsets"):
            if clash in lowered:
                raise UsageError(f"option {clash} reads a stream: it does not go with kind")
        starting: int | str = lowered.get("startingposition", EARLIEST).strip().lower()
        if starting not in (EARLIEST, LATEST):
            position = _position(lowered, "startingposition", "startingPosition")
            assert position is not None
            starting = position
        return cls(
            connection=ConnectionOptions.parse(lowered),
            kind=check_stream_name(lowered["kind"], "kind"),
            as_of=_position(lowered, "asof", "asOf"),
            rows_per_partition=_positive(lowered, "rowsperpartition"),
            starting=starting,
        )

    @property
    def changes_table(self) -> str:
        return changes_table_name(self.kind)

    def query(self, client: Client, sql: str) -> list[tuple[Any, ...]]:
        try:
            if self.as_of is None:
                return client.query(sql).rows
            return client.query_at(sql, self.as_of).rows
        except TableNotFound:
            raise UsageError(f"kind {self.kind} does not exist on {client.address}") from None


def kind_columns(client: Client, options: KindReadOptions) -> list[tuple[str, str]]:
    """(name, Spark type) of every column of a kind read: its changes table's, batch and
    streaming alike (Spark asks for the schema before it knows which the read is)."""
    rows = options.query(client, f'DESCRIBE SELECT * FROM "{options.changes_table}"')
    return [(str(row[0]), spark_type(str(row[1]))) for row in rows]


def schema_ddl(columns: list[tuple[str, str]]) -> str:
    return ", ".join(f"`{name}` {kind}" for name, kind in columns)


def _rows_per_share(options: KindReadOptions, columns: int) -> int:
    if options.rows_per_partition is not None:
        return options.rows_per_partition
    return max(1, VALUES_PER_PARTITION // max(1, columns))


def partition_count(client: Client, options: KindReadOptions, columns: int) -> int:
    [(count,)] = options.query(client, f'SELECT count(*) FROM "{options.kind}"')
    return max(1, math.ceil(int(str(count)) / _rows_per_share(options, columns)))


def read_share(
    client: Client, options: KindReadOptions, schema: pa.Schema, index: int, parts: int
) -> Iterator[pa.RecordBatch]:
    """The entities whose id hashes to ``index`` of ``parts``, as one record batch: the
    kind table's rows with ``deleted`` false (the third column of the changes schema)."""
    where = "" if parts == 1 else f" WHERE hash(entity_id) % {parts} = {index}"
    rows = options.query(client, f'SELECT * FROM "{options.kind}"{where}')
    yield from _rows_batch([(*row[:2], False, *row[2:]) for row in rows], schema)


def changes_end(client: Client, options: KindReadOptions) -> int:
    """One past the kind's last change: every change below it is committed and readable."""
    [(end,)] = options.query(
        client, f'SELECT coalesce(max(version) + 1, 0) FROM "{options.changes_table}"'
    )
    return int(str(end))


def changes_partition_count(
    client: Client, options: KindReadOptions, columns: int, start: int, end: int
) -> int:
    [(count,)] = options.query(
        client,
        f'SELECT count(*) FROM "{options.changes_table}" WHERE version >= {start} '
        f"AND version < {end}",
    )
    return max(1, math.ceil(int(str(count)) / _rows_per_share(options, columns)))


def read_changes(
    client: Client,
    options: KindReadOptions,
    schema: pa.Schema,
    span: tuple[int, int],
    index: int,
    parts: int,
) -> Iterator[pa.RecordBatch]:
    """The changes with ``start <= version < end`` of entities hashing to ``index`` of
    ``parts``, in log order."""
    start, end = span
    where = f"version >= {start} AND version < {end}"
    if parts > 1:
        where += f" AND hash(entity_id) % {parts} = {index}"
    sql = f'SELECT * FROM "{options.changes_table}" WHERE {where} ORDER BY version'
    yield from _rows_batch(options.query(client, sql), schema)


def _rows_batch(rows: list[tuple[Any, ...]], schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    if not rows:
        return
    columns = list(zip(*rows, strict=True))
    arrays = [
        pa.array([_convert(v, field.type) for v in column], type=field.type)
        for column, field in zip(columns, schema, strict=True)
    ]
    yield pa.RecordBatch.from_arrays(arrays, schema=schema)


def _convert(value: Any, arrow_type: pa.DataType) -> Any:
    """A query value (SQL types the wire has no value for arrive as text) as Arrow takes
    it for ``arrow_type``."""
    if value is None:
        return None
    return _converter(arrow_type)(value)


def _converter(arrow_type: pa.DataType) -> Callable[[Any], Any]:
    if pa.types.is_binary(arrow_type):
        return bytes.fromhex
    if pa.types.is_floating(arrow_type):
        return float
    if pa.types.is_decimal(arrow_type):
        return lambda v: decimal.Decimal(str(v))
    if pa.types.is_timestamp(arrow_type):
        return lambda v: v.ns // 1000  # Spark's timestamps are microseconds
    if pa.types.is_integer(arrow_type):
        return int
    return lambda v: v
