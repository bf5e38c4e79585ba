"""A kind's changelog copied from a leader (engine/kinds/replicated.py): a follower that
applies it below the high watermark has the leader's state there (values, versions,
source sets, deletions and re-creations, counts), its subscribers get the changes, it
refuses writes naming the leader, and once it leads it takes them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from headwater.api.replication import Replicas
from headwater.cluster.layout import NodeInfo, PartitionKey
from headwater.cluster.view import not_leader
from headwater.engine.engine import Engine, EngineConfig
from headwater.engine.kinds import (
    ChangeType,
    KindsConfig,
    KindsEngine,
    StateChange,
    TenantKinds,
    assert_op,
    patch_op,
    retract_op,
)
from headwater.engine.kinds.model import changelog_stream
from headwater.errors import NotLeader
from headwater.protocols.convergedb.fields import FieldType
from waiting import wait_until_async

ENGINE = EngineConfig(maintenance_interval_ms=0, tenants={0: "default"})
FIELDS = [("temp", FieldType.F64), ("label", FieldType.STRING)]
STREAM = changelog_stream("sensor")
LEADER = NodeInfo(1, "10.0.0.1", ports={"convergedb": 7402, "http": 8080, "replication": 7409})


def eid(n: int) -> bytes:
    return n.to_bytes(32, "big")


def state(tk: TenantKinds, kind_id: int) -> dict[bytes, tuple[int, int, object]]:
    return {e.entity_id: (e.version, e.source_set, e.values) for e in tk.scan(kind_id)}


def test_a_follower_applies_its_leaders_changelog_below_the_high_watermark(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        leader_engine = await Engine.open(tmp_path / "leader", ENGINE)
        follower_engine = await Engine.open(tmp_path / "follower", ENGINE)
        leader = await KindsEngine.open(leader_engine, KindsConfig(coalesce_ms=5))
        # A hot set smaller than the kind: the follower checkpoints what it applied to
        # its store and evicts, as a leader does after its windows.
        follower = await KindsEngine.open(
            follower_engine, KindsConfig(coalesce_ms=5, hot_entities=4)
        )
        try:
            lt, ft = leader.tenant(0), follower.tenant(0)
            kind = await lt.create_kind("sensor", FIELDS)
            mine = await ft.create_kind("sensor", FIELDS)
            leads = False

            def leader_check(tenant_id: int, stream: str, partition: int) -> None:
                # The cluster's refusal (cluster/view.py), with node 1 leading.
                if not leads:
                    raise not_leader(PartitionKey(tenant_id, stream, partition), LEADER)

            follower_engine.leader_check = leader_check
            high_watermark = 0
            follower.changelogs.limit(0, STREAM, lambda: high_watermark)
            subscription = ft.subscribe(mine.kind_id)

            # The leader's windows: creations by two sources, patches, a retraction that
            # leaves an entity to the other source, deletions, a re-creation.
            a, b = lt.connect("a"), lt.connect("b")
            await a.apply(
                [assert_op(kind, eid(i), [float(i), f"s{i}"]) for i in range(20)]
            ).durable()
            await b.apply([patch_op(kind, eid(i), {0: -1.0}) for i in range(0, 20, 2)]).durable()
            await a.apply([retract_op(kind, eid(i)) for i in range(10)]).durable()
            middle = state(lt, kind.kind_id)
            middle_end = leader.changelogs.state(0, STREAM).log.committed_offset
            await a.apply([assert_op(kind, eid(3), [3.5, "again"])]).durable()
            await b.apply([retract_op(kind, eid(i)) for i in range(10, 20)]).durable()
            final = state(lt, kind.kind_id)

            # Copied byte for byte, then applied only below the high watermark.
            source, copy = (
                Replicas(leader_engine, leader.changelogs),
                Replicas(follower_engine, follower.changelogs),
            )
            stored = await source.read_stored(0, STREAM, 0, 0, 1 << 20)
            end = await copy.append_stored(0, STREAM, 0, stored)
            assert state(ft, mine.kind_id) == {}
            high_watermark = middle_end
            follower.changelogs.moved(0, STREAM)
            applied = follower.changelogs.state(0, STREAM)
            await wait_until_async(lambda: applied.applied_offset == middle_end)
            assert state(ft, mine.kind_id) == middle
            high_watermark = end
            follower.changelogs.moved(0, STREAM)
            await wait_until_async(lambda: applied.applied_offset == end)
            assert state(ft, mine.kind_id) == final
            stored = applied.store.meta
            # The checkpoint is in the store (written by a worker thread), then the
            # loop evicts: a poll between the two once saw 16 hot entities.
            await wait_until_async(
                lambda: (m := stored()) is not None and m.offset == end and len(applied.hot) <= 4
            )
            assert not applied.complete
            assert state(ft, mine.kind_id) == final  # read through the store now

            # A divergent tail cut below what it applied (an old leader returning): the
            # state is rebuilt from the changelog as cut, then follows again.
            assert await copy.truncate(0, STREAM, 0, middle_end) == middle_end
            assert state(ft, mine.kind_id) == middle
            assert applied.applied_offset == middle_end
            tail = await source.read_stored(0, STREAM, 0, middle_end, 1 << 20)
            assert await copy.append_stored(0, STREAM, 0, tail) == end
            follower.changelogs.moved(0, STREAM)
            await wait_until_async(lambda: applied.applied_offset == end)
            assert state(ft, mine.kind_id) == final
            assert applied.count == len(final) == ft.entity_count(mine.kind_id)
            leader_held = leader.changelogs.state(0, STREAM).held_counts
            assert applied.held_counts == leader_held

            # The subscriber saw every change, ending where the leader is: the last
            # change of each entity is its state there (its version), or its deletion.
            last: dict[bytes, StateChange] = {}
            for note in subscription.take_buffered():
                assert isinstance(note, StateChange)
                last[note.entity_id] = note
            assert len(last) == 20
            alive = {e: n.version for e, n in last.items() if n.change != ChangeType.DELETED}
            assert alive == {e: version for e, (version, _, _) in final.items()}

            # A follower refuses writes, naming the kind, its leader and the leader's
            # client listeners (not its replication port); leading, it takes them. Its
            # writer gets a slot no copied entity carries: slots 0 and 1 are the
            # leader's writers' (a and b), which it holds for them once it leads.
            writer = ft.connect("w")
            assert writer.source_id == 2
            with pytest.raises(NotLeader) as refused:
                ft.apply(writer, [assert_op(mine, eid(99), [9.0, "no"])])
            assert refused.value.message == (
                "node 1 leads kind sensor: convergedb 10.0.0.1:7402, http 10.0.0.1:8080"
            )
            assert refused.value.address_of("convergedb") == "10.0.0.1:7402"
            assert refused.value.leader == {
                "node_id": 1,
                "convergedb": "10.0.0.1:7402",
                "http": "10.0.0.1:8080",
            }
            assert state(ft, mine.kind_id) == final  # nothing applied
            with pytest.raises(NotLeader, match="taking over the leadership of kind sensor"):
                leads = True  # the first write has it apply the rest of its copy
                ft.apply(writer, [assert_op(mine, eid(99), [9.0, "not yet"])])
            await wait_until_async(lambda: not applied.following)
            await ft.apply(writer, [assert_op(mine, eid(99), [9.0, "yes"])]).durable()
            assert state(ft, mine.kind_id)[eid(99)][2] == (9.0, "yes")
        finally:
            await leader.close()
            await follower.close()
            await leader_engine.close()
            await follower_engine.close()

    asyncio.run(main())


def test_a_kind_without_a_leader_is_refused_by_name() -> None:
    """During an election the refusal names the kind (retry shortly), and a stream's
    partition is named as the partition."""
    refused = not_leader(PartitionKey(0, STREAM, 0), None)
    assert refused.message == "kind sensor has no leader right now"
    assert refused.leader is None
    refused = not_leader(PartitionKey(0, "events", 2), LEADER)
    assert refused.message.startswith("node 1 leads partition 2 of events: convergedb")
