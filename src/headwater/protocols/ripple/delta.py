"""The delta algebra: what a Ripple ``delta`` does to one entity's state.

A state is a dict ``field -> value`` for a live entity, or None for an absent one. The
functions here never mutate their arguments.

``apply(delta, state)``:

- ``Set values``: the state becomes exactly ``values`` (whatever it was).
- ``Remove``: the state becomes None.
- ``Patch ops``: the ops run in order on a copy of the state, or on ``{}`` when the
  entity is absent (a patch creates it, as a ConvergeDB PATCH does):
  ``Field_set`` / ``Map_set`` assign an entry, ``Field_remove`` / ``Map_remove`` delete it
  (deleting an absent entry is a no-op).

With a ``schema`` the Field ops must name declared fields and a Field_set atom is parsed
into the field's type (:func:`.messages.value_of_sexp`); the Map ops address keys that
are *not* declared fields (dynamic entries) and keep their sexp as sent. Without a schema
every op is a plain assignment or deletion of a sexp. A patch that breaks these rules
raises :class:`PatchError`.

Laws (tests/property/test_ripple_delta.py checks each on random deltas and states):

- Idempotence: ``apply(d, apply(d, s)) == apply(d, s)`` for every delta, including every
  patch op: each op is an assignment or a deletion, so after a patch every key it touches
  holds what its last op put there, whatever it held before, and untouched keys keep
  their value. (None of the four ops is an increment or an append; no restriction
  needed.)
- ``apply(diff(old, new), old) == new``.
- ``apply(compose(a, b), s) == apply(b, apply(a, s))``, hence compose is associative in
  that sense; ``compose(d, Remove) == Remove`` and ``compose(d, Set v) == Set v``.

``diff`` emits the smallest patch it can and falls back to ``Set new`` when a change
cannot be written as a patch (a typed value without a schema to give its text form, a
value whose text form does not parse back to it). ``compose`` of a Set or Remove with a
later Patch is a Set, possibly of a partial record: correct for the algebra, but only a
Set holding exactly the schema's fields can be encoded on the wire (UsageError otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from headwater.errors import UsageError

from .bin_prot import DecodeError
from .messages import (
    Atom,
    Delta,
    FieldRemove,
    FieldSet,
    FieldType,
    MapRemove,
    MapSet,
    Patch,
    PatchOp,
    Remove,
    Schema,
    Set,
    SexpList,
    Value,
    text_of_value,
    value_of_sexp,
)

State = dict[str, Value] | None


class PatchError(DecodeError):
    """A patch op that does not fit the schema (an undeclared field, a Map op on a
    declared field, an atom that does not parse as its field's type)."""


def apply(delta: Delta, state: Mapping[str, Value] | None, schema: Schema | None = None) -> State:
    """The state after ``delta`` (a new dict; ``state`` is not touched)."""
    if isinstance(delta, Set):
        return dict(delta.values)
    if isinstance(delta, Remove):
        return None
    result: dict[str, Value] = {} if state is None else dict(state)
    for op in delta.ops:
        _apply_op(op, result, schema)
    return result


def _apply_op(op: PatchOp, state: dict[str, Value], schema: Schema | None) -> None:
    if isinstance(op, FieldSet):
        if schema is None:
            state[op.field_name] = op.value
            return
        declared = schema.field(op.field_name)
        if declared is None:
            raise PatchError(f"Field_set of {op.field_name!r}, not a field of {schema.name}")
        try:
            state[op.field_name] = value_of_sexp(declared.field_type, op.value)
        except DecodeError as exc:
            raise PatchError(f"Field_set {op.field_name}: {exc.message}") from None
    elif isinstance(op, FieldRemove):
        if schema is not None and schema.field(op.field_name) is None:
            raise PatchError(f"Field_remove of {op.field_name!r}, not a field of {schema.name}")
        state.pop(op.field_name, None)
    elif isinstance(op, MapSet):
        if schema is not None and schema.field(op.key) is not None:
            raise PatchError(f"Map_set of {op.key!r}, a declared field (use Field_set)")
        state[op.key] = op.value
    else:
        if schema is not None and schema.field(op.key) is not None:
            raise PatchError(f"Map_remove of {op.key!r}, a declared field (use Field_remove)")
        state.pop(op.key, None)


def _same(a: Value, b: Value) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _set_op(key: str, value: Value, schema: Schema | None) -> PatchOp | None:
    """The op that makes ``state[key] == value`` under ``apply``; None when none can."""
    if isinstance(value, Atom | SexpList):
        if schema is None:
            return FieldSet(key, value)
        return MapSet(key, value) if schema.field(key) is None else None
    declared = None if schema is None else schema.field(key)
    if declared is None:
        return None  # a typed value needs its field's type to get a text form
    field_type: FieldType = declared.field_type
    try:
        atom = Atom(text_of_value(field_type, value))
        parsed = value_of_sexp(field_type, atom)
    except (UsageError, DecodeError):  # not a value of the field's type
        return None
    return FieldSet(key, atom) if _same(parsed, value) else None


def diff(
    old: Mapping[str, Value] | None, new: Mapping[str, Value] | None, schema: Schema | None = None
) -> Delta:
    """A delta taking ``old`` to ``new``: ``apply(diff(old, new), old) == new``."""
    if new is None:
        return Remove()
    if old is None:
        return Set(dict(new))
    ops: list[PatchOp] = []
    for key, value in new.items():
        if key in old and _same(old[key], value):
            continue
        op = _set_op(key, value, schema)
        if op is None:
            return Set(dict(new))
        ops.append(op)
    for key in old:
        if key not in new:
            declared = schema is None or schema.field(key) is not None
            ops.append(FieldRemove(key) if declared else MapRemove(key))
    return Patch(tuple(ops))


def compose(first: Delta, second: Delta, schema: Schema | None = None) -> Delta:
    """One delta doing ``first`` then ``second``:
    ``apply(compose(a, b), s) == apply(b, apply(a, s))`` for every state ``s``."""
    if isinstance(second, Set | Remove):
        return second
    if isinstance(first, Patch):
        return Patch(first.ops + second.ops)
    if isinstance(first, Set):
        return Set(_as_dict(apply(second, first.values, schema)))
    return Set(_as_dict(apply(second, None, schema)))


def _as_dict(state: State) -> dict[str, Value]:
    assert state is not None  # a Patch always leaves a live entity
    return state
