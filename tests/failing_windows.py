"""A tenant's kind windows made to fail, for the tests of what a front end tells its
writers when a write is lost."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from headwater.engine.kinds import TenantKinds, Window
from headwater.errors import StorageError


class FailingWrites:
    """The tenant's window writes: refused with a StorageError while ``failing``, each
    refusal held until ``release`` is set when ``hold`` is; ``refused`` is set once one
    is under way."""

    def __init__(self, tk: TenantKinds, monkeypatch: pytest.MonkeyPatch) -> None:
        self.real: Callable[[Window], Awaitable[int]] = tk.window_writer.write
        self.failing = False
        self.hold = False
        self.refused = asyncio.Event()
        self.release = asyncio.Event()
        monkeypatch.setattr(tk.window_writer, "write", self.write)

    async def write(self, window: Window) -> int:
        if not self.failing:
            return await self.real(window)
        self.refused.set()
        if self.hold:
            await self.release.wait()
        raise StorageError("write failed: no space left")


def durable_awaited(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """An event set once anyone waits for a window to be durable."""
    awaited = asyncio.Event()
    durable = Window.durable

    async def watched(window: Window) -> None:
        awaited.set()
        await durable(window)

    monkeypatch.setattr(Window, "durable", watched)
    return awaited
