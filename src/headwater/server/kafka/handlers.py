"""Kafka requests answered by the engine API: one coroutine per API, each returning the
answer as a mapping of every field any version has (:func:`.build.build` keeps the
version's own).

A topic is a stream of the connection's tenant, a partition one of its partitions,
and this node (id 0) the leader of every one. What differs from Kafka is in
docs/kafka.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import repeat
from operator import itemgetter, length_hint
from typing import Any

import numpy as np
from kio.schema.errors import ErrorCode

from headwater.api import EngineAPI
from headwater.cluster.view import (
    ClusterView,
    NotEnoughReplicas,
    NotEnoughReplicasAfterAppend,
    ReplicationTimedOut,
)
from headwater.engine.engine import (
    ACKS_LEADER,
    MAX_KAFKA_BATCH_RECORDS,
    MAX_PARTITIONS,
    READ_COMMITTED,
    READ_UNCOMMITTED,
    StreamInfo,
    StreamSettings,
)
from headwater.engine.groups import GroupError, metadata_fits
from headwater.engine.kinds.reader import Buffer
from headwater.engine.names import InvalidName, check_topic_name
from headwater.engine.transactions import ProducerIdentity
from headwater.errors import (
    AppendTooLarge,
    BatchTooLarge,
    HeadwaterError,
    InvalidOffset,
    InvalidRequest,
    InvalidTxnState,
    NotLeader,
    OutOfOrderSequence,
    ProducerFenced,
    StreamAlreadyExists,
    StreamNotFound,
    StreamQuotaExceeded,
)
from headwater.protocols.kafka import (
    ApiKey,
    RecordBatch,
    RecordBatchError,
    checked_together,
    split_batches,
)
from headwater.protocols.kafka.frames import PLACEHOLDER_BYTES
from headwater.protocols.kafka.records import (
    BatchHeader,
    Compression,
    ControlType,
    Record,
    batch_around,
    build_batch,
    control_batch,
    wire_producer_epoch,
    wire_producer_id,
)
from headwater.server.answers import AnswerBudget, AnswerRoom
from headwater.server.topic_configs import TOPIC_CONFIGS, topic_settings
from headwater.storage import kafka_batch
from headwater.storage.batch import Batch, Headers
from headwater.storage.kafka_batch import KafkaSection, fetch_prefix
from headwater.storage.log import ReadResult

log = logging.getLogger("headwater.kafka")

NODE_ID = 0
CLUSTER_ID = "headwater"
MAX_MESSAGE_BYTES = 1_048_588
"""Kafka's default ``max.message.bytes``: a produced batch larger than this is refused
with MESSAGE_TOO_LARGE, as Kafka refuses it."""
SPLICED = "spliced"
"""The key under which an answer's mapping may hold the placeholders its bytes fields
hold and the buffers each stands for (:func:`.frames.encode_response_chunks`); kio's
classes have no such field, so :func:`.build.build` leaves it out."""
MAX_FETCH_WAIT_S = 30.0  # a client asking to be held longer is held this long


def error_code(exc: HeadwaterError) -> ErrorCode:
    """Kafka's error code for an engine refusal."""
    if isinstance(exc, GroupError):
        return ErrorCode(exc.kafka_code)
    if isinstance(exc, StreamNotFound):
        return ErrorCode.unknown_topic_or_partition
    if isinstance(exc, OutOfOrderSequence):
        return ErrorCode.out_of_order_sequence_number
    if isinstance(exc, ProducerFenced):
        return ErrorCode.producer_fenced
    if isinstance(exc, InvalidTxnState):
        return ErrorCode.invalid_txn_state
    if isinstance(exc, StreamAlreadyExists):
        return ErrorCode.topic_already_exists
    if isinstance(exc, StreamQuotaExceeded):
        return ErrorCode.policy_violation
    if isinstance(exc, BatchTooLarge):
        return ErrorCode.record_list_too_large
    if isinstance(exc, AppendTooLarge):
        return ErrorCode.message_too_large
    if isinstance(exc, InvalidOffset):
        return ErrorCode.offset_out_of_range
    if isinstance(exc, InvalidName):
        return ErrorCode.invalid_topic_exception
    if isinstance(exc, InvalidRequest):
        return ErrorCode.invalid_request
    if isinstance(exc, NotLeader):
        return ErrorCode.not_leader_or_follower
    # Stored, then not confirmed: a client must not read these as "not stored".
    if isinstance(exc, NotEnoughReplicasAfterAppend):
        return ErrorCode.not_enough_replicas_after_append
    if isinstance(exc, ReplicationTimedOut):
        return ErrorCode.request_timed_out
    if isinstance(exc, NotEnoughReplicas):
        return ErrorCode.not_enough_replicas
    return ErrorCode.unknown_server_error


@dataclass
class Session:
    """One connection's standing: its tenant and the address it reached us at (what
    Metadata and FindCoordinator give as this node's)."""

    api: EngineAPI
    host: str
    port: int
    peer: str
    tenant_id: int = 0
    client_id: str = ""
    authenticated: bool = False
    # Set when the listener stops: long polls answer at once instead of holding the
    # drain for their max_wait.
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    # With [cluster]: leadership, the high watermark and acks=all (docs/cluster.md).
    cluster: ClusterView | None = None
    # Counts a request refused by a [limits] key (headwater_limit_refusals_total).
    refused: Callable[[str], None] = field(default=lambda limit: None)
    # Counts what a Fetch gave the client: (tenant, stream, events, bytes), as
    # headwater_events_read_total and _bytes_read_total (stored batches' bytes, as a
    # produce counts them).
    counted: Callable[[int, str, int, int], None] = field(default=lambda *read: None)
    # Produce requests of this connection appending through tasks now (see produce).
    spread_produces: int = 0
    # Where this connection's Fetch answers take their bytes (server/answers.py).
    answers: AnswerRoom = field(default_factory=lambda: AnswerRoom(AnswerBudget(1 << 62)))

    @property
    def node_id(self) -> int:
        """This broker's id: the cluster's node id, or 0 on a single node."""
        return NODE_ID if self.cluster is None else self.cluster.node_id

    def broker(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "host": self.host, "port": self.port, "rack": None}

    def brokers(self) -> list[dict[str, Any]]:
        """Every broker a client may be sent to: each live node of a cluster."""
        if self.cluster is None:
            return [self.broker()]
        return [
            {"node_id": n.node_id, "host": n.host, "port": n.ports["kafka"], "rack": n.rack}
            for n in self.cluster.nodes()
            if "kafka" in n.ports
        ]


Handler = Callable[[Session, Any, int], Awaitable[Mapping[str, Any]]]


# ---- metadata and topics --------------------------------------------------------------


def _placement(session: Session, info: StreamInfo, partition: int) -> dict[str, Any]:
    """Leader, epoch, replicas and ISR of one partition: this node alone without a
    cluster; LEADER_NOT_AVAILABLE while a cluster's partition has no leader (or is not
    placed yet)."""
    cluster = session.cluster
    if cluster is None:
        return {
            "error_code": ErrorCode.none,
            "leader_id": NODE_ID,
            "leader_epoch": 0,
            "replica_nodes": [NODE_ID],
            "isr_nodes": [NODE_ID],
        }
    view = cluster.partition(info.tenant_id, info.name, partition)
    if view is None:  # created a moment ago: the controller has not placed it yet
        return {
            "error_code": ErrorCode.leader_not_available,
            "leader_id": -1,
            "leader_epoch": -1,
            "replica_nodes": [],
            "isr_nodes": [],
        }
    return {
        "error_code": ErrorCode.leader_not_available if view.leader < 0 else ErrorCode.none,
        "leader_id": view.leader,
        "leader_epoch": view.epoch,
        "replica_nodes": list(view.replicas),
        "isr_nodes": list(view.isr),
    }


def _topic_entry(info: StreamInfo, session: Session) -> dict[str, Any]:
    return {
        "error_code": ErrorCode.none,
        "name": info.name,
        "topic_id": None,
        "is_internal": False,  # headwater's own streams never reach a client (Engine.stream)
        "partitions": [
            {"partition_index": p, **_placement(session, info, p), "offline_replicas": []}
            for p in range(info.partitions)
        ],
    }


async def metadata(session: Session, request: Any, version: int) -> Mapping[str, Any]:
    api, tenant = session.api, session.tenant_id
    topics: list[dict[str, Any]] = []
    if request.topics is None or (version == 0 and not request.topics):
        topics = [_topic_entry(info, session) for info in api.list_streams(tenant)]
    else:
        # Kafka's auto.create.topics.enable defaults to true; v0-3 always ask for it.
        auto_create = getattr(request, "allow_auto_topic_creation", True)
        for wanted in request.topics:
            name = wanted.name
            try:
                topics.append(_topic_entry(api.stream_named(tenant, name), session))
                continue
            except StreamNotFound:
                pass
            code = ErrorCode.unknown_topic_or_partition
            if auto_create:
                try:
                    check_topic_name(name, (s.name for s in api.list_streams(tenant)))
                    topics.append(_topic_entry(await api.create_stream(tenant, name), session))
                    continue
                except StreamAlreadyExists:
                    try:
                        topics.append(_topic_entry(api.stream_named(tenant, name), session))
                        continue
                    except StreamNotFound:
                        # Another request's create of it is under way: Kafka's answer
                        # for a topic being created (the client asks again).
                        code = ErrorCode.leader_not_available
                except InvalidRequest as exc:
                    log.warning("kafka %s: topic %r not created: %s", session.peer, name, exc)
                    code = ErrorCode.invalid_topic_exception
            topics.append({"error_code": code, "name": name, "partitions": []})
    return {
        "throttle_time": 0,
        "brokers": session.brokers(),
        "cluster_id": CLUSTER_ID,
        "controller_id": NODE_ID if session.cluster is None else session.cluster.controller_id,
        "topics": topics,
    }


@dataclass
class _Outcome:
    """A topic's answer to CreateTopics, DeleteTopics or CreatePartitions."""

    error_code: ErrorCode = ErrorCode.none
    error_message: str | None = None


@contextmanager
def _topic_outcome(session: Session, invalid: ErrorCode) -> Iterator[_Outcome]:
    """The outcome of the block: NONE, or the HeadwaterError it raised, InvalidRequest
    answered as ``invalid`` (the operation's own code for a bad argument) and a refusal
    by a limit counted."""
    outcome = _Outcome()
    try:
        yield outcome
    except HeadwaterError as exc:
        if isinstance(exc, StreamQuotaExceeded):
            session.refused(exc.limit)
        code = error_code(exc)
        outcome.error_code = invalid if code is ErrorCode.invalid_request else code
        outcome.error_message = str(exc)


def _creation_refused(
    name: str, times_named: int, partitions: int, topic: Any
) -> tuple[ErrorCode, str] | None:
    """Kafka's refusal of a CreateTopics entry before its configs are read, if any."""
    if times_named > 1:  # Kafka creates none of them and answers the name once
        return ErrorCode.invalid_request, f"topic {name!r} is named more than once"
    if not 1 <= partitions <= MAX_PARTITIONS:
        return ErrorCode.invalid_partitions, f"num_partitions must be 1 to {MAX_PARTITIONS} or -1"
    if topic.replication_factor not in (-1, 1):
        return ErrorCode.invalid_replication_factor, "one node: replication_factor is 1 or -1"
    return None


async def create_topics(session: Session, request: Any, version: int) -> Mapping[str, Any]:
    api, tenant = session.api, session.tenant_id
    results = []
    named = Counter(topic.name for topic in request.topics)
    answered: set[str] = set()
    for topic in request.topics:
        if topic.name in answered:
            continue  # a name given twice: answered once (a client reads one entry)
        answered.add(topic.name)
        partitions = topic.num_partitions if topic.num_partitions != -1 else 1
        with _topic_outcome(session, ErrorCode.invalid_config) as outcome:
            refused = _creation_refused(topic.name, named[topic.name], partitions, topic)
            if refused is not None:
                outcome.error_code, outcome.error_message = refused
            else:
                check_topic_name(topic.name, (s.name for s in api.list_streams(tenant)))
                settings = StreamSettings.from_dict(
                    {
                        **topic_settings((c.name, c.value) for c in topic.configs),
                        "partitions": partitions,
                    }
                )
                if not request.validate_only:
                    await api.create_stream(tenant, topic.name, settings)
        created = outcome.error_code is ErrorCode.none
        results.append(
            {
                "name": topic.name,
                "topic_id": None,
                **asdict(outcome),
                "num_partitions": partitions if created else -1,
                "replication_factor": 1 if created else -1,
                "configs": [],
            }
        )
    return {"throttle_time": 0, "topics": results}


async def delete_topics(session: Session, request: Any, version: int) -> Mapping[str, Any]:
    api, tenant = session.api, session.tenant_id
    results = []
    for name in request.topic_names:
        with _topic_outcome(session, ErrorCode.invalid_request) as outcome:
            await api.delete_stream(tenant, api.stream_named(tenant, name).stream_id)
        results.append({"name": name, "topic_id": None, **asdict(outcome)})
    return {"throttle_time": 0, "responses": results}


async def create_partitions(session: Session, request: Any, version: int) -> Mapping[str, Any]:
    api, tenant = session.api, session.tenant_id
    results = []
    for topic in request.topics:
        with _topic_outcome(session, ErrorCode.invalid_partitions) as outcome:
            info = api.stream_named(tenant, topic.name)
            if topic.count <= info.partitions:
                raise InvalidRequest(
                    f"{topic.name} has {info.partitions} partitions: it can only grow"
                )
            if not request.validate_only:
                await api.alter_partitions(tenant, info.stream_id, topic.count)
        results.append({"name": topic.name, **asdict(outcome)})
    return {"throttle_time": 0, "results": results}


RESOURCE_TOPIC = 2


UNSET = StreamSettings()  # what a topic created without configs has


async def describe_configs(session: Session, request: Any, version: int) -> Mapping[str, Any]:
    api, tenant = session.api, session.tenant_id
    results = []
    for resource in request.resources:
        entry: dict[str, Any] = {
            "error_code": ErrorCode.none,
            "error_message": None,
            "resource_type": resource.resource_type,
            "resource_name": resource.resource_name,
            "configs": [],
        }
        if resource.resource_type != RESOURCE_TOPIC:
            entry["error_code"] = ErrorCode.invalid_request
            entry["error_message"] = "only topic configs are described"
        else:
            try:
                info = api.stream_named(tenant, resource.resource_name)
            except StreamNotFound as exc:
                entry["error_code"] = ErrorCode.unknown_topic_or_partition
                entry["error_message"] = str(exc)
            else:
                wanted = resource.configuration_keys
                in_effect = api.stream_log_config(tenant, info.name)
                for name, setting in TOPIC_CONFIGS.items():
                    if wanted is not None and name not in wanted:
                        continue
                    own, default = getattr(info.settings, setting), getattr(UNSET, setting)
                    if own == default:
                        # cleanup.policy and message.timestamp.type are always stored: at
                        # their defaults they are told as defaults, as a topic created
                        # without them is (kafka-configs lists overrides).
                        own = None
                    # A setting the topic does not set is the server's, as it runs.
                    value = own if own is not None else getattr(in_effect, setting, default)
                    entry["configs"].append(
                        {
                            "name": name,
                            # None: no limit (retention), as Kafka's -1
                            "value": "-1" if value is None else str(value),
                            "read_only": False,
                            # 1: the topic's own; 5: the broker's default
                            "config_source": 5 if own is None else 1,
                            "config_type": 0,
                            "is_sensitive": False,
                            "synonyms": [],
                        }
                    )
        results.append(entry)
    return {"throttle_time": 0, "results": results}


_GROUP_KEY = 0  # FindCoordinator's key_type of a consumer group (1: a transactional id)


async def find_coordinator(session: Session, request: Any, version: int) -> Mapping[str, Any]:
    keys = list(request.coordinator_keys) if version >= 4 else [request.key]
    key_type = getattr(request, "key_type", _GROUP_KEY)  # v0 asks for groups only
    coordinators = [
        {"key": key, **await _coordinator(session, key_type), "error_message": None} for key in keys
    ]
    first = {k: v for k, v in coordinators[0].items() if k != "key"}
    return {"throttle_time": 0, **first, "coordinators": coordinators}


async def _coordinator(session: Session, key_type: int) -> dict[str, Any]:
    """The coordinator broker of a key: this node, but in a cluster a group's is the
    node leading its tenant's offsets stream, a transactional id's the node leading its
    transaction state stream (docs/cluster.md)."""
    cluster = session.cluster
    if cluster is None:
        return {**session.broker(), "error_code": ErrorCode.none}
    # The stream exists before it can be placed (created here on first use, as Kafka
    # creates __consumer_offsets and __transaction_state on the first FindCoordinator).
    if key_type == _GROUP_KEY:
        await session.api.groups.open_stored(session.tenant_id)
        node = cluster.group_coordinator(session.tenant_id)
    else:
        await session.api.open_transaction_state(session.tenant_id)
        node = cluster.transaction_coordinator(session.tenant_id)
    if node is None or "kafka" not in node.ports:
        return {"node_id": -1, "host": "", "port": -1,
                "error_code": ErrorCode.coordinator_not_available}  # fmt: skip
    return {"node_id": node.node_id, "host": node.host, "port": node.ports["kafka"],
            "error_code": ErrorCode.none}  # fmt: skip


def _stream_or_none(session: Session, name: str) -> StreamInfo | None:
    """The session tenant's stream ``name``; None when there is none (each partition
    asked of it is then answered UNKNOWN_TOPIC_OR_PARTITION)."""
    try:
        return session.api.stream_named(session.tenant_id, name)
    except StreamNotFound:
        return None


def _partitions_asked(
    session: Session,
    topics: Sequence[Any],
    answer: list[dict[str, Any]],
    name: str,
    index: str,
    blank: Mapping[str, Any],
) -> Iterator[tuple[dict[str, Any], StreamInfo, int, Any]]:
    """Each partition a Fetch or ListOffsets asks for (``name`` and ``index``: its
    request's field names of a topic's name, the answer's too, and a partition's index)
    with its answer's entry: ``blank``'s fields (shared by every entry: immutable), under
    its topic in ``answer``. A partition of no stream is answered UNKNOWN_TOPIC_OR_PARTITION
    here and not yielded."""
    for topic in topics:
        topic_name = getattr(topic, name)
        info = _stream_or_none(session, topic_name)
        partitions: list[dict[str, Any]] = []
        answer.append({name: topic_name, "partitions": partitions})
        for wanted in topic.partitions:
            p = getattr(wanted, index)
            entry = {"partition_index": p, "error_code": ErrorCode.none, **blank}
            partitions.append(entry)
            if info is None or not 0 <= p < info.partitions:
                entry["error_code"] = ErrorCode.unknown_topic_or_partition
            else:
                yield entry, info, p, wanted


# ---- produce ----------------------------------------------------------------------------


async def produce(session: Session, request: Any, version: int) -> Mapping[str, Any]:
    if getattr(request, "acks", 1) not in (-1, 0, 1):
        # Kafka stores nothing of a Produce with other acks, every partition answered so.
        message = f"acks must be -1, 0 or 1, not {request.acks}"
        return {
            "responses": [
                {
                    "name": topic.name,
                    "partition_responses": [
                        _produce_answer(data.index, ErrorCode.invalid_required_acks, message)
                        for data in topic.partition_data
                    ],
                }
                for topic in request.topic_data
            ],
            "throttle_time": 0,
        }
    # Each partition's batch, split first: a Produce to several partitions has its
    # batches checked together (one numpy pass per record layout, not one per batch).
    parts: list[tuple[Any, StreamInfo | None, RecordBatch | RecordBatchError | None]] = []
    every: list[RecordBatch] = []
    for topic in request.topic_data:
        info = _stream_or_none(session, topic.name)
        for data in topic.partition_data:
            batch: RecordBatch | RecordBatchError | None = None
            if info is not None and 0 <= data.index < info.partitions:
                try:
                    batch = _one_batch(data.records)
                except RecordBatchError as exc:
                    batch = exc  # answered for the partition, in its turn
                else:
                    every.append(batch)
            parts.append((data, info, batch))
    checked = (
        {id(b) for b, ok in zip(every, checked_together(every), strict=True) if ok}
        if len(every) > 1
        else set()
    )
    txn_id = request.transactional_id
    appends = [
        _produce_partition(session, info, data.index, batch, id(batch) in checked, txn_id, request)
        for data, info, batch in parts
    ]
    # Every partition of every topic at once: the appends of one request are written
    # before those of the next one on the connection (one partition: awaited here, its
    # write done before this returns to the loop; several: tasks, which run on the next
    # loop turn, so a lone append of the next request waits a turn for them).
    if len(appends) == 1:
        if session.spread_produces:
            await asyncio.sleep(0)
        answers = [await appends[0]]
    else:
        session.spread_produces += 1
        try:
            answers = await asyncio.gather(*appends)
        finally:
            session.spread_produces -= 1
    topics = []
    at = 0
    for topic in request.topic_data:
        count = len(topic.partition_data)
        topics.append({"name": topic.name, "partition_responses": answers[at : at + count]})
        at += count
    return {"responses": topics, "throttle_time": 0}


def _produce_answer(
    index: int, code: ErrorCode = ErrorCode.none, message: str | None = None
) -> dict[str, Any]:
    """A partition's answer to a Produce: nothing stored yet (offsets -1)."""
    return {
        "index": index,
        "error_code": code,
        "base_offset": -1,
        "log_append_time": None,
        "log_start_offset": -1,
        "record_errors": [],
        "error_message": message,
    }


def _one_batch(records: bytes | None) -> RecordBatch:
    """A partition's records of a Produce: exactly one v2 batch, as Kafka requires of
    Produce v3 and later (INVALID_RECORD otherwise: nothing of them is stored)."""
    batches = split_batches(records or b"")
    if len(batches) != 1:
        raise RecordBatchError(
            ErrorCode.invalid_record,
            f"a Produce carries exactly one record batch per partition, not {len(batches)}",
        )
    return batches[0]


async def _produce_partition(
    session: Session,
    info: StreamInfo | None,
    index: int,
    batch: RecordBatch | RecordBatchError | None,
    checked: bool,
    transactional_id: str | None,
    request: Any,
) -> dict[str, Any]:
    """One partition's answer: its ``batch`` appended (``checked``: it passed the append
    check already), or the error of its records; None for a partition of no stream."""
    answer = _produce_answer(index)
    if info is None or not 0 <= index < info.partitions:
        answer["error_code"] = ErrorCode.unknown_topic_or_partition
        return answer
    cluster = session.cluster
    all_isr = getattr(request, "acks", 1) == -1
    try:
        if cluster is not None:
            # Only the leader takes writes; acks=all not even then below min ISR.
            cluster.check_leader(session.tenant_id, info.name, index)
            if all_isr:
                cluster.check_min_isr(session.tenant_id, info.name, index)
        if isinstance(batch, RecordBatchError):
            raise batch
        assert batch is not None  # a partition of a stream
        if len(batch.data) > MAX_MESSAGE_BYTES:
            raise RecordBatchError(
                ErrorCode.message_too_large,
                f"a record batch of {len(batch.data)} bytes is over the"
                f" {MAX_MESSAGE_BYTES}-byte limit (max.message.bytes)",
            )
        base_offset, appended_ms = await _append_batch(
            session, info, index, batch, transactional_id, checked=checked
        )
        stored_end = base_offset + batch.header.records_count
        if cluster is not None and all_isr:
            # acks=all: answered once every in-sync replica holds this request's batches.
            # Their own end, not the log's read afterwards: a leader dropped by a
            # reassignment cuts its copy to nothing meanwhile, and an end of 0 was
            # "replicated" at once (an acknowledged batch lost, docs/cluster.md).
            timeout = getattr(request, "timeout", None)
            seconds = timeout.total_seconds() if timeout is not None else 30.0
            await cluster.replicated(session.tenant_id, info.name, index, stored_end, seconds)
        answer["base_offset"] = base_offset
        if info.settings.timestamp_type == "LogAppendTime":
            # Kafka answers the broker's append time on such a topic, -1 (None) otherwise.
            answer["log_append_time"] = _EPOCH + timedelta(milliseconds=appended_ms)
        answer["log_start_offset"] = info.partition_info[index].start_offset
    except RecordBatchError as exc:
        log.warning("kafka %s: produce to %s refused: %s", session.peer, info.name, exc)
        answer["error_code"], answer["error_message"] = exc.code, str(exc)
    except HeadwaterError as exc:
        answer["error_code"], answer["error_message"] = _produce_error(exc), str(exc)
    return answer


def _keyless() -> RecordBatchError:
    # Kafka's rule: compaction keeps the latest record of each key, so every record of
    # a compacted topic needs one.
    return RecordBatchError(ErrorCode.invalid_record, "a compacted topic takes keyed records only")


async def _append_batch(
    session: Session,
    info: StreamInfo,
    index: int,
    batch: RecordBatch,
    transactional_id: str | None,
    *,
    checked: bool = False,
) -> tuple[int, int]:
    """Store one produced batch; the offset of its first record and its stored first
    timestamp (a LogAppendTime topic's: the log's clock). It is checked once (CRC,
    header, its records read batch-at-a-time; not again when ``checked``: with the
    request's other batches) and stored as it came, in Kafka form; the idempotence and
    transaction checks read its header."""
    api, tenant = session.api, session.tenant_id
    header = batch.header
    if header.is_control:
        # Markers are the broker's to write (Kafka: INVALID_RECORD for a client's).
        raise RecordBatchError(ErrorCode.invalid_record, "a client may not produce control batches")
    if header.records_count > MAX_KAFKA_BATCH_RECORDS:
        # Stored whole or not at all, as Kafka stores a batch: cut into several it could
        # be interleaved with other appends, which an idempotent producer's next batch
        # finds out of order.
        raise RecordBatchError(
            ErrorCode.record_list_too_large,
            f"a record batch holds at most {MAX_KAFKA_BATCH_RECORDS} records here, not"
            f" {header.records_count}: lower the producer's batch.num.messages or batch.size",
        )
    if not checked:
        batch.check_for_append()
    if info.settings.cleanup_policy == "compact" and batch.keyless():
        raise _keyless()
    if header.is_transactional:
        section = KafkaSection(batch.section, header.records_count, header.max_timestamp)
        return await _append_transactional(session, info, index, header, transactional_id, section)
    idempotent = header.producer_id >= 0
    stored = await api.append_encoded(
        tenant,
        info.stream_id,
        batch.section,
        header.records_count,
        value_bytes=len(batch.section),
        timestamp_ms=header.max_timestamp,
        partition=index,
        producer=(header.producer_id, header.base_sequence) if idempotent else None,
        producer_epoch=header.producer_epoch if idempotent else None,
        kafka=True,
        acks=ACKS_LEADER,  # acks=all is waited for by _produce_partition, its timeout
    )
    return stored.base_offset, stored.timestamp_ms


async def _append_transactional(
    session: Session,
    info: StreamInfo,
    index: int,
    header: BatchHeader,
    transactional_id: str | None,
    values: Sequence[bytes] | KafkaSection,
    *,
    keys: Sequence[bytes | None] | None = None,
    headers: Sequence[Headers] | None = None,
) -> tuple[int, int]:
    """Store a batch of a transactional producer (as it came, or decoded) inside its
    transaction; its first offset and stored first timestamp."""
    if transactional_id is None or header.producer_id < 0:
        raise InvalidTxnState("a transactional batch in a Produce without transactional_id")
    stored = await session.api.append_transactional(
        session.tenant_id,
        transactional_id,
        ProducerIdentity(header.producer_id, header.producer_epoch),
        info.stream_id,
        header.base_sequence,
        values,
        partition=index,
        keys=keys,
        headers=headers,
    )
    return stored.base_offset, stored.timestamp_ms


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


# ---- fetch and offsets -----------------------------------------------------------------


def _partition_ends(session: Session, info: StreamInfo, partition: int) -> tuple[int, int, int]:
    """A partition's end, the end consumers read to (in a cluster the high watermark,
    on the leader or a follower) and its last stable offset (read_committed's end)."""
    api, tenant = session.api, session.tenant_id
    end = api.stream_end(tenant, info.stream_id, partition)
    stable = api.last_stable_offset(tenant, info.stream_id, partition)
    cluster = session.cluster
    readable = end if cluster is None else cluster.high_watermark(tenant, info.name, partition, end)
    return end, readable, min(stable, readable)


def _isolation(request: Any) -> str:
    return READ_COMMITTED if getattr(request, "isolation_level", 0) == 1 else READ_UNCOMMITTED


def records_of(result: ReadResult) -> list[Buffer]:
    """Kafka record batches of what was read, one per stored batch, as buffers to send
    in order: a batch stored in Kafka form as it was produced (its 17-byte prefix put
    back, the section itself a view of the read), a transaction marker as a control
    batch, and a batch of headwater's form (another front end's) encoded uncompressed
    with its producer id, epoch and transactional flag."""
    out: list[Buffer] = []
    for span in result.spans:
        batch = span.batch
        section = batch.kafka_section
        if section is not None:
            out += (fetch_prefix(batch.base_offset, len(section)), section)
            continue
        if batch.control:
            assert batch.producer is not None  # a marker always has its producer
            out.append(
                control_batch(
                    ControlType.COMMIT if batch.marker_commits() else ControlType.ABORT,
                    producer_id=wire_producer_id(batch.producer[0]),
                    producer_epoch=wire_producer_epoch(batch.producer_epoch or 0),
                    coordinator_epoch=0,
                    base_offset=batch.base_offset,
                    timestamp=batch.first_timestamp_ms,
                )
            )
            continue
        if span.stop > span.start:
            out.append(as_kafka_batch(batch, span.start, span.stop))
    return out


COLUMNS_FROM = 64
"""Below this many events a batch is encoded record by record: numpy's fixed cost per
batch (tens of calls, about 0.2 ms) is then above the records' (3-9 µs each)."""


def as_kafka_batch(batch: Batch, start: int, stop: int) -> bytes:
    """Events ``start..stop`` of a batch of headwater's form (another front end's) as
    one uncompressed Kafka batch, with its producer id, epoch and transactional flag,
    as Kafka would show it: a read_committed client drops an aborted transaction's
    batches by producer id. Batch-at-a-time (kafka_batch.encode_columns), but for
    events with headers and short batches, which are encoded record by record
    (:func:`_kafka_records`)."""
    identity = _producer_fields(batch)
    if stop - start < COLUMNS_FROM or batch.headers_section() is not None:
        return _kafka_records(batch, start, stop, identity)
    if batch.dense:
        offsets = np.arange(batch.base_offset + start, batch.base_offset + stop, dtype=np.int64)
    else:
        offsets = np.array(batch.offsets()[start:stop], np.int64)
    bounds = np.array(batch.value_bounds()[start : stop + 1], np.int64)
    value_lengths = np.diff(bounds) - 8
    keyed = batch.keys()
    keys = b""
    key_lengths = np.full(stop - start, -1, np.int64)
    if keyed is not None:
        present = [key for key, _ in keyed[start:stop]]
        key_lengths = np.fromiter(map(length_hint, present, repeat(-1)), np.int64, stop - start)
        keys = b"".join(filter(None, present))
        tombstones = np.fromiter(map(itemgetter(1), keyed[start:stop]), np.bool_, stop - start)
        value_lengths[tombstones] = -1
    records = kafka_batch.encode_columns(
        batch.values_section(),
        bounds[:-1] + 8,
        value_lengths,
        keys,
        key_lengths,
        offsets - offsets[0],
        np.zeros(stop - start, np.int64),  # one timestamp per batch of headwater's form
    )
    return batch_around(
        records,
        stop - start,
        int(offsets[-1] - offsets[0]),
        base_offset=int(offsets[0]),
        base_timestamp=batch.first_timestamp_ms,
        max_timestamp=batch.first_timestamp_ms,
        partition_leader_epoch=0,
        **identity,
    )


def _producer_fields(batch: Batch) -> dict[str, Any]:
    producer = batch.producer
    if producer is None:
        return {}
    return {
        "producer_id": wire_producer_id(producer[0]),
        "producer_epoch": wire_producer_epoch(batch.producer_epoch or 0),
        # The stored sequence as it is (Rivven's counts batches, not records); a
        # consumer does not check it.
        "base_sequence": producer[1] % (1 << 31),
        "transactional": batch.transactional,
    }


def _kafka_records(batch: Batch, start: int, stop: int, identity: dict[str, Any]) -> bytes:
    """:func:`as_kafka_batch` record by record (events with headers)."""
    events = batch.events(start)
    rows = [next(events) for _ in range(stop - start)]
    base, base_ts = rows[0].offset, rows[0].timestamp_ms
    records = [
        Record(
            offset_delta=event.offset - base,
            timestamp_delta=event.timestamp_ms - base_ts,
            key=event.key,
            value=None if event.tombstone else event.value,
            headers=tuple((n.decode("utf-8", "replace"), v) for n, v in event.headers),
        )
        for event in rows
    ]
    return build_batch(
        records,
        base_offset=base,
        base_timestamp=base_ts,
        compression=Compression.NONE,
        partition_leader_epoch=0,
        **identity,
    )


async def fetch(session: Session, request: Any, version: int) -> Mapping[str, Any]:
    api = session.api
    loop = asyncio.get_running_loop()
    max_wait_s = min(request.max_wait.total_seconds(), MAX_FETCH_WAIT_S)
    deadline = loop.time() + max(max_wait_s, 0.0)
    # What the answer may hold: its bytes are the server's (read_answers_mib) until the
    # client has read them; when none are free within max_wait, it holds nothing.
    asked = sum(p.partition_max_bytes for topic in request.topics for p in topic.partitions)
    wanted = max(min(getattr(request, "max_bytes", 1 << 31), asked), 1)
    while True:
        async with session.answers.turn(wanted, max(deadline - loop.time(), 0.0)) as granted:
            answer, size, waits = await _fetch_once(session, request, granted)
        remaining = deadline - loop.time()
        if size >= max(request.min_bytes, 1) or remaining <= 0 or not waits or api.closing:
            return answer
        # Long poll: until any partition asked for gets something new, or max_wait.
        tasks: list[asyncio.Future[Any]] = [
            asyncio.ensure_future(
                api.wait_readable(session.tenant_id, stream_id, partition, offset, remaining)
            )
            for stream_id, partition, offset in waits
        ]
        tasks.append(asyncio.ensure_future(session.stopping.wait()))
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
        if loop.time() >= deadline or session.stopping.is_set():
            async with session.answers.turn(wanted, 0.0) as granted:
                answer, size, waits = await _fetch_once(session, request, granted)
            return answer


async def _fetch_once(
    session: Session, request: Any, budget: int
) -> tuple[dict[str, Any], int, list[tuple[int, int, int]]]:
    """One pass over the partitions asked, reading up to ``budget`` bytes in all (0:
    nothing, each partition left to wait)."""
    api, tenant = session.api, session.tenant_id
    isolation = _isolation(request)
    size = 0
    waits: list[tuple[int, int, int]] = []
    topics: list[dict[str, Any]] = []
    spliced: dict[bytes, list[Buffer]] = {}
    blank = {
        "high_watermark": -1,
        "last_stable_offset": -1,
        "log_start_offset": -1,
        "aborted_transactions": (),
        "records": b"",
    }
    for entry, info, p, wanted in _partitions_asked(
        session, request.topics, topics, "topic", "partition", blank
    ):
        end, readable, stable = _partition_ends(session, info, p)
        entry["high_watermark"] = readable
        entry["last_stable_offset"] = stable
        entry["log_start_offset"] = info.partition_info[p].start_offset
        offset = wanted.fetch_offset
        if offset > end or offset < 0:
            entry["error_code"] = ErrorCode.offset_out_of_range
            continue
        limit = stable if isolation == READ_COMMITTED else readable
        if offset >= limit or size >= budget:
            # Woken by anything readable past the current end: a new batch, a
            # marker that moves the last stable offset, a high watermark move.
            waits.append((info.stream_id, p, readable))
            continue
        try:
            # Up to the last stable offset for read_committed, aborted batches and
            # markers included: the client drops what the aborted list names.
            result = await api.read(
                tenant,
                info.stream_id,
                offset,
                min(wanted.partition_max_bytes, budget - size),
                partition=p,
                isolation=isolation,
                kafka=True,
            )
        except InvalidOffset:
            entry["error_code"] = ErrorCode.offset_out_of_range
            continue
        except HeadwaterError as exc:
            entry["error_code"] = error_code(exc)
            continue
        events = result.count
        if readable < end:  # whole batches: those from the high watermark on wait
            result.spans = [s for s in result.spans if s.batch.base_offset < limit]
            events = sum(s.stop - s.start for s in result.spans if not s.batch.control)
        records = records_of(result)
        length = sum(memoryview(r).nbytes for r in records)
        if events:
            session.counted(tenant, info.name, events, length)
        if length:
            # The batches are put into the answer's frame as they were read, not
            # copied into it (frames.encode_response_chunks).
            placeholder = os.urandom(PLACEHOLDER_BYTES)
            spliced[placeholder] = records
            entry["records"] = placeholder
        size += length
        if isolation == READ_COMMITTED and result.spans:
            entry["aborted_transactions"] = [
                {
                    "producer_id": wire_producer_id(aborted.producer_id),
                    "first_offset": aborted.first_offset,
                }
                for aborted in api.aborted_transactions(
                    tenant,
                    info.stream_id,
                    p,
                    result.spans[0].batch.base_offset,
                    result.end_offset,
                )
            ]
        if not length:
            waits.append((info.stream_id, p, readable))
    answer = {
        "throttle_time": 0,
        "error_code": ErrorCode.none,
        "session_id": 0,
        "responses": topics,
        SPLICED: spliced,
    }
    return answer, size, waits


EARLIEST, LATEST, MAX_TIMESTAMP = -2, -1, -3


async def list_offsets(session: Session, request: Any, version: int) -> Mapping[str, Any]:
    api, tenant = session.api, session.tenant_id
    committed = _isolation(request) == READ_COMMITTED
    topics: list[dict[str, Any]] = []
    blank = {"timestamp": -1, "offset": -1, "leader_epoch": 0, "old_style_offsets": ()}
    for entry, info, p, wanted in _partitions_asked(
        session, request.topics, topics, "name", "partition_index", blank
    ):
        _, readable, stable = _partition_ends(session, info, p)
        # What the client may fetch: below the last stable offset for read_committed
        # (an open transaction's records are not found by time either, as in Kafka).
        fetchable = stable if committed else readable
        if wanted.timestamp == EARLIEST:
            entry["offset"] = info.partition_info[p].start_offset
        elif wanted.timestamp == LATEST:
            entry["offset"] = fetchable
        elif wanted.timestamp >= 0:
            found = await api.offset_for_timestamp(
                tenant, info.stream_id, wanted.timestamp, partition=p
            )
            if found is not None and found < fetchable:
                entry["offset"] = found
                entry["timestamp"] = await _timestamp_at(session, info, p, found)
        elif wanted.timestamp == MAX_TIMESTAMP and version >= 7:
            latest = await api.offset_of_max_timestamp(tenant, info.stream_id, partition=p)
            if latest is not None and latest[0] < fetchable:
                entry["offset"], entry["timestamp"] = latest
        else:
            entry["error_code"] = ErrorCode.unsupported_version
    return {"throttle_time": 0, "topics": topics}


async def _timestamp_at(session: Session, info: StreamInfo, partition: int, offset: int) -> int:
    result = await session.api.read(
        session.tenant_id,
        info.stream_id,
        offset,
        1,
        max_events=1,
        partition=partition,
        isolation=READ_UNCOMMITTED,
    )
    for event in result.events():
        return event.timestamp_ms
    return -1


# ---- idempotent and transactional producers ---------------------------------------------

# The first version of each transaction API that may answer PRODUCER_FENCED (KIP-588);
# older ones get INVALID_PRODUCER_EPOCH for the same refusal, as Kafka answers them.
_PRODUCER_FENCED_FROM = {
    ApiKey.INIT_PRODUCER_ID: 4,
    ApiKey.ADD_PARTITIONS_TO_TXN: 2,
    ApiKey.ADD_OFFSETS_TO_TXN: 2,
    ApiKey.END_TXN: 2,
    ApiKey.TXN_OFFSET_COMMIT: 3,
}


def partition_exists(session: Session, stream: str, partition: int) -> bool:
    try:
        return 0 <= partition < session.api.stream_named(session.tenant_id, stream).partitions
    except StreamNotFound:
        return False


def refused_offsets(
    session: Session, offsets: dict[tuple[str, int], tuple[int, str]]
) -> dict[tuple[str, int], ErrorCode]:
    """The partitions of an OffsetCommit or TxnOffsetCommit that Kafka refuses on their
    own, the others being committed: no such topic or partition
    (UNKNOWN_TOPIC_OR_PARTITION) and metadata over offset.metadata.max.bytes
    (OFFSET_METADATA_TOO_LARGE). They are taken out of ``offsets``."""
    refused = {}
    for key, (_, metadata) in offsets.items():
        if not partition_exists(session, *key):
            refused[key] = ErrorCode.unknown_topic_or_partition
        elif not metadata_fits(metadata):
            refused[key] = ErrorCode.offset_metadata_too_large
    for key in refused:
        del offsets[key]
    return refused


def partitions_answered(
    topics: Sequence[Any], code: ErrorCode, refused: Mapping[tuple[str, int], ErrorCode] = {}
) -> list[dict[str, Any]]:
    """The answer's topics for an OffsetCommit or TxnOffsetCommit: every partition
    asked of each topic answered ``code`` (the commit stands or falls together), but
    those ``refused`` on their own (:func:`refused_offsets`)."""
    return [
        {
            "name": topic.name,
            "partitions": [
                {
                    "partition_index": p.partition_index,
                    "error_code": refused.get((topic.name, p.partition_index), code),
                }
                for p in topic.partitions
            ],
        }
        for topic in topics
    ]


async def _txn_code(call: Awaitable[Any], api_key: ApiKey, version: int) -> ErrorCode:
    """What a transaction step answers: NONE once ``call`` is done, else its error as
    :func:`_txn_error` maps it."""
    try:
        await call
    except HeadwaterError as exc:
        return _txn_error(exc, api_key, version)
    return ErrorCode.none


def _txn_error(exc: HeadwaterError, api_key: ApiKey, version: int) -> ErrorCode:
    if isinstance(exc, ProducerFenced) and version < _PRODUCER_FENCED_FROM[api_key]:
        return ErrorCode.invalid_producer_epoch
    return error_code(exc)


def _produce_error(exc: HeadwaterError) -> ErrorCode:
    # A Produce from a fenced epoch is INVALID_PRODUCER_EPOCH in every version.
    if isinstance(exc, ProducerFenced):
        return ErrorCode.invalid_producer_epoch
    return error_code(exc)


def _producer(request: Any) -> ProducerIdentity:
    return ProducerIdentity(request.producer_id, request.producer_epoch)


async def init_producer_id(session: Session, request: Any, version: int) -> Mapping[str, Any]:
    timeout_ms = int(request.transaction_timeout.total_seconds() * 1000)
    try:
        producer = await session.api.init_producer(
            session.tenant_id,
            request.transactional_id,
            timeout_ms if request.transactional_id is not None else None,
        )
    except HeadwaterError as exc:
        code = _txn_error(exc, ApiKey.INIT_PRODUCER_ID, version)
        if code is ErrorCode.invalid_request:
            code = ErrorCode.invalid_transaction_timeout
        log.warning("kafka %s: InitProducerId refused: %s", session.peer, exc)
        return {"throttle_time": 0, "error_code": code, "producer_id": -1, "producer_epoch": -1}
    return {
        "throttle_time": 0,
        "error_code": ErrorCode.none,
        "producer_id": producer.producer_id,
        "producer_epoch": producer.epoch,
    }


async def add_partitions_to_txn(session: Session, request: Any, version: int) -> Mapping[str, Any]:
    api, tenant = session.api, session.tenant_id
    transactional_id = request.v3_and_below_transactional_id
    producer = ProducerIdentity(
        request.v3_and_below_producer_id, request.v3_and_below_producer_epoch
    )
    wanted: list[tuple[int, int]] = []
    code = ErrorCode.none
    try:
        for topic in request.v3_and_below_topics:
            info = api.stream_named(tenant, topic.name)
            for partition in topic.partitions:
                if not 0 <= partition < info.partitions:
                    raise StreamNotFound(f"{topic.name} has no partition {partition}")
                wanted.append((info.stream_id, partition))
        await api.add_partitions_to_txn(tenant, transactional_id, producer, wanted)
    except HeadwaterError as exc:
        code = _txn_error(exc, ApiKey.ADD_PARTITIONS_TO_TXN, version)
    return {
        "throttle_time": 0,
        "results_by_topic_v3_and_below": [
            {
                "name": topic.name,
                "results_by_partition": [
                    {"partition_index": partition, "partition_error_code": code}
                    for partition in topic.partitions
                ],
            }
            for topic in request.v3_and_below_topics
        ],
    }


async def add_offsets_to_txn(session: Session, request: Any, version: int) -> Mapping[str, Any]:
    # The group's offsets join with TxnOffsetCommit; this only checks the producer.
    code = await _txn_code(
        session.api.add_offsets_to_txn(
            session.tenant_id, request.transactional_id, _producer(request), request.group_id, {}
        ),
        ApiKey.ADD_OFFSETS_TO_TXN,
        version,
    )
    return {"throttle_time": 0, "error_code": code}


async def txn_offset_commit(session: Session, request: Any, version: int) -> Mapping[str, Any]:
    # KIP-447 (v3+): a commit naming its consumer's member and generation is refused
    # once that consumer has lost the partitions (ILLEGAL_GENERATION, UNKNOWN_MEMBER_ID,
    # FENCED_INSTANCE_ID), or a zombie's transaction would move the group's offsets back.
    member_id = getattr(request, "member_id", "") or ""
    generation = getattr(request, "generation_id", -1)
    instance_id = getattr(request, "group_instance_id", None)
    if member_id or generation >= 0 or instance_id is not None:
        try:
            coordinator = await session.api.groups.coordinator(session.tenant_id)
            coordinator.validate_commit(request.group_id, member_id, generation, instance_id)
        except HeadwaterError as exc:
            log.warning(
                "kafka %s: TxnOffsetCommit of %r refused: %s", session.peer, request.group_id, exc
            )
            return {
                "throttle_time": 0,
                "topics": partitions_answered(request.topics, error_code(exc)),
            }
    offsets = {
        (topic.name, partition.partition_index): (
            partition.committed_offset,
            partition.committed_metadata or "",
        )
        for topic in request.topics
        for partition in topic.partitions
    }
    refused = refused_offsets(session, offsets)  # the others join the transaction
    if not offsets:
        return {
            "throttle_time": 0,
            "topics": partitions_answered(request.topics, ErrorCode.none, refused),
        }
    code = await _txn_code(
        session.api.add_offsets_to_txn(
            session.tenant_id,
            request.transactional_id,
            _producer(request),
            request.group_id,
            offsets,
        ),
        ApiKey.TXN_OFFSET_COMMIT,
        version,
    )
    return {"throttle_time": 0, "topics": partitions_answered(request.topics, code, refused)}


async def end_txn(session: Session, request: Any, version: int) -> Mapping[str, Any]:
    code = await _txn_code(
        session.api.end_transaction(
            session.tenant_id, request.transactional_id, _producer(request), request.committed
        ),
        ApiKey.END_TXN,
        version,
    )
    return {"throttle_time": 0, "error_code": code}


HANDLERS: dict[ApiKey, Handler] = {
    ApiKey.METADATA: metadata,
    ApiKey.PRODUCE: produce,
    ApiKey.FETCH: fetch,
    ApiKey.LIST_OFFSETS: list_offsets,
    ApiKey.CREATE_TOPICS: create_topics,
    ApiKey.DELETE_TOPICS: delete_topics,
    ApiKey.CREATE_PARTITIONS: create_partitions,
    ApiKey.DESCRIBE_CONFIGS: describe_configs,
    ApiKey.FIND_COORDINATOR: find_coordinator,
    ApiKey.INIT_PRODUCER_ID: init_producer_id,
    ApiKey.ADD_PARTITIONS_TO_TXN: add_partitions_to_txn,
    ApiKey.ADD_OFFSETS_TO_TXN: add_offsets_to_txn,
    ApiKey.TXN_OFFSET_COMMIT: txn_offset_commit,
    ApiKey.END_TXN: end_txn,
}
"""The APIs answered so far; a request of another (announced) API is answered with
its error code by the listener."""
