"""The kind engine's notifications as ConvergeDB frames, encoded a window at a time.

A window's notifications of a kind are one object every subscriber of the kind gets (the
engine's :class:`StateColumns` or :class:`WindowNotes`): it is encoded once, kept on the
object (``derived``), and each subscription only adds its stream's headers. The engine's
change types (CREATED 0, UPDATED 1, DELETED) and event ops (ASSERT 2, RETRACT 3, PATCH 8)
are numbered as the wire numbers STATE's change byte and EVENT's op, so they are copied
into frames as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from itertools import chain

from headwater.engine.kinds.model import (
    ChangeType,
    EventNote,
    Notification,
    StateChange,
    StateColumns,
    WindowNotes,
)

from . import messages as m
from .codes import Opcode
from .columns import StateFrames, state_frames
from .frames import encode_frame, encode_header


def encode_notification(stream_id: int, note: Notification, include_previous: bool) -> bytes:
    """One notification as a frame on its subscription's stream."""
    opcode, payload = _notification_payload(note, include_previous)
    return encode_frame(stream_id, opcode, payload)


def encode_window(stream_id: int, notes: Sequence[Notification], include_previous: bool) -> bytes:
    """A window's notifications as frames on one subscription's stream.

    A window is encoded once (kept on the engine's :class:`StateColumns` or
    :class:`WindowNotes`, the object every subscriber of the kind gets). A window of STATE
    frames of one layout (a fixed-width schema) is one record array that each subscriber
    stamps its header into (:mod:`~headwater.protocols.convergedb.columns`); otherwise the
    payloads are kept and a subscriber only adds its headers, which depend on nothing but
    (stream, opcode, length) and come from a cache."""
    if isinstance(notes, StateColumns):
        key = ("convergedb", include_previous)
        frames = notes.derived.get(key)
        if frames is None:
            frames = notes.derived[key] = _state_frames(notes, include_previous)
        if isinstance(frames, StateFrames):
            return frames.for_stream(stream_id)
    if isinstance(notes, WindowNotes | StateColumns):
        key = ("convergedb-payloads", include_previous)
        encoded = notes.derived.get(key)
        if encoded is None:
            encoded = notes.derived[key] = _encode_payloads(notes, include_previous)
        assert isinstance(encoded, _Payloads)
    else:
        encoded = _encode_payloads(notes, include_previous)
    if encoded.uniform is not None:
        header = _frame_header(stream_id, *encoded.uniform)
        return header + header.join(encoded.payloads)
    headers = [_frame_header(stream_id, op, length) for op, length in encoded.shapes]
    return b"".join(chain.from_iterable(zip(headers, encoded.payloads, strict=True)))


def _state_frames(notes: StateColumns, include_previous: bool) -> StateFrames | bool:
    """The window as one block of STATE frames when its changes share one layout (no
    metadata, no previous record sent, no deletion, one record length); else False."""
    if notes.metadata is not None:
        return False
    if include_previous and int(ChangeType.UPDATED) in notes.changes:
        return False
    frames = state_frames(
        notes.kind_id,
        notes.first_version,
        notes.entity_ids,
        notes.changes,
        notes.source_sets,
        notes.changed_fields,
        notes.records,
    )
    return False if frames is None else frames


class _Payloads:
    """A window's notification payloads and each one's (opcode, length)."""

    __slots__ = ("payloads", "shapes", "uniform")

    def __init__(self, shapes: list[tuple[int, int]], payloads: list[bytes]) -> None:
        self.shapes = shapes
        self.payloads = payloads
        first = shapes[0] if shapes else None
        self.uniform = first if first is not None and shapes.count(first) == len(shapes) else None


def _encode_payloads(notes: Sequence[Notification], include_previous: bool) -> _Payloads:
    payloads: list[bytes] = []
    shapes: list[tuple[int, int]] = []
    updated = ChangeType.UPDATED
    for note in notes:
        if isinstance(note, StateChange) and note.change is not ChangeType.DELETED:
            payload = m.encode_state_payload(
                note.kind_id,
                note.entity_id,
                note.change,
                note.version,
                note.source_set,
                note.changed_fields,
                note.record,
                note.previous if include_previous and note.change is updated else None,
                note.metadata,
            )
            opcode: int = Opcode.STATE
        else:
            opcode, payload = _notification_payload(note, include_previous)
        payloads.append(payload)
        shapes.append((opcode, len(payload)))
    return _Payloads(shapes, payloads)


@lru_cache(maxsize=4096)
def _frame_header(stream_id: int, opcode: int, length: int) -> bytes:
    return encode_header(stream_id, opcode, length)


def _notification_payload(note: Notification, include_previous: bool) -> tuple[Opcode, bytes]:
    message: m.Message
    if isinstance(note, EventNote):
        message = m.Event(
            note.kind_id,
            note.entity_id,
            Opcode(note.op),
            note.source_id,
            note.sequence,
            note.presence_mask,
            note.field_data,
            note.metadata,
        )
    elif note.change is ChangeType.DELETED:
        message = m.Deleted(note.kind_id, note.entity_id, note.version, note.metadata)
    else:
        message = m.State(
            note.kind_id,
            note.entity_id,
            m.Change(int(note.change)),
            note.version,
            note.source_set,
            note.changed_fields,
            note.record,
            note.previous if include_previous and note.change is ChangeType.UPDATED else None,
            note.metadata,
        )
    return message.opcode, message.encode()
