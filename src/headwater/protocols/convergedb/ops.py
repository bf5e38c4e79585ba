"""ConvergeDB write messages as the kind engine's write ops.

ASSERT, PATCH and RETRACT messages (alone or in a BATCH) become engine ops with
:func:`from_wire`, their field_data decoded once, here, against each op's kind; the
engine then checks and applies them (a BATCH as a whole: all or nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from headwater.engine.kinds.codec import RecordCodec, codec_for
from headwater.engine.kinds.errors import BadFieldData
from headwater.engine.kinds.fields import decode_present_fields
from headwater.engine.kinds.model import (
    AssertOp,
    AssertRecords,
    KindInfo,
    PatchOp,
    RetractOp,
    WriteOp,
)

from . import messages as wire


def from_wire(
    ops: Sequence[wire.Assert | wire.Patch | wire.Retract], kind_of: Callable[[int], KindInfo]
) -> list[WriteOp]:
    """Decode wire ops against their kinds (``kind_of`` raises KindNotFound); raises
    BadFieldData for field_data that does not fit. Nothing is applied here.

    A BATCH the codec read as an :class:`~.messages.AssertRun` of whole fixed-width
    records becomes one :class:`AssertRecords` (nothing decoded: any bytes of that length
    are a valid record of such a schema), unless the kind is an event stream, whose EVENTs
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
        except BadFieldData as exc:
            raise BadFieldData(f"kind {kind.name!r}: {exc.message}") from None
    return out
