"""Writing rows into an entity kind from Spark: each row becomes a Ripple delta.

A row is a Set of every value column by default, a Patch of the ``patchColumns`` when
that option lists some, and a Remove where the ``deleted`` column is true. Every Spark
task is one Ripple worker (spec/PROTOCOLS.md §4) whose id and sequence numbers are
derived from what Spark keeps across retries and restarts, so a rerun sends the very
same (worker, sequence) pairs and the server drops what it already applied:

* batch writes: worker ``spark/<kind>/<partition>``, sequence = the job's start (ms since
  2025, stamped once on the driver) * 2**21 + row index + 1: every attempt of a task
  sends the same numbers, and a later job numbers past any earlier one;
* streaming writes: worker ``spark/<kind>/<query id>/<partition>`` (the query id is kept
  in the checkpoint), sequence = batch id * 2**32 + row index + 1.

Each worker holds a source slot in the tenant's kinds, as every Ripple worker does: a
Remove clears what the same worker set, so rows of one key must come from the same
partition (partition the DataFrame by the key, with a stable partition count, as a
grouped aggregation does), and at most 64 sources write a tenant's kinds at once. A task
checkpoints (the server answers once every delta is durable and visible) before it
reports success. What a worker wrote stays while it comes back within its liveness
deadline (``[ripple] liveness_ms``, docs/operations.md): a streaming query's next batch
does; raise the deadline to keep what a batch job wrote after it ends.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa

from headwater.client.aio import parse_server
from headwater.errors import UsageError
from headwater.protocols.kimberlite.messages import ripple_port
from headwater.protocols.ripple import messages as rm
from headwater.ripple import Worker, WorkerError

from .options import ConnectionOptions, check_stream_name

RIPPLE_PORT = 7403
MAX_SOURCES = 64  # source slots of a tenant's kinds (spec/PROTOCOLS.md §4)
ROWS_PER_BATCH = 1 << 32  # sequence numbers a streaming batch's task may use
ROWS_PER_MS = 1 << 21  # sequence numbers per millisecond of a batch job's start
EPOCH_2025_MS = 1_735_689_600_000


def batch_job_sequence(now_ms: int) -> int:
    """The first sequence number of a batch job started at ``now_ms`` (Unix ms)."""
    return (now_ms - EPOCH_2025_MS) * ROWS_PER_MS + 1


DELETED_COLUMN = "deleted"

# Arrow types of value columns -> Ripple field types (kinds: string, i64, f64, bool).
_RIPPLE_TYPES: list[tuple[Any, rm.FieldType]] = [
    (pa.types.is_string, rm.FieldType.STRING),
    (pa.types.is_large_string, rm.FieldType.STRING),
    (pa.types.is_boolean, rm.FieldType.BOOL),
    (pa.types.is_integer, rm.FieldType.INT64),
    (pa.types.is_floating, rm.FieldType.FLOAT),
]


@dataclass(frozen=True)
class KindWriteOptions:
    connection: ConnectionOptions
    kind: str
    ripple_server: str | None  # None until found (see with_ripple_server)
    key_column: str
    patch_columns: tuple[str, ...]

    @classmethod
    def parse(cls, lowered: Mapping[str, str]) -> KindWriteOptions:
        """From options with lower-cased keys (``kind`` is among them)."""
        if "stream" in lowered:
            raise UsageError("options stream and kind both name a target: give one")
        connection = ConnectionOptions.parse(lowered)
        ripple = lowered.get("rippleserver")
        if ripple is not None:
            try:
                parse_server(ripple, RIPPLE_PORT)
            except Exception as exc:
                raise UsageError(f"option rippleServer: {exc}") from None
        patch = tuple(c.strip() for c in lowered.get("patchcolumns", "").split(",") if c.strip())
        return cls(
            connection=connection,
            kind=check_stream_name(lowered["kind"], "kind"),
            ripple_server=ripple,
            key_column=lowered.get("key", "key"),
            patch_columns=patch,
        )

    def with_ripple_server(self, capabilities: Sequence[str]) -> KindWriteOptions:
        """Where the tasks send deltas: option rippleServer, else the port the Kimberlite
        Handshake advertises (``ripple:<port>``) on the ``server`` host, else that host on
        the default port 7403 (a server too old to advertise it)."""
        if self.ripple_server is not None:
            return self
        host, _ = parse_server(self.connection.server)
        port = ripple_port(capabilities)
        return replace(self, ripple_server=f"{host}:{port or RIPPLE_PORT}")

    def value_columns(self, schema: pa.Schema) -> list[str]:
        return [n for n in schema.names if n not in (self.key_column, DELETED_COLUMN)]

    def ripple_schema(self, schema: pa.Schema) -> rm.Schema:
        """The Ripple schema of the kind's fields (every value column, in order); raises
        UsageError for a missing key column or a column no kind field can hold."""
        names = schema.names
        if self.key_column not in names:
            raise UsageError(
                f"writing kind {self.kind} needs a key column {self.key_column!r} "
                f"(option key), the columns are {names}"
            )
        if DELETED_COLUMN in names and not pa.types.is_boolean(schema.field(DELETED_COLUMN).type):
            raise UsageError(f"column {DELETED_COLUMN!r} must be boolean")
        unknown = [c for c in self.patch_columns if c not in names]
        if unknown:
            raise UsageError(f"patchColumns {unknown} are not columns of the DataFrame {names}")
        fields = []
        for name in self.value_columns(schema):
            arrow_type = schema.field(name).type
            ripple_type = next((t for test, t in _RIPPLE_TYPES if test(arrow_type)), None)
            if ripple_type is None:
                raise UsageError(
                    f"column {name} of type {arrow_type} cannot be a kind field: kinds written "
                    "from Spark take strings, integers, floating point numbers and booleans"
                )
            fields.append(rm.Field(name, ripple_type))
        if not fields:
            raise UsageError(f"writing kind {self.kind} needs at least one value column")
        return rm.Schema(self.kind, 1, tuple(fields))


@dataclass(frozen=True)
class KindWriteResult:
    rows: int
    sets: int
    patches: int
    removes: int


def _connect(worker_id: str, options: KindWriteOptions, schema: rm.Schema) -> Worker:
    try:
        connection = options.connection
        # The token and tenant go in the Handshake's auth extension; a connection that
        # names neither sends the contract's plain Handshake.
        tenant = None if connection.token is None and connection.tenant == 0 else connection.tenant
        return Worker(
            worker_id,
            {options.kind: schema},
            str(options.ripple_server),
            token=connection.token,
            tenant=tenant,
            **connection.tls_options(),
        )
    except (OSError, WorkerError) as exc:
        if isinstance(exc, WorkerError) and "source slots" in str(exc):
            raise UsageError(
                f"writing kind {options.kind}: worker {worker_id} got no source slot ({exc}). "
                f"Each Spark partition writing kinds is a Ripple source, and a tenant's kinds "
                f"take at most {MAX_SOURCES} at once (with ConvergeDB writers and sources gone "
                "for less than their liveness deadline): write from fewer partitions, e.g. "
                "df.repartition(8, key) or a pipeline kind sink's partitions:"
            ) from None
        if isinstance(exc, WorkerError) and "refused" in str(exc):
            raise  # the server answered: its reason says what is wrong
        raise UsageError(
            f"writing kind {options.kind}: cannot reach the Ripple listener at "
            f"{options.ripple_server} ({exc}); set option rippleServer to the server's "
            "[listen] ripple address"
        ) from None


def write_rows(
    options: KindWriteOptions,
    batches: Iterator[pa.RecordBatch],
    worker_id: str,
    first_sequence: int,
) -> KindWriteResult:
    """Send every row of ``batches`` as one delta, numbered from ``first_sequence``, then
    checkpoint: once this returns, every row is durable and visible in the kind."""
    if options.ripple_server is None:
        raise UsageError("the kind writer was planned without a Ripple server")
    worker: Worker | None = None
    sequence = first_sequence
    sets = patches = removes = 0
    try:
        for batch in batches:
            if worker is None:
                schema = options.ripple_schema(batch.schema)
                worker = _connect(worker_id, options, schema)
            values = options.value_columns(batch.schema)
            for row in batch.to_pylist():
                key = row[options.key_column]
                if key is None:
                    raise UsageError(f"a row of kind {options.kind} has no key: {row}")
                text_key = key if isinstance(key, str) else str(key)
                if row.get(DELETED_COLUMN):
                    worker.remove(options.kind, text_key, sequence_no=sequence)
                    removes += 1
                elif options.patch_columns:
                    fields = {c: row[c] for c in options.patch_columns if row[c] is not None}
                    worker.patch(options.kind, text_key, sequence_no=sequence, **fields)
                    patches += 1
                else:
                    record = {c: row[c] for c in values}
                    missing = [c for c, v in record.items() if v is None]
                    if missing:
                        raise UsageError(
                            f"row {text_key!r} of kind {options.kind}: {missing} are null; a "
                            "Set needs every field (use patchColumns to change some)"
                        )
                    worker.set(options.kind, text_key, record, sequence_no=sequence)
                    sets += 1
                sequence += 1
        if worker is not None:
            worker.checkpoint()
    finally:
        if worker is not None:
            worker.close()
    return KindWriteResult(sequence - first_sequence, sets, patches, removes)
