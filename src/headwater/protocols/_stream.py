"""The shell every incremental decoder of a byte stream shares: bytes fed in any split,
complete items taken in order, and a sticky first error.

A subclass says how long its header and trailer are, how to check the header at the head
of the buffer (giving the payload length) and how to build the item once all its bytes
are in; this class keeps the buffer, refuses a bad header as soon as its bytes arrive (so
a peer cannot pile payload bytes behind it), cuts each complete item off the buffer, and
after an error stays dead: fed bytes are dropped and the same error is raised again, so
the buffer never grows past one fed chunk.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import ClassVar, Generic, TypeVar

from headwater.engine.kinds.reader import Buffer

ItemT = TypeVar("ItemT")
ErrorT = TypeVar("ErrorT", bound=Exception)


class IncrementalDecoder(Generic[ItemT, ErrorT]):
    __slots__ = ("_buffer", "_error", "_length", "max_payload")

    head_size: ClassVar[int]
    """Bytes of header before each item's payload."""
    tail_size: ClassVar[int] = 0
    """Bytes after the payload (a trailer such as a checksum)."""

    def __init__(self, max_payload: int) -> None:
        self.max_payload = max_payload
        self._buffer = bytearray()
        self._error: ErrorT | None = None
        self._length = -1  # payload length from a checked header at the buffer head

    @property
    def buffered_bytes(self) -> int:
        """Bytes held and not yet returned as items."""
        return len(self._buffer)

    @property
    def at_boundary(self) -> bool:
        """True when no partial item is held (the end of input here is clean)."""
        return not self._buffer

    def discard(self) -> None:
        """The input ended: free the bytes held now. A server connection's objects form
        reference cycles (transport and protocol), which the cyclic GC may reach only
        thousands of connections later, holding each one's partial frame until then."""
        self._buffer = bytearray()
        self._length = -1

    @property
    def failed(self) -> bool:
        return self._error is not None

    def feed(self, data: Buffer) -> None:
        if self._error is not None:
            return
        self._buffer += data
        if self._length < 0:
            self._check_header()

    def next_item(self) -> ItemT | None:
        """The next complete item, None when more bytes are needed; raises the error."""
        if self._error is not None:
            raise self._error
        if self._length < 0 and not self._check_header():
            if self._error is not None:
                raise self._error
            return None
        length = self._length
        end = self.head_size + length + self.tail_size
        buffer = self._buffer
        if len(buffer) < end:
            return None
        with memoryview(buffer) as view:
            item = self._item(view, length)
        del buffer[:end]  # CPython advances the start of a bytearray: no memmove
        self._length = -1
        return item

    def __iter__(self) -> Iterator[ItemT]:
        return self

    def __next__(self) -> ItemT:
        item = self.next_item()
        if item is None:
            raise StopIteration
        return item

    def _fail(self, error: ErrorT) -> ErrorT:
        self._error = error
        self._buffer = bytearray()
        self._length = -1
        return error

    # ---- what a subclass provides -------------------------------------------------------

    def _check_header(self) -> bool:
        """Check the header bytes present at the buffer head (calling :meth:`_fail` on a
        bad one); once the whole header is in and good, keep what the item needs, set
        ``_length`` to the payload length and return True."""
        raise NotImplementedError

    def _item(self, view: memoryview, length: int) -> ItemT:
        """The item from its complete bytes at the head of ``view`` (header, ``length``
        payload bytes, trailer). May raise through :meth:`_fail` (a bad checksum)."""
        raise NotImplementedError


class LengthPrefixedDecoder(IncrementalDecoder[bytes, ErrorT]):
    """Frames that are a length field and that many payload bytes (Kafka, Rivven): the
    subclass names the length's struct, the least length it accepts and the error for a
    length outside ``min_length..max_payload``; items are the payloads as bytes."""

    __slots__ = ()
    length_field: ClassVar[struct.Struct]
    min_length: ClassVar[int] = 0

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        cls.head_size = cls.length_field.size  # the header is the length field alone

    def _length_error(self, length: int) -> ErrorT:
        raise NotImplementedError

    def _check_header(self) -> bool:
        buffer = self._buffer
        if len(buffer) < self.head_size:
            return False
        (length,) = self.length_field.unpack_from(buffer)
        if length < self.min_length or length > self.max_payload:
            self._fail(self._length_error(length))
            return False
        self._length = length
        return True

    def _item(self, view: memoryview, length: int) -> bytes:
        return bytes(view[self.head_size : self.head_size + length])
