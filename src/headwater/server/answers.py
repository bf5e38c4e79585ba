"""Read answers held for their peers, bounded (``[limits] read_answers_mib``).

A Kafka Fetch or a Kimberlite ReadEvents answer holds the stored batches it read (read
buffers, anonymous memory) until the peer has read it off the socket. A peer that
pipelines reads and reads nothing back made the server hold every answer at once: four
Fetches of a 300 MB topic took it to 1.4 GiB. So:

* on one connection, large answers are built one at a time, each once the peer has read
  the ones before it (the transport's buffer is below its high-water mark:
  ``pause_writing`` / ``resume_writing``), as Kafka reads nothing more from a channel
  whose answer is still being sent;
* all connections together hold at most ``read_answers_mib`` of them: an answer takes
  what it may need from the server's budget before it reads (less when less is left,
  so it reads less), and gives it back once it is out of the write buffer. With nothing
  left, a read waits for room (a Kafka Fetch no longer than its ``max_wait``: then it
  is answered with nothing, as when no record is there yet).

An answer may pass what it took by one stored batch: a read returns at least the batch
at its offset, whatever its size (Kafka's KIP-74).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class AnswerBudget:
    """The bytes of read answers the server holds at once, all connections together."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("an answer budget holds at least one byte")
        self.capacity = capacity
        self.held = 0
        self.closing = False  # the server is stopping: reads no longer wait for room
        self._room: asyncio.Event | None = None  # made in the loop, when first awaited

    def close(self) -> None:
        """The server is stopping: a read waiting for room goes on with what there is
        (its answer will not be read anyway), so the listeners' drain is not held."""
        self.closing = True
        if self._room is not None:
            self._room.set()

    def take(self, wanted: int) -> int:
        """Up to ``wanted`` bytes of what is left (0: nothing is)."""
        granted = max(min(wanted, self.capacity - self.held), 0)
        self.held += granted
        return granted

    def give_back(self, amount: int) -> None:
        self.held -= amount
        if amount and self._room is not None:
            self._room.set()

    async def take_within(self, wanted: int, wait_s: float | None = None) -> int:
        """Up to ``wanted`` bytes, waiting up to ``wait_s`` (None: as long as it takes)
        for some to be given back when none is left; 0 when none was within it."""
        granted = self.take(wanted)
        if granted or wanted <= 0 or self.closing:
            return granted
        loop = asyncio.get_running_loop()
        deadline = None if wait_s is None else loop.time() + wait_s
        while not granted:
            left = None if deadline is None else deadline - loop.time()
            if (left is not None and left <= 0) or self.closing:
                break
            await self.room(left)
            granted = self.take(wanted)
        return granted

    def hold(self, amount: int) -> None:
        """Count ``amount`` more bytes held, whether or not there is room: an answer
        that came out larger than what it took (the JSON it is sent as)."""
        self.held += amount

    async def room(self, timeout_s: float | None) -> None:
        """Return once some of the budget has been given back, or ``timeout_s`` has
        passed (the caller takes again: another may have taken it first)."""
        if self.held < self.capacity or self.closing:
            return
        if self._room is None:
            self._room = asyncio.Event()
        self._room.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._room.wait(), timeout_s)


class AnswerRoom:
    """One connection's share of the :class:`AnswerBudget`: its large answers one at a
    time, each once the peer has read the one before. The connection forwards its
    transport's ``pause_writing``, ``resume_writing`` and ``connection_lost``."""

    def __init__(self, budget: AnswerBudget) -> None:
        self._budget = budget
        self._turn = asyncio.Lock()
        self._writable = asyncio.Event()
        self._writable.set()
        self._held = 0  # taken by the answer last built, until it is out of the buffer
        self._turns = 0  # which answer ``_held`` is for
        self._lost = False

    def pause_writing(self) -> None:
        if not self._lost:
            self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()
        self._give_back()

    def lost(self) -> None:
        """The connection is gone (or the server stopping): what it held is free, and
        reads waiting for the peer go on (to find the connection closed), this one and
        those after it."""
        self._lost = True
        self._writable.set()
        self._give_back()

    @contextlib.asynccontextmanager
    async def turn(self, wanted: int, wait_s: float | None = None) -> AsyncIterator[int]:
        """This connection's turn to build an answer of up to ``wanted`` bytes: the
        bytes it may read (0: none became free within ``wait_s``). The answer is to be
        handed to the transport before the current task next waits."""
        async with self._turn:
            await self._writable.wait()  # the peer has read the answers before
            self._give_back()
            granted = await self._budget.take_within(wanted, wait_s)
            self._held = granted
            self._turns += 1
            try:
                yield granted
            finally:
                # Once the answer is written (after this task's step): if the transport
                # took it without pausing, it is out of the server's hands.
                asyncio.get_running_loop().call_soon(self._written, self._turns)

    def _written(self, turn: int) -> None:
        if turn == self._turns and self._writable.is_set():
            self._give_back()

    def _give_back(self) -> None:
        held, self._held = self._held, 0
        self._budget.give_back(held)
