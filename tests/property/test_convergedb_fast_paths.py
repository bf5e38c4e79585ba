"""The ConvergeDB hot-path encoders give exactly the bytes of the general ones, and refuse
what the general ones refuse (same exception type)."""

from __future__ import annotations

import functools
import math

import pytest
from convergedb_strategies import blobs, entity_ids, states, u16, u64
from hypothesis import given
from hypothesis import strategies as st

from headwater.engine.kinds import ChangeType, EventNote, StateChange, StateColumns, WindowNotes
from headwater.engine.kinds.codec import codec_for
from headwater.engine.kinds.notify import changed_fields as _changed_fields
from headwater.errors import UsageError
from headwater.protocols.convergedb import messages as m
from headwater.protocols.convergedb.columns import StateFrames, state_frames
from headwater.protocols.convergedb.fields import FieldSpec, FieldType
from headwater.protocols.convergedb.frames import FrameDecoder
from headwater.protocols.convergedb.notifications import encode_notification, encode_window


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


# ---- windows as columns (StateColumns -> one record array per window) -----------------

FIXED = (
    FieldSpec("n", FieldType.U64),
    FieldSpec("x", FieldType.F64),
    FieldSpec("b", FieldType.I8),
)
FIXED_CODEC = codec_for(FIXED)
fixed_records = st.builds(
    FIXED_CODEC.encode,
    st.tuples(st.integers(0, 3), st.sampled_from([0.0, -0.0, 1.5, math.nan]), st.integers(-1, 1)),
)


@st.composite
def column_windows(draw: st.DrawFn) -> StateColumns:
    """A window's changes as the engine builds them: distinct ids, versions from a first
    one; sometimes deletions, metadata or records of other lengths (not one layout)."""
    count = draw(st.integers(0, 8))
    ids = draw(st.lists(entity_ids, min_size=count, max_size=count, unique=True))
    changes = draw(st.lists(st.sampled_from([0, 1, 2]), min_size=count, max_size=count))
    records, previous, source_sets = [], [], []
    odd_length = draw(st.booleans())
    for change in changes:
        if change == ChangeType.DELETED:
            records.append(b"")
            previous.append(None)
            source_sets.append(0)
            continue
        record = draw(fixed_records)
        if odd_length and draw(st.booleans()):
            record += b"\x00"
        records.append(record)
        previous.append(draw(fixed_records) if change == ChangeType.UPDATED else None)
        source_sets.append(draw(st.integers(1, 2**64 - 1)))
    metadata = draw(st.none() | st.lists(blobs, min_size=count, max_size=count))
    return StateColumns(
        ids,
        changes,
        source_sets,
        records,
        previous,
        metadata,
        kind_id=draw(u16),
        first_version=draw(st.integers(0, 2**63)),
        changed_of=functools.partial(_changed_fields, FIXED_CODEC),
    )


@given(column_windows(), st.integers(1, 0xFFFF), st.booleans())
def test_columns_encode_as_each_change_framed_alone(
    window: StateColumns, stream_id: int, include_previous: bool
) -> None:
    """The record-array path (one layout) and the payload path (anything else) give the
    bytes of framing each StateChange alone, for every subscriber stream, from the cache."""
    expected = b"".join(encode_notification(stream_id, n, include_previous) for n in window)
    assert encode_window(stream_id, window, include_previous) == expected
    assert encode_window(stream_id, window, include_previous) == expected  # cached
    other = stream_id % 0xFFFF + 1
    expected_other = b"".join(encode_notification(other, n, include_previous) for n in window)
    assert encode_window(other, window, include_previous) == expected_other


def test_one_layout_window_takes_the_record_array_path() -> None:
    records = [FIXED_CODEC.encode((i, 1.0, 0)) for i in range(3)]
    ids = [bytes([i]) * 32 for i in range(3)]
    window = StateColumns(
        ids,
        [0, 1, 1],
        [1, 1, 3],
        records,
        [None, records[0], records[0]],
        None,
        kind_id=5,
        first_version=100,
        changed_of=functools.partial(_changed_fields, FIXED_CODEC),
    )
    assert window.changed_fields == [0b111, 0b001, 0b001]
    frames = state_frames(
        5, 100, ids, window.changes, window.source_sets, window.changed_fields, records
    )
    assert isinstance(frames, StateFrames)
    assert encode_window(9, window, False) == frames.for_stream(9)


@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(-2, 2)), max_size=6),
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(-2, 2)), max_size=6),
)
def test_changed_fields_of_fixed_records_match_field_by_field(
    new: list[tuple[int, int, int]], old: list[tuple[int, int, int]]
) -> None:
    """numpy's column-at-a-time comparison equals comparing each field's bytes."""
    size = min(len(new), len(old))
    news = [FIXED_CODEC.encode((a, float(b), c)) for a, b, c in new[:size]]
    olds = [FIXED_CODEC.encode((a, float(b), c)) for a, b, c in old[:size]]
    expected = [
        sum(
            1 << i
            for i, (x, y) in enumerate(
                zip(FIXED_CODEC.field_bytes(n), FIXED_CODEC.field_bytes(o), strict=True)
            )
            if x != y
        )
        for n, o in zip(news, olds, strict=True)
    ]
    assert FIXED_CODEC.changed_fields(news, olds) == expected
    assert [FIXED_CODEC._changed_pair(n, o) for n, o in zip(news, olds, strict=True)] == expected


# ---- BATCH of uniform ASSERTs (AssertRun) -------------------------------------------------


@given(
    st.lists(
        st.tuples(
            st.sampled_from([2, 3]),
            entity_ids,
            st.sampled_from([b"", b"12345678", b"abcdefgh", b"123"]),
            st.sampled_from([b"", b"", b"", b"m"]),
        ),
        max_size=6,
    )
)
def test_batch_of_uniform_asserts_decodes_as_sub_op_by_sub_op(
    ops: list[tuple[int, bytes, bytes, bytes]],
) -> None:
    """Whatever the mix (kinds, lengths, metadata), the one-pass AssertRun and the
    sub-op reader agree; a uniform batch is an AssertRun."""
    batch = m.Batch([m.Assert(k, e, d, meta) for k, e, d, meta in ops])
    payload = batch.encode()
    decoded = m.Batch.decode(payload)
    assert decoded == batch
    assert list(decoded.ops) == list(batch.ops)
    uniform = (
        bool(ops)
        and len({(k, len(d)) for k, _, d, _ in ops}) == 1
        and not any(meta for *_, meta in ops)
    )
    assert isinstance(decoded.ops, m.AssertRun) == uniform
    if uniform:
        run = decoded.ops
        assert isinstance(run, m.AssertRun)
        assert run.pairs == [(e, d) for _, e, d, _ in ops]
        assert m.Batch.decode(m.Batch(list(run)).encode()) == decoded
