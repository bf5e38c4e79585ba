"""A bounded little-endian reader: a cursor over a buffer that never reads past its end.

Every read states how many bytes it needs and is refused, with the caller's own
exception type, before anything is sliced or allocated when fewer remain. Nothing here is
specific to one format: the kind engine reads its records with it (:mod:`.fields`), and
so does the ConvergeDB codec its payloads (Kimberlite's ``messages._Reader`` does the same
job with its own string encoding on top).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TypeAlias

Buffer: TypeAlias = bytes | bytearray | memoryview

_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I8 = struct.Struct("<b")
_I16 = struct.Struct("<h")
_I32 = struct.Struct("<i")
_I64 = struct.Struct("<q")
_F32 = struct.Struct("<f")
_F64 = struct.Struct("<d")


def as_view(data: Buffer) -> memoryview:
    """``data`` as a flat unsigned-byte memoryview (no copy)."""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


class BoundedReader:
    """Reads fixed-width little-endian values and length-checked byte runs.

    ``error`` builds the exception raised for a short read (it gets the message).
    """

    __slots__ = ("buf", "end", "error", "pos")

    def __init__(self, buf: memoryview, error: Callable[[str], Exception], pos: int = 0) -> None:
        self.buf = buf
        self.pos = pos
        self.end = len(buf)
        self.error = error

    @property
    def remaining(self) -> int:
        return self.end - self.pos

    def need(self, n: int, what: str) -> int:
        """Claim ``n`` bytes; return where they start. Raises when fewer remain."""
        pos = self.pos
        if n > self.end - pos:
            raise self.error(
                f"truncated {what}: needs {n} bytes at offset {pos}, {self.end - pos} left"
            )
        self.pos = pos + n
        return pos

    def take(self, n: int, what: str) -> bytes:
        """``n`` raw bytes (a copy), length checked first."""
        pos = self.need(n, what)
        return bytes(self.buf[pos : pos + n])

    def peek_u16(self) -> int | None:
        """The u16 at the cursor without consuming it, None when fewer than 2 bytes remain."""
        if self.end - self.pos < 2:
            return None
        value: int = _U16.unpack_from(self.buf, self.pos)[0]
        return value

    def _unpack(self, fmt: struct.Struct, what: str) -> int:
        value: int = fmt.unpack_from(self.buf, self.need(fmt.size, what))[0]
        return value

    def u8(self, what: str) -> int:
        return self._unpack(_U8, what)

    def u16(self, what: str) -> int:
        return self._unpack(_U16, what)

    def u32(self, what: str) -> int:
        return self._unpack(_U32, what)

    def u64(self, what: str) -> int:
        return self._unpack(_U64, what)

    def i8(self, what: str) -> int:
        return self._unpack(_I8, what)

    def i16(self, what: str) -> int:
        return self._unpack(_I16, what)

    def i32(self, what: str) -> int:
        return self._unpack(_I32, what)

    def i64(self, what: str) -> int:
        return self._unpack(_I64, what)

    def f32(self, what: str) -> float:
        value: float = _F32.unpack_from(self.buf, self.need(4, what))[0]
        return value

    def f64(self, what: str) -> float:
        value: float = _F64.unpack_from(self.buf, self.need(8, what))[0]
        return value

    def finish(self, what: str) -> None:
        if self.pos != self.end:
            raise self.error(f"{self.end - self.pos} trailing bytes after {what}")
