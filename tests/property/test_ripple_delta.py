"""The Ripple delta algebra's laws (src/headwater/protocols/ripple/delta.py).

Each law is checked twice: without a schema (every value a sexp, every patch op a plain
assignment or deletion) and with a random schema (typed field values, Field ops parsed
through the field types, Map ops on undeclared keys). States hold no NaN: NaN != NaN
would make state equality meaningless, and the algebra has nothing NaN-specific.

Idempotence is checked for every patch op (Field_set, Field_remove, Map_set, Map_remove):
all four are assignments or deletions, so none needs excluding.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ripple_strategies import (
    schemas,
    typed_deltas,
    typed_states,
    untyped_deltas,
    untyped_states,
)

from headwater.protocols.ripple import (
    Atom,
    Delta,
    Field,
    FieldRemove,
    FieldSet,
    FieldType,
    MapRemove,
    MapSet,
    Patch,
    PatchError,
    Remove,
    Schema,
    Set,
    SexpList,
    apply,
    compose,
    diff,
)

pytestmark = pytest.mark.timeout(120)

LAWS = settings(max_examples=120, deadline=None)
TYPED = settings(max_examples=80, deadline=None)


# --- without a schema ------------------------------------------------------------------


@LAWS
@given(untyped_deltas, untyped_states)
def test_apply_is_idempotent(delta: Delta, state: dict | None) -> None:
    once = apply(delta, state)
    assert apply(delta, once) == once


@LAWS
@given(untyped_deltas, untyped_states)
def test_apply_does_not_mutate_its_arguments(delta: Delta, state: dict | None) -> None:
    before = None if state is None else dict(state)
    apply(delta, state)
    assert state == before


@LAWS
@given(untyped_states, untyped_states)
def test_diff_then_apply_gives_new(old: dict | None, new: dict | None) -> None:
    assert apply(diff(old, new), old) == new


@LAWS
@given(untyped_deltas, untyped_deltas, untyped_states)
def test_compose_is_sequencing(a: Delta, b: Delta, state: dict | None) -> None:
    assert apply(compose(a, b), state) == apply(b, apply(a, state))


@LAWS
@given(untyped_deltas)
def test_compose_with_remove_is_remove(delta: Delta) -> None:
    assert compose(delta, Remove()) == Remove()


@LAWS
@given(untyped_deltas, untyped_states.filter(lambda s: s is not None))
def test_compose_with_set_is_that_set(delta: Delta, values: dict | None) -> None:
    assert values is not None
    assert compose(delta, Set(values)) == Set(values)


@LAWS
@given(untyped_deltas, untyped_deltas, untyped_deltas, untyped_states)
def test_compose_is_associative(a: Delta, b: Delta, c: Delta, state: dict | None) -> None:
    left = compose(compose(a, b), c)
    right = compose(a, compose(b, c))
    assert apply(left, state) == apply(right, state)


@LAWS
@given(untyped_deltas, untyped_deltas, untyped_deltas)
def test_compose_of_patches_is_literally_associative(a: Delta, b: Delta, c: Delta) -> None:
    if all(isinstance(d, Patch) for d in (a, b, c)):
        assert compose(compose(a, b), c) == compose(a, compose(b, c))


# --- with a schema ---------------------------------------------------------------------


@st.composite
def typed_case(draw: st.DrawFn, n_deltas: int, n_states: int) -> tuple:
    schema = draw(schemas())
    deltas = [draw(typed_deltas(schema)) for _ in range(n_deltas)]
    states = [draw(typed_states(schema)) for _ in range(n_states)]
    return (schema, *deltas, *states)


@TYPED
@given(typed_case(1, 1))
def test_typed_apply_is_idempotent(case: tuple) -> None:
    schema, delta, state = case
    once = apply(delta, state, schema)
    assert apply(delta, once, schema) == once


@TYPED
@given(typed_case(0, 2))
def test_typed_diff_then_apply_gives_new(case: tuple) -> None:
    schema, old, new = case
    assert apply(diff(old, new, schema), old, schema) == new


@TYPED
@given(typed_case(0, 2))
def test_typed_diff_of_typed_values_is_a_patch(case: tuple) -> None:
    schema, old, new = case
    if old is not None and new is not None:
        # every typed value and every undeclared sexp has a patch op: no Set fallback
        assert isinstance(diff(old, new, schema), Patch)


@TYPED
@given(typed_case(2, 1))
def test_typed_compose_is_sequencing(case: tuple) -> None:
    schema, a, b, state = case
    assert apply(compose(a, b, schema), state, schema) == apply(b, apply(a, state, schema), schema)


@TYPED
@given(typed_case(3, 1))
def test_typed_compose_is_associative(case: tuple) -> None:
    schema, a, b, c, state = case
    left = compose(compose(a, b, schema), c, schema)
    right = compose(a, compose(b, c, schema), schema)
    assert apply(left, state, schema) == apply(right, state, schema)


@TYPED
@given(typed_case(1, 1))
def test_typed_compose_with_remove_and_set(case: tuple) -> None:
    schema, delta, state = case
    assert compose(delta, Remove(), schema) == Remove()
    values = state or {}
    assert compose(delta, Set(values), schema) == Set(values)


# --- examples ------------------------------------------------------------------------

VWAP = Schema(
    "vwap",
    2,
    (
        Field("symbol", FieldType.STRING),
        Field("price", FieldType.FLOAT),
        Field("volume", FieldType.INT),
        Field("ts", FieldType.INT64),
        Field("live", FieldType.BOOL),
    ),
)


def test_patch_creates_an_absent_entity() -> None:
    assert apply(Patch((FieldSet("price", Atom("150.5")),)), None, VWAP) == {"price": 150.5}
    assert apply(Patch(()), None) == {}


def test_patch_parses_atoms_by_field_type() -> None:
    ops = (
        FieldSet("symbol", Atom("AAPL")),
        FieldSet("price", Atom("1.")),
        FieldSet("volume", Atom("-42")),
        FieldSet("ts", Atom("9223372036854775807")),
        FieldSet("live", Atom("true")),
        MapSet("venue", SexpList((Atom("XNAS"),))),
    )
    assert apply(Patch(ops), {"volume": 1}, VWAP) == {
        "symbol": "AAPL",
        "price": 1.0,
        "volume": -42,
        "ts": 2**63 - 1,
        "live": True,
        "venue": SexpList((Atom("XNAS"),)),
    }


@pytest.mark.parametrize(
    "op",
    [
        FieldSet("nope", Atom("1")),
        FieldRemove("nope"),
        MapSet("price", Atom("1")),
        MapRemove("price"),
        FieldSet("volume", Atom("1.5")),
        FieldSet("volume", Atom(str(2**62))),
        FieldSet("live", Atom("True")),
        FieldSet("price", Atom("1_0")),
        FieldSet("price", SexpList(())),
    ],
)
def test_patch_ops_that_do_not_fit_the_schema(op: object) -> None:
    with pytest.raises(PatchError):
        apply(Patch((op,)), {}, VWAP)  # type: ignore[arg-type]


def test_diff_examples() -> None:
    old = {"symbol": "AAPL", "price": 150.5, "volume": 3}
    new = {"symbol": "AAPL", "price": 151.0, "live": False}
    assert diff(old, new, VWAP) == Patch(
        (FieldSet("price", Atom("151.0")), FieldSet("live", Atom("false")), FieldRemove("volume"))
    )
    assert diff(old, None, VWAP) == Remove()
    assert diff(None, new, VWAP) == Set(new)
    assert diff(None, None) == Remove()
    # a typed value without a schema has no text form to patch with: Set
    assert diff(old, new) == Set(new)
    # a bool where an int is declared cannot be patched either
    assert diff({"volume": 1}, {"volume": True}, VWAP) == Set({"volume": True})


def test_compose_examples() -> None:
    patch = Patch((FieldSet("price", Atom("2.5")),))
    assert compose(Remove(), patch, VWAP) == Set({"price": 2.5})
    assert compose(Set({"volume": 1}), patch, VWAP) == Set({"volume": 1, "price": 2.5})
    assert compose(patch, patch) == Patch(patch.ops + patch.ops)
