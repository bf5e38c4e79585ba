"""Consumer groups with membership: Kafka's group protocol, as the engine's pure parts.

* :mod:`.coordinator`: the group state machine (join, sync, heartbeat, leave, session
  and rebalance timeouts, generations, assignor selection, static membership), no I/O,
  an injected clock;
* :mod:`.assignors`: range, roundrobin and cooperative-sticky;
* :mod:`.offsets`: committed offsets per (group, stream, partition) with metadata, their
  generation checks, and their durable store, an internal compacted stream per tenant;
* :mod:`.errors`: the refusals, with Kafka's names and codes for the front ends to map.

docs/architecture.md ("Consumer groups") describes how they fit together.
"""

from headwater.engine.groups.assignors import ASSIGNORS, MemberSubscription, TopicPartition
from headwater.engine.groups.coordinator import (
    NO_GENERATION,
    GroupConfig,
    GroupCoordinator,
    GroupDescription,
    GroupState,
    JoinFailed,
    JoinResult,
    Reply,
    SyncFailed,
    SyncResult,
)
from headwater.engine.groups.errors import (
    CoordinatorNotAvailable,
    FencedInstanceId,
    GroupError,
    IllegalGeneration,
    InconsistentGroupProtocol,
    NotCoordinator,
    OffsetMetadataTooLarge,
    RebalanceInProgress,
    UnknownMemberId,
)
from headwater.engine.groups.offsets import (
    CommittedOffset,
    CommittedOffsets,
    LogOffsetStore,
    OffsetKey,
    OffsetManager,
    OffsetStore,
    metadata_fits,
)

__all__ = [
    "ASSIGNORS",
    "NO_GENERATION",
    "CommittedOffset",
    "CommittedOffsets",
    "CoordinatorNotAvailable",
    "FencedInstanceId",
    "GroupConfig",
    "GroupCoordinator",
    "GroupDescription",
    "GroupError",
    "GroupState",
    "IllegalGeneration",
    "InconsistentGroupProtocol",
    "JoinFailed",
    "JoinResult",
    "LogOffsetStore",
    "MemberSubscription",
    "NotCoordinator",
    "OffsetKey",
    "OffsetManager",
    "OffsetMetadataTooLarge",
    "OffsetStore",
    "RebalanceInProgress",
    "Reply",
    "SyncFailed",
    "SyncResult",
    "TopicPartition",
    "UnknownMemberId",
    "metadata_fits",
]
