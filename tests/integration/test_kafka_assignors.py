"""Kafka groups assigned by their leader, as Kafka's are: confluent-kafka's range,
roundrobin and cooperative-sticky (incremental rebalance) and aiokafka's roundrobin and a
custom assignor the server has never heard of, each a group of three rebalancing when one
member leaves, against a real server (docs/kafka.md)."""

from __future__ import annotations

import asyncio
import importlib
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.cluster import ClusterMetadata
from aiokafka.coordinator.assignors.abstract import AbstractPartitionAssignor
from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from aiokafka.coordinator.protocol import (
    ConsumerProtocolMemberAssignment,
    ConsumerProtocolMemberMetadata,
)
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from kio.schema.types import GroupId
from kio.static.primitive import i32Timedelta
from servers import LOCAL, Server, serving
from test_kafka_stored_batches import RawKafka

from headwater.protocols.kafka import ApiKey, ErrorCode

PARTITIONS = 6
DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(tmp_path_factory.mktemp("kafka"), listen={"kafka": LOCAL}, clean_log=True)


def create_topic(server: Server) -> str:
    name = "assign_" + uuid.uuid4().hex[:10]
    admin = AdminClient({"bootstrap.servers": server.address_of("kafka")})
    admin.create_topics([NewTopic(name, num_partitions=PARTITIONS)])[name].result(DEADLINE_S)
    return name


class Member:
    """A confluent-kafka group consumer and the partitions its callbacks revoked."""

    def __init__(
        self, server: Server, group: str, strategy: str, topic: str, **config: str
    ) -> None:
        self.consumer = Consumer(
            {
                "bootstrap.servers": server.address_of("kafka"),
                "group.id": group,
                "partition.assignment.strategy": strategy,
                "session.timeout.ms": 6_000,
                "heartbeat.interval.ms": 300,
                "enable.auto.commit": False,
                **config,
            }
        )
        self.revoked: list[int] = []
        self.consumer.subscribe([topic], on_revoke=self._on_revoke)

    def _on_revoke(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.revoked += [tp.partition for tp in partitions]

    def owned(self) -> set[int]:
        return {tp.partition for tp in self.consumer.assignment()}


def poll_until(members: list[Member], done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        for member in members:
            message = member.consumer.poll(0.05)
            assert message is None or message.error() is None, message.error()


def split(members: list[Member], sizes: list[int]) -> bool:
    owned = [m.owned() for m in members]
    every = [p for o in owned for p in o]
    return sorted(len(o) for o in owned) == sizes and sorted(every) == list(range(PARTITIONS))


@pytest.mark.parametrize("strategy", ["range", "roundrobin", "cooperative-sticky"])
def test_confluent_kafka_group_of_three_with_the_clients_assignor(
    server: Server, strategy: str
) -> None:
    topic = create_topic(server)
    group = "g_" + uuid.uuid4().hex[:8]
    members = [Member(server, group, strategy, topic) for _ in range(3)]
    try:
        poll_until(members, lambda: split(members, [2, 2, 2]), "3 x 2 partitions")
        shapes = sorted(tuple(sorted(m.owned())) for m in members)
        if strategy == "range":  # contiguous ranges, members in member id order
            assert shapes == [(0, 1), (2, 3), (4, 5)]
        elif strategy == "roundrobin":  # dealt one at a time
            assert shapes == [(0, 3), (1, 4), (2, 5)]
        before = {id(m): m.owned() for m in members}
        for m in members:
            m.revoked.clear()
        members.pop().consumer.close()  # LeaveGroup
        poll_until(members, lambda: split(members, [3, 3]), "the leaver's partitions to move")
        if strategy == "cooperative-sticky":
            # Incremental: the survivors keep what they had and revoke nothing.
            for m in members:
                assert before[id(m)] <= m.owned()
                assert m.revoked == []
    finally:
        for m in members:
            m.consumer.close()


class LastTakesAll(AbstractPartitionAssignor):
    """Every partition to the member whose id sorts last: no server-side assignor
    would give this."""

    name = "last_takes_all"
    version = 0

    @classmethod
    def assign(
        cls, cluster: ClusterMetadata, members: Mapping[str, ConsumerProtocolMemberMetadata]
    ) -> dict[str, ConsumerProtocolMemberAssignment]:
        topics = sorted({t for m in members.values() for t in m.subscription})
        everything = [(t, sorted(cluster.partitions_for_topic(t) or ())) for t in topics]
        last = max(members)
        return {
            member: ConsumerProtocolMemberAssignment(
                cls.version, everything if member == last else [], b"who=" + member.encode()
            )
            for member in members
        }

    @classmethod
    def metadata(cls, topics: Iterable[str]) -> ConsumerProtocolMemberMetadata:
        return ConsumerProtocolMemberMetadata(cls.version, list(topics), b"")

    @classmethod
    def on_assignment(cls, assignment: ConsumerProtocolMemberAssignment) -> None:
        pass


@pytest.mark.parametrize("assignor", [RoundRobinPartitionAssignor, LastTakesAll])
def test_aiokafka_group_of_three_with_the_clients_assignor(server: Server, assignor: Any) -> None:
    topic = create_topic(server)
    group = "aio_" + uuid.uuid4().hex[:8]

    async def run() -> list[dict[str, set[int]]]:
        consumers = [
            AIOKafkaConsumer(
                topic,
                bootstrap_servers=server.address_of("kafka"),
                group_id=group,
                partition_assignment_strategy=(assignor,),
                session_timeout_ms=6_000,
                heartbeat_interval_ms=300,
                enable_auto_commit=False,
            )
            for _ in range(3)
        ]

        def owned() -> dict[str, set[int]]:
            return {
                c._coordinator.member_id: {tp.partition for tp in c.assignment()} for c in consumers
            }

        async def settled(sizes: list[int]) -> dict[str, set[int]]:
            async with asyncio.timeout(DEADLINE_S):
                while True:
                    now = owned()
                    every = sorted(p for o in now.values() for p in o)
                    if sorted(map(len, now.values())) == sizes and every == list(range(PARTITIONS)):
                        return now
                    await asyncio.gather(*(c.getmany(timeout_ms=50) for c in consumers))

        for consumer in consumers:
            await consumer.start()
        try:
            three = await settled([0, 0, 6] if assignor is LastTakesAll else [2, 2, 2])
            await consumers.pop().stop()  # LeaveGroup
            two = await settled([0, 6] if assignor is LastTakesAll else [3, 3])
            return [three, two]
        finally:
            for consumer in consumers:
                await consumer.stop()

    for owned in asyncio.run(run()):
        if assignor is LastTakesAll:  # the leader's choice, to the member
            assert owned[max(owned)] == set(range(PARTITIONS))
        else:  # sorted member ids dealt the sorted partitions in turn
            ids = sorted(owned)
            assert all(owned[m] == set(range(i, PARTITIONS, len(ids))) for i, m in enumerate(ids))


def test_a_restarted_static_member_gets_its_partitions_back_without_a_rebalance(
    server: Server,
) -> None:
    topic = create_topic(server)
    group = "static_" + uuid.uuid4().hex[:8]

    def static(instance: str) -> Member:
        return Member(server, group, "range", topic, **{"group.instance.id": instance})

    members = [static("a"), static("b")]
    try:
        poll_until(members, lambda: split(members, [3, 3]), "2 x 3 partitions")
        kept, had = members[0].owned(), members[1].owned()
        members[0].revoked.clear()
        members.pop().consumer.close()  # a static member sends no LeaveGroup
        members.append(static("b"))
        poll_until(members, lambda: members[1].owned() == had, "b's partitions back")
        assert members[0].owned() == kept and members[0].revoked == []
    finally:
        for m in members:
            m.consumer.close()


def join(
    kafka: RawKafka, version: int, group: str, kind: str, metadata: bytes, member_id: str = ""
) -> Any:
    """A JoinGroup of protocol type ``kind``, again with the member id the coordinator
    asks it to take (MEMBER_ID_REQUIRED, v4 on)."""
    request_types = importlib.import_module(f"kio.schema.join_group.v{version}.request")

    def request(member: str) -> Any:
        return request_types.JoinGroupRequest(
            group_id=GroupId(group),
            session_timeout=i32Timedelta.parse(timedelta(seconds=10)),
            rebalance_timeout=i32Timedelta.parse(timedelta(seconds=10)),
            member_id=member,
            group_instance_id=None,
            protocol_type=kind,
            protocols=(request_types.JoinGroupRequestProtocol(name="default", metadata=metadata),),
        )

    answer = kafka.call(request(member_id), ApiKey.JOIN_GROUP, version)
    if answer.error_code == ErrorCode.member_id_required:
        answer = kafka.call(request(answer.member_id), ApiKey.JOIN_GROUP, version)
    return answer


# Kafka Connect's worker metadata (ConnectProtocol v0: version, url, config offset) and
# an assignment of its own form: bytes the broker never reads.
CONNECT_METADATA = b"\x00\x00\x00\x15http://127.0.0.1:8083" + bytes(8)
CONNECT_ASSIGNMENT = b"\x00\x00\x00\x00" + b"connect's own assignment"


def test_a_kafka_connect_group_forms_with_its_own_protocol_type(server: Server) -> None:
    """Kafka Connect's workers (protocol type "connect"), like Schema Registry's ("sr"),
    use the classic group protocol with metadata and assignments of their own, which the
    coordinator passes on unread; they were once refused INCONSISTENT_GROUP_PROTOCOL."""
    group = "connect-" + uuid.uuid4().hex[:8]
    kafka = RawKafka(server)
    try:
        joined = join(kafka, 7, group, "connect", CONNECT_METADATA)
        assert joined.error_code == ErrorCode.none, joined
        assert joined.protocol_type == "connect" and joined.protocol_name == "default"
        assert joined.leader == joined.member_id
        assert [bytes(m.metadata) for m in joined.members] == [CONNECT_METADATA]
        sync = importlib.import_module("kio.schema.sync_group.v5.request")
        synced = kafka.call(
            sync.SyncGroupRequest(
                group_id=GroupId(group),
                generation_id=joined.generation_id,
                member_id=joined.member_id,
                group_instance_id=None,
                protocol_type="connect",
                protocol_name="default",
                assignments=(
                    sync.SyncGroupRequestAssignment(
                        member_id=joined.member_id, assignment=CONNECT_ASSIGNMENT
                    ),
                ),
            ),
            ApiKey.SYNC_GROUP,
            5,
        )
        assert synced.error_code == ErrorCode.none, synced
        assert (synced.protocol_type, bytes(synced.assignment)) == ("connect", CONNECT_ASSIGNMENT)
        describe = importlib.import_module("kio.schema.describe_groups.v5.request")
        [described] = kafka.call(
            describe.DescribeGroupsRequest(
                groups=(GroupId(group),), include_authorized_operations=False
            ),
            ApiKey.DESCRIBE_GROUPS,
            5,
        ).groups
        assert (described.group_state, described.protocol_type) == ("Stable", "connect")
        [member] = described.members
        assert bytes(member.member_assignment) == CONNECT_ASSIGNMENT
    finally:
        kafka.close()


@pytest.mark.parametrize("version", [5, 7])
def test_a_refused_join_is_answered_in_every_version(server: Server, version: int) -> None:
    """A JoinGroup refused before it joins (here a consumer joining a group of Connect
    workers: a group speaks one protocol type while it has members) is answered with the
    error, in versions where the answer's protocol name is not nullable (v0-6) too; it
    once failed to encode there and the client waited for ever on a connection that
    answered nothing more."""
    group = "refused-" + uuid.uuid4().hex[:8]
    kafka = RawKafka(server)
    try:
        assert join(kafka, version, group, "connect", CONNECT_METADATA).error_code == 0
        for _ in range(2):  # answered, and the connection still answers the next one
            answer = join(kafka, version, group, "consumer", b"")
            assert answer.error_code == ErrorCode.inconsistent_group_protocol
            assert answer.generation_id == -1
    finally:
        kafka.close()
