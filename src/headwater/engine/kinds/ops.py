"""Write ops from Python values, checked against the kind's schema.

Callers with Python values (Ripple, tests) use :func:`assert_op` and :func:`patch_op`,
which check every value against its field's type, and :func:`retract_op`. A front end
that carries records as the engine encodes them (ConvergeDB) builds the ops from those
instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from headwater.engine.kinds.errors import BadFieldData
from headwater.engine.kinds.fields import (
    FieldValue,
    SchemaLike,
    default_value,
    encode_fields,
    encode_present_fields,
)
from headwater.engine.kinds.model import AssertOp, KindInfo, PatchOp, RetractOp, check_entity_id
from headwater.errors import UsageError

_Values = TypeVar("_Values")


def assert_op(
    kind: KindInfo, entity_id: bytes, values: Sequence[FieldValue], metadata: bytes = b""
) -> AssertOp:
    """An ASSERT of fields 0..len(values)-1 (the rest take their defaults), checked."""
    _check(kind, entity_id, encode_fields, values)
    full = list(values) + [default_value(f.type) for f in kind.fields[len(values) :]]
    return AssertOp(kind.kind_id, entity_id, tuple(full), metadata)


def patch_op(
    kind: KindInfo, entity_id: bytes, values: Mapping[int, FieldValue], metadata: bytes = b""
) -> PatchOp:
    """A PATCH of the fields in ``values`` (ordinal -> value), checked."""
    _check(kind, entity_id, encode_present_fields, values)
    return PatchOp(kind.kind_id, entity_id, dict(values), metadata)


def retract_op(kind: KindInfo, entity_id: bytes, metadata: bytes = b"") -> RetractOp:
    return RetractOp(kind.kind_id, check_entity_id(entity_id), metadata)


def _check(
    kind: KindInfo,
    entity_id: bytes,
    encode: Callable[[SchemaLike, _Values], object],
    values: _Values,
) -> None:
    """BadFieldData unless the entity id has its size and ``values`` encode under the
    kind's schema (``encode`` says what values must be)."""
    check_entity_id(entity_id)
    try:
        encode(kind.fields, values)
    except UsageError as exc:
        raise BadFieldData(str(exc)) from None
