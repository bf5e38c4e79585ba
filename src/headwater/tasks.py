"""Background tasks' ending, for every layer (storage's group committer to the cluster)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel the tasks (None: none there), then wait until each has ended: a service's
    stop returns only once its background work can no longer touch what it closes."""
    running = [task for task in tasks if task is not None]
    for task in running:
        task.cancel()
    for task in running:
        with contextlib.suppress(asyncio.CancelledError):
            await task
