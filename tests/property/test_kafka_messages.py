"""Round trips of every request and response of every API version headwater's Kafka
codec implements: kio writes, our bounded reader reads back the same message, framed
with the header its version takes; and any split of the bytes gives the same requests."""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka_strategies import message
from kio.schema.errors import ErrorCode

from headwater.engine.kinds.reader import Buffer
from headwater.errors import UsageError
from headwater.protocols.kafka.apis import SUPPORTED, ApiKey, request_type, response_type
from headwater.protocols.kafka.connection import Reply, Request, ServerConnection
from headwater.protocols.kafka.frames import (
    LONG_FRAME,
    PLACEHOLDER_BYTES,
    FrameDecoder,
    decode_response,
    encode_request,
    encode_response,
    encode_response_chunks,
)
from headwater.protocols.kafka.schema import decode_exact, encode_entity
from kafka_answers import fetch_answer

VERSIONS = [
    (key, version)
    for key, versions in sorted(SUPPORTED.items())
    for version in range(versions.min_version, versions.max_version + 1)
]
IDS = [f"{key.name.lower()}-v{version}" for key, version in VERSIONS]
CORRELATION_IDS = st.integers(0, 2**31 - 1)
FEW = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize(("api_key", "version"), VERSIONS, ids=IDS)
def test_request_round_trips_through_the_connection(api_key: ApiKey, version: int) -> None:
    @FEW
    @given(
        request=message(request_type(api_key, version)), correlation_id=st.integers(0, 2**31 - 1)
    )
    def check(request: Any, correlation_id: int) -> None:
        assert decode_exact(type(request), encode_entity(request)) == request
        [event] = ServerConnection().receive_data(encode_request(correlation_id, request))
        if api_key is ApiKey.API_VERSIONS:
            assert isinstance(event, Reply)
            return
        assert isinstance(event, Request)
        assert (event.api_key, event.api_version, event.correlation_id) == (
            api_key,
            version,
            correlation_id,
        )
        assert event.request == request

    check()


@pytest.mark.parametrize(("api_key", "version"), VERSIONS, ids=IDS)
def test_response_round_trips(api_key: ApiKey, version: int) -> None:
    @FEW
    @given(
        response=message(response_type(api_key, version)), correlation_id=st.integers(0, 2**31 - 1)
    )
    def check(response: Any, correlation_id: int) -> None:
        framed = encode_response(correlation_id, response)
        assert int.from_bytes(framed[:4], "big") == len(framed) - 4
        assert decode_response(api_key, version, framed[4:]) == (correlation_id, response)

    check()


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_any_split_of_pipelined_requests_gives_the_same_events(data: st.DataObject) -> None:
    chosen = data.draw(st.lists(st.sampled_from(VERSIONS), min_size=1, max_size=4))
    requests = [data.draw(message(request_type(key, version))) for key, version in chosen]
    stream = b"".join(encode_request(index, request) for index, request in enumerate(requests))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    connection = ServerConnection()
    events = []
    for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        events += connection.receive_data(stream[start:end])
    assert len(events) == len(requests)
    for event, request in zip(events, requests, strict=True):
        if isinstance(event, Request):
            assert event.request == request
        else:
            assert isinstance(event, Reply)
    assert connection.receive_eof() == []


@settings(max_examples=30, deadline=None)
@given(order=st.permutations(range(5)))
def test_answers_go_out_in_request_order_whatever_order_they_come(order: list[int]) -> None:
    heartbeat = request_type(ApiKey.HEARTBEAT, 4)
    answer = response_type(ApiKey.HEARTBEAT, 4)
    connection = ServerConnection()
    requests = [
        heartbeat(group_id="g", generation_id=1, member_id="m", group_instance_id=None)  # type: ignore[call-arg]
        for _ in range(5)
    ]
    events = connection.receive_data(
        b"".join(encode_request(index, request) for index, request in enumerate(requests))
    )
    assert all(isinstance(event, Request) for event in events)
    sent = b""

    for index in order:
        event = events[index]
        assert isinstance(event, Request)
        sent += connection.send(
            event, answer(throttle_time=timedelta(0), error_code=ErrorCode.none)
        )  # type: ignore[call-arg]
    assert connection.pending_responses == 0
    correlation_ids = []
    while sent:
        size = int.from_bytes(sent[:4], "big")
        correlation_ids.append(decode_response(ApiKey.HEARTBEAT, 4, sent[4 : 4 + size])[0])
        sent = sent[4 + size :]
    assert correlation_ids == [0, 1, 2, 3, 4]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_long_frames_split_anyhow_give_the_same_bodies(data: st.DataObject) -> None:
    # A frame from LONG_FRAME bytes on is kept as its chunks and joined once whole
    # (FrameDecoder): any split of long and short frames, the pieces as bytes, bytearray
    # or memoryview (the caller may reuse the last two), gives every body as sent, and
    # what the decoder holds is what was fed and not yet given back.
    sizes = data.draw(
        st.lists(
            st.sampled_from([8, 100, LONG_FRAME - 1, LONG_FRAME, 3 * LONG_FRAME + 5]), max_size=4
        )
    )
    bodies = [
        bytes([index]) * 8 + bytes(range(256)) * (size // 256) + b"x" * (size % 256)
        for index, size in enumerate(sizes)
    ]
    bodies = [body[:size] for body, size in zip(bodies, sizes, strict=True)]
    stream = b"".join(len(body).to_bytes(4, "big") + body for body in bodies)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12)))
    decoder = FrameDecoder()
    got: list[bytes] = []
    fed = 0
    for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        piece = stream[start:end]
        kind = data.draw(st.sampled_from([bytes, bytearray, memoryview]))
        chunk = bytearray(piece) if kind is bytearray else kind(piece)
        decoder.feed(chunk)
        if isinstance(chunk, bytearray):
            chunk[:] = b"\xff" * len(chunk)  # the caller reuses its buffer
        fed += len(piece)
        got += [bytes(body) for body in decoder]
        taken = sum(4 + len(body) for body in got)
        assert decoder.buffered_bytes == fed - taken
    assert got == bodies
    assert decoder.at_boundary


@pytest.mark.parametrize("version", [3, 8, 9, 10, 11])
def test_a_produces_records_are_a_view_of_its_frame_not_a_copy(version: int) -> None:
    # The record batches are checked and stored from the frame's own bytes (immutable:
    # kio's readers refuse a writable buffer), not from a copy of them.
    produce = request_type(ApiKey.PRODUCE, version)
    module = __import__(produce.__module__, fromlist=["TopicProduceData"])
    request = produce(
        transactional_id=None,
        acks=-1,
        timeout=timedelta(seconds=30),
        topic_data=(
            module.TopicProduceData(
                name="t",
                partition_data=tuple(
                    module.PartitionProduceData(index=index, records=records)
                    for index, records in enumerate((b"batch-bytes", None))
                ),
            ),
        ),
    )
    body = encode_entity(request)
    decoded = decode_exact(produce, body)
    first, second = decoded.topic_data[0].partition_data
    assert isinstance(first.records, memoryview) and first.records.obj is body
    assert bytes(first.records) == b"batch-bytes" and second.records is None
    with pytest.raises(Exception, match="records"):
        decode_exact(produce, body[: body.index(b"batch-bytes") + 3])


FETCH_VERSIONS = range(SUPPORTED[ApiKey.FETCH].min_version, SUPPORTED[ApiKey.FETCH].max_version + 1)


@pytest.mark.parametrize("version", FETCH_VERSIONS)
def test_a_fetch_answer_with_spliced_records_is_the_frame_it_stands_for(version: int) -> None:
    # The Fetch handler puts a placeholder where each partition's records go and hands
    # the read batches to encode_response_chunks: the bytes sent must be those of the
    # answer with the records in place, and the batches must be sent, not copied.
    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        response=message(response_type(ApiKey.FETCH, version)),
        correlation_id=CORRELATION_IDS,
        data=st.data(),
    )
    def check(response: Any, correlation_id: int, data: st.DataObject) -> None:
        spliced: dict[bytes, list[Buffer]] = {}
        topics = []
        for topic in response.responses:
            partitions = []
            for partition in topic.partitions:
                if partition.records:
                    records = bytes(partition.records)
                    cuts = sorted(data.draw(st.lists(st.integers(0, len(records)), max_size=3)))
                    chunks: list[Buffer] = [
                        memoryview(records)[start:end]
                        for start, end in zip([0, *cuts], [*cuts, len(records)], strict=True)
                    ]
                    placeholder = os.urandom(PLACEHOLDER_BYTES)
                    spliced[placeholder] = chunks
                    partition = dataclasses.replace(partition, records=placeholder)
                partitions.append(partition)
            topics.append(dataclasses.replace(topic, partitions=tuple(partitions)))
        with_placeholders = dataclasses.replace(response, responses=tuple(topics))
        frame = encode_response_chunks(correlation_id, with_placeholders, spliced)
        assert b"".join(frame) == encode_response(correlation_id, response)
        sent = {id(chunk) for chunk in frame}
        assert all(id(chunk) in sent for chunks in spliced.values() for chunk in chunks)

    check()


def test_a_placeholder_must_stand_once_as_a_bytes_value() -> None:
    placeholder = os.urandom(PLACEHOLDER_BYTES)
    answer = fetch_answer
    batches: dict[bytes, list[Buffer]] = {placeholder: [b"batch"]}
    assert b"".join(encode_response_chunks(1, answer(placeholder), batches)) == encode_response(
        1, answer(b"batch")
    )
    for misused in (
        answer(None),  # not in the answer
        answer(placeholder, placeholder),  # twice
        answer(None, topic=placeholder.hex()[:16]),  # not a bytes value (a name)
    ):
        with pytest.raises(UsageError, match="placeholder"):
            encode_response_chunks(1, misused, batches)
    with pytest.raises(UsageError, match="placeholder"):
        encode_response_chunks(1, answer(b"short"), {b"short": [b"batch"]})
