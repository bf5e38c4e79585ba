"""The blocking entities client: :func:`connect` and :class:`EntityClient`.

An :class:`EntityClient` runs an :class:`~headwater.entities.aio.AsyncEntityClient` on
its own event-loop thread (:mod:`headwater.client._core.blocking`, as :mod:`headwater.client.sync`
does). Writes are encoded and buffered in the calling thread without a round trip to the
loop; everything else waits for the loop's answer.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Coroutine, Iterator, Mapping
from types import TracebackType
from typing import Any, TypeVar

from headwater.client._core.blocking import (
    Blocking,
    BlockingSubscription,
    Inner,
    LoopThread,
    blocking,
)
from headwater.client._core.session import same_parameters_as

from .aio import (
    AsyncEntityClient,
    AsyncEntitySubscription,
    ResubscribeMode,
)
from .catalog import KindDescription, describe_kind_async, list_kinds_async
from .schema import Entity, EntityEvent, KeyLike, Kind

T = TypeVar("T")


class EntityClient(Blocking[AsyncEntityClient]):
    """A blocking ConvergeDB client (a source, or read-only). Make one with
    :func:`connect`; use it as a context manager or call :meth:`close`."""

    def __init__(self, inner: AsyncEntityClient, runner: LoopThread) -> None:
        # Dropped without close(): close without waiting for buffered writes.
        super().__init__(inner, runner, functools.partial(inner.close, flush=False))

    # ---- lifecycle ----------------------------------------------------------------------

    def close(self, *, flush: bool = True) -> None:
        """Flush (raising a write the server refused), unsubscribe, close and stop the
        client's thread."""
        if self._runner.stopped:
            return
        try:
            self._run(self._inner.close(flush=flush))
        finally:
            self._finalizer()

    source_id = Inner[int | None]()
    read_only = Inner[bool]()

    # ---- kinds --------------------------------------------------------------------------

    create_kind = blocking(AsyncEntityClient.create_kind)

    get_kind = blocking(AsyncEntityClient.get_kind)

    kind_from_schema = blocking(AsyncEntityClient.kind_from_schema)

    # ---- writes -------------------------------------------------------------------------

    def assert_(self, kind: Kind[T], key: KeyLike, value: T, *, metadata: bytes = b"") -> None:
        """Buffer an ASSERT: this source holds the entity and sets every field."""
        if self._inner.buffer_assert(kind, key, value, metadata):
            self._run(self._inner.drain())

    def patch(
        self,
        kind: Kind[Any],
        key: KeyLike,
        changes: Mapping[str, Any] | None = None,
        *,
        metadata: bytes = b"",
        **fields: Any,
    ) -> None:
        """Buffer a PATCH of the named fields (``changes`` and/or keyword arguments)."""
        if self._inner.buffer_patch(kind, key, {**(changes or {}), **fields}, metadata):
            self._run(self._inner.drain())

    def retract(self, kind: Kind[Any], key: KeyLike, *, metadata: bytes = b"") -> None:
        """Buffer a RETRACT: this source no longer holds the entity."""
        if self._inner.buffer_retract(kind, key, metadata):
            self._run(self._inner.drain())

    flush = blocking(AsyncEntityClient.flush)

    def epoch(self) -> Epoch:
        """``with client.epoch() as epoch:``: see :meth:`AsyncEntityClient.epoch`."""
        return Epoch(self)

    # ---- reads --------------------------------------------------------------------------

    get = blocking(AsyncEntityClient.get)

    scan = blocking(AsyncEntityClient.scan)

    def subscribe(
        self,
        kind: Kind[T],
        *,
        bootstrap: bool = True,
        resubscribe: ResubscribeMode = ResubscribeMode.FULL,
        include_previous: bool = False,
        events: bool = False,
    ) -> EntitySubscription[T]:
        """A subscription: iterate it (``for entity in sub``) or use it in a ``with``
        block; it unsubscribes when the block or the loop ends. ``include_previous`` and
        ``events``: see :meth:`AsyncEntityClient.subscribe` (``for event in
        sub.events()``)."""
        return EntitySubscription(
            self,
            self._inner.subscribe(
                kind,
                bootstrap=bootstrap,
                resubscribe=resubscribe,
                include_previous=include_previous,
                events=events,
            ),
        )


class Epoch:
    """A source epoch as a context manager."""

    def __init__(self, client: EntityClient) -> None:
        self._client = client
        self.retracted: int | None = None

    def __enter__(self) -> Epoch:
        self._client._run(self._client._inner.begin_epoch())
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.retracted = self._client._run(self._client._inner.end_epoch())


class EntitySubscription(BlockingSubscription[AsyncEntitySubscription[T]]):
    """Blocking view of an :class:`~headwater.entities.aio.AsyncEntitySubscription`."""

    def __iter__(self) -> Iterator[Entity[T]]:
        return self._drain(self._inner.next_batch)

    def next_batch(self, timeout: float | None = None) -> list[Entity[T]]:
        """The changes accepted so far (waiting for one); [] on timeout or once closed."""
        return self._client._run(self._inner.next_batch(timeout))

    def next(self, timeout: float | None = None) -> Entity[T] | None:
        return self._client._run(self._inner.next(timeout))

    def events(self) -> Iterator[EntityEvent]:
        """The EVENTs of an event-stream kind subscribed with ``events=True``, in
        sequence order; it unsubscribes when the loop ends."""
        return self._drain(self._inner.next_events)

    def next_events(self, timeout: float | None = None) -> list[EntityEvent]:
        """The EVENTs received so far (waiting for one); [] on timeout or once closed."""
        return self._client._run(self._inner.next_events(timeout))

    def wait_bootstrapped(self, timeout: float | None = None) -> None:
        self._client._run(self._inner.wait_bootstrapped(timeout))

    @property
    def view(self) -> dict[bytes, Entity[T]]:
        """Entity id -> the latest state of every live entity seen."""
        return self._inner.view

    bootstrapped = Inner[bool]()


@same_parameters_as(AsyncEntityClient)
def connect(inner: AsyncEntityClient) -> EntityClient:
    """Connect to the ConvergeDB listener (default 127.0.0.1:7402) as a source or
    ``read_only`` (the parameters are :class:`~headwater.entities.aio.AsyncEntityClient`'s);
    raises :class:`~headwater.client.ServerUnavailable` when nothing answers."""
    return EntityClient(inner, LoopThread.connected(inner))


@same_parameters_as(list_kinds_async)
def list_kinds(kinds: Coroutine[Any, Any, list[KindDescription]]) -> list[KindDescription]:
    """Every kind of the tenant (from the HTTP API; see :mod:`.catalog`)."""
    return asyncio.run(kinds)


@same_parameters_as(describe_kind_async)
def describe_kind(kind: Coroutine[Any, Any, KindDescription]) -> KindDescription:
    """One kind's schema (from the HTTP API; see :mod:`.catalog`)."""
    return asyncio.run(kind)
