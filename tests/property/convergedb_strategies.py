"""Hypothesis strategies for ConvergeDB messages, frames, schemas and field values
(shared by the property and fuzz tests)."""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from typing import Any

from hypothesis import strategies as st

from headwater.protocols.convergedb import (
    CLIENT_OPCODES,
    MAX_FIELDS,
    Ack,
    Assert,
    Batch,
    BootstrapBegin,
    BootstrapEnd,
    Change,
    ClientMessage,
    Connect,
    ConnectAck,
    CreateKind,
    Deleted,
    EpochEndAck,
    ErrorMessage,
    Event,
    FieldSpec,
    FieldType,
    FieldValue,
    Frame,
    GetKind,
    Heartbeat,
    KindAck,
    Message,
    Opcode,
    Patch,
    Query,
    Retract,
    ServerMessage,
    SourceEpochBegin,
    SourceEpochEnd,
    State,
    Subscribe,
    Unsubscribe,
    WriteOp,
)

u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
sources = st.integers(0, 63)
texts = st.text(max_size=12)
blobs = st.binary(max_size=24)
entity_ids = st.binary(min_size=32, max_size=32)
kind_ids = u16
flags = st.booleans()

# --- schemas and field values ----------------------------------------------------------

field_types = st.sampled_from(FieldType)
field_specs = st.builds(FieldSpec, st.text(max_size=8), field_types)
schemas = st.lists(field_specs, max_size=MAX_FIELDS).filter(lambda s: len(s) <= MAX_FIELDS)
small_schemas = st.lists(field_specs, max_size=10)

_VALUES: dict[FieldType, st.SearchStrategy[Any]] = {
    FieldType.BOOL: st.booleans(),
    FieldType.U8: st.integers(0, 2**8 - 1),
    FieldType.U16: st.integers(0, 2**16 - 1),
    FieldType.U32: st.integers(0, 2**32 - 1),
    FieldType.U64: st.integers(0, 2**64 - 1),
    FieldType.I8: st.integers(-(2**7), 2**7 - 1),
    FieldType.I16: st.integers(-(2**15), 2**15 - 1),
    FieldType.I32: st.integers(-(2**31), 2**31 - 1),
    FieldType.I64: i64,
    FieldType.F32: st.floats(width=32, allow_nan=False),
    FieldType.F64: st.floats(allow_nan=False),
    FieldType.STRING: st.text(max_size=16),
    FieldType.BYTES: st.binary(max_size=16),
    FieldType.TIMESTAMP: i64,
}


def value_of(field_type: FieldType) -> st.SearchStrategy[FieldValue]:
    return _VALUES[field_type]


@st.composite
def schema_and_prefix(draw: st.DrawFn) -> tuple[list[FieldSpec], list[FieldValue]]:
    """A schema and values for fields 0..k-1 (an ASSERT's prefix)."""
    schema = draw(small_schemas)
    k = draw(st.integers(0, len(schema)))
    return schema, [draw(value_of(spec.type)) for spec in schema[:k]]


@st.composite
def schema_and_present(draw: st.DrawFn) -> tuple[list[FieldSpec], dict[int, FieldValue]]:
    """A schema and values for a subset of its fields (a PATCH)."""
    schema = draw(small_schemas)
    chosen = draw(st.sets(st.integers(0, max(len(schema) - 1, 0)))) if schema else set()
    return schema, {i: draw(value_of(schema[i].type)) for i in sorted(chosen)}


# --- messages --------------------------------------------------------------------------

asserts = st.builds(Assert, kind_ids, entity_ids, blobs, blobs)
retracts = st.builds(Retract, kind_ids, entity_ids, blobs)
patches = st.builds(Patch, kind_ids, entity_ids, u64, blobs, blobs)
write_ops: st.SearchStrategy[WriteOp] = st.one_of(asserts, retracts, patches)
kind_fields = st.lists(st.tuples(st.text(max_size=8), field_types), max_size=6)

client_messages: st.SearchStrategy[ClientMessage] = st.one_of(
    st.builds(Connect, texts, texts, st.none() | sources, flags, u32),
    asserts,
    retracts,
    patches,
    st.builds(Query, kind_ids, entity_ids),
    st.builds(Subscribe, kind_ids, flags, flags, flags),
    st.builds(Unsubscribe, kind_ids),
    st.builds(Heartbeat),
    st.builds(SourceEpochBegin),
    st.builds(SourceEpochEnd),
    st.builds(Batch, st.lists(write_ops, max_size=5)),
    st.builds(CreateKind, texts, kind_fields, flags),
    st.builds(GetKind, texts, kind_fields, flags),
)


@st.composite
def states(draw: st.DrawFn) -> State:
    change = draw(st.sampled_from(Change))
    previous = draw(st.none() | blobs) if change is Change.UPDATED else None
    return State(
        draw(kind_ids),
        draw(entity_ids),
        change,
        draw(u64),
        draw(u64),
        draw(u64),
        draw(blobs),
        previous,
        draw(blobs),
    )


_PLAIN_ACKED = sorted(
    CLIENT_OPCODES - {Opcode.CONNECT, Opcode.CREATE_KIND, Opcode.GET_KIND, Opcode.SOURCE_EPOCH_END}
)

server_messages: st.SearchStrategy[ServerMessage] = st.one_of(
    states(),
    st.builds(Deleted, kind_ids, entity_ids, u64, blobs),
    st.builds(BootstrapBegin, kind_ids),
    st.builds(BootstrapEnd, kind_ids),
    st.builds(Ack, st.sampled_from(_PLAIN_ACKED)),
    st.builds(ConnectAck, sources | st.just(0xFF)),
    st.builds(KindAck, st.sampled_from([Opcode.CREATE_KIND, Opcode.GET_KIND]), u16, u16, u8),
    st.builds(EpochEndAck, u32),
    st.builds(ErrorMessage, u16, u16, texts),
    st.builds(
        Event,
        kind_ids,
        entity_ids,
        st.sampled_from([Opcode.ASSERT, Opcode.RETRACT, Opcode.PATCH]),
        sources,
        u64,
        u64,
        blobs,
        blobs,
    ),
)

messages: st.SearchStrategy[Message] = st.one_of(client_messages, server_messages)
stream_ids = st.one_of(st.just(0), u16)
frames = st.builds(Frame, stream_ids, messages)
client_frames = st.builds(Frame, stream_ids, client_messages)


def typed(value: Any) -> Any:
    """``value`` with each leaf's type attached, so True and 1 (or 1 and 1.0) differ where
    == alone calls them equal; IntEnum members count as plain ints."""
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        # Any sequence compares by its items: a decoded BATCH of uniform ASSERTs holds a
        # lazy AssertRun where the message built by hand holds a tuple of Asserts.
        return [typed(item) for item in value]
    if isinstance(value, dict):
        return {key: typed(item) for key, item in value.items()}
    if hasattr(value, "__dataclass_fields__"):
        return (type(value), [typed(getattr(value, name)) for name in value.__dataclass_fields__])
    if isinstance(value, IntEnum):
        return (int, int(value))
    return (type(value), value)
