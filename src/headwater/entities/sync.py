"""The blocking entities client: :func:`connect` and :class:`EntityClient`.

An :class:`EntityClient` runs an :class:`~headwater.entities.aio.AsyncEntityClient` on
its own event-loop thread (the approach of :mod:`headwater.client.sync`). Writes are
encoded and buffered in the calling thread without a round trip to the loop; everything
else waits for the loop's answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Generic, TypeVar

from headwater.client.sync import _LoopThread

from .aio import (
    DEFAULT_BATCH_OPS,
    DEFAULT_BUFFER_BYTES,
    DEFAULT_LINGER,
    DEFAULT_SERVER,
    DEFAULT_TIMEOUT,
    AsyncEntityClient,
    AsyncEntitySubscription,
    ResubscribeMode,
)
from .catalog import DEFAULT_HTTP, KindDescription, describe_kind_async, list_kinds_async
from .schema import Entity, EntityEvent, KeyLike, Kind

T = TypeVar("T")
_R = TypeVar("_R")


def _finalize(inner: AsyncEntityClient, runner: _LoopThread) -> None:
    if runner.stopped:
        return
    with contextlib.suppress(BaseException):
        runner.submit(inner.close(flush=False)).result(5)
    runner.stop()


class EntityClient:
    """A blocking ConvergeDB client (a source, or read-only). Make one with
    :func:`connect`; use it as a context manager or call :meth:`close`."""

    def __init__(self, inner: AsyncEntityClient, runner: _LoopThread) -> None:
        self._inner = inner
        self._runner = runner
        self._finalizer = weakref.finalize(self, _finalize, inner, runner)

    def _run(self, coro: Coroutine[Any, Any, _R]) -> _R:
        return self._runner.run(coro)

    # ---- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> EntityClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self, *, flush: bool = True) -> None:
        """Flush (raising a write the server refused), unsubscribe, close and stop the
        client's thread."""
        if self._runner.stopped:
            return
        try:
            self._run(self._inner.close(flush=flush))
        finally:
            self._finalizer()

    @property
    def closed(self) -> bool:
        return self._runner.stopped or self._inner.closed

    @property
    def aio(self) -> AsyncEntityClient:
        """The underlying asyncio client (it runs on this client's loop thread)."""
        return self._inner

    @property
    def source_id(self) -> int | None:
        return self._inner.source_id

    @property
    def read_only(self) -> bool:
        return self._inner.read_only

    @property
    def reconnects(self) -> int:
        return self._inner.reconnects

    # ---- kinds --------------------------------------------------------------------------

    def create_kind(
        self, cls: type[T], name: str | None = None, *, event_stream: bool = False
    ) -> Kind[T]:
        return self._run(self._inner.create_kind(cls, name, event_stream=event_stream))

    def get_kind(self, cls: type[T], name: str | None = None) -> Kind[T]:
        return self._run(self._inner.get_kind(cls, name))

    def kind_from_schema(
        self,
        name: str,
        specs: Sequence[tuple[str, int]],
        *,
        create: bool = False,
        event_stream: bool = False,
    ) -> Kind[dict[str, Any]]:
        """A kind read and written as dicts (see ``AsyncEntityClient.kind_from_schema``)."""
        return self._run(
            self._inner.kind_from_schema(name, specs, create=create, event_stream=event_stream)
        )

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

    def flush(self) -> None:
        """Return once every earlier write is durable and visible; raise the first write
        the server refused since the last flush."""
        self._run(self._inner.flush())

    def epoch(self) -> Epoch:
        """``with client.epoch() as epoch:``: see :meth:`AsyncEntityClient.epoch`."""
        return Epoch(self)

    # ---- reads --------------------------------------------------------------------------

    def get(self, kind: Kind[T], key: KeyLike) -> Entity[T] | None:
        return self._run(self._inner.get(kind, key))

    def scan(self, kind: Kind[T]) -> list[Entity[T]]:
        return self._run(self._inner.scan(kind))

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


class EntitySubscription(Generic[T]):
    """Blocking view of an :class:`~headwater.entities.aio.AsyncEntitySubscription`."""

    def __init__(self, client: EntityClient, inner: AsyncEntitySubscription[T]) -> None:
        self._client = client
        self._inner = inner

    def __repr__(self) -> str:
        return repr(self._inner).replace("AsyncEntitySubscription", "EntitySubscription", 1)

    def start(self) -> EntitySubscription[T]:
        self._client._run(self._inner.start())
        return self

    def __enter__(self) -> EntitySubscription[T]:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Entity[T]]:
        return self._drain(self._inner.next_batch)

    def _drain(self, take: Callable[[], Coroutine[Any, Any, list[_R]]]) -> Iterator[_R]:
        """What ``take`` gets, batch after batch, until the subscription closes; it
        unsubscribes when the loop ends."""
        self.start()
        try:
            while True:
                batch = self._client._run(take())
                if not batch:
                    if self._inner.closed:
                        return
                    continue
                yield from batch
        finally:
            self.close()

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

    def close(self) -> None:
        if self._inner.closed or self._client._runner.stopped:
            return
        self._client._run(self._inner.close())

    @property
    def view(self) -> dict[bytes, Entity[T]]:
        """Entity id -> the latest state of every live entity seen."""
        return self._inner.view

    @property
    def bootstrapped(self) -> bool:
        return self._inner.bootstrapped

    @property
    def closed(self) -> bool:
        return self._inner.closed

    @property
    def resubscribes(self) -> int:
        return self._inner.resubscribes


def connect(
    server: str = DEFAULT_SERVER,
    *,
    token: str | None = None,
    name: str = "",
    source_id: int | None = None,
    read_only: bool = False,
    liveness_ms: int = 0,
    timeout: float | None = DEFAULT_TIMEOUT,
    reconnect: bool = True,
    reconnect_attempts: int = 10,
    backoff_base: float = 0.05,
    backoff_max: float = 2.0,
    linger: float = DEFAULT_LINGER,
    batch_ops: int = DEFAULT_BATCH_OPS,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
) -> EntityClient:
    """Connect to the ConvergeDB listener (default 127.0.0.1:7402) as a source or
    ``read_only``; raises :class:`~headwater.client.ServerUnavailable` when nothing
    answers."""
    inner = AsyncEntityClient(
        server,
        token=token,
        name=name,
        source_id=source_id,
        read_only=read_only,
        liveness_ms=liveness_ms,
        timeout=timeout,
        reconnect=reconnect,
        reconnect_attempts=reconnect_attempts,
        backoff_base=backoff_base,
        backoff_max=backoff_max,
        linger=linger,
        batch_ops=batch_ops,
        buffer_bytes=buffer_bytes,
    )
    runner = _LoopThread()
    try:
        runner.run(inner._ensure())
    except BaseException:
        runner.stop()
        raise
    return EntityClient(inner, runner)


def list_kinds(
    http: str = DEFAULT_HTTP, *, token: str | None = None, tenant: int = 0, timeout: float = 10.0
) -> list[KindDescription]:
    """Every kind of the tenant (from the HTTP API; see :mod:`.catalog`)."""
    return asyncio.run(list_kinds_async(http, token=token, tenant=tenant, timeout=timeout))


def describe_kind(
    name: str,
    http: str = DEFAULT_HTTP,
    *,
    token: str | None = None,
    tenant: int = 0,
    timeout: float = 10.0,
) -> KindDescription:
    """One kind's schema (from the HTTP API; see :mod:`.catalog`)."""
    return asyncio.run(describe_kind_async(name, http, token=token, tenant=tenant, timeout=timeout))
