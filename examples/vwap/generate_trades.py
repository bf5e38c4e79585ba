"""Append synthetic trades to stream ``raw_trades`` (the VWAP example's input).

Trade i: symbol SYM0000..SYM0099 in turn, a price on the 0.1 grid of 100.0..110.0, a
size of 1..13, an event time 1 ms after the previous trade (from a whole minute), a
venue. The same count always gives the same trades.

    python examples/vwap/generate_trades.py --count 300000
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import headwater
from headwater.errors import StreamAlreadyExists

START_NS = 1_700_000_040_000_000_000  # 2023-11-14 22:14:00 UTC, a whole minute
SYMBOLS = 100
CHUNK = 5_000  # trades per append


def trade(i: int) -> dict[str, Any]:
    return {
        "symbol": f"SYM{i % SYMBOLS:04d}",
        "price": round(100.0 + (i * 37 % 101) / 10, 1),
        "size": 1 + i * 7 % 13,
        "timestamp_ns": START_NS + i * 1_000_000,
        "venue": ("XNAS", "XNYS", "BATS")[i % 3],
    }


def trades(count: int, first: int = 0) -> Iterator[dict[str, Any]]:
    return (trade(i) for i in range(first, first + count))


def append(server: str, stream: str, count: int, first: int = 0) -> None:
    with headwater.connect(server) as hw:
        with contextlib.suppress(StreamAlreadyExists):  # extending an existing tape
            hw.create_stream(stream)
        for start in range(first, first + count, CHUNK):
            n = min(CHUNK, first + count - start)
            hw.append(stream, [json.dumps(t).encode() for t in trades(n, start)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="127.0.0.1:7401", help="Kimberlite listener")
    parser.add_argument("--stream", default="raw_trades")
    parser.add_argument("--count", type=int, default=300_000, help="trades to append")
    parser.add_argument("--first", type=int, default=0, help="index of the first trade")
    args = parser.parse_args(argv)
    append(args.server, args.stream, args.count, args.first)
    print(f"appended trades {args.first}..{args.first + args.count - 1} to {args.stream}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
