"""Clients that write over HTTP follow the leader (docs/cluster.md, "Clients follow the
leader"): pointed at a follower, the SDK's HTTP client (``Client.http_api()``), the CLI
and the Spark sink store every event once on the partition's leader, with the token
they were given; a client whose leader is killed with its append in flight ends on the
new leader with nothing lost and nothing twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pytest
from cluster_nodes import WAIT_S, Cluster
from servers import AUTH_CONFIG, LOCAL, Server, http_call, http_json

from headwater.client.arrow import HttpApi
from headwater.errors import StreamNotFound
from waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TOKEN = "s3cret"  # AUTH_CONFIG's token of tenant 0: every node requires it


def add_node(cluster: Cluster, node_id: int) -> Server:
    server = Server(
        cluster.root / f"node{node_id}",
        config=cluster.config(node_id) + AUTH_CONFIG,
        listen={"kafka": LOCAL, "http": LOCAL},
    )
    cluster.nodes[node_id] = server
    return server.start()


def api_at(server: Server, leader_wait_s: float = WAIT_S) -> HttpApi:
    host, port = server.address_of("http").split(":")
    return HttpApi(host, int(port), token=TOKEN, leader_wait_s=leader_wait_s)


def start_cluster(cluster: Cluster, partitions: int = 1) -> dict[int, int]:
    """Three nodes and stream "events": each partition's leader, once every node knows
    the stream and each leader takes writes (its first write, ``first-<p>``, stored)."""
    for node_id in (1, 2, 3):
        add_node(cluster, node_id)
    with api_at(cluster.nodes[1]) as api:
        api.request(
            "POST",
            "/api/streams",
            json.dumps({"name": "events", "settings": {"partitions": partitions}}).encode(),
            "application/json",
        )
    placed = cluster.wait_partitions(partitions)
    leaders = {p: int(placed[f"0/events/{p}"]["leader"]) for p in range(partitions)}
    for node in cluster.nodes.values():  # the others make the stream at their next tick
        with api_at(node) as api:
            wait_until(lambda a=api: _has_events(a), timeout=WAIT_S)
    for p, leader in leaders.items():
        # A leader takes its epoch on its next tick: until then it refuses (503), which
        # the client waits out.
        with api_at(cluster.nodes[leader]) as api:
            api.append_arrow("events", values([f"first-{p}"]), partition=p)
            assert api.redirects == 0
    return leaders


def _has_events(api: HttpApi) -> bool:
    try:
        api.request("GET", "/api/streams/events")
    except StreamNotFound:  # until the node's tick makes it
        return False
    return True


def values(texts: list[str]) -> pa.RecordBatch:
    return pa.record_batch({"value": pa.array([t.encode() for t in texts], pa.binary())})


def stored(server: Server, partition: int = 0) -> list[str]:
    """Every value of the partition, read from ``server`` over HTTP from offset 0."""
    out: list[str] = []
    with api_at(server) as api:
        while True:
            page = api.request(
                "GET", f"/api/streams/events/events?partition={partition}&from={len(out)}"
            )
            out += [e["value"] for e in page["events"]]
            if not page["events"]:
                return out


def cli(*args: str, stdin: bytes) -> str:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    env.pop("HEADWATER_SERVER", None)
    env.pop("HEADWATER_TOKEN", None)
    proc = subprocess.run(
        [sys.executable, "-m", "headwater.cli.main", *args],
        input=stdin,
        capture_output=True,
        env=env,
        timeout=WAIT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    return proc.stdout.decode()


def test_http_client_and_cli_at_a_follower_store_once_on_the_leader(cluster: Cluster) -> None:
    [leader] = start_cluster(cluster).values()
    follower, other = (n for n in (1, 2, 3) if n != leader)
    lead = cluster.nodes[leader]

    # Idempotent (the Spark sink's way) and plain appends, and the JSON append.
    with api_at(cluster.nodes[follower]) as api:
        first = api.append_arrow("events", values([f"a{i}" for i in range(100)]), producer=(7, 0))
        assert (first["base_offset"], first["count"]) == (1, 100)
        assert api.redirects == 1 and api.address == lead.address_of("http")
        plain = api.append_arrow("events", values(["b0", "b1"]))
        assert plain["base_offset"] == 101
        assert api.redirects == 1  # later requests go to the leader straight away
        # The same producer and sequence again: answered from the leader's producer
        # table with where it is, nothing appended.
        again = api.append_arrow("events", values([f"a{i}" for i in range(100)]), producer=(7, 0))
        assert again["base_offset"] == 1
    with api_at(cluster.nodes[other]) as api:
        body = json.dumps({"records": [{"value": "c0"}, {"value": "c1"}]}).encode()
        answer = api.request("POST", "/api/streams/events/events", body, "application/json")
        assert api.redirects == 1, answer

    # The CLI pointed at a follower, with the token (its append follows the leader).
    out = cli(
        "append",
        "events",
        "--server",
        cluster.nodes[follower].address,
        "--token",
        TOKEN,
        stdin=b"cli-0\ncli-1\ncli-2\n",
    )
    assert "appended 3 events to events" in out, out

    expected = ["first-0", *(f"a{i}" for i in range(100)), "b0", "b1", "c0", "c1"]
    expected += ["cli-0", "cli-1", "cli-2"]
    cluster.wait_replicas_agree([1, 2, 3], len(expected))
    for node in cluster.nodes.values():  # once each node's high watermark covers them
        wait_until(
            lambda n=node: stored(n) == expected,
            timeout=WAIT_S,
            message=lambda n=node: str(stored(n)),
        )
    # Nothing was stored on a follower by the refused requests (the replicas agree) and
    # the followers' logs show one refusal each, without a traceback.
    for node_id in (follower, other):
        assert "Traceback" not in cluster.nodes[node_id].log_tail()


def test_leader_killed_with_an_append_in_flight(cluster: Cluster) -> None:
    """The client, moved to the leader, has an idempotent append in flight when the
    leader is stopped, replaced (etcd elects another) and killed: the client goes back
    to the node it was given, follows it to the new leader and resends; the append is
    stored once, and so is everything acknowledged before."""
    [leader] = start_cluster(cluster).values()
    home = next(n for n in (1, 2, 3) if n != leader)
    old = cluster.nodes[leader]
    api = api_at(cluster.nodes[home])
    try:
        for sequence in range(5):
            batch = values([f"s{sequence}-{i}" for i in range(10)])
            api.append_arrow("events", batch, producer=(11, sequence))
        assert api.address == old.address_of("http")
        cluster.wait_replicas_agree([1, 2, 3], 51)  # all acknowledged, everywhere

        os.kill(old.pid, signal.SIGSTOP)  # takes the request, never answers it
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(
                api.append_arrow,
                "events",
                values([f"s5-{i}" for i in range(10)]),
                producer=(11, 5),
            )
            new_leader = wait_until(
                lambda: (
                    (p := cluster.partitions()["0/events/0"])["leader"] != leader
                    and p["leader"] != -1
                    and int(p["leader"])
                ),
                timeout=WAIT_S,
                message=lambda: str(cluster.status()),
            )
            assert not in_flight.done()  # still waiting on the stopped leader
            old.kill()
            answer = in_flight.result(WAIT_S)
        assert answer["base_offset"] == 51
        assert api.address == cluster.nodes[new_leader].address_of("http")
        # To the old leader, then back home, which is the new leader or names it.
        assert api.redirects >= (1 if new_leader == home else 2)
        after = api.append_arrow("events", values(["s6-0"]), producer=(11, 6))
        assert after["base_offset"] == 61
    finally:
        api.close()
    survivors = [n for n in (1, 2, 3) if n != leader]
    expected = ["first-0", *(f"s{s}-{i}" for s in range(6) for i in range(10)), "s6-0"]
    cluster.wait_replicas_agree(survivors, len(expected))
    for node_id in survivors:
        wait_until(lambda n=cluster.nodes[node_id]: stored(n) == expected, timeout=WAIT_S)


@pytest.mark.spark
def test_spark_sink_at_a_follower_stores_every_row_once(cluster: Cluster, spark: Any) -> None:
    """Two partitions led by two nodes; the sink is given the third, which leads
    neither: each partition's appends follow its own leader."""
    leaders = start_cluster(cluster, partitions=2)
    assert len(set(leaders.values())) == 2, leaders  # placed evenly
    neither = next(n for n in (1, 2, 3) if n not in leaders.values())
    rows = spark.range(0, 2000, numPartitions=3).selectExpr(
        "concat('k', CAST(id % 13 AS STRING)) AS key", "concat('v', CAST(id AS STRING)) AS value"
    )
    (
        rows.write.format("headwater")
        .option("server", cluster.nodes[neither].address)
        .option("token", TOKEN)
        .option("stream", "events")
        .mode("append")
        .save()
    )
    written: list[str] = []
    for p, leader in leaders.items():
        on_leader = stored(cluster.nodes[leader], p)
        assert on_leader[0] == f"first-{p}"
        written += on_leader[1:]
        for node in cluster.nodes.values():  # every replica the same, once followers catch up
            wait_until(lambda n=node, p=p, want=on_leader: stored(n, p) == want, timeout=WAIT_S)
    assert sorted(written) == sorted(f"v{i}" for i in range(2000))  # each row once


def test_a_node_without_a_replica_of_a_partition_refuses_its_reads(cluster: Cluster) -> None:
    """With more nodes than replicas, a node holds no copy of some partitions: it made
    the stream, but its copy of those is empty, and reads (and SQL) there answered
    nothing, as if nothing was written. They are NotLeader now, naming the leader
    (HTTP: 421 with its addresses); reads on a replica are answered as ever."""
    extra = "replication_factor = 2\nmin_insync_replicas = 1\n"
    for node_id in (1, 2, 3):
        server = Server(
            cluster.root / f"node{node_id}",
            config=cluster.config(node_id, extra),
            listen={"kafka": LOCAL, "http": LOCAL},
        )
        cluster.nodes[node_id] = server
        server.start()
    http_json(cluster.nodes[1], "POST", "/api/streams", {"name": "events"})
    placed = cluster.wait_partitions(1)["0/events/0"]
    outsider = next(n for n in (1, 2, 3) if n not in placed["replicas"])
    replica, leader = placed["replicas"][-1], placed["leader"]
    wait_until(  # the leader takes its epoch at its next tick (until then: 503)
        lambda: (
            http_call(cluster.nodes[leader], "POST", "/api/streams/events/events", ["a"])[0] == 200
        ),
        timeout=WAIT_S,
    )
    read = "/api/streams/events/events?partition=0"
    wait_until(
        lambda: (
            [e["value"] for e in http_json(cluster.nodes[replica], "GET", read)["events"]] == ["a"]
        ),
        timeout=WAIT_S,
    )
    status, answer = http_call(cluster.nodes[outsider], "GET", read)
    assert status == 421 and answer["error"]["name"] == "NotLeader", answer
    assert answer["error"]["leader"]["node_id"] == leader
    count = {"sql": "SELECT count(*) FROM events"}
    status, answer = http_call(cluster.nodes[outsider], "POST", "/api/sql", count)
    assert answer["error"]["name"] == "NotLeader", (status, answer)
    # A replica's SQL follows its own commits (its fsync of the copy), which may come a
    # moment after the read above was served up to the leader's high watermark.
    wait_until(
        lambda: http_json(cluster.nodes[replica], "POST", "/api/sql", count)["rows"] == [[1]],
        timeout=WAIT_S,
    )
