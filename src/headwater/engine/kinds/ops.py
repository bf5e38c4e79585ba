"""Turning requests into engine write ops, checked against the kind's schema.

Front ends that carry ConvergeDB's wire form use :func:`from_wire` (field_data decoded
once, here); callers with Python values (Ripple, tests) use :func:`assert_op` and
:func:`patch_op`, which check every value against its field's type.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from headwater.engine.kinds.codec import RecordCodec, codec_for
from headwater.engine.kinds.errors import BadFieldData
from headwater.engine.kinds.model import (
    AssertOp,
    AssertRecords,
    KindInfo,
    PatchOp,
    RetractOp,
    WriteOp,
    check_entity_id,
)
from headwater.errors import UsageError
from headwater.protocols.convergedb import messages as wire
from headwater.protocols.convergedb.codes import DecodeError
from headwater.protocols.convergedb.fields import (
    FieldValue,
    decode_present_fields,
    default_value,
    encode_fields,
    encode_present_fields,
)


def assert_op(
    kind: KindInfo, entity_id: bytes, values: Sequence[FieldValue], metadata: bytes = b""
) -> AssertOp:
    """An ASSERT of fields 0..len(values)-1 (the rest take their defaults), checked."""
    check_entity_id(entity_id)
    try:
        encode_fields(kind.fields, values)
    except UsageError as exc:
        raise BadFieldData(str(exc)) from None
    full = list(values) + [default_value(f.type) for f in kind.fields[len(values) :]]
    return AssertOp(kind.kind_id, entity_id, tuple(full), metadata)


def patch_op(
    kind: KindInfo, entity_id: bytes, values: Mapping[int, FieldValue], metadata: bytes = b""
) -> PatchOp:
    """A PATCH of the fields in ``values`` (ordinal -> value), checked."""
    check_entity_id(entity_id)
    try:
        encode_present_fields(kind.fields, values)
    except UsageError as exc:
        raise BadFieldData(str(exc)) from None
    return PatchOp(kind.kind_id, entity_id, dict(values), metadata)


def retract_op(kind: KindInfo, entity_id: bytes, metadata: bytes = b"") -> RetractOp:
    return RetractOp(kind.kind_id, check_entity_id(entity_id), metadata)


def from_wire(
    ops: Sequence[wire.Assert | wire.Patch | wire.Retract], kind_of: Callable[[int], KindInfo]
) -> list[WriteOp]:
    """Decode wire ops against their kinds (``kind_of`` raises KindNotFound); raises
    BadFieldData for field_data that does not fit. Nothing is applied here.

    A BATCH the codec read as an :class:`~wire.AssertRun` of whole fixed-width records
    becomes one :class:`AssertRecords` (nothing decoded: any bytes of that length are a
    valid record of such a schema), unless the kind is an event stream, whose EVENTs
    need each op's values."""
    if isinstance(ops, wire.AssertRun) and ops.pairs:
        kind = kind_of(ops.kind_id)
        fixed = codec_for(kind.fields).fixed
        if not kind.event_stream and fixed is not None and ops.field_data_size == fixed.size:
            return [AssertRecords(ops.kind_id, ops.pairs)]
    out: list[WriteOp] = []
    append = out.append
    kinds: dict[int, tuple[KindInfo, RecordCodec]] = {}
    for op in ops:
        kind_id = op.kind_id
        known = kinds.get(kind_id)
        if known is None:
            kind = kind_of(kind_id)
            known = kinds[kind_id] = (kind, codec_for(kind.fields))
        kind, codec = known
        try:
            if type(op) is wire.Assert:
                data = op.field_data
                if codec.fixed is not None and len(data) == codec.fixed.size:
                    # the whole record: it is stored and sent on as it came
                    append(
                        AssertOp(kind_id, op.entity_id, codec.fixed.unpack(data), op.metadata, data)
                    )
                else:
                    append(AssertOp(kind_id, op.entity_id, codec.decode_assert(data), op.metadata))
            elif isinstance(op, wire.Patch):
                present = decode_present_fields(kind.fields, op.presence_mask, op.field_data)
                append(PatchOp(kind_id, op.entity_id, present, op.metadata))
            else:
                append(RetractOp(kind_id, op.entity_id, op.metadata))
        except DecodeError as exc:
            raise BadFieldData(f"kind {kind.name!r}: {exc.message}") from None
    return out
