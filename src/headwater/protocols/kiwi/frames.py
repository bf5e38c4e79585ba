"""Server-to-client WebSocket text frames (RFC 6455 §5.2: FIN, opcode 1, unmasked).

The gateway frames each stream RESULT once and writes the same bytes to every subscriber
of the stream, so framing happens here rather than in the WebSocket library per send.
"""

from __future__ import annotations

import struct

_FIN_TEXT = 0x81
_LEN16 = struct.Struct("!BBH")
_LEN64 = struct.Struct("!BBQ")


def text_frame(payload: bytes) -> bytes:
    """One unfragmented, unmasked text frame carrying ``payload`` (UTF-8 JSON)."""
    n = len(payload)
    if n < 126:
        return bytes((_FIN_TEXT, n)) + payload
    if n < 1 << 16:
        return _LEN16.pack(_FIN_TEXT, 126, n) + payload
    return _LEN64.pack(_FIN_TEXT, 127, n) + payload
