"""Blocking clients over asyncio ones: one mechanism for every SDK.

A blocking client runs its asyncio client on an event loop of its own, on a daemon
thread (:class:`LoopThread`), and waits for each call there; calls from several threads
are pipelined on the one connection. A client dropped without ``close()`` is closed by
a finalizer. :class:`Blocking` and :class:`BlockingSubscription` are the shared halves
of ``headwater.Client`` / ``headwater.entities.EntityClient`` (and the Ripple worker)
and of their subscriptions.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, Self, TypeVar, cast, overload

from ..errors import ClientClosed

T = TypeVar("T")
P = ParamSpec("P")


class _AsyncClosable(Protocol):
    """What a blocking client and a blocking subscription both close and ask."""

    @property
    def closed(self) -> bool: ...

    async def close(self) -> None: ...


class _AsyncClient(_AsyncClosable, Protocol):
    @property
    def reconnects(self) -> int: ...

    async def _ensure(self) -> Any: ...


class _AsyncSubscription(_AsyncClosable, Protocol):
    @property
    def resubscribes(self) -> int: ...

    async def start(self) -> Any: ...


A = TypeVar("A", bound=_AsyncClient)
AS = TypeVar("AS", bound=_AsyncSubscription)


class Inner(Generic[T]):
    """A read-only attribute that a blocking object shows from its asyncio one:
    ``address = Inner[str]()`` in a class body reads ``self._inner.address``."""

    def __init__(self, doc: str | None = None) -> None:
        self.__doc__ = doc
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Inner[T]: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...

    def __get__(self, obj: object | None, owner: type | None = None) -> Inner[T] | T:
        if obj is None:
            return self
        return cast(T, getattr(getattr(obj, "_inner"), self.name))  # noqa: B009

    def __set__(self, obj: object, value: T) -> None:
        raise AttributeError(f"{self.name} is read-only")


def blocking(
    method: Callable[Concatenate[A, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[Blocking[A], P], T]:
    """The blocking form of an asyncio client's method: ``read = blocking(AsyncClient.read)``
    in a class body runs ``self._inner.read(...)`` on the client's loop and waits for its
    answer. It takes the method's parameters (for type checkers and ``help()`` too) and
    has its documentation, so the two cannot drift apart."""

    def call(self: Blocking[A], /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._run(method(self._inner, *args, **kwargs))

    functools.update_wrapper(call, method)
    call.__qualname__ = method.__name__  # not the asyncio class's
    return call


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class LoopThread:
    """An event loop running forever on a daemon thread."""

    def __init__(
        self, name: str = "headwater-client", closed_message: str = "the client is closed"
    ) -> None:
        self.loop = _new_loop()
        self.stopped = False
        self.closed_message = closed_message
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        if self.stopped:
            coro.close()
            raise ClientClosed(self.closed_message)
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = self.submit(coro)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt: stop the coroutine too
            raise

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        if threading.current_thread() is self.thread:
            self.loop.call_soon(self.loop.stop)
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_cancel_tasks(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()

    @classmethod
    def started(
        cls, start: Callable[[], Coroutine[Any, Any, T]], **kwargs: str
    ) -> tuple[LoopThread, T]:
        """A loop thread, and what ``start()`` answered there (its error raises, the
        thread stopped): a client connected, or made and started, on its own loop."""
        runner = cls(**kwargs)
        try:
            return runner, runner.run(start())
        except BaseException:
            runner.stop()
            raise

    @classmethod
    def connected(cls, inner: _AsyncClient, **kwargs: str) -> LoopThread:
        """A loop thread on which ``inner`` has connected (its error raises, the thread
        stopped)."""
        return cls.started(inner._ensure, **kwargs)[0]


async def _cancel_tasks() -> None:
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


def _finalize(close: Callable[[], Coroutine[Any, Any, None]], runner: LoopThread) -> None:
    """Close a client that was dropped without close() (or is being closed)."""
    if runner.stopped:
        return
    with contextlib.suppress(BaseException):
        runner.submit(close()).result(5)
    runner.stop()


class Blocking(Generic[A]):
    """A blocking client: the asyncio client ``inner`` run on ``runner``'s loop.
    ``close`` is what closing it runs there (``inner.close`` by default)."""

    def __init__(
        self,
        inner: A,
        runner: LoopThread,
        close: Callable[[], Coroutine[Any, Any, None]] | None = None,
    ) -> None:
        self._inner = inner
        self._runner = runner
        self._finalizer = weakref.finalize(self, _finalize, close or inner.close, runner)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._runner.run(coro)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the client (its subscriptions and connection) and stop its thread."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._runner.stopped or self._inner.closed

    reconnects = Inner[int]("How many times the client reconnected.")

    @property
    def aio(self) -> A:
        """The underlying asyncio client (it runs on this client's loop thread)."""
        return self._inner


class BlockingSubscription(Generic[AS]):
    """Blocking view of an asyncio subscription of a :class:`Blocking` client."""

    def __init__(self, client: Blocking[Any], inner: AS) -> None:
        self._client = client
        self._inner = inner

    def __repr__(self) -> str:
        return repr(self._inner).replace(type(self._inner).__name__, type(self).__name__, 1)

    def start(self) -> Self:
        self._client._run(self._inner.start())
        return self

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _drain(self, take: Callable[[], Coroutine[Any, Any, list[T] | None]]) -> Iterator[T]:
        """What ``take`` gets, batch after batch, until the subscription closes (``take``
        answers None or nothing once closed); it unsubscribes when the loop ends."""
        self.start()
        try:
            while True:
                batch = self._client._run(take())
                if not batch:
                    if batch is None or self._inner.closed:
                        return
                    continue
                yield from batch
        finally:
            self.close()

    def close(self) -> None:
        if self._inner.closed or self._client._runner.stopped:
            return
        self._client._run(self._inner.close())

    closed = Inner[bool]()
    resubscribes = Inner[int]()
