"""Print every VWAP the pipeline writes to kind ``vwap``, as it lands (ConvergeDB): a
window's entity is created with the VWAP of its first trades and updated as more arrive.

python examples/vwap/watch_vwap.py
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from headwater import entities
from headwater.entities.errors import KindNotFound


@dataclass
class Vwap:
    """The kind as the pipeline's Spark sink creates it (columns after the key)."""

    symbol: str
    window_start_us: int
    vwap: float
    volume: int


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="127.0.0.1:7402", help="ConvergeDB listener")
    args = parser.parse_args(argv)
    with entities.connect(args.server, read_only=True) as reader:
        while True:
            try:
                kind = reader.get_kind(Vwap, "vwap")
                break
            except KindNotFound:  # the pipeline's first batch creates it
                time.sleep(1)
        for change in reader.subscribe(kind, include_previous=True):
            v, before = change.value, change.previous
            if v is None:
                continue
            was = "" if before is None else f" (was {before.vwap!r} over {before.volume})"
            line = f"{change.change:9s} {v.symbol} {v.window_start_us} {v.vwap!r} {v.volume}{was}"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
