"""A bounded little-endian reader: a cursor over a buffer that never reads past its end.

Every read states how many bytes it needs and is refused, with the caller's own
exception type, before anything is sliced or allocated when fewer remain. Nothing here is
specific to one format: the kind engine reads its records with it (:mod:`.fields`), and
every wire codec its payloads (ConvergeDB directly; Kimberlite and Ripple's bin_prot
subclass it with their own strings, options and counts on top).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TypeAlias, TypeVar

Buffer: TypeAlias = bytes | bytearray | memoryview

_T = TypeVar("_T", int, float)

_U16 = struct.Struct("<H")


def as_view(data: Buffer) -> memoryview:
    """``data`` as a flat unsigned-byte memoryview (no copy)."""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _fixed(code: str, _kind: type[_T]) -> Callable[[BoundedReader, str], _T]:
    """A reader method for one little-endian struct ``code``: length checked, then
    unpacked in place (the check is inlined: these are the innermost calls of every
    decoder)."""
    layout = struct.Struct("<" + code)
    size, unpack = layout.size, layout.unpack_from

    def read(self: BoundedReader, what: str) -> _T:
        pos = self.pos
        if size > self.end - pos:
            raise self.short(size, what)
        self.pos = pos + size
        value: _T = unpack(self.buf, pos)[0]
        return value

    return read


class BoundedReader:
    """Reads fixed-width little-endian values and length-checked byte runs.

    ``error`` builds the exception raised for a short read (it gets the message). A
    format whose errors carry more (Ripple's carry the offset) overrides :meth:`fail`
    and :meth:`short`.
    """

    __slots__ = ("buf", "end", "error", "pos")

    def __init__(
        self, buf: memoryview | bytes, error: Callable[[str], Exception], pos: int = 0
    ) -> None:
        self.buf = buf
        self.pos = pos
        self.end = len(buf)
        self.error = error

    @property
    def remaining(self) -> int:
        return self.end - self.pos

    def fail(self, message: str, at: int) -> Exception:
        """The exception for a malformed value found at offset ``at``."""
        return self.error(message)

    def short(self, n: int, what: str) -> Exception:
        """The exception for ``n`` bytes wanted where fewer remain."""
        pos = self.pos
        return self.error(
            f"truncated {what}: needs {n} bytes at offset {pos}, {self.end - pos} left"
        )

    def need(self, n: int, what: str) -> int:
        """Claim ``n`` bytes; return where they start. Raises when fewer remain."""
        pos = self.pos
        if n > self.end - pos:
            raise self.short(n, what)
        self.pos = pos + n
        return pos

    def take(self, n: int, what: str) -> bytes:
        """``n`` raw bytes (a copy), length checked first."""
        pos = self.need(n, what)
        return bytes(self.buf[pos : pos + n])

    def text(self, n: int, what: str, at: int | None = None) -> str:
        """``n`` bytes of UTF-8 text (a string's length prefix, read by the caller,
        started at ``at``)."""
        pos = self.need(n, what)
        try:
            return str(self.buf[pos : pos + n], "utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(
                f"{what}: invalid UTF-8 ({exc.reason})", pos if at is None else at
            ) from None

    def fits(self, n: int, item_bytes: int, what: str, at: int | None = None) -> int:
        """``n``, a count of items of at least ``item_bytes`` each, when that many can fit
        in what remains (checked before anything loops over them)."""
        left = self.end - self.pos
        if n * item_bytes > left:
            raise self.fail(
                f"{what}: {n} items cannot fit in the {left} bytes left",
                self.pos if at is None else at,
            )
        return n

    def peek_u16(self) -> int | None:
        """The u16 at the cursor without consuming it, None when fewer than 2 bytes remain."""
        if self.end - self.pos < 2:
            return None
        value: int = _U16.unpack_from(self.buf, self.pos)[0]
        return value

    u8 = _fixed("B", int)
    u16 = _fixed("H", int)
    u32 = _fixed("I", int)
    u64 = _fixed("Q", int)
    i8 = _fixed("b", int)
    i16 = _fixed("h", int)
    i32 = _fixed("i", int)
    i64 = _fixed("q", int)
    f32 = _fixed("f", float)
    f64 = _fixed("d", float)

    def finish(self, what: str) -> None:
        if self.pos != self.end:
            raise self.fail(f"{self.end - self.pos} trailing bytes after {what}", self.pos)
