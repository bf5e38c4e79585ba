"""Kafka's consumer group APIs over the engine's group coordinator (engine/groups).

As in Kafka, the group's leader assigns: its JoinGroup answer lists every member with
its subscription metadata, its client's assignor (range, roundrobin, cooperative-sticky,
aiokafka's, any) computes the assignment, and each member's SyncGroup answer is exactly
the bytes the leader's SyncGroup gave it; a SyncGroup before the leader's waits for it
(the coordinator's ``sync_client``).

The member metadata and assignments are Kafka's consumer protocol
(ConsumerProtocolSubscription / ConsumerProtocolAssignment, written here: kio models
only the wire messages, not these embedded byte layouts).
"""

from __future__ import annotations

import contextlib
import logging
import struct
from collections.abc import Mapping
from typing import Any

from kio.schema.errors import ErrorCode

from headwater.api import EngineAPI
from headwater.engine.groups import (
    GroupError,
    JoinFailed,
    JoinResult,
    SyncFailed,
    SyncResult,
    TopicPartition,
)
from headwater.errors import HeadwaterError, InvalidRequest, StreamNotFound
from headwater.server.groups import GroupShells, TenantGroups
from headwater.server.kafka.handlers import (
    Session,
    error_code,
    partitions_answered,
    refused_offsets,
)

log = logging.getLogger("headwater.kafka")

PROTOCOL_TYPE = "consumer"

_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")


# ---- the consumer protocol's embedded bytes ---------------------------------------------


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def _take(self, size: int) -> bytes:
        if size < 0 or self.pos + size > len(self.data):
            raise InvalidRequest("consumer protocol metadata is cut short")
        chunk = self.data[self.pos : self.pos + size]
        self.pos += size
        return chunk

    def i16(self) -> int:
        value: int = _I16.unpack(self._take(2))[0]
        return value

    def i32(self) -> int:
        value: int = _I32.unpack(self._take(4))[0]
        return value

    def string(self) -> str:
        return self._take(self.i16()).decode("utf-8", "replace")

    def nullable_bytes(self) -> None:
        size = self.i32()
        if size >= 0:
            self._take(size)

    def count(self) -> int:
        count = self.i32()
        if count > len(self.data) - self.pos:  # every element takes at least a byte
            raise InvalidRequest("consumer protocol metadata claims more than it holds")
        return max(count, 0)


def parse_subscription(data: bytes) -> tuple[list[str], list[TopicPartition] | None]:
    """The topics a member subscribes to and (version 1+) the partitions it owns."""
    reader = _Reader(data)
    version = reader.i16()
    topics = [reader.string() for _ in range(reader.count())]
    reader.nullable_bytes()  # user data
    if version < 1 or reader.pos >= len(data):
        return topics, None
    owned = []
    for _ in range(reader.count()):
        topic = reader.string()
        owned += [TopicPartition(topic, reader.i32()) for _ in range(reader.count())]
    return topics, owned


def parse_assignment(data: bytes) -> list[TopicPartition]:
    """The partitions a ConsumerProtocolAssignment (any version) names; its user data
    (and a later version's fields) are the client's."""
    if not data:
        return []  # Kafka's "no assignment"
    reader = _Reader(data)
    reader.i16()  # version
    assigned = []
    for _ in range(reader.count()):
        topic = reader.string()
        assigned += [TopicPartition(topic, reader.i32()) for _ in range(reader.count())]
    return assigned


def encode_assignment(assignment: tuple[TopicPartition, ...]) -> bytes:
    """ConsumerProtocolAssignment v0: topics with their partitions, no user data."""
    by_topic: dict[str, list[int]] = {}
    for tp in assignment:
        by_topic.setdefault(tp.stream, []).append(tp.partition)
    out = bytearray(_I16.pack(0) + _I32.pack(len(by_topic)))
    for topic, partitions in sorted(by_topic.items()):
        name = topic.encode()
        out += _I16.pack(len(name)) + name + _I32.pack(len(partitions))
        for partition in sorted(partitions):
            out += _I32.pack(partition)
    out += _I32.pack(0)  # user data: empty
    return bytes(out)


# ---- the shell around each tenant's coordinator -----------------------------------------


def _ms(delta: Any) -> int:
    return int(delta.total_seconds() * 1000)


def _check_coordinator(session: Session) -> None:
    """In a cluster, only the node leading the tenant's offsets stream serves its groups:
    NOT_COORDINATOR (or COORDINATOR_NOT_AVAILABLE during a move) elsewhere, and the
    client finds the coordinator again (docs/cluster.md)."""
    if session.cluster is not None:
        session.cluster.check_group_coordinator(session.tenant_id)


class KafkaGroups:
    """The group APIs of one Kafka listener, for every tenant."""

    def __init__(self, api: EngineAPI) -> None:
        self.api = api
        self._shells = GroupShells(api)

    async def _tenant(self, tenant_id: int) -> TenantGroups:
        return await self._shells.tenant(tenant_id)

    async def close(self) -> None:
        await self._shells.close()

    # ---- membership ---------------------------------------------------------------

    async def join_group(self, session: Session, request: Any, version: int) -> Mapping[str, Any]:
        tenant = await self._tenant(session.tenant_id)
        group_id = request.group_id
        protocols = {p.name: bytes(p.metadata) for p in request.protocols}
        answer: dict[str, Any] = {
            "throttle_time": 0,
            "error_code": ErrorCode.none,
            "generation_id": -1,
            "protocol_type": PROTOCOL_TYPE,
            # Nullable from v7 only: an error answer to v0-6 carries "" (None cannot be
            # encoded there).
            "protocol_name": None if version >= 7 else "",
            "leader": "",
            "skip_assignment": False,
            "member_id": request.member_id,
            "members": [],
        }
        # Any protocol type (Kafka Connect's "connect", Schema Registry's "sr", ...), one
        # per group while it has members; only a consumer's metadata is read (for the
        # group's lag and ownership), the others' are the clients' own bytes.
        kind = request.protocol_type
        group = tenant.coordinator.groups.get(group_id)
        if group is None or not tenant.coordinator.describe(group_id).members:
            tenant.protocol_types.pop(group_id, None)
        if tenant.protocol_types.setdefault(group_id, kind) != kind:
            answer["error_code"] = ErrorCode.inconsistent_group_protocol
            return answer
        answer["protocol_type"] = kind
        session_timeout = _ms(request.session_timeout)
        rebalance = getattr(request, "rebalance_timeout", None)
        try:
            _check_coordinator(session)
            topics: list[str] = []
            owned: list[TopicPartition] | None = None
            if kind == PROTOCOL_TYPE:
                # Kafka's coordinator takes any bytes: a custom assignor's are not read.
                with contextlib.suppress(InvalidRequest):
                    topics, owned = parse_subscription(next(iter(protocols.values()), b""))
            member_id, replies = tenant.coordinator.join(
                group_id,
                request.member_id,
                protocols=list(protocols),
                streams=topics,
                client_id=session.client_id,
                instance_id=getattr(request, "group_instance_id", None),
                session_timeout_ms=session_timeout,
                rebalance_timeout_ms=_ms(rebalance) if rebalance is not None else session_timeout,
                owned=owned,
                client_assigns=True,
            )
        except HeadwaterError as exc:
            log.warning("kafka %s: JoinGroup %r refused: %s", session.peer, group_id, exc)
            answer["error_code"] = error_code(exc)
            return answer
        tenant.metadata[(group_id, member_id)] = protocols
        reply = await tenant.wait_join(member_id, replies)
        answer["member_id"] = member_id
        if isinstance(reply, JoinFailed):
            answer["error_code"] = error_code(reply.error)
            return answer
        assert isinstance(reply, JoinResult)
        answer.update(
            generation_id=reply.generation,
            protocol_name=reply.protocol,
            leader=reply.leader,
        )
        if member_id == reply.leader:
            # The leader's assignor sees each member's static instance id too (a sticky
            # assignor keys what a restarted static member had on it).
            instances = {
                m.member_id: m.instance_id for m in tenant.coordinator.describe(group_id).members
            }
            answer["members"] = [
                {
                    "member_id": member,
                    "group_instance_id": instances.get(member),
                    "metadata": tenant.metadata.get((group_id, member), {}).get(
                        reply.protocol, b""
                    ),
                }
                for member in reply.members
            ]
        return answer

    async def sync_group(self, session: Session, request: Any, version: int) -> Mapping[str, Any]:
        tenant = await self._tenant(session.tenant_id)
        kind = tenant.protocol_types.get(request.group_id, PROTOCOL_TYPE)
        answer: dict[str, Any] = {
            "throttle_time": 0,
            "error_code": ErrorCode.none,
            "protocol_type": kind,
            "protocol_name": getattr(request, "protocol_name", None),
            "assignment": b"",
        }
        try:
            _check_coordinator(session)
            # Only the leader's assignments count (Kafka ignores a follower's); a
            # consumer's are read, any other protocol's passed on as they are.
            assignments = {
                a.member_id: (
                    parse_assignment(bytes(a.assignment)) if kind == PROTOCOL_TYPE else [],
                    bytes(a.assignment),
                )
                for a in request.assignments
            }
            replies = tenant.coordinator.sync_client(
                request.group_id,
                request.member_id,
                request.generation_id,
                getattr(request, "group_instance_id", None),
                assignments if request.assignments else None,
            )
        except HeadwaterError as exc:
            log.warning("kafka %s: SyncGroup %r refused: %s", session.peer, request.group_id, exc)
            answer["error_code"] = error_code(exc)
            return answer
        reply = await tenant.wait_sync(request.member_id, replies)
        if isinstance(reply, SyncFailed):
            answer["error_code"] = error_code(reply.error)
            return answer
        assert isinstance(reply, SyncResult)
        answer["assignment"] = reply.data
        return answer

    async def heartbeat(self, session: Session, request: Any, version: int) -> Mapping[str, Any]:
        tenant = await self._tenant(session.tenant_id)
        code = ErrorCode.none
        try:
            _check_coordinator(session)
            tenant.coordinator.heartbeat(
                request.group_id,
                request.member_id,
                request.generation_id,
                getattr(request, "group_instance_id", None),
            )
        except HeadwaterError as exc:
            code = error_code(exc)
        tenant.wake.set()
        return {"throttle_time": 0, "error_code": code}

    async def leave_group(self, session: Session, request: Any, version: int) -> Mapping[str, Any]:
        tenant = await self._tenant(session.tenant_id)
        group_id = request.group_id
        if version < 3:
            leaving = [(request.member_id, None)]
        else:
            leaving = [(m.member_id, m.group_instance_id) for m in request.members]
        results = []
        top = ErrorCode.none
        for member_id, instance_id in leaving:
            code = ErrorCode.none
            try:
                _check_coordinator(session)
                tenant.dispatch(tenant.coordinator.leave(group_id, member_id, instance_id))
                tenant.metadata.pop((group_id, member_id), None)
            except HeadwaterError as exc:
                code = error_code(exc)
                top = code if version < 3 else top
            results.append(
                {"member_id": member_id, "group_instance_id": instance_id, "error_code": code}
            )
        return {"throttle_time": 0, "error_code": top, "members": results}

    # ---- offsets --------------------------------------------------------------------

    async def offset_commit(
        self, session: Session, request: Any, version: int
    ) -> Mapping[str, Any]:
        offsets = {
            (topic.name, p.partition_index): (p.committed_offset, p.committed_metadata or "")
            for topic in request.topics
            for p in topic.partitions
        }
        refused = refused_offsets(session, offsets)  # the others are committed
        code = ErrorCode.none
        try:
            _check_coordinator(session)
            if offsets:
                await self.api.groups.commit(
                    session.tenant_id,
                    request.group_id,
                    offsets,
                    member_id=request.member_id,
                    generation=request.generation_id_or_member_epoch,
                    instance_id=getattr(request, "group_instance_id", None),
                )
        except StreamNotFound:
            code = ErrorCode.unknown_topic_or_partition
        except HeadwaterError as exc:
            code = error_code(exc)
            if code is ErrorCode.invalid_request:
                code = ErrorCode.unknown_topic_or_partition
        if code is not ErrorCode.none:
            log.warning(
                "kafka %s: OffsetCommit of %r refused: %s", session.peer, request.group_id, code
            )
        return {
            "throttle_time": 0,
            "topics": partitions_answered(request.topics, code, refused),
        }

    async def _fetch_group(
        self, session: Session, group_id: str, topics: Any
    ) -> list[dict[str, Any]]:
        wanted = (
            None if topics is None else [(t.name, p) for t in topics for p in t.partition_indexes]
        )
        committed = await self.api.groups.fetch(session.tenant_id, group_id, wanted)
        by_topic: dict[str, list[dict[str, Any]]] = {}
        for name, partition in wanted if wanted is not None else sorted(committed):
            offset = committed.get((name, partition))
            by_topic.setdefault(name, []).append(
                {
                    "partition_index": partition,
                    "committed_offset": offset.offset if offset is not None else -1,
                    "committed_leader_epoch": -1,
                    "metadata": offset.metadata if offset is not None else "",
                    "error_code": ErrorCode.none,
                }
            )
        return [{"name": name, "partitions": parts} for name, parts in by_topic.items()]

    async def offset_fetch(self, session: Session, request: Any, version: int) -> Mapping[str, Any]:
        try:
            _check_coordinator(session)
        except HeadwaterError as exc:
            code = error_code(exc)
            if version >= 8:
                groups = [
                    {"group_id": group.group_id, "topics": [], "error_code": code}
                    for group in request.groups
                ]
                return {"throttle_time": 0, "groups": groups}
            return {"throttle_time": 0, "topics": [], "error_code": code}
        if version >= 8:
            groups = [
                {
                    "group_id": group.group_id,
                    "topics": await self._fetch_group(session, group.group_id, group.topics),
                    "error_code": ErrorCode.none,
                }
                for group in request.groups
            ]
            return {"throttle_time": 0, "groups": groups}
        topics = await self._fetch_group(session, request.group_id, request.topics)
        return {"throttle_time": 0, "topics": topics, "error_code": ErrorCode.none}

    # ---- administration ---------------------------------------------------------------

    async def list_groups(self, session: Session, request: Any, version: int) -> Mapping[str, Any]:
        tenant = await self._tenant(session.tenant_id)
        groups: list[dict[str, Any]] = []
        try:
            _check_coordinator(session)
        except HeadwaterError:
            # Kafka's ListGroups names the groups the broker asked coordinates: none.
            return {"throttle_time": 0, "error_code": ErrorCode.none, "groups": groups}
        for group_id in await self.api.groups.group_ids(session.tenant_id):
            group = tenant.coordinator.groups.get(group_id)
            state = str(group.state) if group is not None else "Empty"
            wanted = getattr(request, "states_filter", ())
            if wanted and state not in wanted:
                continue
            kind = tenant.protocol_types.get(group_id, PROTOCOL_TYPE)
            groups.append({"group_id": group_id, "protocol_type": kind, "group_state": state})
        return {"throttle_time": 0, "error_code": ErrorCode.none, "groups": groups}

    async def describe_groups(
        self, session: Session, request: Any, version: int
    ) -> Mapping[str, Any]:
        tenant = await self._tenant(session.tenant_id)
        described = []
        stored: set[str] = set()
        try:
            _check_coordinator(session)
            refused = ErrorCode.none
            # Groups with committed offsets and no members (after a restart, or only
            # ever committed to) are Empty, as ListGroups says, not Dead.
            stored = set(await self.api.groups.group_ids(session.tenant_id))
        except HeadwaterError as exc:
            refused = error_code(exc)
        for group_id in request.groups:
            entry: dict[str, Any] = {
                "error_code": ErrorCode.none,
                "group_id": group_id,
                "group_state": "Dead",
                "protocol_type": "",
                "protocol_data": "",
                "members": [],
                "authorized_operations": -(2**31),
            }
            if refused is not ErrorCode.none:
                entry["error_code"] = refused
            elif group_id in tenant.coordinator.groups:
                description = tenant.coordinator.describe(group_id)
                entry.update(
                    group_state=str(description.state),
                    protocol_type=tenant.protocol_types.get(group_id, PROTOCOL_TYPE),
                    protocol_data=description.protocol or "",
                    members=[
                        {
                            "member_id": m.member_id,
                            "group_instance_id": m.instance_id,
                            "client_id": m.client_id,
                            "client_host": "",
                            "member_metadata": tenant.metadata.get((group_id, m.member_id), {}).get(
                                description.protocol or "", b""
                            ),
                            "member_assignment": (
                                m.assignment_data
                                if description.client_assigned
                                else encode_assignment(m.assignment)
                            ),
                        }
                        for m in description.members
                    ],
                )
            elif group_id in stored:
                entry.update(group_state="Empty", protocol_type=PROTOCOL_TYPE)
            described.append(entry)
        return {"throttle_time": 0, "groups": described}

    async def delete_groups(
        self, session: Session, request: Any, version: int
    ) -> Mapping[str, Any]:
        results = []
        for group_id in request.groups_names:
            code = ErrorCode.none
            try:
                _check_coordinator(session)
                if group_id not in await self.api.groups.group_ids(session.tenant_id):
                    # No member and no committed offset: Kafka's GROUP_ID_NOT_FOUND.
                    results.append(
                        {"group_id": group_id, "error_code": ErrorCode.group_id_not_found}
                    )
                    continue
                await self.api.groups.delete(session.tenant_id, group_id)
            except GroupError as exc:
                code = error_code(exc)
            except InvalidRequest:
                code = ErrorCode.non_empty_group
            except HeadwaterError as exc:
                code = error_code(exc)
            results.append({"group_id": group_id, "error_code": code})
        return {"throttle_time": 0, "results": results}
