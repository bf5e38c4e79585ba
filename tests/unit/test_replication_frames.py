"""The internal replication protocol's frames (headwater.protocols.replication)."""

from __future__ import annotations

import struct

import pytest

from headwater.errors import ProtocolError
from headwater.protocols.replication import MAX_FRAME_BYTES, Fetch, FrameReader, encode


def test_frames_survive_any_split() -> None:
    fetch = Fetch(0, "events", 2, 120, 3, 1, 1 << 20)
    stream = fetch.encode() + encode({"error": None, "hw": 7}, b"\x00batch bytes\xff")
    for cut in range(len(stream) + 1):
        reader = FrameReader()
        frames = reader.feed(stream[:cut]) + reader.feed(stream[cut:])
        assert [f.header for f in frames] == [
            {"tenant": 0, "stream": "events", "partition": 2, "offset": 120, "epoch": 3,
             "replica": 1, "max_bytes": 1 << 20},
            {"error": None, "hw": 7},
        ]  # fmt: skip
        assert frames[1].data == b"\x00batch bytes\xff"
        assert Fetch.from_header(frames[0].header) == fetch


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (struct.pack(">II", MAX_FRAME_BYTES + 1, 2), "length"),
        (struct.pack(">II", 6, 9) + b"{}", "length"),
        (struct.pack(">II", 7, 3) + b"{x}", "not JSON"),
        (struct.pack(">II", 6, 2) + b"[]", "JSON object"),
    ],
)
def test_bad_frames_are_protocol_errors(raw: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        FrameReader().feed(raw)


def test_a_fetch_with_a_field_of_the_wrong_type_is_refused() -> None:
    header = {"tenant": 0, "stream": "s", "partition": 0, "offset": "12", "epoch": 1}
    with pytest.raises(ProtocolError, match="'offset' must be int"):
        Fetch.from_header(header)
    with pytest.raises(ProtocolError, match="'stream' must be str"):
        Fetch.from_header({**header, "stream": 5})
