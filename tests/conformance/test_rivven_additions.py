"""headwater's additions to the Rivven schema (docs/protocols/rivven.md, "headwater's
additions"): Rivven's own messages keep their bytes when the added fields are unset, the
added operations decode, and Rivven's limits hold for them too."""

from __future__ import annotations

import pytest

from headwater.protocols.rivven import rivven_pb2 as pb
from headwater.protocols.rivven.messages import (
    MAX_LIST_LEN,
    MAX_NAME_LEN,
    DecodeError,
    decode_request,
    request_of,
)


def test_rivvens_messages_keep_their_bytes_without_the_added_fields() -> None:
    # CommitOffset as Rivven's own client sends it (fields 1-5, hand-encoded here):
    # headwater's member_id (100) and generation (101) add nothing while unset.
    rivven_bytes = (
        b"\x0a\x01g"  # consumer_group "g"
        b"\x12\x01t"  # topic "t"
        b"\x18\x02"  # partition 2
        b"\x20\x07"  # offset 7
        b"\x2a\x01m"  # metadata "m"
    )
    ours = pb.CommitOffsetRequest(
        consumer_group="g", topic="t", partition=2, offset=7, metadata="m"
    ).SerializeToString()
    assert ours == rivven_bytes
    assert pb.CommitOffsetRequest.FromString(rivven_bytes).HasField("generation") is False
    # Set, they travel at their own numbers, which a Rivven decoder skips.
    member = pb.CommitOffsetRequest(member_id="m-1", generation=0).SerializeToString()
    assert member == b"\xa2\x06\x03m-1" + b"\xa8\x06\x00"


def test_added_operations_decode() -> None:
    batch = pb.BatchPublishRequest(topic="t", producer_id=5, producer_epoch=1, txn_id="x")
    batch.partition_records.add(partition=3, base_sequence=9, records=[pb.Record(value=b"v")])
    decoded = decode_request(request_of(batch).SerializeToString())
    assert decoded.WhichOneof("request_type") == "publish_batch"
    assert decoded.publish_batch == batch
    join = pb.JoinGroupRequest(group_id="g", topics=["t"], assignors=["range"])
    assert decode_request(request_of(join).SerializeToString()).join_group == join
    for message, field in (
        (pb.GroupHeartbeatRequest(group_id="g", member_id="m", generation=3), "group_heartbeat"),
        (pb.LeaveGroupRequest(group_id="g", member_id="m"), "leave_group"),
    ):
        assert getattr(decode_request(request_of(message).SerializeToString()), field) == message
    # The Request field numbers are headwater's, clear of Rivven's (which end at 99).
    numbers = {f.name: f.number for f in pb.Request.DESCRIPTOR.fields}
    added = ("publish_batch", "join_group", "group_heartbeat", "leave_group")
    assert [numbers[name] for name in added] == [200, 201, 202, 203]


@pytest.mark.parametrize(
    "message",
    [
        pb.JoinGroupRequest(group_id="g", member_id="m" * (MAX_NAME_LEN + 1)),
        pb.JoinGroupRequest(group_id="g", instance_id="i" * (MAX_NAME_LEN + 1)),
        pb.JoinGroupRequest(group_id="g", assignors=["a" * (MAX_NAME_LEN + 1)]),
        pb.GroupHeartbeatRequest(group_id="g" * (MAX_NAME_LEN + 1)),
        pb.CommitOffsetRequest(consumer_group="g", member_id="m" * (MAX_NAME_LEN + 1)),
        pb.BatchPublishRequest(topic="t", producer_epoch=1 << 16),
    ],
)
def test_added_fields_are_held_to_rivvens_limits(message: object) -> None:
    with pytest.raises(DecodeError):
        decode_request(request_of(message).SerializeToString())  # type: ignore[arg-type]


def test_a_batch_of_one_partition_past_the_list_limit_is_refused() -> None:
    batch = pb.BatchPublishRequest(topic="t")
    batch.partition_records.add(
        partition=0, records=[pb.Record(value=b"") for _ in range(MAX_LIST_LEN + 1)]
    )
    with pytest.raises(DecodeError, match=str(MAX_LIST_LEN)):
        decode_request(request_of(batch).SerializeToString())
