"""Each Rivven request mapped to the engine (docs/protocols/rivven.md, "Messages").

A handler takes the connection's :class:`Session` and the request's message and returns
the answer's message, or raises a :class:`~headwater.errors.HeadwaterError` that the
listener answers as an ErrorResponse. Topics are the session tenant's streams; a
partition is a stream's partition.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import Message

from headwater.api import (
    MAX_APPEND_BYTES,
    MAX_APPEND_EVENTS,
    EngineAPI,
    ReadResult,
    StreamInfo,
    StreamSettings,
    StreamTarget,
)
from headwater.api.auth import Principal
from headwater.engine.engine import ACKS_ALL, ACKS_LEADER, READ_COMMITTED, READ_UNCOMMITTED
from headwater.engine.groups import JoinFailed, JoinResult, TopicPartition
from headwater.engine.groups.coordinator import NO_GENERATION
from headwater.engine.partitioner import keyed_partition
from headwater.engine.transactions import ProducerIdentity
from headwater.errors import (
    AppendTooLarge,
    AuthenticationFailed,
    InvalidOffset,
    InvalidRequest,
    InvalidTxnState,
    ProducerFenced,
)
from headwater.protocols.rivven import MAX_FRAME
from headwater.protocols.rivven import rivven_pb2 as pb
from headwater.protocols.rivven.messages import record_key
from headwater.server.answers import AnswerBudget, AnswerRoom
from headwater.server.groups import GroupShells
from headwater.server.topic_configs import TOPIC_CONFIGS, topic_settings

BROKER_ID = 0  # this server: the one broker of every topic's metadata
DEFAULT_MAX_MESSAGES = 1000  # a Consume that names no count
MAX_CONSUME_BYTES = 8 << 20  # what one Consume reads, below the 10 MiB frame
# Each record of an answer costs protobuf up to this much beside its stored bytes (its
# offset, partition, timestamp, flags and lengths): at most this many records a
# Consume keeps the answer within the frame however small they are (a client asking for
# "as many as fit" got MESSAGE_TOO_LARGE for ever over 1-byte records).
RECORD_OVERHEAD = 64
MAX_CONSUME_MESSAGES = (MAX_FRAME - MAX_CONSUME_BYTES) // RECORD_OVERHEAD
MAX_WAIT_MS = 30_000  # longest long poll a Consume may ask for
SESSION_EXPIRES_S = 3600  # what Authenticate tells the client (the token does not expire)

# CreateTopic's config keys: Kafka's names, as Rivven takes them, and compression.
TOPIC_CONFIG_KEYS = {**TOPIC_CONFIGS, "compression.type": "compression"}


class PartitionNotFound(InvalidRequest):
    """A partition the topic does not have (answered PARTITION_NOT_FOUND)."""


SUPERSEDED_KEPT = 16  # replaced instances remembered per transactional id


@dataclass
class TransactionalIds:
    """Rivven names a transaction's producer by the id and epoch InitProducerId gave it,
    then BeginTransaction binds a transactional id to them; the engine gives a
    transactional id its own producer (init_producer, which fences an older instance).
    This maps each (tenant, transactional id) to the client's (producer id, epoch) that
    began it and the engine's identity for it; shared by every connection of the
    listener, so a producer may reconnect between calls."""

    bound: dict[tuple[int, str], tuple[tuple[int, int], ProducerIdentity]] = field(
        default_factory=dict
    )
    # The client pairs each binding replaced, most recent first: a superseded instance
    # may not begin again (producer ids are not ordered by age in a cluster, where each
    # node hands out its own block, so "lower is older" cannot tell).
    superseded: dict[tuple[int, str], tuple[tuple[int, int], ...]] = field(default_factory=dict)

    async def begin(
        self, api: EngineAPI, tenant_id: int, txn_id: str, client: tuple[int, int], timeout: int
    ) -> None:
        found = self.bound.get((tenant_id, txn_id))
        if found is not None:
            (producer_id, epoch), _identity = found
            if (producer_id, epoch) == client:
                return  # the next transaction of the same producer
            if producer_id == client[0] and client[1] < epoch:
                raise ProducerFenced(
                    f"producer {producer_id} epoch {client[1]} is fenced: transaction"
                    f" {txn_id!r} was begun by epoch {epoch}"
                )
            if client in self.superseded.get((tenant_id, txn_id), ()):
                # An older instance, already fenced by one that began after it: it may
                # not take the transactional id back (and abort the newer's work).
                raise ProducerFenced(
                    f"producer {client[0]} epoch {client[1]} is fenced: transaction"
                    f" {txn_id!r} was begun by a newer producer ({producer_id})"
                )
        # A new producer (or this server's first sight of it): the engine bumps the
        # transactional id's epoch, aborting what an older instance left open.
        identity = await api.init_producer(tenant_id, txn_id, timeout or None)
        key = (tenant_id, txn_id)
        if found is not None:
            earlier = self.superseded.get(key, ())
            self.superseded[key] = (found[0], *earlier)[:SUPERSEDED_KEPT]
        self.bound[key] = (client, identity)

    def forget(self, tenant_id: int, txn_id: str) -> None:
        """The engine forgot the transactional id (idle past its expiry): so do these
        maps, which otherwise grew with every id ever begun."""
        self.bound.pop((tenant_id, txn_id), None)
        self.superseded.pop((tenant_id, txn_id), None)

    def identity(self, tenant_id: int, txn_id: str, client: tuple[int, int]) -> ProducerIdentity:
        found = self.bound.get((tenant_id, txn_id))
        if found is None:
            raise InvalidTxnState(f"transaction {txn_id!r} has not begun: BeginTransaction first")
        bound_client, identity = found
        if bound_client != client:
            raise ProducerFenced(
                f"producer {client[0]} epoch {client[1]} is not transaction {txn_id!r}'s"
                f" (begun by producer {bound_client[0]} epoch {bound_client[1]})"
            )
        return identity


@dataclass
class Session:
    """One connection's state: who it is and what it may touch."""

    api: EngineAPI
    transactions: TransactionalIds
    host: str
    port: int
    # Set as the listener stops: a long-polling Consume answers with what it has.
    stopping: asyncio.Event
    groups: GroupShells  # the listener's group membership (headwater's additions)
    principal: Principal | None = None  # set by Authenticate, or on first use without auth
    tls: bool = False  # the connection is TLS (the listener's [tls])
    client_id: str = ""  # the client's name (its Header's, else its Handshake's)
    # Where this connection's Consume answers take their bytes (server/answers.py).
    answers: AnswerRoom = field(default_factory=lambda: AnswerRoom(AnswerBudget(1 << 62)))
    # Counts what a Consume gave the client: (tenant, stream, events, value bytes), as
    # headwater_events_read_total and _bytes_read_total.
    counted: Callable[[int, str, int, int], None] = field(default=lambda *read: None)

    @property
    def tenant_id(self) -> int:
        principal = self.principal
        if principal is None:
            principal = self.principal = self.api.authenticate(None)  # required: refused
        return principal.default_tenant

    def stream(self, topic: str) -> StreamInfo:
        return self.api.stream_named(self.tenant_id, topic)

    def target(self, topic: str) -> StreamTarget:
        """The topic a publish writes to (one record a request: a StreamInfo would cost
        more than the append with many partitions)."""
        return self.api.stream_target(self.tenant_id, topic)

    def partition(self, topic: str, partition: int) -> StreamInfo:
        info = self.stream(topic)
        if not 0 <= partition < info.partitions:
            raise PartitionNotFound(
                f"topic {topic!r} has no partition {partition} (it has {info.partitions})"
            )
        return info


Handler = Callable[[Session, Any], Awaitable[Message]]


# ---- auth and metadata --------------------------------------------------------------


async def authenticate(session: Session, request: pb.AuthenticateRequest) -> Message:
    if request.WhichOneof("mechanism") != "plain":
        raise AuthenticationFailed("headwater takes PLAIN authentication (the token as password)")
    if request.plain.require_tls and not session.tls:
        # The client asked to be refused on a cleartext link: its token is not looked at.
        raise AuthenticationFailed(
            "require_tls: this connection is not TLS (the server has no [tls] section)"
        )
    principal = session.api.authenticate(request.plain.password or None)
    tenant_id = session.api.session_tenant(principal)
    session.principal = principal
    return pb.AuthenticateResponse(
        session_id=f"tenant-{tenant_id}",
        expires_in=SESSION_EXPIRES_S,
    )


async def ping(session: Session, request: pb.PingRequest) -> Message:
    return pb.PingResponse()


def _topic_metadata(info: StreamInfo) -> pb.TopicMetadata:
    return pb.TopicMetadata(
        name=info.name,
        internal=False,  # headwater's own streams never reach a client (Engine.stream)
        partitions=[
            pb.PartitionMetadata(id=n, leader=BROKER_ID, replicas=[BROKER_ID], isr=[BROKER_ID])
            for n in range(info.partitions)
        ],
    )


def _topics(session: Session, names: list[str]) -> list[pb.TopicMetadata]:
    if names:
        return [_topic_metadata(session.stream(name)) for name in names]
    return [_topic_metadata(info) for info in session.api.list_streams(session.tenant_id)]


def _broker(session: Session) -> pb.BrokerInfo:
    return pb.BrokerInfo(id=BROKER_ID, host=session.host, port=session.port)


async def get_metadata(session: Session, request: pb.GetMetadataRequest) -> Message:
    return pb.GetMetadataResponse(
        topics=_topics(session, list(request.topics)), brokers=[_broker(session)]
    )


async def get_cluster_metadata(session: Session, request: pb.GetClusterMetadataRequest) -> Message:
    return pb.GetClusterMetadataResponse(
        controller_id=str(BROKER_ID),
        brokers=[_broker(session)],
        topics=_topics(session, list(request.topics)),
    )


async def list_topics(session: Session, request: pb.ListTopicsRequest) -> Message:
    names = [
        info.name
        for info in session.api.list_streams(session.tenant_id)
        if info.name.startswith(request.prefix)
    ]
    return pb.ListTopicsResponse(topics=names)


# ---- topics -------------------------------------------------------------------------


def _settings(partitions: int, config: dict[str, str]) -> StreamSettings:
    values = topic_settings(config.items(), TOPIC_CONFIG_KEYS)
    return StreamSettings.from_dict({**values, "partitions": partitions or 1})


async def create_topic(session: Session, request: pb.CreateTopicRequest) -> Message:
    if request.replication_factor > 1:
        raise InvalidRequest("headwater is one broker: replication_factor must be 0 or 1")
    settings = _settings(request.partitions, dict(request.config))
    info = await session.api.create_stream(session.tenant_id, request.name, settings)
    return pb.CreateTopicResponse(name=info.name, partitions=info.partitions)


async def delete_topic(session: Session, request: pb.DeleteTopicRequest) -> Message:
    info = session.stream(request.name)
    await session.api.delete_stream(session.tenant_id, info.stream_id)
    return pb.DeleteTopicResponse()


async def create_partitions(session: Session, request: pb.CreatePartitionsRequest) -> Message:
    info = session.stream(request.topic)
    grown = await session.api.alter_partitions(
        session.tenant_id, info.stream_id, request.new_partition_count
    )
    return pb.CreatePartitionsResponse(topic=grown.name, new_partition_count=grown.partitions)


# ---- produce ------------------------------------------------------------------------


def _headers(record: pb.Record) -> list[tuple[bytes, bytes]]:
    return [(header.key.encode(), header.value) for header in record.headers]


_Publish = pb.PublishRequest | pb.IdempotentPublishRequest | pb.TransactionalPublishRequest


def _named_partition(info: StreamTarget, request: _Publish) -> int | None:
    """The partition a publish names (None: it names none); one the topic lacks is
    refused."""
    if not request.HasField("partition"):
        return None
    if not 0 <= request.partition < info.partitions:
        raise PartitionNotFound(
            f"topic {info.name!r} has no partition {request.partition} (it has {info.partitions})"
        )
    return request.partition


def _producer_target(
    session: Session, request: pb.IdempotentPublishRequest | pb.TransactionalPublishRequest
) -> tuple[StreamTarget, bytes | None, int]:
    """The topic, key and partition of an idempotent or transactional publish. The
    partition: the one it names, else its key's (murmur2, as any publish), else the
    producer's own (producer id modulo the count), so a retry lands where its first
    attempt went and its sequence is checked there."""
    info = session.target(request.topic)
    key = record_key(request.record)
    partition = _named_partition(info, request)
    if partition is None:
        if key is not None:
            partition = keyed_partition(key, info.partitions)
        else:
            partition = request.producer_id % info.partitions
    return info, key, partition


async def publish(session: Session, request: pb.PublishRequest) -> Message:
    info = session.target(request.topic)
    record = request.record
    explicit = _named_partition(info, request)
    placed = await session.api.append_partitioned(
        session.tenant_id,
        info.stream_id,
        [record.value],
        keys=[record_key(record)],
        headers=[_headers(record)],
        partitions=[explicit],
        timestamps=[record.timestamp or None],
    )
    return pb.PublishResponse(
        offset=placed.offsets[0], partition=placed.partitions[0], timestamp=placed.timestamps[0]
    )


async def init_producer_id(session: Session, request: pb.InitProducerIdRequest) -> Message:
    # A given producer id is not resumed: an idempotent producer without a
    # transactional id gets a new id each time, as Kafka's does.
    identity = await session.api.init_producer(session.tenant_id)
    return pb.InitProducerIdResponse(
        producer_id=identity.producer_id, producer_epoch=identity.epoch
    )


async def idempotent_publish(session: Session, request: pb.IdempotentPublishRequest) -> Message:
    info, key, partition = _producer_target(session, request)
    record = request.record
    stored = await session.api.append(
        session.tenant_id,
        info.stream_id,
        [record.value],
        timestamp_ms=record.timestamp or None,
        partition=partition,
        keys=[key],
        headers=[_headers(record)] if record.headers else None,
        producer=(request.producer_id, request.sequence),
        producer_epoch=request.producer_epoch,
    )
    # A retry is answered with the first attempt's offsets and no log position.
    return pb.IdempotentPublishResponse(
        offset=stored.base_offset, partition=partition, duplicate=stored.first_position < 0
    )


async def publish_batch(session: Session, request: pb.BatchPublishRequest) -> Message:
    """headwater's batch publish: each partition's records in one append, plain,
    idempotent (``producer_id``: its ``base_sequence`` checked, a retry answered with the
    first offsets and ``duplicate``) or transactional (``txn_id`` too). The partitions'
    appends run together; the first failure answers the whole request (an idempotent
    producer sends it again: what was stored is recognised)."""
    info = session.target(request.topic)
    entries = list(request.partition_records)
    if not entries:
        raise InvalidRequest("publish_batch carries no partition_records")
    for entry in entries:
        if not 0 <= entry.partition < info.partitions:
            raise PartitionNotFound(
                f"topic {info.name!r} has no partition {entry.partition} (it has {info.partitions})"
            )
        if not 1 <= len(entry.records) <= MAX_APPEND_EVENTS:
            raise InvalidRequest(
                f"partition {entry.partition}: a batch carries 1..{MAX_APPEND_EVENTS} records"
            )
        # Checked before any partition is written: a refusal stores nothing.
        if sum(len(record.value) for record in entry.records) > MAX_APPEND_BYTES:
            raise AppendTooLarge(
                f"partition {entry.partition}: a batch carries at most {MAX_APPEND_BYTES}"
                " bytes of values"
            )
    # acks 1: the leader's alone; -1 every in-sync replica, and so 0 too: proto3 cannot
    # tell it from unset, and every publish is answered anyway (docs/protocols/rivven.md).
    acks = ACKS_LEADER if request.acks == 1 else ACKS_ALL
    identity = None
    if request.txn_id:
        if not request.HasField("producer_id"):
            raise InvalidRequest("a transactional publish_batch names its producer_id")
        identity = session.transactions.identity(
            session.tenant_id, request.txn_id, (request.producer_id, request.producer_epoch)
        )

    async def write(entry: pb.PartitionRecords) -> pb.PartitionPublishResult:
        records = entry.records
        values = [record.value for record in records]
        keys = [record_key(record) for record in records]
        headers = [_headers(record) for record in records]
        some_headers = headers if any(headers) else None
        partition = entry.partition
        if identity is not None:
            stored = await session.api.append_transactional(
                session.tenant_id,
                request.txn_id,
                identity,
                info.stream_id,
                entry.base_sequence,
                values,
                partition=partition,
                keys=keys,
                headers=some_headers,
            )
        elif request.HasField("producer_id"):
            # One stored batch has one timestamp: the first record's (0: on arrival).
            stored = await session.api.append(
                session.tenant_id,
                info.stream_id,
                values,
                timestamp_ms=records[0].timestamp or None,
                partition=partition,
                keys=keys,
                headers=some_headers,
                producer=(request.producer_id, entry.base_sequence),
                producer_epoch=request.producer_epoch,
                acks=acks,
            )
        else:
            placed = await session.api.append_partitioned(
                session.tenant_id,
                info.stream_id,
                values,
                keys=keys,
                headers=headers,
                partitions=[partition] * len(values),
                timestamps=[record.timestamp or None for record in records],
                acks=acks,
            )
            return pb.PartitionPublishResult(partition=partition, base_offset=placed.offsets[0])
        return pb.PartitionPublishResult(
            partition=partition,
            base_offset=stored.base_offset,
            duplicate=stored.first_position < 0,
        )

    results = await asyncio.gather(*(write(entry) for entry in entries))
    return pb.BatchPublishResponse(results=results)


# ---- consume ------------------------------------------------------------------------


async def consume(session: Session, request: pb.ConsumeRequest) -> Message:
    api, tenant_id = session.api, session.tenant_id
    info = session.partition(request.topic, request.partition)
    partition, offset = request.partition, request.offset
    isolation = READ_COMMITTED if request.isolation_level == 1 else READ_UNCOMMITTED
    end = api.stream_end(tenant_id, info.stream_id, partition)
    if offset > end:
        raise InvalidOffset(f"offset {offset} is past partition {partition}'s end ({end})")
    max_bytes = min(request.max_bytes or MAX_CONSUME_BYTES, MAX_CONSUME_BYTES)
    max_events = min(request.max_messages or DEFAULT_MAX_MESSAGES, MAX_CONSUME_MESSAGES)
    wait_s = min(request.max_wait_ms, MAX_WAIT_MS) / 1000 if request.HasField("max_wait_ms") else 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        # What the answer reads is the server's until the client has read it
        # (limits.read_answers_mib): built within its room, written as this returns.
        async with session.answers.turn(max_bytes, max(deadline - loop.time(), 0.0)) as room:
            if not room:  # none within the wait: nothing now, as an empty long poll
                return _consumed(api, tenant_id, info.stream_id, partition, None)
            result = await api.read(
                tenant_id,
                info.stream_id,
                offset,
                room,
                max_events=max_events,
                partition=partition,
                isolation=isolation,
            )
            if result.count:
                session.counted(tenant_id, info.name, result.count, result.value_bytes)
                return _consumed(api, tenant_id, info.stream_id, partition, result)
        # Nothing to give (yet): a long poll waits for the partition to pass its end,
        # then reads again (under read_committed the new events may still be open).
        left = deadline - loop.time()
        if left <= 0 or session.stopping.is_set():
            break
        # Past what readers may read: the end here, a cluster's high watermark.
        end = max(offset, api.readable_end(tenant_id, info.stream_id, partition))
        arrived = asyncio.ensure_future(
            api.wait_readable(tenant_id, info.stream_id, partition, end, left)
        )
        stopping = asyncio.ensure_future(session.stopping.wait())
        await asyncio.wait((arrived, stopping), return_when=asyncio.FIRST_COMPLETED)
        arrived.cancel()
        stopping.cancel()
        if not (arrived.done() and not arrived.cancelled() and arrived.result()):
            break
        # A read that skipped only aborted events or markers resumes past them.
        offset = max(offset, result.end_offset)
    return _consumed(api, tenant_id, info.stream_id, partition, result)


def _consumed(
    api: EngineAPI, tenant_id: int, stream_id: int, partition: int, result: ReadResult | None
) -> pb.ConsumeResponse:
    """A Consume's answer: ``result``'s events (None: none)."""
    response = pb.ConsumeResponse(high_watermark=api.readable_end(tenant_id, stream_id, partition))
    records = response.records
    for event in () if result is None else result.events():
        records.add(
            offset=event.offset,
            partition=partition,
            timestamp=event.timestamp_ms,
            key=event.key or b"",
            has_key=event.key is not None,
            value=event.value,
            headers=[
                pb.RecordHeader(key=k.decode(errors="replace"), value=v) for k, v in event.headers
            ],
        )
    return response


async def get_offset_bounds(session: Session, request: pb.GetOffsetBoundsRequest) -> Message:
    info = session.partition(request.topic, request.partition)
    bounds = info.partition_info[request.partition]
    return pb.GetOffsetBoundsResponse(earliest=bounds.start_offset, latest=bounds.next_offset)


async def get_offset_for_timestamp(
    session: Session, request: pb.GetOffsetForTimestampRequest
) -> Message:
    info = session.partition(request.topic, request.partition)
    offset = await session.api.offset_for_timestamp(
        session.tenant_id, info.stream_id, request.timestamp_ms, partition=request.partition
    )
    response = pb.GetOffsetForTimestampResponse()
    if offset is not None:
        response.offset = offset
    return response


# ---- consumer groups ----------------------------------------------------------------


async def commit_offset(session: Session, request: pb.CommitOffsetRequest) -> Message:
    session.partition(request.topic, request.partition)
    # A member's commit (headwater's member_id and generation) is checked against the
    # group's generation: a member that lost the partition in a rebalance is refused.
    await session.api.groups.commit(
        session.tenant_id,
        request.consumer_group,
        {(request.topic, request.partition): (request.offset, request.metadata)},
        member_id=request.member_id,
        generation=request.generation if request.HasField("generation") else NO_GENERATION,
    )
    return pb.CommitOffsetResponse()


def _assignment(partitions: tuple[TopicPartition, ...]) -> list[pb.GroupAssignment]:
    by_topic: dict[str, list[int]] = {}
    for tp in partitions:
        by_topic.setdefault(tp.stream, []).append(tp.partition)
    return [
        pb.GroupAssignment(topic=topic, partitions=sorted(numbers))
        for topic, numbers in sorted(by_topic.items())
    ]


async def join_group(session: Session, request: pb.JoinGroupRequest) -> Message:
    """headwater's JoinGroup: Kafka's join, answered once the rebalance completes, then
    the member's SyncGroup, so the answer carries its assignment."""
    tenant = await session.groups.tenant(session.tenant_id)
    coordinator = tenant.coordinator
    session_timeout = request.session_timeout_ms or 45_000
    instance_id = request.instance_id or None
    member_id, replies = coordinator.join(
        request.group_id,
        request.member_id,
        protocols=list(request.assignors) or ["range"],
        streams=list(request.topics),
        client_id=session.client_id,
        instance_id=instance_id,
        session_timeout_ms=session_timeout,
        rebalance_timeout_ms=request.rebalance_timeout_ms or session_timeout,
        owned=[
            TopicPartition(entry.topic, partition)
            for entry in request.owned
            for partition in entry.partitions
        ],
    )
    reply = await tenant.wait_join(member_id, replies)
    if isinstance(reply, JoinFailed):
        raise reply.error
    if not isinstance(reply, JoinResult):  # only a join's reply is kept for a member joining
        raise InvalidRequest(f"member {member_id!r} got {type(reply).__name__} to its join")
    synced = coordinator.sync(request.group_id, member_id, reply.generation, instance_id)
    tenant.wake.set()  # the sync may end the rebalance's deadlines
    return pb.JoinGroupResponse(
        member_id=member_id,
        generation=reply.generation,
        leader=reply.leader,
        assignor=reply.protocol,
        assignment=_assignment(synced.assignment),
        revoke=_assignment(synced.revoke),
        members=list(reply.members),
    )


async def group_heartbeat(session: Session, request: pb.GroupHeartbeatRequest) -> Message:
    tenant = await session.groups.tenant(session.tenant_id)
    tenant.coordinator.heartbeat(
        request.group_id, request.member_id, request.generation, request.instance_id or None
    )
    tenant.wake.set()
    return pb.GroupHeartbeatResponse()


async def leave_group(session: Session, request: pb.LeaveGroupRequest) -> Message:
    tenant = await session.groups.tenant(session.tenant_id)
    tenant.dispatch(
        tenant.coordinator.leave(request.group_id, request.member_id, request.instance_id or None)
    )
    return pb.LeaveGroupResponse()


async def get_offset(session: Session, request: pb.GetOffsetRequest) -> Message:
    session.partition(request.topic, request.partition)
    found = await session.api.groups.fetch(
        session.tenant_id, request.consumer_group, [(request.topic, request.partition)]
    )
    committed = found.get((request.topic, request.partition))
    if committed is None:
        return pb.GetOffsetResponse(offset=-1)
    return pb.GetOffsetResponse(offset=committed.offset, metadata=committed.metadata)


async def list_groups(session: Session, request: pb.ListGroupsRequest) -> Message:
    return pb.ListGroupsResponse(groups=await session.api.groups.group_ids(session.tenant_id))


async def describe_group(session: Session, request: pb.DescribeGroupRequest) -> Message:
    found = await session.api.groups.fetch(session.tenant_id, request.consumer_group)
    by_topic: dict[str, list[pb.GroupPartitionOffset]] = {}
    for (topic, partition), committed in sorted(found.items()):
        by_topic.setdefault(topic, []).append(
            pb.GroupPartitionOffset(partition=partition, offset=committed.offset)
        )
    return pb.DescribeGroupResponse(
        consumer_group=request.consumer_group,
        topic_offsets=[
            pb.GroupTopicOffsets(topic=topic, partition_offsets=offsets)
            for topic, offsets in by_topic.items()
        ],
    )


async def delete_group(session: Session, request: pb.DeleteGroupRequest) -> Message:
    await session.api.groups.delete(session.tenant_id, request.consumer_group)
    return pb.DeleteGroupResponse()


# ---- transactions -------------------------------------------------------------------


async def begin_transaction(session: Session, request: pb.BeginTransactionRequest) -> Message:
    timeout = request.timeout_ms if request.HasField("timeout_ms") else 0
    await session.transactions.begin(
        session.api,
        session.tenant_id,
        request.txn_id,
        (request.producer_id, request.producer_epoch),
        timeout,
    )
    return pb.BeginTransactionResponse(txn_id=request.txn_id)


def _txn_identity(session: Session, request: Any) -> ProducerIdentity:
    return session.transactions.identity(
        session.tenant_id, request.txn_id, (request.producer_id, request.producer_epoch)
    )


async def transactional_publish(
    session: Session, request: pb.TransactionalPublishRequest
) -> Message:
    identity = _txn_identity(session, request)
    info, key, partition = _producer_target(session, request)
    record = request.record
    stored = await session.api.append_transactional(
        session.tenant_id,
        request.txn_id,
        identity,
        info.stream_id,
        request.sequence,
        [record.value],
        partition=partition,
        keys=[key],
        headers=[_headers(record)] if record.headers else None,
    )
    return pb.TransactionalPublishResponse(
        offset=stored.base_offset, partition=partition, sequence=request.sequence
    )


async def add_partitions_to_txn(session: Session, request: pb.AddPartitionsToTxnRequest) -> Message:
    identity = _txn_identity(session, request)
    pairs = []
    for entry in request.partitions:
        info = session.partition(entry.topic, entry.partition)
        pairs.append((info.stream_id, entry.partition))
    await session.api.add_partitions_to_txn(session.tenant_id, request.txn_id, identity, pairs)
    return pb.PartitionsAddedToTxnResponse(txn_id=request.txn_id, partition_count=len(pairs))


async def add_offsets_to_txn(session: Session, request: pb.AddOffsetsToTxnRequest) -> Message:
    identity = _txn_identity(session, request)
    offsets = {}
    for entry in request.offsets:
        session.partition(entry.topic, entry.partition)
        offsets[(entry.topic, entry.partition)] = (entry.offset, "")
    await session.api.add_offsets_to_txn(
        session.tenant_id, request.txn_id, identity, request.group_id, offsets
    )
    return pb.OffsetsAddedToTxnResponse(txn_id=request.txn_id)


async def commit_transaction(session: Session, request: pb.CommitTransactionRequest) -> Message:
    identity = _txn_identity(session, request)
    await session.api.end_transaction(session.tenant_id, request.txn_id, identity, True)
    return pb.CommitTransactionResponse(txn_id=request.txn_id)


async def abort_transaction(session: Session, request: pb.AbortTransactionRequest) -> Message:
    identity = _txn_identity(session, request)
    await session.api.end_transaction(session.tenant_id, request.txn_id, identity, False)
    return pb.AbortTransactionResponse(txn_id=request.txn_id)


HANDLERS: dict[str, Handler] = {
    "authenticate": authenticate,
    "ping": ping,
    "get_metadata": get_metadata,
    "get_cluster_metadata": get_cluster_metadata,
    "list_topics": list_topics,
    "create_topic": create_topic,
    "delete_topic": delete_topic,
    "create_partitions": create_partitions,
    "publish": publish,
    "publish_batch": publish_batch,
    "init_producer_id": init_producer_id,
    "idempotent_publish": idempotent_publish,
    "consume": consume,
    "get_offset_bounds": get_offset_bounds,
    "get_offset_for_timestamp": get_offset_for_timestamp,
    "commit_offset": commit_offset,
    "get_offset": get_offset,
    "list_groups": list_groups,
    "describe_group": describe_group,
    "delete_group": delete_group,
    "join_group": join_group,
    "group_heartbeat": group_heartbeat,
    "leave_group": leave_group,
    "begin_transaction": begin_transaction,
    "transactional_publish": transactional_publish,
    "add_partitions_to_txn": add_partitions_to_txn,
    "add_offsets_to_txn": add_offsets_to_txn,
    "commit_transaction": commit_transaction,
    "abort_transaction": abort_transaction,
}
"""Every operation headwater answers; the schema's others (SCRAM, topic configs,
DeleteRecords, quotas) are answered INVALID_REQUEST, naming the operation."""
