"""The HTTP API's Arrow paths for bulk clients against a real server: a partition's
records with keys and headers read from its log under read_committed or
read_uncommitted (``GET /api/streams/{name}/arrow?records=true``), and idempotent Arrow
appends to a named partition (``POST /api/streams/{name}/arrow``). A Kafka client
writes the transactions: the oracle for what each isolation level shows."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from confluent_kafka import Producer
from servers import LOCAL, Server, serving

import headwater
from headwater.client.arrow import HttpApi
from headwater.errors import InvalidRequest, OutOfOrderSequence
from headwater.sql.records import HEADERS_TYPE

DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("arrow_records"),
        listen={"http": LOCAL, "kafka": LOCAL},
        clean_log=True,
    )


def _stream(hw: headwater.Client, partitions: int) -> tuple[str, HttpApi]:
    name = "s_" + uuid.uuid4().hex[:10]
    api = hw.http_api()
    body = {"name": name, "settings": {"partitions": partitions}}
    api.request("POST", "/api/streams", json.dumps(body).encode(), "application/json")
    return name, api


def _records(hw: headwater.Client, stream: str, partition: int, **kw: Any) -> list[dict[str, Any]]:
    batches = list(hw.read_arrow(stream, 0, None, partition=partition, records=True, **kw))
    rows: list[dict[str, Any]] = pa.Table.from_batches(batches).to_pylist() if batches else []
    return [{k: r[k] for k in ("offset", "data", "key", "headers")} for r in rows]


def test_records_keys_headers_and_isolation(server: Server) -> None:
    with headwater.connect(server.address) as hw:
        stream, api = _stream(hw, 3)
        config = {"bootstrap.servers": server.address_of("kafka"), "linger.ms": 5}
        plain = Producer(config)
        plain.produce(stream, b"v0", key=b"k0", partition=1, headers=[("h", b"1"), ("h", b"2")])
        plain.produce(stream, b"v1", partition=1)
        assert plain.flush(DEADLINE_S) == 0
        tx = Producer({**config, "transactional.id": "tx_" + uuid.uuid4().hex[:8]})
        tx.init_transactions(DEADLINE_S)
        tx.begin_transaction()
        tx.produce(stream, b"committed", key=b"kc", partition=1)
        tx.commit_transaction(DEADLINE_S)
        tx.begin_transaction()
        tx.produce(stream, b"aborted", partition=1)
        tx.flush(DEADLINE_S)
        tx.abort_transaction(DEADLINE_S)
        tx.begin_transaction()
        tx.produce(stream, b"open", partition=1)
        tx.flush(DEADLINE_S)  # stored, its transaction not ended

        committed = _records(hw, stream, 1)
        assert committed == [
            {
                "offset": 0,
                "data": b"v0",
                "key": b"k0",
                "headers": [{"key": "h", "value": b"1"}, {"key": "h", "value": b"2"}],
            },
            {"offset": 1, "data": b"v1", "key": None, "headers": None},
            {"offset": 2, "data": b"committed", "key": b"kc", "headers": None},
        ]  # offset 3 is the commit marker; the aborted and the open ones are not shown
        uncommitted = _records(hw, stream, 1, isolation="read_uncommitted")
        assert [(r["offset"], r["data"]) for r in uncommitted] == [
            (0, b"v0"),
            (1, b"v1"),
            (2, b"committed"),
            (4, b"aborted"),
            (6, b"open"),
        ]
        lso = api.stream(stream)["partition_offsets"][1]
        assert (lso["last_stable_offset"], lso["next_offset"]) == (6, 7)
        tx.commit_transaction(DEADLINE_S)
        assert [r["data"] for r in _records(hw, stream, 1)][-1] == b"open"
        assert _records(hw, stream, 0) == []  # an empty partition
        with pytest.raises(InvalidRequest, match="isolation"):
            _records(hw, stream, 1, isolation="dirty")
        with pytest.raises(InvalidRequest, match="partition 3 does not exist"):
            _records(hw, stream, 3)
        api.close()


def test_append_arrow_idempotent_to_a_partition(server: Server) -> None:
    with headwater.connect(server.address) as hw:
        stream, api = _stream(hw, 4)
        batch = pa.record_batch(
            {
                "value": pa.array(["a", "bb", ""]),
                "key": pa.array([b"k", None, b""]),
                "headers": pa.array([None, [{"key": "t", "value": b"x"}], []], HEADERS_TYPE),
            }
        )
        first = api.append_arrow(stream, batch, partition=3, producer=(41, 0))
        assert first == {"partition": 3, "base_offset": 0, "count": 3, "next_offset": 3}
        assert api.append_arrow(stream, batch, partition=3, producer=(41, 0)) == first  # retry
        keyless = batch.select(["value"])
        assert api.append_arrow(stream, keyless, partition=3, producer=(41, 1))["base_offset"] == 3
        with pytest.raises(OutOfOrderSequence):
            api.append_arrow(stream, keyless, partition=3, producer=(41, 3))
        assert _records(hw, stream, 3) == [
            {"offset": 0, "data": b"a", "key": b"k", "headers": None},
            {"offset": 1, "data": b"bb", "key": None, "headers": [{"key": "t", "value": b"x"}]},
            {"offset": 2, "data": b"", "key": b"", "headers": None},
            {"offset": 3, "data": b"a", "key": None, "headers": None},
            {"offset": 4, "data": b"bb", "key": None, "headers": None},
            {"offset": 5, "data": b"", "key": None, "headers": None},
        ]
        refusals = {
            "partition 4 does not exist": lambda: api.append_arrow(stream, keyless, partition=4),
            "needs a value column": lambda: api.append_arrow(stream, batch.select(["key"])),
            "value has nulls": lambda: api.append_arrow(
                stream, pa.record_batch({"value": pa.array([b"x", None])})
            ),
            "unknown column": lambda: api.append_arrow(
                stream, pa.record_batch({"value": pa.array([b"x"]), "other": pa.array([1])})
            ),
            "1..10000 events": lambda: api.append_arrow(
                stream, pa.record_batch({"value": pa.array([b"x"] * 10_001)})
            ),
            "at most 4194304 bytes": lambda: api.append_arrow(
                stream, pa.record_batch({"value": pa.array([b"x" * (1 << 20)] * 5)})
            ),
            "must be binary or string": lambda: api.append_arrow(
                stream, pa.record_batch({"value": pa.array([1, 2])})
            ),
        }
        for message, attempt in refusals.items():
            with pytest.raises(InvalidRequest, match=message):
                attempt()
        path = f"/api/streams/{stream}/arrow"
        with pytest.raises(InvalidRequest, match="go together"):
            api.request("POST", path + "?producer_id=1", b"", "application/vnd.apache.arrow.stream")
        with pytest.raises(InvalidRequest, match="not an Arrow IPC stream"):
            api.request("POST", path, b"garbage", "application/vnd.apache.arrow.stream")
        with pytest.raises(InvalidRequest, match="the body must be"):
            api.request("POST", path, b"[]", "application/json")
        # Nothing of the refused appends was stored.
        assert api.stream(stream)["partition_offsets"][3]["next_offset"] == 6
        assert sum(p["next_offset"] for p in api.stream(stream)["partition_offsets"]) == 6
        api.close()


def test_the_server_process_never_loads_pandas(server: Server) -> None:
    """pandas is installed here (the tests use it) but a server never needs it: pyarrow
    would import it at a projection's first numpy conversion, in a worker thread whose
    import stalled the loop's appends, and keep it in memory (cli/main.py)."""
    with headwater.connect(server.address) as hw:
        stream, _ = _stream(hw, 1)
        hw.append(stream, [b'{"n": %d}' % i for i in range(1_000)])
        (count,) = hw.query(f"SELECT count(*) FROM {stream}").rows
    assert count == (1_000,)  # the stream's projection was built: pyarrow's numpy path ran
    with open(f"/proc/{server.pid}/maps") as maps:
        loaded = [line.split()[-1] for line in maps if "/pandas/" in line]
    assert loaded == []
