"""Adding a node and moving a partition onto it (``headwater cluster reassign``) while
an idempotent acks=all producer writes: the new replica is copied and joins the ISR,
then the old replica (here the leader, so leadership moves too) is dropped; nothing
acknowledged is lost or duplicated and the new replica holds the same bytes."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
from cluster_nodes import WAIT_S, Cluster
from test_cluster_faults import TOPIC, Acks, produce_forever, read_back
from test_cluster_membership import create_topic

from waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def reassign(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "headwater.cli.main", "cluster", "reassign",
         "--etcd", cluster.etcd.endpoint, *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_partition_moves_onto_a_new_node(cluster: Cluster) -> None:
    for node_id in (1, 2, 3):
        cluster.add(node_id)
    create_topic(cluster.nodes[1].address_of("kafka"), TOPIC, 1)
    part = cluster.wait_partitions(1)[f"0/{TOPIC}/0"]
    old_leader, epoch = part["leader"], part["epoch"]
    acks = Acks()
    stop = threading.Event()
    producer = threading.Thread(
        target=produce_forever, args=(cluster.bootstrap(), acks, stop), daemon=True
    )
    producer.start()
    try:
        wait_until(lambda: acks.count() >= 500, timeout=WAIT_S)
        cluster.add(4)
        wait_until(lambda: 4 in {n["node_id"] for n in cluster.status()["nodes"]})
        # Refused clearly, nothing requested: a node that is not alive, a repeat.
        dead = reassign(cluster, "--stream", TOPIC, "--partition", "0", "--replicas", "4,9")
        assert dead.returncode == 1 and "node(s) 9 not alive" in dead.stderr, dead
        twice = reassign(cluster, "--stream", TOPIC, "--partition", "0", "--replicas", "4,4")
        assert twice.returncode == 1 and "distinct" in twice.stderr, twice
        missing = reassign(cluster, "--stream", "nope", "--partition", "0", "--replicas", "4")
        assert missing.returncode == 1 and "not placed" in missing.stderr, missing

        target = [4, *(n for n in part["replicas"] if n != old_leader)]
        moved = reassign(
            cluster, "--stream", TOPIC, "--partition", "0",
            "--replicas", ",".join(map(str, target)), "--wait", str(WAIT_S),
        )  # fmt: skip
        assert moved.returncode == 0, moved
        assert "done" in moved.stdout, moved.stdout
        after = cluster.partitions()[f"0/{TOPIC}/0"]
        assert after["replicas"] == target and sorted(after["isr"]) == sorted(target)
        assert after["leader"] in target and after["epoch"] == epoch + 1
        assert after["reassigning"] is None
        # The old replica is dropped: nothing left of it on its node.
        wait_until(
            lambda: "replica dropped" in cluster.nodes[old_leader].log_text(), timeout=WAIT_S
        )
        assert not any(cluster.log_files(old_leader).values())
        # Writes go on at the moved partition.
        more = acks.count() + 300
        wait_until(lambda: acks.count() >= more, timeout=WAIT_S)
    finally:
        stop.set()
        producer.join(150)
    assert not producer.is_alive()
    assert acks.failed == []
    end = max(acks.offsets.values()) + 1
    assert cluster.wait_replicas_agree(target, end)
    found = read_back(cluster.nodes[4].address_of("kafka"), end)
    values = [value for _, value in found]
    assert len(values) == len(set(values)) == end
    stored_at = {value: offset for offset, value in found}
    assert all(stored_at[v] == offset for v, offset in acks.offsets.items())
    assert all(v in stored_at for v in acks.acknowledged())
