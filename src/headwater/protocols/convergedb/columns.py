"""STATE notifications encoded a window at a time, as columns.

A server sends every subscriber of a kind the same net changes of each 20 ms window,
each as a STATE frame that differs between subscribers only in its header's stream_id.
When every change of a window is CREATED or UPDATED with field_data of one length and no
metadata or previous record (what writers of a fixed-width schema produce), the frames
have one layout, so the whole window is one numpy record array: the payload fields are
filled column by column, once, and each subscriber's frames are that array with its own
header stamped into every row, copied out in one call. Nothing is done per change in
Python. The bytes are exactly those of :class:`~.messages.State` framed by
:func:`~.frames.encode_frame` (tests/property holds the two to each other).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from .codes import ENTITY_ID_SIZE, Opcode
from .frames import HEADER_SIZE, encode_header
from .messages import Change

_CHANGES = frozenset({int(Change.CREATED), int(Change.UPDATED)})


@lru_cache(maxsize=256)
def _frame_layout(fd_len: int) -> np.dtype[np.void]:
    return np.dtype(
        [
            ("header", f"V{HEADER_SIZE}"),
            ("kind_id", "<u2"),
            ("entity_id", f"V{ENTITY_ID_SIZE}"),
            ("change", "u1"),
            ("version", "<u8"),
            ("source_set", "<u8"),
            ("changed_fields", "<u8"),
            ("fd_len", "<u4"),
            ("field_data", f"V{fd_len}"),
            ("meta_len", "<u2"),
        ]
    )


class StateFrames:
    """A window's STATE frames, ready to be framed for any subscription stream."""

    __slots__ = ("_framed", "_rows", "payload_size")

    def __init__(self, rows: np.ndarray, payload_size: int) -> None:
        self._rows = rows
        self._framed: dict[int, bytes] = {}
        self.payload_size = payload_size

    def __len__(self) -> int:
        return len(self._rows)

    def for_stream(self, stream_id: int) -> bytes:
        """Every frame with ``stream_id`` in its header, one after another. Kept per
        stream id: clients number their streams from 1, so the subscribers of a kind
        mostly share an id and then share these bytes too (one copy, not one each)."""
        framed = self._framed.get(stream_id)
        if framed is None:
            header = encode_header(stream_id, Opcode.STATE, self.payload_size)
            rows = self._rows
            rows["header"] = np.frombuffer(header, dtype=rows.dtype["header"])[0]
            framed = self._framed[stream_id] = rows.tobytes()
        return framed


def state_frames(
    kind_id: int,
    first_version: int,
    entity_ids: Sequence[bytes],
    changes: Sequence[int],
    source_sets: Sequence[int],
    changed_fields: Sequence[int],
    records: Sequence[bytes],
) -> StateFrames | None:
    """The STATE frames of a window's changes (change ``i`` has version
    ``first_version + i``), or None when they do not share one layout: a DELETED change,
    field_data of different lengths, or an id that is not 32 bytes."""
    count = len(entity_ids)
    if count == 0 or not records:
        return None
    fd_len = len(records[0])
    ids = b"".join(entity_ids)
    data = b"".join(records)
    if len(ids) != count * ENTITY_ID_SIZE or len(data) != count * fd_len:
        return None
    if not _CHANGES.issuperset(changes):
        return None
    layout = _frame_layout(fd_len)
    rows = np.zeros(count, dtype=layout)
    rows["kind_id"] = kind_id
    rows["entity_id"] = np.frombuffer(ids, dtype=layout["entity_id"])
    rows["change"] = changes
    rows["version"] = np.arange(first_version, first_version + count, dtype=np.uint64)
    rows["source_set"] = np.array(source_sets, dtype=np.uint64)
    rows["changed_fields"] = np.array(changed_fields, dtype=np.uint64)
    rows["fd_len"] = fd_len
    rows["field_data"] = np.frombuffer(data, dtype=layout["field_data"])
    return StateFrames(rows, layout.itemsize - HEADER_SIZE)
