"""Server-to-client WebSocket text frames (RFC 6455 §5.2: FIN, opcode 1, unmasked).

The gateway frames each stream RESULT once and writes the same bytes to every subscriber
of the stream, so framing happens here rather than in the WebSocket library per send.

:func:`packed_frames` frames for connections that opted into headwater's packing
extension (docs/protocols/kiwi.md): consecutive messages travel as one text frame holding
a JSON array of them, in order.
"""

from __future__ import annotations

import struct
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate

_FIN_TEXT = 0x81
_LEN16 = struct.Struct("!BBH")
_LEN64 = struct.Struct("!BBQ")


PACK_MAX_BYTES = 256 << 10  # message bytes per packed frame (clients often cap at 1 MiB)


def _text_header(n: int) -> bytes:
    if n < 126:
        return bytes((_FIN_TEXT, n))
    if n < 1 << 16:
        return _LEN16.pack(_FIN_TEXT, 126, n)
    return _LEN64.pack(_FIN_TEXT, 127, n)


def text_frame(payload: bytes) -> bytes:
    """One unfragmented, unmasked text frame carrying ``payload`` (UTF-8 JSON)."""
    return _text_header(len(payload)) + payload


def packed_frames(messages: Sequence[bytes], max_bytes: int) -> list[bytes]:
    """Text frames carrying ``messages`` (each a JSON text) in order, for ``writelines``:
    every run of messages holding at most ``max_bytes`` of message bytes becomes one frame
    whose text is the JSON array ``[m1,m2,...]``; a run of one is sent as itself. The
    work per message is C's (lengths summed, bytes joined), not Python's."""
    out: list[bytes] = []
    total = len(messages)
    if total == 1:
        out.append(text_frame(messages[0]))
        return out
    ends = list(accumulate(map(len, messages)))  # message bytes up to and including i
    start = 0
    base = 0
    while start < total:
        stop = max(start + 1, bisect_right(ends, base + max_bytes, start))
        if stop - start == 1:
            out.append(text_frame(messages[start]))
        else:
            body = b",".join(messages[start:stop])
            out += (_text_header(len(body) + 2) + b"[", body, b"]")
        base = ends[stop - 1]
        start = stop
    return out
