"""Membership, placement and leadership in etcd, against real etcd and real nodes:
partitions placed evenly, a killed leader's partitions moved to an in-sync follower
with a new epoch, a node that stops cleanly handing over at once, and the start-up
refusals (etcd unreachable, a node id a live node holds)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cluster_nodes import LEASE_S, WAIT_S, Cluster
from confluent_kafka.admin import AdminClient, NewTopic
from servers import free_port

from headwater.cluster.local import EtcdProcess, node_config
from waiting import wait_until

pytestmark = pytest.mark.cluster


def create_topic(bootstrap: str, name: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, partitions, 1)])[name].result(15)


def test_partitions_are_placed_evenly_and_streams_reach_every_node(cluster: Cluster) -> None:
    for node_id in (1, 2, 3):
        cluster.add(node_id)
    create_topic(cluster.nodes[1].address_of("kafka"), "orders", 3)
    placed = cluster.wait_partitions(3)
    assert sorted(p["leader"] for p in placed.values()) == [1, 2, 3]
    for part in placed.values():
        assert sorted(part["replicas"]) == [1, 2, 3] and sorted(part["isr"]) == [1, 2, 3]
        assert part["epoch"] == 1
    # Created through node 1 only; the others made it from etcd's registry.
    for node_id in (2, 3):
        admin = AdminClient({"bootstrap.servers": cluster.nodes[node_id].address_of("kafka")})
        wait_until(
            lambda admin=admin: "orders" in admin.list_topics(timeout=5).topics, timeout=WAIT_S
        )
    status = cluster.status()
    assert sorted(n["node_id"] for n in status["nodes"]) == [1, 2, 3]
    assert status["controller"] in (1, 2, 3)


def test_a_killed_leader_s_partitions_move_to_in_sync_followers(cluster: Cluster) -> None:
    for node_id in (1, 2, 3):
        cluster.add(node_id)
    create_topic(cluster.nodes[1].address_of("kafka"), "moves", 3)
    before = cluster.wait_partitions(3)
    victim = before["0/moves/0"]["leader"]
    killed_at = time.monotonic()
    cluster.nodes[victim].kill()

    def moved() -> bool:
        return cluster.partitions()["0/moves/0"]["leader"] != victim

    wait_until(moved, timeout=WAIT_S, message=lambda: str(cluster.status()))
    failover_s = time.monotonic() - killed_at
    print(f"failover after SIGKILL: {failover_s:.2f} s (lease_s = {LEASE_S})")

    # The leaders of the victim's other partitions drop it from their ISR later (after
    # replica_lag_s without its fetches): that is waited for too.
    def dropped() -> dict[str, dict[str, Any]] | None:
        now = cluster.partitions()
        return now if all(victim not in part["isr"] for part in now.values()) else None

    after = wait_until(dropped, timeout=WAIT_S, message=lambda: str(cluster.status()))
    for path, part in after.items():
        assert victim not in part["isr"]
        if before[path]["leader"] == victim:
            assert part["leader"] in before[path]["isr"] and part["leader"] != victim
            assert part["epoch"] == before[path]["epoch"] + 1
        else:  # its leader lived: same leader, same epoch, only the ISR shrank
            assert (part["leader"], part["epoch"]) == (
                before[path]["leader"],
                before[path]["epoch"],
            )
    # The killed node comes back (after its old registration expires) as a member.
    cluster.nodes[victim].start()
    wait_until(lambda: victim in [n["node_id"] for n in cluster.status()["nodes"]], timeout=WAIT_S)

    # A node stopped cleanly revokes its lease: its partitions move without waiting it
    # out. Its registration is gone as soon as it has exited (a lease would keep it
    # for lease_s), which is what lets the controller move them at its next tick.
    leader = cluster.partitions()["0/moves/1"]["leader"]
    assert cluster.nodes[leader].stop() == 0
    assert leader not in [n["node_id"] for n in cluster.status()["nodes"]]
    wait_until(
        lambda: cluster.partitions()["0/moves/1"]["leader"] != leader,
        timeout=WAIT_S,
        message=lambda: str(cluster.status()),
    )


def serve(tmp_path: Path, config: str) -> subprocess.CompletedProcess[str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "node.toml").write_text(config)
    return subprocess.run(
        [sys.executable, "-m", "headwater.cli.main", "serve", "--data-dir",
         str(tmp_path / "data"), "--config", str(tmp_path / "node.toml")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_a_node_id_held_by_a_live_node_is_refused(
    cluster: Cluster, etcd: EtcdProcess, tmp_path: Path
) -> None:
    cluster.add(1)
    listen = {"kimberlite": "127.0.0.1:0", "kafka": "", "http": "", "convergedb": ""}
    listen |= {"ripple": "", "rivven": "", "postgres": ""}
    config = node_config(1, etcd.endpoint, listen, extra=f"lease_s = {LEASE_S}\n")
    refused = serve(tmp_path / "second", config)
    assert refused.returncode == 2, refused.stderr
    assert "node_id 1 is held by another live node" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert cluster.nodes[1].running


def test_etcd_unreachable_at_start_is_one_line(tmp_path: Path) -> None:
    listen = {"kimberlite": "127.0.0.1:0", "kafka": "", "http": "", "convergedb": ""}
    listen |= {"ripple": "", "rivven": "", "postgres": ""}
    config = node_config(1, f"127.0.0.1:{free_port()}", listen)
    refused = serve(tmp_path, config)
    assert refused.returncode == 2, refused.stderr
    assert "cannot join the cluster: no etcd endpoint answered" in refused.stderr
    assert "Traceback" not in refused.stderr
