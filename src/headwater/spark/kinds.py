"""Reading an entity kind in Spark: its current state, or its state as of a tenant log
position (option ``asOf``), through the kind's SQL table.

A kind's table is ``(entity_id, version, fields...)`` (docs/protocols/convergedb.md). The
read is split by a hash of the entity id, so each Spark partition holds disjoint entities
and each answer stays well under the wire's 16 MiB frame: every partition asks the server
for its share itself. With ``asOf`` every partition reads exactly that position; without
it, each reads the kind's state when it runs (as a JDBC read of a live table does).
"""

from __future__ import annotations

import decimal
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from headwater.client import Client
from headwater.errors import TableNotFound, UsageError

from .options import ConnectionOptions, _positive, check_stream_name

DEFAULT_ROWS_PER_PARTITION = 20_000

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


@dataclass(frozen=True)
class KindReadOptions:
    connection: ConnectionOptions
    kind: str
    as_of: int | None
    rows_per_partition: int

    @classmethod
    def parse(cls, lowered: Mapping[str, str]) -> KindReadOptions:
        """From options with lower-cased keys (``kind`` is among them)."""
        for clash in ("stream", "streams", "startingoffsets", "endingoffsets"):
            if clash in lowered:
                raise UsageError(f"option {clash} reads a stream: it does not go with kind")
        as_of = lowered.get("asof")
        position: int | None = None
        if as_of is not None:
            try:
                position = int(as_of)
            except ValueError:
                raise UsageError(f"option asOf must be a log position, not {as_of!r}") from None
            if position < 0:
                raise UsageError(f"option asOf must be a log position >= 0, not {as_of!r}")
        return cls(
            connection=ConnectionOptions.parse(lowered),
            kind=check_stream_name(lowered["kind"], "kind"),
            as_of=position,
            rows_per_partition=_positive(lowered, "rowsperpartition") or DEFAULT_ROWS_PER_PARTITION,
        )

    def query(self, client: Client, sql: str) -> list[tuple[Any, ...]]:
        try:
            if self.as_of is None:
                return client.query(sql).rows
            return client.query_at(sql, self.as_of).rows
        except TableNotFound:
            raise UsageError(f"kind {self.kind} does not exist on {client.address}") from None


def kind_columns(client: Client, options: KindReadOptions) -> list[tuple[str, str]]:
    """(name, Spark type) of every column of the kind's table."""
    rows = options.query(client, f'DESCRIBE SELECT * FROM "{options.kind}"')
    return [(str(row[0]), spark_type(str(row[1]))) for row in rows]


def schema_ddl(columns: list[tuple[str, str]]) -> str:
    return ", ".join(f"`{name}` {kind}" for name, kind in columns)


def partition_count(client: Client, options: KindReadOptions) -> int:
    [(count,)] = options.query(client, f'SELECT count(*) FROM "{options.kind}"')
    return max(1, math.ceil(int(str(count)) / options.rows_per_partition))


def read_share(
    client: Client, options: KindReadOptions, schema: pa.Schema, index: int, parts: int
) -> Iterator[pa.RecordBatch]:
    """The entities whose id hashes to ``index`` of ``parts``, as one record batch."""
    where = "" if parts == 1 else f" WHERE hash(entity_id) % {parts} = {index}"
    rows = options.query(client, f'SELECT * FROM "{options.kind}"{where}')
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
