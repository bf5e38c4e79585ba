"""The shell every incremental decoder of a byte stream shares: bytes fed in any split,
complete items taken in order, and a sticky first error.

A subclass says how to check the header at the head of the buffer and how to take the
item once its bytes are in; this class keeps the buffer, refuses a bad header as soon as
its bytes arrive (so a peer cannot pile payload bytes behind it), and after an error stays
dead: fed bytes are dropped and the same error is raised again, so the buffer never grows
past one fed chunk.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeAlias, TypeVar

Buffer: TypeAlias = bytes | bytearray | memoryview

ItemT = TypeVar("ItemT")
ErrorT = TypeVar("ErrorT", bound=Exception)


class IncrementalDecoder(Generic[ItemT, ErrorT]):
    __slots__ = ("_buffer", "_error", "max_payload")

    def __init__(self, max_payload: int) -> None:
        self.max_payload = max_payload
        self._buffer = bytearray()
        self._error: ErrorT | None = None

    @property
    def buffered_bytes(self) -> int:
        """Bytes held and not yet returned as items."""
        return len(self._buffer)

    @property
    def at_boundary(self) -> bool:
        """True when no partial item is held (the end of input here is clean)."""
        return not self._buffer

    @property
    def failed(self) -> bool:
        return self._error is not None

    def feed(self, data: Buffer) -> None:
        if self._error is not None:
            return
        self._buffer += data
        if not self._header_ready():
            self._check_header()

    def next_item(self) -> ItemT | None:
        """The next complete item, None when more bytes are needed; raises the error."""
        if self._error is not None:
            raise self._error
        if not self._header_ready() and not self._check_header():
            if self._error is not None:
                raise self._error
            return None
        return self._take()

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
        self._forget_header()
        return error

    # ---- what a subclass provides -------------------------------------------------------

    def _header_ready(self) -> bool:
        """True when the head item's header has been checked and kept."""
        raise NotImplementedError

    def _check_header(self) -> bool:
        """Check the header bytes present at the buffer head (calling :meth:`_fail` on a
        bad one); True once the whole header is in and kept."""
        raise NotImplementedError

    def _take(self) -> ItemT | None:
        """With the header kept: the item once all its bytes are in (removing them and
        forgetting the header), else None. May raise through :meth:`_fail`."""
        raise NotImplementedError

    def _forget_header(self) -> None:
        raise NotImplementedError
