"""The group coordinator's refusals, named and numbered as Kafka's group protocol names
them, so that every front end maps them the same way: ``kafka_name`` / ``kafka_code``
for a Kafka-shaped wire (Rivven), and, being :class:`InvalidRequest` (code 2), a plain
error on the wires that have no group errors of their own. ``retryable`` says whether the
client should rejoin and try again (a rebalance) or give up (a misconfiguration)."""

from __future__ import annotations

from typing import ClassVar

from headwater.errors import InvalidRequest


class GroupError(InvalidRequest):
    """Root of the coordinator's errors."""

    kafka_name: ClassVar[str] = "UNKNOWN_SERVER_ERROR"
    kafka_code: ClassVar[int] = -1


class IllegalGeneration(GroupError):
    """The request names a generation other than the group's current one: the member
    missed a rebalance and must rejoin (a commit from it is refused, nothing stored)."""

    kafka_name, kafka_code = "ILLEGAL_GENERATION", 22
    retryable = True


class InconsistentGroupProtocol(GroupError):
    """The member's assignors share none with the group's (or none is known here)."""

    kafka_name, kafka_code = "INCONSISTENT_GROUP_PROTOCOL", 23


class InvalidGroupId(GroupError):
    kafka_name, kafka_code = "INVALID_GROUP_ID", 24


class OffsetMetadataTooLarge(GroupError):
    """An offset's metadata is over Kafka's offset.metadata.max.bytes: that partition's
    offset is not committed (the request's others are, on the Kafka wire)."""

    kafka_name, kafka_code = "OFFSET_METADATA_TOO_LARGE", 12


class UnknownMemberId(GroupError):
    """The member id is not (or no longer: left, timed out) a member of the group."""

    kafka_name, kafka_code = "UNKNOWN_MEMBER_ID", 25
    retryable = True


class InvalidSessionTimeout(GroupError):
    kafka_name, kafka_code = "INVALID_SESSION_TIMEOUT", 26


class RebalanceInProgress(GroupError):
    """The group is rebalancing: the member must rejoin before it syncs or commits."""

    kafka_name, kafka_code = "REBALANCE_IN_PROGRESS", 27
    retryable = True


class GroupMaxSizeReached(GroupError):
    kafka_name, kafka_code = "GROUP_MAX_SIZE_REACHED", 81


class FencedInstanceId(GroupError):
    """A static member's instance id is now held by a newer member id (the old process
    is a zombie: it must stop)."""

    kafka_name, kafka_code = "FENCED_INSTANCE_ID", 82


class CoordinatorNotAvailable(GroupError):
    """In a cluster: the group's offsets partition has no leader right now (not placed
    yet, or failing over); the client asks again (FindCoordinator)."""

    kafka_name, kafka_code = "COORDINATOR_NOT_AVAILABLE", 15
    retryable = True


class NotCoordinator(GroupError):
    """In a cluster: another node leads the group's offsets partition, so it is the
    group's coordinator; the client finds it again (FindCoordinator) and moves there."""

    kafka_name, kafka_code = "NOT_COORDINATOR", 16
    retryable = True
