"""A kind's subscribers: registering them, and handing each committed window to them.

Each window's net changes of a kind go to every state subscriber as the one
:class:`StateColumns` object (a front end encodes it once for all of them), its EVENTs to
every event subscriber as one :class:`WindowNotes`; pushed right after the committed
state moved on, so a subscription registered before a bootstrap scan misses nothing.
"""

from __future__ import annotations

import contextlib

from headwater.engine.kinds.codec import RecordCodec
from headwater.engine.kinds.model import ChangeType, EventNote, StateColumns, WindowNotes
from headwater.engine.kinds.state import KindState
from headwater.engine.kinds.subscriptions import KindSubscription


def subscribe(
    state: KindState, *, include_previous: bool, events: bool, capacity: int
) -> KindSubscription:
    """A live subscription to ``state``'s kind, registered now; it unregisters itself
    when closed. ``events`` is honoured for event-stream kinds only."""

    def remove(sub: KindSubscription) -> None:
        with contextlib.suppress(ValueError):
            state.subscribers.remove(sub)

    sub = KindSubscription(
        state.info.kind_id,
        include_previous=include_previous,
        events=events and state.info.event_stream,
        capacity=capacity,
        on_close=remove,
    )
    state.subscribers.append(sub)
    return sub


def publish(state: KindState, changes: StateColumns, events: list[EventNote]) -> None:
    """A committed window of ``state``'s kind to each of its subscribers."""
    event_notes = WindowNotes(events)
    for sub in list(state.subscribers):
        sub.push(event_notes if sub.events else changes)


def changed_fields(codec: RecordCodec, columns: StateColumns) -> list[int]:
    """The changed_fields column of a window's changes: every field for CREATED, none
    for DELETED, the fields whose bytes differ for UPDATED (all at once)."""
    everything = (1 << len(codec.fields)) - 1
    changes, records, previous = columns.changes, columns.records, columns.previous
    created, deleted = int(ChangeType.CREATED), int(ChangeType.DELETED)
    if deleted in changes:
        updated = [i for i, c in enumerate(changes) if c == ChangeType.UPDATED]
        out = [everything if c == created else 0 for c in changes]
        news = [records[i] for i in updated]
        olds = [previous[i] or b"" for i in updated]
        for i, mask in zip(updated, codec.changed_fields(news, olds), strict=True):
            out[i] = mask
        return out
    # A created entity is compared with itself (no bit), then gets every bit.
    olds = [r if p is None else p for r, p in zip(records, previous, strict=True)]
    masks = codec.changed_fields(records, olds)
    if created in changes:
        return [everything if c == created else m for c, m in zip(changes, masks, strict=True)]
    return masks
