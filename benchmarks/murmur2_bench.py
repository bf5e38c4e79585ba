#!/usr/bin/env python3
"""Kafka's murmur2 over a batch of keys: headwater's numpy batch hash
(``headwater.engine.partitioner.murmur2_spans`` over an Arrow binary column's buffers:
the Spark sink's ``murmur2_column``) against the numba kernel it replaced
(``headwater.sql.kernels.murmur2_column``, in a tree from before: ``--before-src``) and
against one Python call per key (aiokafka's murmur2, kafka-python's code; timed on
``--keys // 20`` keys and scaled).

Three sets of ``--keys`` keys: ``cust-<n>`` (6-11 bytes, what the Spark benchmarks
write), 16 random bytes each (one length: no sort), and random lengths 0-64. Each side
runs in its own process (numba's import and compile stay out of the other side),
processes alternating round by round; every side checks its hashes against the
numpy side's. Median seconds per set; Markdown on stdout.

    .venv/bin/python benchmarks/murmur2_bench.py --before-src /tmp/wt/src --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

SETS = ("cust-<n>", "16 random bytes", "0-64 random bytes")


def keys_of(name: str, count: int) -> pa.Array:
    rng = np.random.default_rng(7)
    if name == "cust-<n>":
        return pa.array([b"cust-%d" % n for n in rng.integers(0, 10**6, count)], pa.binary())
    if name == "16 random bytes":
        return pa.FixedSizeBinaryArray.from_buffers(
            pa.binary(16), count, [None, pa.py_buffer(rng.bytes(16 * count))]
        ).cast(pa.binary())
    lengths = rng.integers(0, 65, count)
    offsets = np.zeros(count + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    data = pa.py_buffer(rng.bytes(int(offsets[-1])))
    return pa.Array.from_buffers(pa.binary(), count, [None, pa.py_buffer(offsets), data])


def hasher(side: str) -> Any:
    if side == "numpy":
        from headwater.spark.streams import murmur2_column

        return murmur2_column
    if side == "numba":
        from headwater.sql.kernels import murmur2_column  # type: ignore[import-not-found]

        return murmur2_column
    from aiokafka.partitioner import murmur2

    def python_hash(items: pa.Array) -> np.ndarray:
        return np.array([murmur2(k) & 0xFFFFFFFF for k in items.to_pylist()], np.uint32)

    return python_hash


def worker(side: str, count: int) -> None:
    """One round of one side: seconds per set, and a digest of its hashes."""
    hash_keys = hasher(side)
    out = {}
    for name in SETS:
        items = keys_of(name, count)
        hash_keys(items.slice(0, 10))  # numba: load or compile the kernel, untimed
        started = time.perf_counter()
        hashes = np.asarray(hash_keys(items), np.uint32)
        out[name] = [time.perf_counter() - started, int(hashes.astype(np.uint64).sum())]
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=1_000_000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--before-src", type=Path, help="src of a tree with sql/kernels.py")
    p.add_argument("--worker", choices=("numpy", "numba", "python"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.keys)
        return
    here = Path(__file__).resolve().parents[1] / "src"
    sides = {"numpy": (here, args.keys), "python": (here, args.keys // 20)}
    if args.before_src:
        sides["numba"] = (args.before_src.resolve(), args.keys)
    runs: dict[str, dict[str, list[float]]] = {s: {n: [] for n in SETS} for s in sides}
    digests: dict[str, dict[str, int]] = {}
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for side, (src, count) in sides.items():
            env = {**os.environ, "PYTHONPATH": str(src)}
            command = [sys.executable, __file__, "--worker", side, "--keys", str(count)]
            done = subprocess.run(command, env=env, check=True, capture_output=True)
            result = json.loads(done.stdout)
            for name, (seconds, digest) in result.items():
                runs[side][name].append(seconds * args.keys / count)
                if count == args.keys:
                    digests.setdefault(name, {})[side] = digest
    load.append(os.getloadavg()[0])
    for name, by_side in digests.items():
        assert len(set(by_side.values())) == 1, f"{name}: the sides' hashes differ: {by_side}"
    print(f"{args.keys:,} keys, median of {args.rounds} rounds, ", end="")
    print(f"load {load[0]:.1f} -> {load[1]:.1f}\n")
    print("| keys | " + " | ".join(f"{s} keys/s" for s in sides) + " | numpy / numba |")
    print("|---|" + "--:|" * (len(sides) + 1))
    for name in SETS:
        rates = {s: args.keys / statistics.median(runs[s][name]) for s in sides}
        ratio = f"{rates['numpy'] / rates['numba']:.2f}" if "numba" in rates else "-"
        cells = " | ".join(f"{rates[s]:,.0f}" for s in sides)
        print(f"| {name} | {cells} | {ratio} |")


if __name__ == "__main__":
    main()
