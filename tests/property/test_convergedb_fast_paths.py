"""The ConvergeDB hot-path encoders give exactly the bytes of the general ones, and refuse
what the general ones refuse (same exception type)."""

from __future__ import annotations

import pytest
from convergedb_strategies import blobs, entity_ids, states, u16, u64
from hypothesis import given
from hypothesis import strategies as st

from headwater.engine.kinds import ChangeType, EventNote, StateChange, WindowNotes
from headwater.errors import UsageError
from headwater.protocols.convergedb import messages as m
from headwater.protocols.convergedb.frames import FrameDecoder
from headwater.server.convergedb.listener import encode_notification, encode_window


@given(states())
def test_encode_state_payload_is_state_encode(state: m.State) -> None:
    fast = m.encode_state_payload(
        state.kind_id,
        state.entity_id,
        state.change,
        state.version,
        state.source_set,
        state.changed_fields,
        state.field_data,
        state.previous,
        state.metadata,
    )
    assert fast == state.encode()
    assert m.State.decode(fast) == state


@given(
    st.integers(-1, 0x10000),
    st.binary(min_size=30, max_size=34),
    st.integers(-1, 5),
    st.integers(-1, 2**64),
    st.one_of(st.none(), blobs),
)
def test_encode_state_payload_refuses_like_state(
    kind_id: int, entity_id: bytes, change: int, version: int, previous: bytes | None
) -> None:
    args = (kind_id, entity_id, change, version, 1, 2, b"fd", previous, b"")
    try:
        expected: bytes | type[Exception] = m.State(
            kind_id, entity_id, m.Change(change), version, 1, 2, b"fd", previous
        ).encode()
    except (UsageError, ValueError):
        expected = UsageError
    if expected is UsageError:
        with pytest.raises(UsageError):
            m.encode_state_payload(*args)
    else:
        assert m.encode_state_payload(*args) == expected


def test_encode_state_payload_refuses_oversized_metadata() -> None:
    with pytest.raises(UsageError):
        m.encode_state_payload(1, bytes(32), 0, 1, 1, 1, b"", None, bytes(0x10000))


notes = st.one_of(
    st.builds(
        StateChange,
        u16,
        entity_ids,
        st.sampled_from(ChangeType),
        u64,
        u64,
        u64,
        blobs,
        st.none() | blobs,
        blobs,
    ),
    st.builds(
        EventNote,
        u16,
        entity_ids,
        st.sampled_from([0x02, 0x03, 0x08]),
        st.integers(0, 63),
        u64,
        u64,
        blobs,
        blobs,
    ),
)


@given(st.lists(notes, max_size=8), st.integers(1, 0xFFFF), st.booleans(), st.booleans())
def test_encode_window_is_one_frame_per_notification(
    window: list[StateChange | EventNote], stream_id: int, include_previous: bool, shared: bool
) -> None:
    """Whether the window is the engine's shared WindowNotes (payloads cached) or a plain
    list, and whether the frames are uniform or not: the same bytes as framing each
    notification alone, and they decode back to one frame per notification."""
    given_notes = WindowNotes(window) if shared else list(window)
    data = encode_window(stream_id, given_notes, include_previous)
    again = encode_window(stream_id, given_notes, include_previous)  # from the cache
    expected = b"".join(encode_notification(stream_id, n, include_previous) for n in window)
    assert data == again == expected
    decoder = FrameDecoder()
    decoder.feed(data)
    raws = list(decoder)
    assert len(raws) == len(window)
    assert all(raw.stream_id == stream_id for raw in raws)


def test_encode_window_uniform_and_mixed() -> None:
    """A uniform window (one header for all) and one whose lengths differ."""
    same = [
        StateChange(1, bytes([i]) * 32, ChangeType.CREATED, i, 1, 1, b"12345678") for i in range(3)
    ]
    mixed = [*same, StateChange(1, bytes(32), ChangeType.DELETED, 9, 0, 0, b"", None, b"m")]
    for window in (same, mixed):
        expected = b"".join(encode_notification(7, n, False) for n in window)
        assert encode_window(7, WindowNotes(window), False) == expected
