"""The replication protocol's transaction marker request (a coordinator asking a
partition's leader for a marker: headwater.protocols.replication.TxnMarker)."""

from __future__ import annotations

import pytest

from headwater.errors import ProtocolError
from headwater.protocols.replication import TXN_MARKER, Fetch, FrameReader, TxnMarker


def test_a_marker_request_round_trips_and_is_told_from_a_fetch() -> None:
    marker = TxnMarker(3, "events", 1, (1 << 56) + 7, 2, True)
    fetch = Fetch(3, "events", 1, 0, -1, 2, 1 << 20)
    frames = FrameReader().feed(marker.encode() + fetch.encode())
    assert frames[0].header["kind"] == TXN_MARKER
    assert TxnMarker.from_header(frames[0].header) == marker
    assert "kind" not in frames[1].header  # a frame without kind is a fetch
    assert Fetch.from_header(frames[1].header) == fetch


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"commit": 1}, "'commit' must be bool"),  # an int is not a decision
        ({"epoch": True}, "'epoch' must be int"),  # nor a bool an epoch
        ({"stream": 5}, "'stream' must be str"),
        ({"producer_id": None}, "'producer_id' must be int"),
    ],
)
def test_a_bad_marker_request_is_a_protocol_error(change: dict[str, object], message: str) -> None:
    header = {"kind": TXN_MARKER, **TxnMarker(0, "events", 0, 1, 0, False).__dict__, **change}
    with pytest.raises(ProtocolError, match=message):
        TxnMarker.from_header(header)
