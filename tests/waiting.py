"""Waiting for something to happen, instead of sleeping and hoping it did.

Every test that waits on a condition it cannot await directly polls it through
:func:`wait_until` (threads, processes, files, a server seen from outside) or
:func:`wait_until_async` (inside an event loop): the condition is checked at once and
then every ``interval`` seconds until it holds or ``timeout`` passes, which fails the
test with ``message``. The value returned is the predicate's own (truthy) value, so a
predicate can hand back what it found.

Tests that show something did *not* happen do not wait here: they wait for a later
event that would have come after it (a marker), see the tests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

TIMEOUT = 15.0  # generous: the machine is shared; a bound, never a measurement
INTERVAL = 0.01


def wait_until(
    predicate: Callable[[], T],
    timeout: float = TIMEOUT,
    message: str | Callable[[], str] = "the condition never held",
    *,
    interval: float = INTERVAL,
) -> T:
    """``predicate()`` once it is truthy; AssertionError(``message``) after ``timeout``.

    ``message`` may be a callable, evaluated only on failure (e.g. to read a log)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            raise AssertionError(f"after {timeout:g}s: {text} (last: {value!r})")
        # The one sleep of the polling helpers: the pace of a poll, not a guess at how
        # long something takes.
        time.sleep(interval)


async def wait_until_async(
    predicate: Callable[[], T | Awaitable[T]],
    timeout: float = TIMEOUT,
    message: str | Callable[[], str] = "the condition never held",
    *,
    interval: float = INTERVAL,
) -> T:
    """:func:`wait_until` inside an event loop (the predicate may be a coroutine
    function); other tasks run between polls."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if loop.time() >= deadline:
            text = message() if callable(message) else message
            raise AssertionError(f"after {timeout:g}s: {text} (last: {value!r})")
        await asyncio.sleep(interval)  # the async twin's poll pace (see wait_until)


async def scheduled_callbacks_run() -> None:
    """Return once every callback the loop had scheduled to run soon has run (a task
    just made has taken its first step, a ``call_soon`` callback has been called): a
    future of its own is resolved by a callback queued after them, and the loop runs
    its ready callbacks in order."""
    loop = asyncio.get_running_loop()
    ran: asyncio.Future[None] = loop.create_future()
    loop.call_soon(ran.set_result, None)
    await ran
