"""Many items sent as few requests, within what one request of a protocol may carry."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def batches(
    items: Sequence[T],
    size: Callable[[T], int],
    max_count: int,
    max_bytes: int,
    *,
    too_large: Callable[[int, int], Exception] | None = None,
) -> list[list[T]]:
    """``items`` split, in order, into runs of at most ``max_count`` items and
    ``max_bytes`` bytes (each item's ``size``). An item over ``max_bytes`` raises
    ``too_large(index, size)`` when that is given, else it makes a run of its own."""
    runs: list[list[T]] = []
    current: list[T] = []
    total = 0
    for index, item in enumerate(items):
        n = size(item)
        if n > max_bytes and too_large is not None:
            raise too_large(index, n)
        if current and (len(current) >= max_count or total + n > max_bytes):
            runs.append(current)
            current, total = [], 0
        current.append(item)
        total += n
    if current:
        runs.append(current)
    return runs
