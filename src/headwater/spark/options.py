"""Options of the ``headwater`` Spark format, parsed without Spark.

Offsets follow Spark's Kafka source: ``earliest``, ``latest`` or JSON such as
``{"trades": {"0": 10, "1": 4}}`` (stream, then partition) where -2 means earliest and -1
latest. Offsets that Spark checkpoints are plain JSON with streams in name order and
partitions in number order, because Spark compares offsets as JSON text.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from headwater.client.aio import DEFAULT_SERVER, parse_server
from headwater.engine import names as name_rules
from headwater.errors import InvalidRequest, UsageError

EARLIEST = -2
LATEST = -1
READ_COMMITTED = "read_committed"
READ_UNCOMMITTED = "read_uncommitted"
ISOLATION_LEVELS = (READ_COMMITTED, READ_UNCOMMITTED)
VALUE_FORMATS = ("raw", "json", "csv")

# Columns of a read, as Spark's Kafka source has them plus the tenant log position.
METADATA_DDL = (
    "stream STRING, partition INT, offset BIGINT, timestamp TIMESTAMP, timestampType INT, "
    "position BIGINT"
)
HEADERS_DDL = "headers ARRAY<STRUCT<key: STRING, value: BINARY>>"
DEFAULT_SPLIT = 1_000_000  # offsets per Spark partition before a range is split


class DataLossError(RuntimeError):
    """Offsets a query needed were removed by retention and failOnDataLoss is true."""


def _bool(options: Mapping[str, str], name: str, default: bool) -> bool:
    text = options.get(name)
    if text is None:
        return default
    lowered = str(text).strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise UsageError(f"option {name} must be true or false, not {text!r}")


def _positive(options: Mapping[str, str], name: str) -> int | None:
    text = options.get(name)
    if text is None:
        return None
    try:
        value = int(str(text))
    except ValueError:
        raise UsageError(f"option {name} must be a positive integer, not {text!r}") from None
    if value <= 0:
        raise UsageError(f"option {name} must be a positive integer, not {text!r}")
    return value


def check_stream_name(name: str, what: str = "stream") -> str:
    """``name`` when it is a valid stream (or kind) name (engine/names.py: a stream's
    may hold '.' and '-'); it is quoted into SQL as is (neither may hold a quote)."""
    check = name_rules.check_stream_name if what == "stream" else name_rules.check_name
    try:
        check(name, internal=True)
    except InvalidRequest as exc:
        raise UsageError(f"{what}: {exc.message}") from None
    return name


@dataclass(frozen=True)
class ConnectionOptions:
    """``server``, ``token``, ``tenant``, and TLS: ``tls`` (true: verify the server
    against the system's CAs), ``caFile`` (a CA file, implies TLS), ``certFile`` and
    ``keyFile`` (a client certificate for mutual TLS). The files are read where a task
    connects: on every executor."""

    server: str = DEFAULT_SERVER
    token: str | None = None
    tenant: int = 0
    tls: bool = False
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def tls_options(self) -> dict[str, Any]:
        """The SDK clients' and the Ripple worker's TLS keyword arguments."""
        return {"tls": self.tls, "ca": self.ca_file, "cert": self.cert_file, "key": self.key_file}

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> ConnectionOptions:
        server = str(options.get("server", DEFAULT_SERVER))
        try:
            parse_server(server)
        except Exception as exc:
            raise UsageError(f"option server: {exc}") from None
        tenant_text = options.get("tenant", "0")
        try:
            tenant = int(str(tenant_text))
        except ValueError:
            raise UsageError(f"option tenant must be an integer, not {tenant_text!r}") from None
        token = options.get("token")
        # Keys as parse() gets them: lower-cased (Spark lower-cases them on some paths).
        cert_file, key_file = options.get("certfile"), options.get("keyfile")
        if key_file and not cert_file:
            raise UsageError("option keyFile is the key of certFile: set certFile too")
        return cls(
            server,
            str(token) if token else None,
            tenant,
            tls=_bool(options, "tls", False),
            ca_file=options.get("cafile") or None,
            cert_file=cert_file or None,
            key_file=key_file or None,
        )


@dataclass(frozen=True)
class OffsetSpec:
    """Where reading starts (or ends) in each partition of one stream: the offset named
    for a partition, else ``default`` (EARLIEST or LATEST). A partition the stream does
    not have is refused when the read is planned (:meth:`check`)."""

    default: int
    partitions: Mapping[int, int] = field(default_factory=dict)

    def at(self, partition: int) -> int:
        return self.partitions.get(partition, self.default)

    def check(self, stream: str, partitions: int, name: str) -> None:
        missing = sorted(p for p in self.partitions if p >= partitions)
        if missing:
            raise UsageError(
                f"option {name} names partition {missing[0]} of stream {stream}, which has "
                f"{partitions} (0..{partitions - 1})"
            )


def parse_offsets(
    text: str | None, streams: list[str], name: str, default: int
) -> dict[str, OffsetSpec]:
    """``earliest``/``latest``/Kafka JSON -> {stream: OffsetSpec}; a partition the JSON
    does not name gets ``default``."""
    if text is None:
        return {s: OffsetSpec(default) for s in streams}
    stripped = str(text).strip()
    if stripped == "earliest":
        return {s: OffsetSpec(EARLIEST) for s in streams}
    if stripped == "latest":
        return {s: OffsetSpec(LATEST) for s in streams}
    try:
        data = json.loads(stripped)
    except ValueError:
        raise UsageError(
            f"option {name} must be earliest, latest or JSON like "
            f'{{"{streams[0]}": {{"0": 10, "1": -2}}}}, not {text!r}'
        ) from None
    if not isinstance(data, dict):
        raise UsageError(f"option {name}: JSON must be an object of streams, not {text!r}")
    unknown = sorted(set(data) - set(streams))
    if unknown:
        raise UsageError(f"option {name} names streams that are not read: {', '.join(unknown)}")
    result = {s: OffsetSpec(default) for s in streams}
    for stream, partitions in data.items():
        if not isinstance(partitions, dict):
            raise UsageError(f'option {name}: {stream} needs partitions, e.g. {{"0": 10}}')
        named: dict[int, int] = {}
        for partition, offset in partitions.items():
            if not (isinstance(partition, str) and partition.isdigit()):
                raise UsageError(
                    f'option {name}: partitions of {stream} are numbers like "0", not {partition!r}'
                )
            if not isinstance(offset, int) or isinstance(offset, bool) or offset < EARLIEST:
                raise UsageError(
                    f"option {name}: offset of {stream} partition {partition} must be an "
                    f"integer >= -2, not {offset!r}"
                )
            named[int(partition)] = offset
        result[stream] = OffsetSpec(default, named)
    return result


@dataclass(frozen=True)
class ReadOptions:
    connection: ConnectionOptions
    streams: tuple[str, ...]
    starting: dict[str, OffsetSpec]
    ending: dict[str, OffsetSpec]
    max_offsets_per_trigger: int | None
    fail_on_data_loss: bool
    include_headers: bool
    value_format: str
    value_schema: str | None
    split: int
    isolation: str = READ_COMMITTED

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> ReadOptions:
        # Spark lower-cases option keys on some paths: accept any case.
        lowered = {str(k).lower(): str(v) for k, v in options.items()}
        one, many = lowered.get("stream"), lowered.get("streams")
        if (one is None) == (many is None):
            raise UsageError("set exactly one of the options stream or streams")
        names = [one] if one is not None else [s.strip() for s in str(many).split(",")]
        streams = sorted({check_stream_name(s) for s in names if s})
        if not streams:
            raise UsageError("option streams names no stream")
        value_format = lowered.get("valueformat", "raw").lower()
        if value_format not in VALUE_FORMATS:
            raise UsageError(f"option valueFormat must be one of {', '.join(VALUE_FORMATS)}")
        value_schema = lowered.get("schema")
        if value_format != "raw" and not value_schema:
            raise UsageError(f"valueFormat {value_format} needs a schema option (Spark DDL)")
        ending = parse_offsets(lowered.get("endingoffsets"), streams, "endingOffsets", LATEST)
        if any(
            spec.default == EARLIEST or EARLIEST in spec.partitions.values()
            for spec in ending.values()
        ):
            raise UsageError("option endingOffsets cannot be earliest (-2)")
        isolation = lowered.get("isolation", READ_COMMITTED).strip().lower()
        if isolation not in ISOLATION_LEVELS:
            raise UsageError(
                f"option isolation must be {READ_COMMITTED} or {READ_UNCOMMITTED}, "
                f"not {lowered['isolation']!r}"
            )
        return cls(
            connection=ConnectionOptions.parse(lowered),
            streams=tuple(streams),
            starting=parse_offsets(
                lowered.get("startingoffsets"), streams, "startingOffsets", EARLIEST
            ),
            ending=ending,
            max_offsets_per_trigger=_positive(lowered, "maxoffsetspertrigger"),
            fail_on_data_loss=_bool(lowered, "failondataloss", True),
            include_headers=_bool(lowered, "includeheaders", False),
            value_format=value_format,
            value_schema=value_schema,
            split=_positive(lowered, "maxoffsetsperpartition") or DEFAULT_SPLIT,
            isolation=isolation,
        )

    def schema_ddl(self) -> str:
        parts = []
        if self.value_format == "raw":
            parts.append("key BINARY, value BINARY")
        else:
            parts.append(f"{self.value_schema}, key BINARY")
        parts.append(METADATA_DDL)
        if self.include_headers:
            parts.append(HEADERS_DDL)
        return ", ".join(parts)


@dataclass(frozen=True)
class WriteOptions:
    connection: ConnectionOptions
    stream: str
    create: bool

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> WriteOptions:
        lowered = {str(k).lower(): str(v) for k, v in options.items()}
        stream = lowered.get("stream")
        if stream is None:
            raise UsageError("writing needs the option stream")
        return cls(
            connection=ConnectionOptions.parse(lowered),
            stream=check_stream_name(stream),
            create=_bool(lowered, "createstream", True),
        )


Offsets = dict[str, dict[int, int]]  # stream -> partition -> offset


def offsets_json(offsets: Mapping[str, Mapping[int, int]]) -> dict[str, dict[str, int]]:
    """Spark offset dict with a stable key order (Spark compares offsets as JSON text):
    streams by name, partitions by number."""
    return {
        stream: {str(p): int(offsets[stream][p]) for p in sorted(offsets[stream])}
        for stream in sorted(offsets)
    }


def offsets_from_json(data: Mapping[str, object]) -> Offsets:
    result: Offsets = {}
    for stream, partitions in data.items():
        if not isinstance(partitions, dict) or not all(
            isinstance(p, str) and p.isdigit() for p in partitions
        ):
            raise UsageError(
                f"checkpointed offset of {stream} is not {{partition: offset}}: {partitions!r}"
            )
        result[stream] = {int(p): int(o) for p, o in partitions.items()}
    return result


_K = TypeVar("_K", bound=Hashable)


def limit_offsets(
    start: Mapping[_K, int], latest: Mapping[_K, int], max_rows: int | None
) -> dict[_K, int]:
    """Admission control: at most ``max_rows`` offsets past ``start`` in all, shared out in
    proportion to what each (stream, partition) has waiting (like Kafka's
    maxOffsetsPerTrigger)."""
    ends = {k: max(latest[k], start.get(k, 0)) for k in latest}
    if max_rows is None:
        return ends
    waiting = {k: ends[k] - start.get(k, 0) for k in ends}
    total = sum(waiting.values())
    if total <= max_rows:
        return ends
    result: dict[_K, int] = {}
    left = max_rows
    order = sorted(ends, key=repr)
    for key in order:
        share = min(waiting[key], waiting[key] * max_rows // total)
        result[key] = start.get(key, 0) + share
        left -= share
    for key in order:  # hand out what rounding down kept back, in key order
        extra = min(left, ends[key] - result[key])
        result[key] += extra
        left -= extra
    return result


def split_range(start: int, end: int, size: int) -> list[tuple[int, int]]:
    if end <= start:
        return []
    return [(a, min(a + size, end)) for a in range(start, end, size)]


def producer_id(*parts: object) -> int:
    """A stable u64 producer id for an idempotent writer (same inputs, same id, on any
    machine: no Python hash randomisation)."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")
