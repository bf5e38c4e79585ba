"""Replies a server builds from the kind engine's values: the STATEs of committed
entities (QUERY's answer, a subscription's bootstrap) and CREATE_KIND / GET_KIND ACKs."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from headwater.engine.kinds.model import EntityState, KindInfo

from . import messages as m
from .codes import Opcode


def kind_ack(opcode: Opcode, kind: KindInfo) -> m.KindAck:
    """CREATE_KIND's or GET_KIND's ACK: the kind's id, schema version and field count."""
    return m.KindAck(opcode, kind.kind_id, kind.schema_version, kind.field_count)


def query_state(kind: KindInfo, entity: EntityState) -> m.State:
    """QUERY's answer: the committed entity, every field."""
    return _state(kind, entity, m.Change.QUERY, (1 << kind.field_count) - 1)


def bootstrap_frames(
    stream_id: int, kind: KindInfo, entities: Iterable[EntityState]
) -> Iterator[bytes]:
    """A subscription's bootstrap: a STATE frame per committed entity, every field."""
    everything = (1 << kind.field_count) - 1
    for entity in entities:
        yield m.Frame(stream_id, _state(kind, entity, m.Change.BOOTSTRAP, everything)).encode()


def _state(kind: KindInfo, entity: EntityState, change: m.Change, fields: int) -> m.State:
    return m.State(
        kind.kind_id,
        entity.entity_id,
        change,
        entity.version,
        entity.source_set,
        fields,
        entity.record,
    )
