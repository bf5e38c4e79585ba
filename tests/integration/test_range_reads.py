"""Bulk range reads of a stream against a real server: the HTTP API's Arrow endpoint
(``GET /api/streams/{name}/arrow``, :meth:`headwater.Client.read_arrow`) and the Spark
reader's two paths over it (columnar over HTTP, ReadEvents pages over Kimberlite), which
must give the very same rows."""

from __future__ import annotations

import http.client
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pyarrow as pa
import pytest
from servers import AUTH_CONFIG, LOCAL, RETENTION_CONFIG, Server

import headwater
from headwater.client.errors import ServerUnavailable
from headwater.errors import AuthenticationFailed, InvalidOffset, InvalidRequest, StreamNotFound
from headwater.spark import streams as spark_streams
from headwater.spark.options import ConnectionOptions, DataLossError
from headwater.spark.streams import ROW_SCHEMA, RangeReader
from waiting import wait_until

HTTP_ON = {"http": LOCAL}


def _fill(address: str, stream: str) -> list[bytes]:
    """Appends of mixed sizes (empty and 64 KiB values included) to ``stream``, with
    another stream's appends in between so positions are not offsets."""
    values: list[bytes] = []
    with headwater.connect(address) as hw:
        hw.create_stream(stream)
        hw.create_stream(stream + "_other")
        for round_ in range(12):
            batch = [b'{"n":%d,"pad":"%s"}' % (round_ * 100 + i, b"x" * (i % 7)) for i in range(97)]
            if round_ == 3:
                batch += [b"", b"y" * 65536]
            hw.append(stream, batch)
            hw.append(stream + "_other", [b"o"] * (round_ + 1))
            values += batch
    return values


def _rows(reader: RangeReader, *, via_http: bool) -> dict[str, list[Any]]:
    table = pa.Table.from_batches(list(reader.batches(via_http=via_http)), ROW_SCHEMA)
    return table.to_pydict()


def _reader(address: str, stream: str, start: int, end: int, **kw: Any) -> RangeReader:
    return RangeReader(
        ConnectionOptions(server=address, token=kw.pop("token", None)),
        stream,
        start,
        end,
        kw.pop("fail_on_data_loss", True),
        kw.pop("value_format", "raw"),
        kw.pop("schema", ROW_SCHEMA),
    )


@pytest.fixture
def http_server(make_server: Callable[..., Server]) -> Server:
    return make_server(listen=HTTP_ON)


def test_both_paths_read_the_same_rows(http_server: Server) -> None:
    values = _fill(http_server.address, "mixed")
    with headwater.connect(http_server.address) as hw:
        expected = [(e.offset, e.value) for e in hw.scan("mixed")]
    assert [v for _, v in expected] == values
    for start, end in ((0, len(values)), (7, 123), (290, 310), (len(values) - 1, len(values))):
        reader = _reader(http_server.address, "mixed", start, end)
        http_rows = _rows(reader, via_http=True)
        assert http_rows == _rows(reader, via_http=False)
        assert (
            list(zip(http_rows["offset"], http_rows["value"], strict=True)) == expected[start:end]
        )
        assert set(http_rows["stream"]) == {"mixed"} and set(http_rows["timestampType"]) == {1}
        positions = http_rows["position"]
        assert positions == sorted(positions) and len(set(positions)) == end - start
        if end - start > 100:  # spans the other stream's appends
            assert positions[-1] - positions[0] > end - start - 1
        assert all(ts is not None for ts in http_rows["timestamp"])


def test_both_paths_parse_json_values_alike(http_server: Server) -> None:
    with headwater.connect(http_server.address) as hw:
        hw.create_stream("js")
        hw.append("js", [b'{"n":%d,"s":"v%d"}' % (i, i) for i in range(500)])
    schema = pa.schema([("n", pa.int64()), ("s", pa.string()), ("offset", pa.int64())])
    reader = _reader(http_server.address, "js", 10, 490, value_format="json", schema=schema)
    via_http = pa.Table.from_batches(list(reader.batches(via_http=True)), schema).to_pydict()
    assert (
        via_http == pa.Table.from_batches(list(reader.batches(via_http=False)), schema).to_pydict()
    )
    assert via_http["n"] == list(range(10, 490)) and via_http["s"][0] == "v10"


def test_a_range_past_the_end_is_data_loss_on_both_paths(http_server: Server) -> None:
    with headwater.connect(http_server.address) as hw:
        hw.create_stream("short")
        hw.append("short", [b"a", b"b", b"c"])
    reader = _reader(http_server.address, "short", 0, 10)
    for via_http in (True, False):
        with pytest.raises(DataLossError, match="before offset 10 that was planned"):
            _rows(reader, via_http=via_http)


def test_retention_is_data_loss_or_skipped_on_both_paths(
    make_server: Callable[..., Server],
) -> None:
    server = make_server(config=RETENTION_CONFIG, listen=HTTP_ON)
    with headwater.connect(server.address) as hw:
        hw.create_stream("ret")
        for i in range(40):
            hw.append("ret", [b"v%03d-%d" % (i, k) + b"." * 100 for k in range(10)])
        # Until retention is done: offset 0 is gone and the log is under its byte limit.
        wait_until(
            lambda: (
                int(str(hw.query('SELECT min("offset") FROM ret').scalar())) > 0
                and hw.stream_info("ret").size_bytes <= 8192
            ),
            30,
            "retention removed nothing",
        )
        start = int(str(hw.query('SELECT min("offset") FROM ret').scalar()))
        end = hw.stream_info("ret").next_offset
        kept = [e.value for e in hw.scan("ret", start)]
        with pytest.raises(InvalidOffset, match="removed by retention"):
            list(hw.read_arrow("ret", 0, end))
    strict = _reader(server.address, "ret", 0, end)
    lenient = _reader(server.address, "ret", 0, end, fail_on_data_loss=False)
    for via_http in (True, False):
        with pytest.raises(DataLossError, match=rf"offsets 0\.\.{start - 1} were removed"):
            _rows(strict, via_http=via_http)
        rows = _rows(lenient, via_http=via_http)
        assert rows["offset"] == list(range(start, end)) and rows["value"] == kept


def test_read_arrow_endpoint(http_server: Server) -> None:
    with headwater.connect(http_server.address) as hw:
        hw.create_stream("arr")
        hw.append("arr", [b"e%d" % i for i in range(200_000)])
        assert f"http:{http_server.ports['http']}" in hw.capabilities
        batches = list(hw.read_arrow("arr"))
        table = pa.Table.from_batches(batches)
        assert table.schema.names == ["offset", "position", "ts", "data"]
        assert table.column("offset").to_pylist() == list(range(200_000))
        assert table.column("data")[123_456].as_py() == b"e123456"
        assert max(b.num_rows for b in batches) <= 65_536  # a big range comes in pieces
        part = pa.Table.from_batches(list(hw.read_arrow("arr", 199_990, 199_995)))
        assert part.column("data").to_pylist() == [b"e%d" % i for i in range(199_990, 199_995)]
        assert list(hw.read_arrow("arr", 500_000)) == []  # past the end: nothing
        with pytest.raises(InvalidRequest, match="must not be below"):
            list(hw.read_arrow("arr", 10, 5))
        with pytest.raises(StreamNotFound):
            list(hw.read_arrow("no_such_stream"))
    conn = http.client.HTTPConnection("127.0.0.1", http_server.ports["http"], timeout=30)
    conn.request("GET", "/api/streams/arr/arrow?from=0&to=3")
    response = conn.getresponse()
    assert response.status == 200
    assert response.getheader("Content-Type") == "application/vnd.apache.arrow.stream"
    assert pa.ipc.open_stream(response.read()).read_all().num_rows == 3
    conn.close()


def test_read_arrow_takes_the_token(make_server: Callable[..., Server]) -> None:
    server = make_server(config=AUTH_CONFIG, listen=HTTP_ON)
    with headwater.connect(server.address, token="s3cret") as hw:
        hw.create_stream("sec")
        hw.append("sec", [b"a", b"b"])
        assert [b.num_rows for b in hw.read_arrow("sec")] == [2]
    port = server.ports["http"]
    with pytest.raises(AuthenticationFailed):
        list(headwater.client.arrow.read_arrow("127.0.0.1", port, "sec", 0))
    reader = _reader(server.address, "sec", 0, 2, token="s3cret")
    assert _rows(reader, via_http=True)["value"] == [b"a", b"b"]


def test_without_a_reachable_http_api_the_reader_uses_kimberlite(
    make_server: Callable[..., Server],
) -> None:
    off = make_server()  # HTTP off: nothing advertised
    # HTTP on another loopback address: advertised, but not where the client connects.
    elsewhere = make_server(listen={"http": "127.0.0.2:0"})
    for server in (off, elsewhere):
        with headwater.connect(server.address) as hw:
            hw.create_stream("kb")
            hw.append("kb", [b"v%d" % i for i in range(50)])
            if server is off:
                with pytest.raises(ServerUnavailable, match="does not advertise"):
                    hw.read_arrow("kb")
            else:
                with pytest.raises(ServerUnavailable, match="cannot reach"):
                    list(hw.read_arrow("kb"))
        rows = _rows(_reader(server.address, "kb", 5, 50), via_http=True)
        assert rows["value"] == [b"v%d" % i for i in range(5, 50)]


class _FakeQueries:
    """Answers the Kimberlite reader's two metadata queries from fixed rows."""

    def __init__(self, groups: list[tuple[int, ...]], runs: list[tuple[int, ...]]) -> None:
        self.answers = {"count(*)": groups, "row_number()": runs}
        self.asked: list[str] = []
        self.aio = self

    async def query(self, sql: str, *params: object) -> Any:
        key = next(k for k in self.answers if k in sql)
        self.asked.append(key)
        return type("Result", (), {"rows": self.answers[key]})()

    def submit(self, coro: Any) -> Future[Any]:
        import asyncio

        future: Future[Any] = Future()
        future.set_result(asyncio.run(coro))
        return future


def test_metadata_takes_exact_runs_when_a_group_is_not_contiguous() -> None:
    contiguous = _FakeQueries([(0, 9, 5, 100, 10), (10, 19, 7, 200, 10)], [])
    runs = spark_streams._metadata_runs(contiguous, "s", 0, 20).result()  # type: ignore[arg-type]
    assert runs == [(0, 9, 5, 100), (10, 19, 7, 200)] and contiguous.asked == ["count(*)"]
    # Offsets 0-4 and 10-14 share (delta, timestamp) around a different group: the
    # cheap grouping cannot tell their runs apart, the exact query can.
    exact = [(0, 4, 5, 100), (5, 9, 5, 300), (10, 14, 5, 100)]
    split = _FakeQueries([(0, 14, 5, 100, 10), (5, 9, 5, 300, 5)], exact)
    runs = spark_streams._metadata_runs(split, "s", 0, 15).result()  # type: ignore[arg-type]
    assert runs == exact and split.asked == ["count(*)", "row_number()"]


def test_arrow_reads_count_events_and_value_bytes(http_server: Server) -> None:
    with headwater.connect(http_server.address) as hw:
        hw.create_stream("met")
        hw.append("met", [b"abc", b"de"])
        assert sum(b.num_rows for b in hw.read_arrow("met")) == 2
    conn = http.client.HTTPConnection("127.0.0.1", http_server.ports["http"], timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    assert 'headwater_events_read_total{stream="met",tenant="0"} 2.0' in text
    assert 'headwater_bytes_read_total{stream="met",tenant="0"} 5.0' in text
