"""Entity kinds in a cluster (docs/cluster.md, "Entity kinds"): a kind's changelog is a
replicated partition (``hw_kind_<name>``) placed by the controller. Writes through the
entities SDK are taken by its leader and acknowledged once the in-sync replicas hold
them; a follower refuses them naming the leader's ConvergeDB address; a follower's
kind state (read, scan) is the leader's; and when the leader is SIGKILLed right after
an acknowledged write, the new leader serves every acknowledged entity, and retracts
those of the old leader's writer once it has not come back within the liveness
deadline. Below min_insync_replicas a write is refused, nothing stored."""

from __future__ import annotations

import signal
from dataclasses import dataclass

import pytest
from cluster_nodes import WAIT_S, Cluster
from servers import LOCAL, Server

from headwater import entities
from headwater.entities import EntityError, KindNotFound
from headwater.entities.sync import EntityClient
from waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

COUNT = 50  # entities written on the first leader
ORPHAN_LIVENESS_MS = 6000  # the servers' default liveness deadline


@dataclass
class Sensor:
    site: str
    temp: float


def add_node(cluster: Cluster, node_id: int) -> Server:
    server = Server(
        cluster.root / f"node{node_id}",
        # A paused follower leaves the ISR soon; a writer of the old leader's that does
        # not come back to the new one loses its entities soon.
        config=cluster.config(
            node_id,
            f"replica_lag_s = 2\n\n[convergedb]\ndefault_liveness_ms = {ORPHAN_LIVENESS_MS}\n",
        ),
        listen={"kafka": LOCAL, "convergedb": LOCAL},
    )
    cluster.nodes[node_id] = server
    return server.start()


def leader_of(cluster: Cluster, changelog: str, not_node: int = -1) -> int:
    """The node etcd names as the changelog partition's leader (not ``not_node``)."""

    def found() -> int | None:
        part = cluster.partitions().get(f"0/{changelog}/0")
        leader = None if part is None else int(part["leader"])
        return leader if leader not in (None, -1, not_node) else None

    return wait_until(found, message=lambda: f"no leader: {cluster.status()}", timeout=WAIT_S)


def writer_at(address: str) -> EntityClient:
    """The test's writer: always source 1, with a long liveness deadline (its entities
    stay while it reconnects; the new leader knows neither, and gives it the default)."""
    return entities.connect(address, name="w", source_id=1, liveness_ms=600_000)


def has_kind(server: Server, cls: type[Sensor]) -> bool:
    with entities.connect(server.address_of("convergedb"), read_only=True) as reader:
        try:
            reader.get_kind(cls)
        except KindNotFound:
            return False
        return True


def state_of(server: Server, cls: type[Sensor]) -> dict[str, tuple[Sensor, int]]:
    """The kind's entities as ``server`` reads them: value and version by key."""
    with entities.connect(server.address_of("convergedb"), read_only=True) as reader:
        kind = reader.get_kind(cls)
        return {e.key: (e.value, e.version) for e in reader.scan(kind)}


def test_kind_replicated_refused_on_followers_and_kept_through_leader_kill(
    cluster: Cluster,
) -> None:
    for node_id in (1, 2, 3):
        add_node(cluster, node_id)
    # CREATE_KIND on node 1 is answered once the changelog has a leader (any node).
    with entities.connect(cluster.nodes[1].address_of("convergedb"), name="setup") as setup:
        kind = setup.create_kind(Sensor)
    changelog = f"hw_kind_{kind.name}"
    leader = leader_of(cluster, changelog)
    followers = [n for n in cluster.nodes if n != leader]
    for node in cluster.nodes.values():  # the others make the kind at their next tick
        wait_until(lambda n=node: has_kind(n, Sensor), timeout=WAIT_S)
    # A follower's subscriber gets the replicated changes as they are applied there.
    watcher = entities.connect(cluster.nodes[followers[1]].address_of("convergedb"), read_only=True)
    subscription = watcher.subscribe(watcher.get_kind(Sensor)).start()
    subscription.wait_bootstrapped(WAIT_S)

    # Writes on the leader, acknowledged (flush) once the in-sync replicas hold them.
    with writer_at(cluster.nodes[leader].address_of("convergedb")) as writer:
        kind = writer.get_kind(Sensor)
        for i in range(COUNT):
            writer.assert_(kind, f"s{i}", Sensor(f"site{i}", float(i)))
        writer.flush()
        writer.retract(kind, "s0")  # a deletion is replicated too
        writer.flush()

    # A follower refuses a write, naming the leader's ConvergeDB address.
    follower = cluster.nodes[followers[0]]
    leader_address = cluster.nodes[leader].address_of("convergedb")
    with entities.connect(follower.address_of("convergedb"), name="stray") as stray:
        stray_kind = stray.get_kind(Sensor)
        with pytest.raises(EntityError) as refused:
            stray.assert_(stray_kind, "stray", Sensor("nowhere", -1.0))
            stray.flush()
    assert f"node {leader} leads kind {kind.name}" in str(refused.value)
    assert f"convergedb {leader_address}" in str(refused.value)

    # Every follower's state is the leader's (entities, values and versions).
    expected = state_of(cluster.nodes[leader], Sensor)
    assert len(expected) == COUNT - 1
    for node_id in followers:
        wait_until(
            lambda n=node_id: state_of(cluster.nodes[n], Sensor) == expected,
            message=lambda n=node_id: f"node {n}: {len(state_of(cluster.nodes[n], Sensor))}",
            timeout=WAIT_S,
        )

    def seen_everything() -> bool:
        subscription.next_batch(timeout=0.2)
        view = {entity.key: entity.value for entity in subscription.view.values()}
        return view == {key: value for key, (value, _version) in expected.items()}

    wait_until(seen_everything, message=lambda: f"{len(subscription.view)} seen", timeout=WAIT_S)
    subscription.close()
    watcher.close()

    # Below min_insync_replicas (both followers paused, out of the ISR): a write taken
    # before the ISR shrank is answered as stored but unconfirmed, the next refused.
    paused = [cluster.nodes[n] for n in followers]
    part = f"0/{changelog}/0"
    with writer_at(leader_address) as writer:
        kind = writer.get_kind(Sensor)
        for node in paused:
            node.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        try:
            with pytest.raises(EntityError, match="stored on the leader, unconfirmed"):
                writer.assert_(kind, "unconfirmed", Sensor("leader only", 0.5))
                writer.flush()
            wait_until(
                lambda: cluster.partitions()[part]["isr"] == [leader],
                message=lambda: str(cluster.partitions()[part]),
                timeout=WAIT_S,
            )
            with pytest.raises(EntityError, match="below min_insync_replicas"):
                writer.assert_(kind, "refused", Sensor("nowhere", 0.25))
                writer.flush()
        finally:
            for node in paused:
                node.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
        wait_until(
            lambda: len(cluster.partitions()[part]["isr"]) == 3,
            message=lambda: str(cluster.partitions()[part]),
            timeout=WAIT_S,
        )
        assert writer.get(kind, "refused") is None
        assert writer.get(kind, "unconfirmed") is not None  # stored: kept with the log
    expected = state_of(cluster.nodes[leader], Sensor)

    # An acknowledged write, then the leader SIGKILLed at once: the new leader has it.
    with writer_at(leader_address) as writer:
        kind = writer.get_kind(Sensor)
        writer.assert_(kind, "last", Sensor("acked", 99.0))
        writer.flush()
        cluster.nodes[leader].kill()  # SIGKILL
    new_leader = leader_of(cluster, changelog, not_node=leader)
    new_address = cluster.nodes[new_leader].address_of("convergedb")

    def served() -> dict[str, tuple[Sensor, int]] | None:
        state = state_of(cluster.nodes[new_leader], Sensor)
        return state if len(state) == len(expected) + 1 else None

    after = wait_until(served, message=lambda: "the acknowledged write is lost", timeout=WAIT_S)
    assert {k: v for k, v in after.items() if k in expected} == expected
    (last,) = [value for k, (value, _version) in after.items() if k not in expected]
    assert last == Sensor("acked", 99.0)
    # And it takes writes (once it has applied all of its copy).
    with entities.connect(new_address, name="w2") as writer2:
        kind = writer2.get_kind(Sensor)

        def written() -> bool:
            try:
                writer2.assert_(kind, "after", Sensor("new leader", 1.0))
                writer2.flush()
            except EntityError:
                return False
            return True

        wait_until(written, timeout=WAIT_S)
        found = writer2.get(kind, "after")
        assert found is not None and found.value == Sensor("new leader", 1.0)
        # The old leader's writer (source 1) did not come back: after the default
        # liveness deadline the new leader retracts what it alone held.
        wait_until(
            lambda: set(state_of(cluster.nodes[new_leader], Sensor)) == {"after"},
            message=lambda: f"{len(state_of(cluster.nodes[new_leader], Sensor))} entities",
            timeout=WAIT_S,
        )
