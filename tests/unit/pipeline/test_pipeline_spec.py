"""Pipeline files are checked before Spark starts: every mistake gets a message that
says where it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from headwater.pipeline.spec import PipelineError, load_pipeline, parse_ddl, parse_pipeline
from headwater.spark.options import OffsetSpec, limit_offsets, offsets_json, parse_offsets

GOOD = {
    "name": "p",
    "sources": [
        {
            "name": "trades",
            "type": "stream",
            "stream": "raw_trades",
            "format": "json",
            "schema": "symbol STRING, price DOUBLE, size INT, ts TIMESTAMP, tags ARRAY<STRING>",
        }
    ],
    "transforms": [
        {"filter": "price > 0"},
        {"mask": ["symbol"]},
        {"select": {"symbol": "sym", "price": "px", "size": "size", "ts": "ts"}},
        {
            "window": {
                "time": "ts",
                "duration": "1 minute",
                "watermark": "10 seconds",
                "group_by": ["sym"],
                "aggregations": {"vwap": "sum(px * size) / sum(size)"},
            }
        },
    ],
    "sinks": [{"type": "parquet", "path": "out"}],
    "checkpoint": "cp",
    "trigger": "5 seconds",
}


def _with(**changes: object) -> dict[str, object]:
    data = dict(GOOD)
    data.update(changes)
    return data


def test_good_pipeline_tracks_columns_through_steps(tmp_path: Path):
    spec = parse_pipeline(GOOD, tmp_path)
    assert [t.type for t in spec.transforms] == ["filter", "mask", "select", "window"]
    assert spec.views["step2"] == {
        "sym": "STRING",
        "px": "DOUBLE",
        "size": "INT",
        "ts": "TIMESTAMP",
    }
    assert spec.checkpoint == tmp_path / "cp"
    assert spec.trigger == {"processingTime": "5 seconds"}
    assert spec.streams_read() == ["raw_trades"]
    assert parse_ddl("a INT, m MAP<STRING, INT>, d DECIMAL(10, 2)", "x") == {
        "a": "INT",
        "m": "MAP<STRING, INT>",
        "d": "DECIMAL(10, 2)",
    }


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (["a list"], "must be a YAML mapping"),
        (_with(sinks=[]), "sinks must be a non-empty list"),
        (_with(colour="red"), "unknown key"),
        (_with(sources=[{"name": "s", "type": "kafka"}]), r"sources\[0\]: type must be one of"),
        (
            _with(sources=[{"name": "s", "type": "stream", "stream": "bad name"}]),
            "use 1..256 characters",
        ),
        (
            _with(sources=[{"name": "s", "type": "stream", "stream": "x", "format": "json"}]),
            r"sources\[0\]: schema must be",
        ),
        (_with(transforms=[{"filter": "a", "mask": ["b"]}]), "needs exactly one of"),
        (_with(transforms=[{"mask": ["nope"]}]), r"transforms\[0\]: unknown column\(s\) nope"),
        (_with(transforms=[{"filter": "x", "input": "ghost"}]), "input 'ghost' is not"),
        (
            _with(
                transforms=[
                    {
                        "window": {
                            "time": "size",
                            "duration": "1 minute",
                            "watermark": "1 minute",
                            "aggregations": {"n": "count(*)"},
                        }
                    }
                ]
            ),
            "window time column size is INT, not TIMESTAMP",
        ),
        (
            _with(transforms=[], sinks=[{"type": "stream", "stream": "out"}]),
            "a stream sink needs a value column",
        ),
        (
            _with(
                transforms=[{"select": {"price": "value"}}],
                sinks=[{"type": "stream", "stream": "out"}],
            ),
            "value is DOUBLE; a stream sink needs STRING or BINARY",
        ),
        (
            _with(transforms=[], sinks=[{"type": "kind", "kind": "k", "key": "sym"}]),
            r"sinks\[0\]: the key column 'sym' is not among",
        ),
        (
            _with(transforms=[], sinks=[{"type": "kind", "kind": "k", "key": "symbol"}]),
            "column ts is TIMESTAMP; a kind field takes",
        ),
        (
            _with(
                transforms=[{"select": {"symbol": "symbol", "price": "price"}}],
                sinks=[{"type": "kind", "kind": "k", "key": "symbol", "patch_columns": ["px"]}],
            ),
            "patch column 'px' is not a column",
        ),
        (_with(sinks=[{"type": "kind", "kind": "bad-name"}]), r"sinks\[0\]: kind"),
        (_with(trigger=[1]), "trigger must be"),
        (_with(server="host:notaport"), "option server"),
    ],
)
def test_mistakes_are_reported_with_their_place(tmp_path: Path, data: object, message: str):
    with pytest.raises(PipelineError, match=message):
        parse_pipeline(data, tmp_path)


def test_kind_sink_settings(tmp_path: Path):
    data = _with(
        transforms=[{"select": {"symbol": "key", "price": "price", "size": "size"}}],
        sinks=[{"type": "kind", "kind": "quotes", "patch_columns": ["price"]}],
    )
    [sink] = parse_pipeline(data, tmp_path).sinks
    assert sink.settings == {"kind": "quotes", "key": "key", "patchColumns": "price"}
    assert sink.partitions == 8  # Ripple workers (source slots) the sink writes from
    data["sinks"] = [{"type": "kind", "kind": "quotes", "partitions": 64}]
    assert parse_pipeline(data, tmp_path).sinks[0].partitions == 64
    for bad in (0, 65, "4", True):
        data["sinks"] = [{"type": "kind", "kind": "quotes", "partitions": bad}]
        with pytest.raises(PipelineError, match=r"sinks\[0\]: partitions must be .* 1 to 64"):
            parse_pipeline(data, tmp_path)


KIND_SOURCE = {"name": "quotes", "type": "kind", "kind": "quotes"}
QUOTE_COLUMNS = {
    "entity_id": "STRING",
    "version": "BIGINT",
    "deleted": "BOOLEAN",
    "px": "DOUBLE",
    "at": "TIMESTAMP",
}


def test_kind_source_takes_its_columns_from_the_lookup(tmp_path: Path):
    asked: list[tuple[str, str]] = []

    def lookup(connection: object, kind: str) -> dict[str, str]:
        asked.append((getattr(connection, "server", ""), kind))
        return dict(QUOTE_COLUMNS)

    data = _with(
        server="127.0.0.1:7555",
        sources=[{**KIND_SOURCE, "options": {"startingPosition": "latest"}}],
        transforms=[{"filter": "NOT deleted"}, {"select": {"entity_id": "key", "px": "px"}}],
        sinks=[{"type": "kind", "kind": "quotes_copy"}],
    )
    spec = parse_pipeline(data, tmp_path, lookup)
    assert asked == [("127.0.0.1:7555", "quotes")]
    [source] = spec.sources
    assert (source.type, source.settings, source.options) == (
        "kind",
        {"kind": "quotes"},
        {"startingPosition": "latest"},
    )
    assert spec.views["quotes"] == QUOTE_COLUMNS
    # The columns are checked downstream: a TIMESTAMP cannot become a kind field.
    bad = _with(
        sources=[KIND_SOURCE],
        transforms=[],
        sinks=[{"type": "kind", "kind": "k2", "key": "entity_id"}],
    )
    with pytest.raises(PipelineError, match="column at is TIMESTAMP"):
        parse_pipeline(bad, tmp_path, lookup)
    # Without a lookup (no server at hand) the columns are unknown, not guessed.
    assert parse_pipeline(bad, tmp_path).views["quotes"] is None


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ({"name": "q", "type": "kind"}, r"sources\[0\]: missing kind"),
        ({"name": "q", "type": "kind", "kind": "bad-name"}, r"sources\[0\]: kind"),
        ({"name": "q", "type": "kind", "kind": "k", "stream": "s"}, "unknown key"),
    ],
)
def test_kind_source_mistakes(tmp_path: Path, source: dict[str, object], message: str):
    with pytest.raises(PipelineError, match=message):
        parse_pipeline(_with(sources=[source], transforms=[]), tmp_path)


def test_bad_yaml_and_missing_file(tmp_path: Path):
    path = tmp_path / "p.yaml"
    path.write_text("sources: [unclosed\n")
    with pytest.raises(PipelineError, match="is not valid YAML"):
        load_pipeline(path)
    with pytest.raises(PipelineError, match="cannot read"):
        load_pipeline(tmp_path / "missing.yaml")


def test_offsets_forms_and_admission_control():
    streams = ["a", "b"]
    assert parse_offsets(None, streams, "startingOffsets", -2) == {
        "a": OffsetSpec(-2),
        "b": OffsetSpec(-2),
    }
    assert parse_offsets("latest", streams, "startingOffsets", -2)["b"] == OffsetSpec(-1)
    spec = parse_offsets('{"b": {"0": 7, "3": -1}}', streams, "startingOffsets", -2)
    assert spec["a"] == OffsetSpec(-2)
    assert [spec["b"].at(p) for p in range(4)] == [7, -2, -2, -1]  # unnamed: the default
    with pytest.raises(Exception, match="names partition 3 of stream b, which has 2"):
        spec["b"].check("b", 2, "startingOffsets")
    with pytest.raises(Exception, match="partitions of a are numbers"):
        parse_offsets('{"a": {"x": 7}}', streams, "startingOffsets", -2)
    with pytest.raises(Exception, match="not read"):
        parse_offsets('{"c": {"0": 7}}', streams, "startingOffsets", -2)
    # Spark compares offsets as JSON text: stable order whatever the input order.
    assert list(offsets_json({"b": {0: 1}, "a": {0: 2}})) == ["a", "b"]
    assert list(offsets_json({"a": {10: 1, 2: 5, 0: 3}})["a"]) == ["0", "2", "10"]
    # At most max rows past start, shared by waiting amounts, never past the end.
    assert limit_offsets({"a": 0, "b": 0}, {"a": 300, "b": 100}, 100) == {"a": 75, "b": 25}
    assert limit_offsets({"a": 0, "b": 0}, {"a": 1, "b": 100}, 10) == {"a": 1, "b": 9}
    assert limit_offsets({"a": 5}, {"a": 8}, 100) == {"a": 8}


def test_progress_line_counts_lag_of_streams_and_kinds():
    from headwater.pipeline.runner import progress_line

    progress = {
        "name": "p_sink0",
        "batchId": 4,
        "numInputRows": 10,
        "sink": {"numOutputRows": 3},
        "durationMs": {"triggerExecution": 120},
        "sources": [
            {"endOffset": '{"t": {"0": 5}}', "latestOffset": '{"t": {"0": 12}}'},
            {"endOffset": '{"position": 40}', "latestOffset": '{"position": 45}'},
        ],
    }
    assert progress_line(progress) == (
        "[p_sink0] batch 4: in 10 rows, out 3 rows, lag 12 offsets, 120 ms"
    )


def test_tls_keys_reach_the_connection_and_the_spark_options(tmp_path: Path):
    from headwater.pipeline.runner import _connection_options

    data = _with(server="hw:7401", tls=True, ca_file="/etc/ca.pem", cert_file="/etc/me.pem")
    spec = parse_pipeline(data, tmp_path)
    assert spec.connection.tls_options() == {
        "tls": True,
        "ca": "/etc/ca.pem",
        "cert": "/etc/me.pem",
        "key": None,
    }
    assert _connection_options(spec) == {
        "server": "hw:7401",
        "tenant": "0",
        "tls": "true",
        "caFile": "/etc/ca.pem",
        "certFile": "/etc/me.pem",
    }
    with pytest.raises(PipelineError, match="keyFile is the key of certFile"):
        parse_pipeline(_with(key_file="/etc/me.key"), tmp_path)
