"""Result types of the SDK: events, reads, appends and query results."""

from __future__ import annotations

import datetime as _dt
import importlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from headwater.protocols.kimberlite.messages import EventBatch, QueryValue, Timestamp

_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)


class Event(NamedTuple):
    """One event of a stream: its offset and its bytes."""

    offset: int
    value: bytes

    @property
    def text(self) -> str:
        """The value decoded as UTF-8 (raises UnicodeDecodeError when it is not)."""
        return self.value.decode()


@dataclass(frozen=True, slots=True)
class ReadResult:
    """What one ``read`` returned.

    ``events`` are consecutive offsets from the read's ``from_offset``; ``next_offset`` is
    where the next read continues (the offset after the last event returned; with none,
    the first offset after a hole ``from_offset`` was in, or ``from_offset`` at the end);
    ``at_end`` is True when the read reached the end of the stream. Unpacks as
    ``events, next_offset = client.read(...)``.
    """

    events: list[Event]
    next_offset: int
    at_end: bool

    def __iter__(self) -> Iterator[Any]:
        return iter((self.events, self.next_offset))

    def __len__(self) -> int:
        return len(self.events)


@dataclass(frozen=True, slots=True)
class RawReadResult:
    """What one ``read_batch`` returned: ``events`` still in wire form, the first at
    ``first_offset``; ``next_offset`` and ``at_end`` as in :class:`ReadResult`."""

    first_offset: int
    events: EventBatch
    next_offset: int
    at_end: bool


@dataclass(frozen=True, slots=True)
class AppendResult:
    """What one ``append`` stored: ``first_offset`` and ``count`` (unpacks as a pair).

    An append larger than one request's limits is split; ``batches`` lists the
    ``(first_offset, count)`` of each request, in order. The batches are contiguous unless
    another producer appended to the stream between them.
    """

    first_offset: int
    count: int
    batches: list[tuple[int, int]] = field(default_factory=list)

    def __iter__(self) -> Iterator[int]:
        return iter((self.first_offset, self.count))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, tuple):
            return (self.first_offset, self.count) == other
        if isinstance(other, AppendResult):
            return (self.first_offset, self.count, self.batches) == (
                other.first_offset,
                other.count,
                other.batches,
            )
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    @property
    def last_offset(self) -> int:
        """The offset of the last event appended (the last batch's last offset)."""
        if not self.batches:
            return self.first_offset + self.count - 1
        first, count = self.batches[-1]
        return first + count - 1


def timestamp_to_datetime(value: Timestamp) -> _dt.datetime:
    """A Timestamp query value as an aware UTC datetime (microsecond precision)."""
    return _EPOCH + _dt.timedelta(microseconds=value.ns // 1000)


def datetime_to_timestamp(value: _dt.datetime) -> Timestamp:
    """An aware datetime (naive ones are taken as UTC) as a Timestamp query value."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=_dt.UTC)
    return Timestamp((value - _EPOCH) // _dt.timedelta(microseconds=1) * 1000)


class QueryResult:
    """The rows of a Query / QueryAt.

    ``columns`` are the column names; ``rows`` are tuples of ``None``, ``int``, ``str``,
    ``bool`` or :class:`~headwater.protocols.kimberlite.Timestamp` (SQL types the wire
    has no value for arrive as their canonical text). Iterating yields the rows.
    """

    __slots__ = ("columns", "rows")

    def __init__(self, columns: Sequence[str], rows: Sequence[Sequence[QueryValue]]) -> None:
        self.columns: list[str] = list(columns)
        self.rows: list[tuple[QueryValue, ...]] = [tuple(row) for row in rows]

    def __iter__(self) -> Iterator[tuple[QueryValue, ...]]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[QueryValue, ...]:
        return self.rows[index]

    def __repr__(self) -> str:
        return f"QueryResult(columns={self.columns!r}, rows={len(self.rows)})"

    def scalar(self) -> QueryValue:
        """The first column of the first row (None when there are no rows)."""
        return self.rows[0][0] if self.rows and self.rows[0] else None

    def as_dicts(self) -> list[dict[str, QueryValue]]:
        return [dict(zip(self.columns, row, strict=True)) for row in self.rows]

    def to_arrow(self) -> Any:
        """A ``pyarrow.Table``: BigInt -> int64, Text -> string, Boolean -> bool,
        Timestamp -> timestamp[ns]; a column of mixed kinds becomes strings."""
        try:
            pa = importlib.import_module("pyarrow")
        except ImportError:
            raise ImportError("QueryResult.to_arrow() needs pyarrow: pip install pyarrow") from None
        arrays = [
            _arrow_column(pa, [row[i] for row in self.rows]) for i in range(len(self.columns))
        ]
        return pa.Table.from_arrays(arrays, names=_unique_names(self.columns))

    def to_pandas(self) -> Any:
        """A ``pandas.DataFrame`` (through :meth:`to_arrow`); needs pandas installed."""
        try:
            importlib.import_module("pandas")
        except ImportError:
            raise ImportError(
                "QueryResult.to_pandas() needs pandas, which is not installed: "
                "pip install pandas (or use .to_arrow() / .rows)"
            ) from None
        return self.to_arrow().to_pandas()


def _unique_names(columns: Sequence[str]) -> list[str]:
    seen: dict[str, int] = {}
    names = []
    for name in columns:
        n = seen.get(name, 0)
        seen[name] = n + 1
        names.append(name if n == 0 else f"{name}_{n}")
    return names


def _arrow_column(pa: Any, values: list[QueryValue]) -> Any:
    kinds = {type(v) for v in values if v is not None}
    if not kinds:
        return pa.nulls(len(values))
    if kinds == {bool}:
        return pa.array(values, pa.bool_())
    if kinds == {int}:
        return pa.array(values, pa.int64())
    if kinds == {str}:
        return pa.array(values, pa.string())
    if kinds == {Timestamp}:
        return pa.array(
            [None if v is None else v.ns for v in values],  # type: ignore[union-attr]
            pa.timestamp("ns"),
        )
    return pa.array([None if v is None else _text(v) for v in values], pa.string())


def _text(value: QueryValue) -> str:
    if isinstance(value, Timestamp):
        return timestamp_to_datetime(value).isoformat()
    return str(value)
