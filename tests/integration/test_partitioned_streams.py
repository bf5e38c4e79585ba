"""Partitioned streams against a real server: created over HTTP and with the CLI, keyed
records placed as Kafka places them, read back per partition with keys, headers and
timestamps, seek by time, SQL's partition column, bad input refused with nothing
stored, and every partition intact after a restart and after SIGKILL."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any

import pyarrow as pa
from servers import LOCAL, Server

import headwater
from headwater.engine.partitioner import keyed_partition

PARTITIONS = 6
BASE_TS = 1_700_000_000_000


def http(server: Server, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://{server.address_of('http')}{path}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json", "X-Headwater-Tenant": "0"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            payload = response.read()
            return response.status, json.loads(payload) if payload else None
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def cli(server: Server, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "headwater.cli.main", *args, "--server", server.address],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def records(count: int) -> list[dict[str, Any]]:
    return [
        {
            "key": f"customer-{i % 17}",
            "value": json.dumps({"n": i}),
            "headers": [{"name": "trace", "value": f"t{i}"}, {"name": "bin", "value_b64": "AAE="}],
            "timestamp_ms": BASE_TS + i,
        }
        for i in range(count)
    ]


def read_partition(server: Server, stream: str, partition: int) -> list[dict[str, Any]]:
    status, page = http(
        server, "GET", f"/api/streams/{stream}/events?partition={partition}&limit=10000"
    )
    assert status == 200, page
    assert page["partition"] == partition
    events: list[dict[str, Any]] = page["events"]
    return events


def snapshot(server: Server, stream: str) -> list[list[tuple[int, Any, str, int, Any]]]:
    return [
        [
            (e["offset"], e.get("key"), e["value"], e["timestamp_ms"], e.get("headers"))
            for e in read_partition(server, stream, p)
        ]
        for p in range(PARTITIONS)
    ]


def test_six_partitions_over_http_and_cli_survive_restart_and_sigkill(make_server: Any) -> None:
    server: Server = make_server(listen={"http": LOCAL})

    # The CLI creates and grows one; shrinking is refused.
    made = cli(server, "stream", "create", "cli_six", "--partitions", str(PARTITIONS))
    assert made.returncode == 0, made.stderr
    assert f"partitions={PARTITIONS}" in made.stdout
    status, described = http(server, "GET", "/api/streams/cli_six")
    assert status == 200 and described["partitions"] == PARTITIONS
    grown = cli(server, "stream", "alter", "cli_six", "--partitions", "8")
    assert grown.returncode == 0 and "has 8 partitions" in grown.stdout, grown.stderr
    shrink = cli(server, "stream", "alter", "cli_six", "--partitions", "3")
    assert shrink.returncode == 1
    assert "InvalidRequest" in shrink.stderr and "never removed" in shrink.stderr
    assert "Traceback" not in shrink.stderr

    # HTTP creates another and appends keyed records with headers and timestamps.
    status, created = http(
        server, "POST", "/api/streams", {"name": "orders", "settings": {"partitions": PARTITIONS}}
    )
    assert status == 201, created
    assert created["partitions"] == PARTITIONS and len(created["partition_offsets"]) == PARTITIONS
    sent = records(120)
    status, appended = http(server, "POST", "/api/streams/orders/events", {"records": sent})
    assert status == 200, appended
    placed = [r["partition"] for r in appended["records"]]
    assert placed == [keyed_partition(r["key"].encode(), PARTITIONS) for r in sent]
    assert len(set(placed)) > 1

    for partition in range(PARTITIONS):
        mine = [r for r, p in zip(sent, placed, strict=True) if p == partition]
        events = read_partition(server, "orders", partition)
        assert [e["key"] for e in events] == [r["key"] for r in mine]
        assert [e["value"] for e in events] == [r["value"] for r in mine]
        assert [e["timestamp_ms"] for e in events] == [r["timestamp_ms"] for r in mine]
        assert [e["offset"] for e in events] == list(range(len(mine)))
        for event, record in zip(events, mine, strict=True):
            assert event["partition"] == partition
            assert [(h["name"], base64.b64decode(h["value_b64"])) for h in event["headers"]] == [
                ("trace", record["headers"][0]["value"].encode()),
                ("bin", b"\x00\x01"),
            ]
        if mine:  # seek by time: the first of this partition's events at or after T
            target = mine[len(mine) // 2]["timestamp_ms"]
            status, sought = http(
                server,
                "GET",
                f"/api/streams/orders/offsets?partition={partition}&timestamp_ms={target}",
            )
            assert status == 200, sought
            assert sought["offset"] == next(
                e["offset"] for e in events if e["timestamp_ms"] >= target
            )

    # The CLI reads a partition with its keys; JSON lines carry the same as HTTP.
    busiest = max(range(PARTITIONS), key=placed.count)
    read = cli(server, "read", "orders", "--partition", str(busiest), "--format", "json")
    assert read.returncode == 0, read.stderr
    lines = [json.loads(line) for line in read.stdout.splitlines()]
    assert [(e["partition"], e["key"]) for e in lines] == [
        (busiest, r["key"]) for r, p in zip(sent, placed, strict=True) if p == busiest
    ]
    text = cli(server, "read", "orders", "--partition", str(busiest), "--limit", "1")
    assert text.stdout.split("\t")[:2] == [str(busiest), "0"], text.stdout
    # Without --partition the read is Kimberlite's, of partition 0: stderr says that the
    # other partitions' events exist; a stream of one partition reads with no such note.
    zero = cli(server, "read", "orders")
    assert zero.returncode == 0, zero.stderr
    in_zero = [r["value"] for r, p in zip(sent, placed, strict=True) if p == 0]
    assert zero.stdout.splitlines() == [f"{i}\t{value}" for i, value in enumerate(in_zero)]
    assert f"orders has {PARTITIONS} partitions" in zero.stderr, zero.stderr
    assert "--partition N" in zero.stderr
    assert cli(server, "stream", "create", "one_part").returncode == 0
    single = cli(server, "read", "one_part")
    assert single.returncode == 0 and single.stderr == "", single.stderr

    # SQL: one table, partition column last, counts per partition as placed.
    status, result = http(
        server,
        "POST",
        "/api/sql",
        {"sql": "SELECT partition, count(*) FROM orders GROUP BY 1 ORDER BY 1"},
    )
    assert status == 200, result
    assert result["rows"] == [[p, placed.count(p)] for p in sorted(set(placed))]
    status, star = http(server, "POST", "/api/sql", {"sql": "SELECT * FROM orders LIMIT 1"})
    assert star["columns"][-1] == "partition"
    # The columnar range read of one partition (what the Spark source reads).
    arrow_url = f"http://{server.address_of('http')}/api/streams/orders/arrow?partition={busiest}"
    with urllib.request.urlopen(arrow_url, timeout=30) as response:
        table = pa.ipc.open_stream(response.read()).read_all()
    assert table.column("offset").to_pylist() == list(range(placed.count(busiest)))
    assert [json.loads(v) for v in table.column("data").to_pylist()] == [
        json.loads(r["value"]) for r, p in zip(sent, placed, strict=True) if p == busiest
    ]

    # Bad input: a partition that does not exist, a record without a value. Refused
    # whole, nothing stored, and the server goes on serving.
    before = snapshot(server, "orders")
    for bad in (
        {"records": [{"value": "x", "key": "a"}, {"value": "y", "partition": PARTITIONS}]},
        {"records": [{"key": "a"}]},
        {"records": [{"value": "x", "headers": [{"value": "no name"}]}]},
    ):
        status, error = http(server, "POST", "/api/streams/orders/events", bad)
        assert status == 400 and error["error"]["name"] == "InvalidRequest", error
    status, error = http(
        server, "POST", "/api/streams", {"name": "huge", "settings": {"partitions": 2000}}
    )
    assert status == 400 and "from 1 to 1024" in error["error"]["message"], error
    assert http(server, "GET", "/api/streams/huge")[0] == 404
    status, error = http(server, "GET", "/api/streams/orders/events?partition=6")
    assert status == 400 and "partition 6 does not exist" in error["error"]["message"]
    assert snapshot(server, "orders") == before

    # A client that knows no partitions (Kimberlite) appends to partition 0 as ever.
    with headwater.connect(server.address) as hw:
        hw.append("orders", [b"from kimberlite"])
    zero = read_partition(server, "orders", 0)
    assert zero[-1]["value"] == "from kimberlite" and "key" not in zero[-1]
    expected = snapshot(server, "orders")

    server.restart()
    assert snapshot(server, "orders") == expected
    status, described = http(server, "GET", "/api/streams/cli_six")
    assert described["partitions"] == 8

    status, more = http(server, "POST", "/api/streams/orders/events", {"records": records(30)})
    assert status == 200, more
    expected = snapshot(server, "orders")
    server.kill()
    server.start()
    assert snapshot(server, "orders") == expected


def test_kiwi_results_carry_each_events_partition_offset_key_and_time(make_server: Any) -> None:
    from websockets.sync.client import connect

    server: Server = make_server(listen={"http": LOCAL})
    status, _ = http(server, "POST", "/api/streams", {"name": "k", "settings": {"partitions": 3}})
    assert status == 201
    url = f"ws://{server.address_of('http')}/ws"
    with connect(url, open_timeout=30) as ws:
        ws.send(json.dumps({"type": "SUBSCRIBE", "sourceId": "k", "mode": "push"}))
        assert json.loads(ws.recv(timeout=30))["type"] == "SUBSCRIBE_OK"
        sent = [
            {"key": "a", "value": "one", "partition": 2, "timestamp_ms": BASE_TS},
            {"key": "b", "value": "two", "partition": 0, "timestamp_ms": BASE_TS + 1},
            {"value": "three", "partition": 2, "timestamp_ms": BASE_TS + 2},
        ]
        status, appended = http(server, "POST", "/api/streams/k/events", {"records": sent})
        assert status == 200, appended
        got = [json.loads(ws.recv(timeout=30))["data"] for _ in sent]
        seen = sorted(
            (d["partition"], d["offset"], d["key"], d["value"], d["timestamp"]) for d in got
        )
        assert seen == [
            (0, 0, "b", "two", BASE_TS + 1),
            (2, 0, "a", "one", BASE_TS),
            (2, 1, None, "three", BASE_TS + 2),
        ]
        # Deleting the stream closes the source once, not once per partition.
        status, _ = http(server, "DELETE", "/api/streams/k")
        assert status == 204
        notice = json.loads(ws.recv(timeout=30))
        assert notice["type"] == "NOTICE" and notice["data"]["type"] == "SUBSCRIPTION_CLOSED"
        ws.send(json.dumps({"type": "UNSUBSCRIBE", "sourceId": "k"}))
        assert json.loads(ws.recv(timeout=30))["type"] == "UNSUBSCRIBE_ERROR"
