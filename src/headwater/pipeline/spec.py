"""Reading and checking a pipeline file, without Spark.

Everything that can be wrong with a pipeline file is reported here, before a
SparkSession (seconds to start) exists: YAML syntax, unknown keys, names that refer to
nothing, streams the server does not have, and column types where the file declares them.

Source and sink types are looked up in :data:`SOURCE_TYPES` / :data:`SINK_TYPES`; a new
type adds an entry there and a builder in :mod:`.runner`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from headwater.errors import UsageError
from headwater.spark.options import ConnectionOptions, check_stream_name


class PipelineError(ValueError):
    """The pipeline file is wrong; the message says where."""


# Columns of a stream source without a valueFormat (Spark's Kafka source plus position).
STREAM_COLUMNS = {
    "key": "BINARY",
    "value": "BINARY",
    "stream": "STRING",
    "partition": "INT",
    "offset": "BIGINT",
    "timestamp": "TIMESTAMP",
    "timestampType": "INT",
    "position": "BIGINT",
}
_TYPE_ALIASES = {"LONG": "BIGINT", "INTEGER": "INT", "SHORT": "SMALLINT", "BYTE": "TINYINT"}
Columns = dict[str, str] | None  # name -> Spark SQL type; None when not known statically
# (connection, kind) -> the columns of a streaming read of the kind (its changelog).
KindColumns = Callable[[ConnectionOptions, str], dict[str, str]]


def parse_ddl(text: str, where: str) -> dict[str, str]:
    """Top-level ``name TYPE, ...`` of a Spark DDL schema (nested types kept as text)."""
    columns: dict[str, str] = {}
    depth = 0
    part: list[str] = []
    parts: list[str] = []
    for ch in text:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(part))
            part = []
        else:
            part.append(ch)
    parts.append("".join(part))
    for item in parts:
        words = item.strip().split(None, 1)
        if len(words) != 2:
            raise PipelineError(f"{where}: schema entry {item.strip()!r} is not 'name TYPE'")
        name = words[0].strip("`")
        sql_type = words[1].strip().upper()
        base = re.split(r"[<(\s]", sql_type, maxsplit=1)[0]
        columns[name] = _TYPE_ALIASES.get(base, base) + sql_type[len(base) :]
    return columns


def _expect(data: Mapping[str, Any], where: str, allowed: set[str], required: set[str]) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise PipelineError(
            f"{where}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(allowed))})"
        )
    missing = sorted(required - set(data))
    if missing:
        raise PipelineError(f"{where}: missing {', '.join(missing)}")


def _str(data: Mapping[str, Any], key: str, where: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise PipelineError(f"{where}: {key} must be a non-empty string")
    return value


def _options(data: Mapping[str, Any], where: str) -> dict[str, str]:
    raw = data.get("options", {})
    if not isinstance(raw, dict):
        raise PipelineError(f"{where}: options must be a mapping")
    return {str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in raw.items()}


@dataclass
class SourceSpec:
    name: str
    type: str
    settings: dict[str, Any]
    options: dict[str, str]
    columns: Columns


@dataclass
class TransformSpec:
    name: str
    type: str
    input: str
    settings: Any
    columns: Columns


@dataclass
class SinkSpec:
    name: str
    type: str
    input: str
    settings: dict[str, Any]  # data source options the sink's type derives from the file
    options: dict[str, str]
    partitions: int | None = None  # kind sinks: Spark partitions (Ripple workers) writing


@dataclass
class PipelineSpec:
    name: str
    connection: ConnectionOptions
    sources: list[SourceSpec]
    transforms: list[TransformSpec]
    sinks: list[SinkSpec]
    checkpoint: Path
    trigger: dict[str, Any]
    output_mode: str = "append"
    spark_conf: dict[str, str] = field(default_factory=dict)
    views: dict[str, Columns] = field(default_factory=dict)

    def streams_read(self) -> list[str]:
        return [s.settings["stream"] for s in self.sources if s.type == "stream"]


# ---- sources ---------------------------------------------------------------------------


def _stream_source(name: str, data: Mapping[str, Any], where: str) -> SourceSpec:
    _expect(data, where, {"name", "type", "stream", "format", "schema", "options"}, {"stream"})
    stream = _str(data, "stream", where)
    try:
        check_stream_name(stream)
    except UsageError as exc:
        raise PipelineError(f"{where}: {exc}") from None
    fmt = str(data.get("format", "raw"))
    if fmt not in ("raw", "json", "csv"):
        raise PipelineError(f"{where}: format must be raw, json or csv, not {fmt!r}")
    columns: dict[str, str] = dict(STREAM_COLUMNS)
    if fmt != "raw":
        schema = _str(data, "schema", where)
        declared = parse_ddl(schema, where)
        del columns["value"]
        clash = sorted(set(declared) & set(columns))
        if clash:
            raise PipelineError(f"{where}: schema columns {', '.join(clash)} clash with metadata")
        columns = {**declared, **columns}
    settings = {"stream": stream, "format": fmt, "schema": data.get("schema")}
    return SourceSpec(name, "stream", settings, _options(data, where), columns)


def _file_source(kind: str) -> Callable[[str, Mapping[str, Any], str], SourceSpec]:
    def build(name: str, data: Mapping[str, Any], where: str) -> SourceSpec:
        required = {"path"} if kind == "parquet" else {"path", "schema"}
        _expect(data, where, {"name", "type", "path", "schema", "options"}, required)
        path = _str(data, "path", where)
        schema = data.get("schema")
        columns = parse_ddl(str(schema), where) if schema else None
        settings = {"path": path, "schema": schema}
        return SourceSpec(name, kind, settings, _options(data, where), columns)

    return build


def _kind_source(name: str, data: Mapping[str, Any], where: str) -> SourceSpec:
    _expect(data, where, {"name", "type", "kind", "options"}, {"kind"})
    kind = _str(data, "kind", where)
    try:
        check_stream_name(kind, "kind")
    except UsageError as exc:
        raise PipelineError(f"{where}: {exc}") from None
    # The columns come from the server (see parse_pipeline's kind_columns).
    return SourceSpec(name, "kind", {"kind": kind}, _options(data, where), None)


SOURCE_TYPES: dict[str, Callable[[str, Mapping[str, Any], str], SourceSpec]] = {
    "stream": _stream_source,
    "kind": _kind_source,
    "csv": _file_source("csv"),
    "json": _file_source("json"),
    "parquet": _file_source("parquet"),
}

# ---- transforms ------------------------------------------------------------------------

TRANSFORM_TYPES = ("sql", "filter", "select", "mask", "window")
TIME_TYPES = ("TIMESTAMP", "TIMESTAMP_NTZ")


def _transform(
    index: int, data: Mapping[str, Any], previous: str, views: dict[str, Columns]
) -> TransformSpec:
    where = f"transforms[{index}]"
    if not isinstance(data, dict):
        raise PipelineError(f"{where}: must be a mapping")
    kinds = [k for k in TRANSFORM_TYPES if k in data]
    if len(kinds) != 1:
        raise PipelineError(f"{where}: needs exactly one of {', '.join(TRANSFORM_TYPES)}")
    kind = kinds[0]
    _expect(data, where, {kind, "name", "input"}, set())
    name = str(data.get("name", f"step{index}"))
    source = str(data.get("input", previous))
    if kind != "sql" and source not in views:
        raise PipelineError(f"{where}: input {source!r} is not a source or earlier transform")
    columns = views.get(source)
    settings = data[kind]
    out: Columns = None
    if kind == "sql":
        if not isinstance(settings, str):
            raise PipelineError(f"{where}: sql must be a query string")
    elif kind == "filter":
        if not isinstance(settings, str):
            raise PipelineError(f"{where}: filter must be a SQL condition string")
        out = columns
    elif kind == "select":
        if isinstance(settings, list):
            settings = {str(c): str(c) for c in settings}
        if not isinstance(settings, dict) or not settings:
            raise PipelineError(f"{where}: select must be a list of columns or a mapping")
        settings = {str(k): str(v) for k, v in settings.items()}
        _known(columns, settings, where)
        out = None if columns is None else {v: columns[k] for k, v in settings.items()}
    elif kind == "mask":
        if isinstance(settings, str):
            settings = [settings]
        if not isinstance(settings, list) or not settings:
            raise PipelineError(f"{where}: mask must list the fields to mask")
        settings = [str(c) for c in settings]
        _known(columns, settings, where)
        out = (
            None
            if columns is None
            else {c: ("STRING" if c in settings else t) for c, t in columns.items()}
        )
    else:
        settings, out = _window(settings, columns, where)
    return TransformSpec(name, kind, source, settings, out)


def _known(columns: Columns, names: Any, where: str) -> None:
    if columns is None:
        return
    unknown = [c for c in names if c not in columns]
    if unknown:
        raise PipelineError(
            f"{where}: unknown column(s) {', '.join(unknown)} (columns: {', '.join(columns)})"
        )


def _window(data: Any, columns: Columns, where: str) -> tuple[dict[str, Any], Columns]:
    if not isinstance(data, dict):
        raise PipelineError(f"{where}: window must be a mapping")
    allowed = {"time", "duration", "slide", "watermark", "group_by", "aggregations"}
    _expect(data, where + ".window", allowed, {"time", "duration", "watermark", "aggregations"})
    time_col = str(data["time"])
    group_by = [str(c) for c in data.get("group_by", [])]
    _known(columns, [time_col, *group_by], where)
    if columns is not None and columns[time_col] not in TIME_TYPES:
        raise PipelineError(
            f"{where}: window time column {time_col} is {columns[time_col]}, not TIMESTAMP "
            "(convert it first, e.g. with a sql step: timestamp_micros(ts_ns DIV 1000))"
        )
    aggs = data["aggregations"]
    if not isinstance(aggs, dict) or not aggs:
        raise PipelineError(f"{where}: aggregations must map output names to SQL expressions")
    settings = {
        "time": time_col,
        "duration": str(data["duration"]),
        "slide": str(data["slide"]) if "slide" in data else None,
        "watermark": str(data["watermark"]),
        "group_by": group_by,
        "aggregations": {str(k): str(v) for k, v in aggs.items()},
    }
    out: Columns = None
    if columns is not None:
        out = {"window_start": "TIMESTAMP", "window_end": "TIMESTAMP"}
        out.update({c: columns[c] for c in group_by})
        out.update(dict.fromkeys(aggs, "UNKNOWN"))
    return settings, out


# ---- sinks -----------------------------------------------------------------------------


def _stream_sink(data: Mapping[str, Any], where: str, columns: Columns) -> dict[str, Any]:
    _expect(data, where, {"name", "type", "input", "stream", "options"}, {"stream"})
    stream = _str(data, "stream", where)
    try:
        check_stream_name(stream)
    except UsageError as exc:
        raise PipelineError(f"{where}: {exc}") from None
    if columns is not None:
        if "value" not in columns:
            raise PipelineError(
                f"{where}: a stream sink needs a value column (columns: {', '.join(columns)})"
            )
        if columns["value"] not in ("STRING", "BINARY"):
            raise PipelineError(
                f"{where}: value is {columns['value']}; a stream sink needs STRING or BINARY "
                "(e.g. a sql step with to_json(struct(*)) AS value)"
            )
    return {"stream": stream}


# Spark SQL types a kind field can take from a column (docs/spark.md, Writing entity kinds).
KIND_COLUMN_TYPES = {"STRING", "BOOLEAN", "TINYINT", "SMALLINT", "INT", "BIGINT", "FLOAT", "DOUBLE"}


# Spark partitions a kind sink writes from by default: each is a Ripple worker holding one
# of the tenant's 64 source slots (docs/spark.md, "Sources and liveness").
KIND_SINK_PARTITIONS = 8
MAX_KIND_SINK_PARTITIONS = 64


def _kind_sink(data: Mapping[str, Any], where: str, columns: Columns) -> dict[str, Any]:
    allowed = {"name", "type", "input", "kind", "key", "patch_columns", "partitions", "options"}
    _expect(data, where, allowed, {"kind"})
    partitions = data.get("partitions", KIND_SINK_PARTITIONS)
    if (
        not isinstance(partitions, int)
        or isinstance(partitions, bool)
        or not 1 <= partitions <= MAX_KIND_SINK_PARTITIONS
    ):
        raise PipelineError(
            f"{where}: partitions must be an integer from 1 to {MAX_KIND_SINK_PARTITIONS} "
            f"(each is a Ripple source of the tenant's {MAX_KIND_SINK_PARTITIONS}), "
            f"not {partitions!r}"
        )
    kind = _str(data, "kind", where)
    try:
        check_stream_name(kind, "kind")
    except UsageError as exc:
        raise PipelineError(f"{where}: {exc}") from None
    key = str(data.get("key", "key"))
    patch = data.get("patch_columns", [])
    if not isinstance(patch, list) or not all(isinstance(c, str) for c in patch):
        raise PipelineError(f"{where}: patch_columns must be a list of column names")
    if columns is not None:
        if key not in columns:
            raise PipelineError(
                f"{where}: the key column {key!r} is not among {', '.join(columns)} "
                "(name it with key:)"
            )
        for name in patch:
            if name not in columns:
                raise PipelineError(f"{where}: patch column {name!r} is not a column")
        for name, sql_type in columns.items():
            if name == key or sql_type == "UNKNOWN":
                continue
            if name == "deleted" and sql_type != "BOOLEAN":
                raise PipelineError(f"{where}: column deleted must be BOOLEAN, not {sql_type}")
            if sql_type not in KIND_COLUMN_TYPES:
                raise PipelineError(
                    f"{where}: column {name} is {sql_type}; a kind field takes "
                    f"{', '.join(sorted(KIND_COLUMN_TYPES))} (cast it in a sql step)"
                )
    settings: dict[str, Any] = {"kind": kind, "key": key, "partitions": partitions}
    if patch:
        settings["patchColumns"] = ",".join(patch)
    return settings


def _parquet_sink(data: Mapping[str, Any], where: str, columns: Columns) -> dict[str, Any]:
    _expect(data, where, {"name", "type", "input", "path", "options"}, {"path"})
    return {"path": _str(data, "path", where)}


def _console_sink(data: Mapping[str, Any], where: str, columns: Columns) -> dict[str, Any]:
    _expect(data, where, {"name", "type", "input", "options"}, set())
    return {}


SINK_TYPES: dict[str, Callable[[Mapping[str, Any], str, Columns], dict[str, Any]]] = {
    "stream": _stream_sink,
    "kind": _kind_sink,
    "parquet": _parquet_sink,
    "console": _console_sink,
}

TRIGGERS = ("processingTime", "availableNow", "once")
# Top-level keys that say where and how to connect (TLS: docs/operations.md, "TLS").
CONNECTION_KEYS = ("server", "token", "tenant", "tls", "ca_file", "cert_file", "key_file")


def _trigger(data: Any) -> dict[str, Any]:
    if data is None:
        return {"processingTime": "1 second"}
    if data in ("availableNow", "once"):
        return {str(data): True}
    if isinstance(data, str):
        return {"processingTime": data}
    if isinstance(data, dict) and len(data) == 1 and next(iter(data)) in TRIGGERS:
        return dict(data)
    raise PipelineError(
        "trigger must be a processing interval ('5 seconds'), availableNow, once, "
        "or a mapping with one of processingTime/availableNow/once"
    )


def _typed_entries(
    data: Mapping[str, Any], key: str, types: Mapping[str, Any]
) -> Iterator[tuple[int, str, dict[str, Any], str]]:
    """``(index, where, entry, type)`` of each entry of the non-empty list ``data[key]``,
    each a mapping whose ``type`` is one of ``types``."""
    entries = data[key]
    if not isinstance(entries, list) or not entries:
        raise PipelineError(f"{key} must be a non-empty list")
    for i, entry in enumerate(entries):
        where = f"{key}[{i}]"
        if not isinstance(entry, dict):
            raise PipelineError(f"{where}: must be a mapping")
        kind = str(entry.get("type", ""))
        if kind not in types:
            raise PipelineError(f"{where}: type must be one of {', '.join(types)}")
        yield i, where, entry, kind


def parse_pipeline(data: Any, base: Path, kind_columns: KindColumns | None = None) -> PipelineSpec:
    """Check a pipeline's YAML data. ``kind_columns`` gives the columns of each kind a
    source reads (see :func:`server_kind_columns`); without it they are not checked."""
    if not isinstance(data, dict):
        raise PipelineError("a pipeline file must be a YAML mapping")
    top = {
        "name",
        *CONNECTION_KEYS,
        "sources",
        "transforms",
        "sinks",
        "checkpoint",
        "trigger",
        "output_mode",
        "spark_conf",
    }
    _expect(data, "pipeline", top, {"sources", "sinks", "checkpoint"})
    # The YAML's connection keys as the Spark connector's options (lower-cased).
    conn_opts = {key.replace("_", ""): str(data[key]) for key in CONNECTION_KEYS if key in data}
    try:
        connection = ConnectionOptions.parse(conn_opts)
    except UsageError as exc:
        raise PipelineError(f"pipeline: {exc}") from None
    views: dict[str, Columns] = {}
    sources = []
    for _, where, entry, kind in _typed_entries(data, "sources", SOURCE_TYPES):
        name = _str(entry, "name", where)
        if name in views:
            raise PipelineError(f"{where}: name {name!r} is used twice")
        source = SOURCE_TYPES[kind](name, entry, where)
        if source.type == "kind" and kind_columns is not None:
            source.columns = kind_columns(connection, source.settings["kind"])
        sources.append(source)
        views[name] = source.columns
    transforms = []
    previous = sources[-1].name
    raw_transforms = data.get("transforms") or []
    if not isinstance(raw_transforms, list):
        raise PipelineError("transforms must be a list")
    for i, entry in enumerate(raw_transforms):
        step = _transform(i, entry, previous, views)
        if step.name in views:
            raise PipelineError(f"transforms[{i}]: name {step.name!r} is used twice")
        transforms.append(step)
        views[step.name] = step.columns
        previous = step.name
    sinks = []
    for i, where, entry, kind in _typed_entries(data, "sinks", SINK_TYPES):
        input_name = str(entry.get("input", previous))
        if input_name not in views:
            raise PipelineError(f"{where}: input {input_name!r} is not a source or transform")
        settings = SINK_TYPES[kind](entry, where, views[input_name])
        partitions = settings.pop("partitions", None)
        name = str(entry.get("name", f"sink{i}"))
        sinks.append(SinkSpec(name, kind, input_name, settings, _options(entry, where), partitions))
    checkpoint = Path(_str(data, "checkpoint", "pipeline"))
    output_mode = str(data.get("output_mode", "append"))
    if output_mode not in ("append", "update", "complete"):
        raise PipelineError("output_mode must be append, update or complete")
    spark_conf = data.get("spark_conf", {})
    if not isinstance(spark_conf, dict):
        raise PipelineError("spark_conf must map Spark settings to values")
    return PipelineSpec(
        spark_conf={
            str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in spark_conf.items()
        },
        name=str(data.get("name", "pipeline")),
        connection=connection,
        sources=sources,
        transforms=transforms,
        sinks=sinks,
        checkpoint=checkpoint if checkpoint.is_absolute() else base / checkpoint,
        trigger=_trigger(data.get("trigger")),
        output_mode=output_mode,
        views=views,
    )


def load_pipeline(
    path: Path,
    kind_columns: KindColumns | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> PipelineSpec:
    """Read and check a pipeline file; ``overrides`` replace top-level keys of it (the
    command line's --server, --checkpoint) before it is checked."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise PipelineError(f"cannot read {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PipelineError(f"{path} is not valid YAML: {exc}") from None
    if overrides and isinstance(data, dict):
        data = {**data, **overrides}
    return parse_pipeline(data, path.parent, kind_columns)


def server_kind_columns(connection: ConnectionOptions, kind: str) -> dict[str, str]:
    """The columns of a streaming read of ``kind``, asked of the server."""
    from headwater.spark.kinds import KindReadOptions, kind_columns
    from headwater.spark.streams import open_client

    options = KindReadOptions(connection, kind, None, 1)
    try:
        with open_client(connection) as client:
            return dict(kind_columns(client, options))
    except UsageError as exc:
        raise PipelineError(str(exc)) from None
    except Exception as exc:
        raise PipelineError(f"cannot reach the server {connection.server}: {exc}") from None


def check_streams(spec: PipelineSpec) -> None:
    """Every stream a source reads must exist on the server (sinks create theirs)."""
    from headwater.client import connect

    wanted = spec.streams_read()
    if not wanted:
        return
    try:
        with connect(
            spec.connection.server,
            token=spec.connection.token,
            tenant=spec.connection.tenant,
            **spec.connection.tls_options(),
        ) as client:
            known = {s.name for s in client.list_streams()}
    except Exception as exc:
        raise PipelineError(f"cannot reach the server {spec.connection.server}: {exc}") from None
    missing = [s for s in wanted if s not in known]
    if missing:
        raise PipelineError(f"unknown stream(s) on {spec.connection.server}: {', '.join(missing)}")
