"""Placement and failover decisions of the cluster controller (headwater.cluster.layout),
and the [cluster] config table."""

from __future__ import annotations

from collections import Counter

import pytest

from headwater.cluster.layout import (
    NO_LEADER,
    NodeInfo,
    PartitionState,
    after_failures,
    place_replicas,
    reassignment_step,
)
from headwater.server.config import ConfigError, config_from_dict


def nodes(*racks: str | None) -> list[NodeInfo]:
    return [NodeInfo(i + 1, "127.0.0.1", rack) for i, rack in enumerate(racks)]


def test_partitions_spread_evenly_and_leaders_rotate() -> None:
    load: Counter[int] = Counter()
    leaders: Counter[int] = Counter()
    placed = [place_replicas(nodes(None, None, None, None), load, leaders, 3) for _ in range(8)]
    assert all(len(set(replicas)) == 3 for replicas in placed)
    assert load == Counter({1: 6, 2: 6, 3: 6, 4: 6})  # 8 partitions x 3 replicas / 4 nodes
    assert leaders == Counter({1: 2, 2: 2, 3: 2, 4: 2})
    assert len({replicas[0] for replicas in placed[:4]}) == 4  # the first four: all lead


def test_replicas_go_to_different_racks_first() -> None:
    load: Counter[int] = Counter()
    leaders: Counter[int] = Counter()
    # nodes 1, 2 in rack a; 3, 4 in rack b: two replicas always span both racks
    for _ in range(6):
        replicas = place_replicas(nodes("a", "a", "b", "b"), load, leaders, 2)
        assert {1, 2} & set(replicas) and {3, 4} & set(replicas), replicas


def test_fewer_live_nodes_than_the_factor_gives_fewer_replicas() -> None:
    assert len(place_replicas(nodes(None, None), Counter(), Counter(), 3)) == 2
    assert place_replicas([], Counter(), Counter(), 3) == ()


def test_a_dead_leader_moves_to_a_live_in_sync_replica_with_a_new_epoch() -> None:
    state = PartitionState((1, 2, 3), leader=1, epoch=4, isr=(1, 2, 3))
    moved = after_failures(state, live={2, 3})
    assert moved == PartitionState((1, 2, 3), leader=2, epoch=5, isr=(2, 3))


def test_an_out_of_sync_replica_never_leads() -> None:
    state = PartitionState((1, 2, 3), leader=1, epoch=4, isr=(1, 2))
    moved = after_failures(state, live={3})  # 3 is alive but was not in sync
    assert moved.leader == NO_LEADER and moved.epoch == 5
    assert moved.isr == (1,)  # the old leader holds every acknowledged write
    back = after_failures(moved, live={1, 3})
    assert back == PartitionState((1, 2, 3), leader=1, epoch=6, isr=(1,))


def test_a_dead_follower_leaves_the_isr_without_a_new_epoch() -> None:
    state = PartitionState((1, 2, 3), leader=1, epoch=4, isr=(1, 2, 3))
    assert after_failures(state, live={1, 2}) == PartitionState((1, 2, 3), 1, 4, (1, 2))
    assert after_failures(state, live={1, 2, 3}) is state


def test_a_reassignment_adds_first_then_drops_once_in_sync() -> None:
    state = PartitionState((1, 2, 3), 1, 4, (1, 2, 3))
    live = {1, 2, 3, 4}
    assert reassignment_step(state, (4, 2, 3), {1, 2, 3}) is state  # 4 not alive: waits
    adding = reassignment_step(state, (4, 2, 3), live)
    assert adding == PartitionState((1, 2, 3, 4), 1, 4, (1, 2, 3))
    assert reassignment_step(adding, (4, 2, 3), live) is adding  # 4 not in sync yet
    in_sync = PartitionState((1, 2, 3, 4), 1, 4, (1, 2, 3, 4))
    # The leader (1) is left out: the first in-sync target replica leads, epoch + 1.
    done = reassignment_step(in_sync, (4, 2, 3), live)
    assert done == PartitionState((4, 2, 3), 4, 5, (2, 3, 4))
    assert reassignment_step(done, (4, 2, 3), live) is done
    # A leader that stays keeps leading and its epoch.
    kept = reassignment_step(PartitionState((1, 2, 3, 4), 2, 4, (1, 2, 3, 4)), (2, 3, 4), live)
    assert kept == PartitionState((2, 3, 4), 2, 4, (2, 3, 4))


def test_cluster_config_table() -> None:
    assert config_from_dict({}).cluster is None
    config = config_from_dict(
        {
            "cluster": {
                "node_id": 2,
                "etcd": ["127.0.0.1:2379"],
                "rack": "r1",
                "lease_s": 3,
                "advertise_ports": {"replication": 7500, "kafka": 19092},
            }
        }
    ).cluster
    assert config is not None
    assert (config.node_id, config.etcd, config.rack, config.lease_s) == (
        2, ("127.0.0.1:2379",), "r1", 3,
    )  # fmt: skip
    assert (config.replication_factor, config.min_insync_replicas) == (3, 2)
    assert dict(config.advertise_ports) == {"kafka": 19092, "replication": 7500}


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"etcd": ["e:1"]}, "node_id"),
        ({"node_id": 1}, "cluster.etcd"),
        ({"node_id": 1, "etcd": ["e:1"], "lease_s": 0}, "lease_s"),
        ({"node_id": 1, "etcd": ["e:1"], "replication_factor": 1}, "min_insync_replicas"),
        ({"node_id": 1, "etcd": ["e:1"], "leader": 1}, "unknown key"),
        ({"node_id": 1, "etcd": ["e:1"], "advertise_ports": {"kafka": 0}}, "advertise_ports"),
        ({"node_id": 1, "etcd": ["e:1"], "advertise_ports": 9092}, "advertise_ports"),
    ],
)
def test_bad_cluster_config_is_refused(table: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"cluster": table})
