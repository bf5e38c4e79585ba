"""Hypothesis strategies for Ripple values (shared by the property, delta and fuzz tests)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from headwater.protocols.ripple import (
    Atom,
    CheckpointAck,
    CheckpointRequest,
    Delta,
    DeltaMsg,
    Field,
    FieldRemove,
    FieldSet,
    FieldType,
    FieldValue,
    Handshake,
    HandshakeAuth,
    Heartbeat,
    MapRemove,
    MapSet,
    Message,
    Patch,
    PatchOp,
    Remove,
    Schema,
    SchemaNegotiation,
    Set,
    Sexp,
    SexpList,
    Value,
    text_of_value,
)
from headwater.protocols.ripple.bin_prot import INT64_MAX, INT64_MIN, INT_MAX, INT_MIN

_INT_EDGES = [
    0,
    1,
    -1,
    0x7F,
    0x80,
    -0x80,
    -0x81,
    0x7FFF,
    0x8000,
    -0x8000,
    -0x8001,
    0xFFFF,
    0x1_0000,
    2**31 - 1,
    2**31,
    -(2**31),
    -(2**31) - 1,
    2**32 - 1,
    2**32,
]
ocaml_ints = st.one_of(
    st.integers(-300, 300),
    st.sampled_from([*_INT_EDGES, INT_MIN, INT_MAX]),
    st.integers(INT_MIN, INT_MAX),
)
int64s = st.one_of(
    st.integers(-300, 300),
    st.sampled_from([*_INT_EDGES, INT_MIN, INT_MAX, INT64_MIN, INT64_MAX]),
    st.integers(INT64_MIN, INT64_MAX),
)
nat0s = st.one_of(
    st.integers(0, 300),
    st.sampled_from([n for n in _INT_EDGES if n >= 0] + [INT_MAX]),
    st.integers(0, INT_MAX),
)
texts = st.text(max_size=12)
names = st.from_regex(r"[A-Za-z0-9_]{1,10}", fullmatch=True)
finite_floats = st.floats(allow_nan=False)

atoms = texts.map(Atom)
sexps: st.SearchStrategy[Sexp] = st.recursive(
    atoms,
    lambda inner: st.lists(inner, max_size=3).map(lambda items: SexpList(tuple(items))),
    max_leaves=8,
)
field_types = st.sampled_from(list(FieldType))


@st.composite
def schemas(draw: st.DrawFn, max_fields: int = 5) -> Schema:
    field_names = draw(st.lists(names, max_size=max_fields, unique=True))
    fields = tuple(Field(name, draw(field_types)) for name in field_names)
    return Schema(draw(names), draw(st.integers(0, 9999)), fields, draw(st.none() | texts))


def field_values(field_type: FieldType, *, nan: bool = True) -> st.SearchStrategy[Any]:
    if field_type is FieldType.STRING:
        return texts
    if field_type is FieldType.INT:
        return ocaml_ints
    if field_type is FieldType.INT64:
        return int64s
    if field_type is FieldType.FLOAT:
        return st.floats(allow_nan=nan)
    return st.booleans()


@st.composite
def records(draw: st.DrawFn, schema: Schema, *, nan: bool = True) -> dict[str, FieldValue]:
    return {f.field_name: draw(field_values(f.field_type, nan=nan)) for f in schema.fields}


@st.composite
def untyped_patch_ops(draw: st.DrawFn, keys: st.SearchStrategy[str] = names) -> PatchOp:
    kind = draw(st.sampled_from([FieldSet, FieldRemove, MapSet, MapRemove]))
    key = draw(keys)
    if kind is FieldSet or kind is MapSet:
        return kind(key, draw(sexps))  # type: ignore[no-any-return]
    return kind(key)  # type: ignore[no-any-return]


@st.composite
def typed_patch_ops(draw: st.DrawFn, schema: Schema) -> PatchOp:
    """Ops valid for ``schema``: Field ops on declared fields with well-typed atoms,
    Map ops on keys that are not declared fields."""
    undeclared = names.filter(lambda n: schema.field(n) is None)
    if not schema.fields or draw(st.booleans()):
        key = draw(undeclared)
        return MapSet(key, draw(sexps)) if draw(st.booleans()) else MapRemove(key)
    declared = draw(st.sampled_from(schema.fields))
    if draw(st.booleans()):
        return FieldRemove(declared.field_name)
    value = draw(field_values(declared.field_type, nan=False))
    return FieldSet(declared.field_name, Atom(text_of_value(declared.field_type, value)))


@st.composite
def wire_deltas(draw: st.DrawFn, schema: Schema) -> Delta:
    """Deltas that can be encoded under ``schema`` (any patch op: the wire does not check
    patches against the schema)."""
    kind = draw(st.sampled_from(["set", "patch", "remove"]))
    if kind == "set":
        return Set(draw(records(schema)))
    if kind == "patch":
        return Patch(tuple(draw(st.lists(untyped_patch_ops(), max_size=4))))
    return Remove()


_small_keys = st.sampled_from(["a", "b", "c", "d"])
untyped_dicts: st.SearchStrategy[dict[str, Value]] = st.dictionaries(_small_keys, sexps, max_size=4)
untyped_states: st.SearchStrategy[dict[str, Value] | None] = st.none() | untyped_dicts
untyped_deltas: st.SearchStrategy[Delta] = st.one_of(
    untyped_dicts.map(Set),
    st.just(Remove()),
    st.lists(untyped_patch_ops(_small_keys), max_size=5).map(lambda ops: Patch(tuple(ops))),
)


@st.composite
def typed_states(draw: st.DrawFn, schema: Schema) -> dict[str, Value] | None:
    """None, or some declared fields with typed values plus undeclared sexp entries."""
    if draw(st.booleans()) and draw(st.booleans()):
        return None
    state: dict[str, Value] = {}
    for f in schema.fields:
        if draw(st.booleans()):
            state[f.field_name] = draw(field_values(f.field_type, nan=False))
    extra = draw(
        st.dictionaries(names.filter(lambda n: schema.field(n) is None), sexps, max_size=2)
    )
    state.update(extra)
    return state


@st.composite
def typed_deltas(draw: st.DrawFn, schema: Schema) -> Delta:
    kind = draw(st.sampled_from(["set", "patch", "remove"]))
    if kind == "set":
        state = draw(typed_states(schema))
        return Set(state if state is not None else {})
    if kind == "patch":
        return Patch(tuple(draw(st.lists(typed_patch_ops(schema), max_size=5))))
    return Remove()


handshake_auths = st.builds(HandshakeAuth, st.none() | texts, st.none() | ocaml_ints)
"""headwater's Handshake extension (FLAG_HANDSHAKE_AUTH)."""


@st.composite
def handshakes(draw: st.DrawFn) -> Handshake:
    """Handshakes of the contract, and with headwater's auth extension."""
    outputs = draw(st.lists(names, max_size=3, unique=True))
    return Handshake(
        draw(texts),
        tuple((output, draw(schemas())) for output in outputs),
        draw(ocaml_ints),
        draw(st.none() | handshake_auths),
    )


delta_msgs = st.builds(
    DeltaMsg,
    texts,
    st.binary(max_size=12),
    st.binary(max_size=24),
    ocaml_ints,
    st.none() | int64s,
)
heartbeats = st.builds(Heartbeat, texts, int64s, st.floats(allow_nan=False))
checkpoint_requests = st.builds(CheckpointRequest, texts, ocaml_ints)
checkpoint_acks = st.builds(CheckpointAck, texts, texts, ocaml_ints, ocaml_ints)
negotiations = st.builds(SchemaNegotiation, st.booleans(), st.lists(texts, max_size=3).map(tuple))
messages: st.SearchStrategy[Message] = st.one_of(
    handshakes(), delta_msgs, heartbeats, checkpoint_requests, checkpoint_acks, negotiations
)
