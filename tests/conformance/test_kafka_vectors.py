"""Kafka conformance vectors: requests a real client sent (confluent-kafka 2.16 /
librdkafka 2.16.0, captured by tests/conformance/kafka_capture.py into
tests/conformance/kafka/), and byte layouts written out by hand from Kafka's message
definitions (clients/src/main/resources/common/message/*.json) and the record batch v2
format."""

from __future__ import annotations

import struct
from datetime import timedelta
from pathlib import Path

import pytest
from crc32c import crc32c
from kio.schema.api_versions.v3.response import ApiVersionsResponse, SupportedFeatureKey
from kio.schema.errors import ErrorCode
from kio.schema.metadata.v0.request import MetadataRequest as MetadataRequestV0
from kio.schema.produce.v10.request import ProduceRequest

from headwater.protocols.kafka.apis import SUPPORTED, ApiKey, api_versions_response
from headwater.protocols.kafka.connection import Close, Reply, Request, ServerConnection
from headwater.protocols.kafka.frames import FrameDecoder, decode_response, encode_response
from headwater.protocols.kafka.records import (
    Compression,
    ControlType,
    Record,
    RecordBatch,
    build_batch,
    control_batch,
    control_type,
    split_batches,
    stamp,
)

VECTORS = Path(__file__).parent / "kafka"
LIBRDKAFKA = "librdkafka-2.16.0"

# What kafka_capture.py produced: key, value, headers, timestamp.
RECORDS = [
    (b"key-0", b"value-0", (("trace", b"abc"),), 1_700_000_000_000),
    (None, b"value-1 without a key", (), 1_700_000_000_001),
    (b"key-2", None, (), 1_700_000_000_002),
    (b"key-3", b"x" * 300, (("a", b"1"), ("b", None)), 1_700_000_000_010),
    (b"key-4", "unicode \u00e9\u4e2d".encode(), (), 1_700_000_000_004),
]
CODECS = {
    "none": Compression.NONE,
    "gzip": Compression.GZIP,
    "snappy": Compression.SNAPPY,
    "lz4": Compression.LZ4,
    "zstd": Compression.ZSTD,
}


def only_event(data: bytes) -> Request | Reply | Close:
    events = ServerConnection().receive_data(data)
    assert len(events) == 1
    return events[0]


def produced_batch(codec: str) -> tuple[Request, RecordBatch]:
    event = only_event((VECTORS / f"{LIBRDKAFKA}-produce-v10-{codec}.bin").read_bytes())
    assert isinstance(event, Request)
    assert (event.api_key, event.api_version) == (ApiKey.PRODUCE, 10)
    request = event.request
    assert isinstance(request, ProduceRequest)
    [topic] = request.topic_data
    [partition] = topic.partition_data
    assert (topic.name, partition.index) == ("vectors", 0)
    assert partition.records is not None
    [batch] = split_batches(partition.records)
    return event, batch


@pytest.mark.parametrize("codec", CODECS)
def test_librdkafka_produce_batch_reads_with_its_crc(codec: str) -> None:
    event, batch = produced_batch(codec)
    assert event.client_id == "vectors"
    assert event.expects_response  # acks=all
    header = batch.header
    assert header.compression == CODECS[codec]
    assert (header.producer_id, header.producer_epoch, header.base_sequence) == (-1, -1, -1)
    assert not header.is_transactional and not header.is_control
    # librdkafka's CRC-32C over the bytes from the attributes on, as sent.
    assert header.crc == crc32c(batch.data[21:])
    batch.check_crc()
    columns = batch.validate_for_append()
    assert columns.keys == [key for key, _, _, _ in RECORDS]
    assert columns.values == [value for _, value, _, _ in RECORDS]
    assert columns.headers == [headers for _, _, headers, _ in RECORDS]
    assert [header.base_timestamp + delta for delta in columns.timestamp_deltas] == [
        timestamp for _, _, _, timestamp in RECORDS
    ]
    assert header.max_timestamp == max(timestamp for _, _, _, timestamp in RECORDS)


def test_uncompressed_librdkafka_batch_is_rebuilt_byte_for_byte() -> None:
    _, batch = produced_batch("none")
    header = batch.header
    rebuilt = build_batch(
        batch.records().rows(),
        base_offset=header.base_offset,
        base_timestamp=header.base_timestamp,
        partition_leader_epoch=header.partition_leader_epoch,
    )
    assert rebuilt == batch.data


def test_a_flipped_byte_fails_the_crc() -> None:
    _, batch = produced_batch("zstd")
    data = bytearray(batch.data)
    data[-1] ^= 0x01
    [damaged] = split_batches(bytes(data))
    with pytest.raises(Exception, match="CRC-32C") as raised:
        damaged.check_crc()
    assert getattr(raised.value, "code", None) == ErrorCode.corrupt_message


def test_stamping_a_stored_batch_keeps_its_crc_unless_log_append_time() -> None:
    _, batch = produced_batch("lz4")
    stored = stamp(batch.data, base_offset=1234, partition_leader_epoch=3)
    [again] = split_batches(bytes(stored))
    assert (again.header.base_offset, again.header.partition_leader_epoch) == (1234, 3)
    assert again.header.crc == batch.header.crc
    again.check_crc()
    appended = stamp(batch.data, base_offset=7, log_append_time=1_800_000_000_000)
    [timed] = split_batches(bytes(appended))
    timed.check_crc()
    assert timed.header.timestamp_type == 1
    assert timed.header.max_timestamp == 1_800_000_000_000
    assert timed.records().values == batch.records().values


def test_librdkafka_api_versions_v3_request_is_answered_by_the_connection() -> None:
    data = (VECTORS / f"{LIBRDKAFKA}-api_versions-v3.bin").read_bytes()
    # size, api key 18, version 3, then the correlation id and client id "vectors"
    assert data[4:8] == bytes.fromhex("00120003")
    assert data[12:21] == b"\x00\x07vectors"
    event = only_event(data)
    assert isinstance(event, Reply)
    response = event.answer
    assert isinstance(response, ApiVersionsResponse)
    assert {
        entry.api_key: (entry.min_version, entry.max_version) for entry in response.api_keys
    } == {
        int(key): (versions.min_version, versions.max_version)
        for key, versions in SUPPORTED.items()
    }
    correlation_id = int.from_bytes(data[8:12], "big")
    assert event.data[4:8] == correlation_id.to_bytes(4, "big")  # header v0: no tags


def test_librdkafka_metadata_v12_request_decodes() -> None:
    event = only_event((VECTORS / f"{LIBRDKAFKA}-metadata-v12.bin").read_bytes())
    assert isinstance(event, Request)
    assert (event.api_key, event.api_version) == (ApiKey.METADATA, 12)
    topics = event.request.topics  # type: ignore[attr-defined]
    assert [topic.name for topic in topics] == ["vectors"]
    assert topics[0].topic_id is None  # a null UUID (all zeroes) for a request by name


# ---- hand-built vectors ------------------------------------------------------------------


def test_api_versions_v0_request_and_answer_bytes() -> None:
    # ApiVersionsRequest v0: header v1 (key 18, version 0, correlation id 5, client id
    # "c"), no body.
    request = bytes.fromhex("0000000b0012000000000005000163")
    event = only_event(request)
    assert isinstance(event, Reply)
    data = event.data
    entries = len(SUPPORTED)
    # size, correlation id, error 0, int32 count, then key/min/max int16 each (v0)
    assert struct.unpack_from(">iihi", data) == (4 + 2 + 4 + 6 * entries, 5, 0, entries)
    assert struct.unpack_from(">hhh", data, 14) == (0, 3, 10)  # Produce 3..10 first


def test_a_newer_api_versions_gets_v0_unsupported_version_with_the_table() -> None:
    # v9, flexible header (client id, empty tags) and a body we never read.
    request = bytes.fromhex("0000000e001200090000002a00016300ffff")
    event = only_event(request)
    assert isinstance(event, Reply)
    correlation_id, response = decode_response(18, 0, event.data[4:])
    assert correlation_id == 42
    assert response.error_code == ErrorCode.unsupported_version  # type: ignore[attr-defined]
    assert len(response.api_keys) == len(SUPPORTED)  # type: ignore[attr-defined]


def test_metadata_v0_request_bytes() -> None:
    # Metadata v0: header v1 then topics as an int32 array of int16-length strings.
    request = bytes.fromhex("0000001600030000000000010000000000010006") + b"orders"
    event = only_event(request)
    assert isinstance(event, Request)
    assert event.client_id == ""
    assert event.request == MetadataRequestV0(topics=(_topic_v0("orders"),))


def _topic_v0(name: str) -> object:
    from kio.schema.metadata.v0.request import MetadataRequestTopic

    return MetadataRequestTopic(name=name)


def skip_tags_librdkafka_2_0_2(data: bytes, pos: int) -> int:
    """rd_kafka_buf_skip_tags as librdkafka shipped it until 2.2.0 (fixed by #4278):
    it skips ``length - 1`` bytes of each tagged field."""

    def uvarint(pos: int) -> tuple[int, int]:
        value = shift = 0
        while True:
            if pos >= len(data):
                raise EOFError("Read underflow")
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value, pos
            shift += 7

    count, pos = uvarint(pos)
    for _ in range(count):
        _, pos = uvarint(pos)
        length, pos = uvarint(pos)
        if length > 1:
            pos += length - 1
        if pos > len(data):
            raise EOFError("Read underflow")
    return pos


def read_api_versions_like_librdkafka_2_0_2(body: bytes) -> int:
    """rd_kafka_handle_ApiVersion of librdkafka 2.0.2 on a v3 answer (after the v0
    response header): the bytes it consumed."""
    pos = 2  # error code
    count = body[pos] - 1  # compact array length (small here)
    pos += 1
    for _ in range(count):
        pos += 6
        pos = skip_tags_librdkafka_2_0_2(body, pos)
    pos += 4  # throttle time
    return skip_tags_librdkafka_2_0_2(body, pos)


def test_api_versions_v3_answer_reads_whole_under_librdkafka_2_0_2() -> None:
    body = encode_response(1, api_versions_response(3))[8:]
    assert body[-1] == 0  # the top-level tag section is empty
    assert read_api_versions_like_librdkafka_2_0_2(body) == len(body)


def test_tagged_features_would_be_misread_by_librdkafka_2_0_2() -> None:
    # What a Kafka 3.x broker may put in the v3 answer's tagged fields: librdkafka 2.0.2
    # lands one byte short of the end, or runs past it; headwater never sends them.
    answer = ApiVersionsResponse(
        error_code=ErrorCode.none,
        api_keys=api_versions_response(3).api_keys,  # type: ignore[attr-defined]
        throttle_time=timedelta(0),
        supported_features=(
            SupportedFeatureKey(name="metadata.version", min_version=1, max_version=20),
        ),
        finalized_features_epoch=7,
    )
    body = encode_response(1, answer)[8:]
    try:
        consumed = read_api_versions_like_librdkafka_2_0_2(body)
    except EOFError:
        return
    assert consumed != len(body)


def test_control_batch_layout() -> None:
    marker = control_batch(
        ControlType.COMMIT,
        producer_id=4000,
        producer_epoch=2,
        coordinator_epoch=9,
        base_offset=77,
        timestamp=1_700_000_000_000,
    )
    [batch] = split_batches(marker)
    batch.check_crc()
    header = batch.header
    assert header.attributes == 0x30  # transactional | control, no codec
    assert (header.producer_id, header.producer_epoch, header.base_offset) == (4000, 2, 77)
    assert header.base_sequence == -1
    columns = batch.records()
    assert columns.keys == [bytes.fromhex("00000001")]  # version 0, COMMIT
    assert columns.values == [bytes.fromhex("000000000009")]  # version 0, epoch 9
    assert control_type(batch) is ControlType.COMMIT


def test_record_layout_of_a_hand_built_batch() -> None:
    batch = build_batch(
        [Record(offset_delta=0, timestamp_delta=0, key=b"k", value=b"v", headers=(("h", b"x"),))],
        base_timestamp=0,
    )
    # record: length 12 (zigzag 0x18), attributes 0, timestamp delta 0, offset delta 0,
    # key length 1 (zigzag 2) "k", value length 1 "v", 1 header (zigzag 2): key length 1
    # "h", value length 1 "x"
    assert batch[61:] == bytes.fromhex("1800000002") + b"k" + b"\x02v\x02\x02h\x02x"
    assert struct.unpack_from(">i", batch, 8)[0] == len(batch) - 12
    assert struct.unpack_from(">I", batch, 17)[0] == crc32c(batch[21:])


def test_request_split_at_every_byte_gives_the_same_events() -> None:
    data = b"".join(
        (VECTORS / f"{LIBRDKAFKA}-{name}.bin").read_bytes()
        for name in ("api_versions-v3", "metadata-v12", "produce-v10-snappy")
    )
    whole = ServerConnection().receive_data(data)
    assert [type(event) for event in whole] == [Reply, Request, Request]
    for cut in range(1, len(data)):
        connection = ServerConnection()
        events = connection.receive_data(data[:cut]) + connection.receive_data(data[cut:])
        assert [getattr(event, "request", None) for event in events] == [
            getattr(event, "request", None) for event in whole
        ]


def test_frame_decoder_refuses_a_2_gib_size_before_the_body() -> None:
    decoder = FrameDecoder()
    decoder.feed(b"\x7f\xff\xff\xff")
    with pytest.raises(Exception, match="exceeds"):
        decoder.next_item()
    decoder.feed(b"\x00" * 1000)
    assert decoder.buffered_bytes == 0
