#!/usr/bin/env python3
"""value_spans over values of different sizes (pages of JSON events) against a plain
loop over the length fields, alternated in one process; median of 7.

    .venv/bin/python benchmarks/value_spans_bench.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import struct
import timeit

from headwater.storage.batch import encode_values, value_spans

_U64_AT = struct.Struct("<Q").unpack_from


def loop_spans(section: bytes, count: int) -> list[int]:
    """The reference: one checked step per value."""
    end, bounds, pos = len(section), [0], 0
    for _ in range(count):
        if pos + 8 > end:
            raise ValueError("truncated")
        pos += 8 + _U64_AT(section, pos)[0]
        if pos > end:
            raise ValueError("overrun")
        bounds.append(pos)
    if pos != end:
        raise ValueError("trailing bytes")
    return bounds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--values", type=int, default=100_000)
    args = p.parse_args()
    values = [os.urandom(60 + i % 31) for i in range(args.values)]
    section = encode_values(values)
    assert value_spans(section, len(values)) == loop_spans(section, len(values))
    loop, spans = [], []
    for _ in range(7):
        loop.append(timeit.timeit(lambda: loop_spans(section, len(values)), number=5))
        spans.append(timeit.timeit(lambda: value_spans(section, len(values)), number=5))
    per = 5 * len(values) / 1e9
    a, b = statistics.median(loop) / per, statistics.median(spans) / per
    print(f"loop {a:.0f} ns/value, value_spans {b:.0f} ns/value, ratio {b / a:.2f}")


if __name__ == "__main__":
    main()
