"""Child process for the crash tests: append in a loop, print every acknowledged append.

Usage::

    python crash_writer.py DATA_DIR MODE RUN SEED [MAX_SECONDS]

MODE is ``plain`` (a stream with the delete policy), ``kafka`` (the same appends as
Kafka record batches stored in Kafka form, each codec in turn, as the Kafka listener
stores a Produce) or ``compact`` (a compacted stream with keys from a small key space,
plus a task that runs compaction over and over, so a kill often lands in the middle of
one). RUN numbers the restarts of one test so each
run's values differ; SEED makes every value reproducible.

Output on stdout, one flushed line each:

* ``READY <stream_id> <end_offset>`` once the engine has recovered the data directory;
* ``ACK <first_offset> <count> <run> <seq>`` once an append is acknowledged (fsynced
  under the default policy): batch ``seq`` of run ``run``, whose exact values, keys and
  tombstone flags :func:`batch_spec` rebuilds;
* ``COMPACTING`` / ``COMPACTED <events_removed>`` around each maintenance pass;
* ``DONE`` after a clean close once MAX_SECONDS have passed without a kill.

Every value carries its own identity (run, seq, index, length) and a digest, so the
parent can check any served event, acknowledged or not, byte for byte.

The test imports this file for :func:`batch_spec` and :func:`parse_value`.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import struct
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

SEGMENT_BYTES = 64 << 10
MAX_BATCH_VALUE_BYTES = 40 << 10  # keeps every batch well under one segment
APPENDERS = 3
KEY_SPACE = 24
STREAM_NAMES = {"plain": "events", "kafka": "produced", "compact": "table"}

MAGIC = b"HWCR"
IDENT = struct.Struct("<4sIIII")  # magic, run, seq, index, payload length
DIGEST_BYTES = 8


@dataclass(frozen=True)
class BatchSpec:
    values: tuple[bytes, ...]
    keys: tuple[bytes, ...] | None
    tombstones: tuple[bool, ...] | None


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


def make_value(run: int, seq: int, index: int, payload: bytes) -> bytes:
    head = IDENT.pack(MAGIC, run, seq, index, len(payload)) + payload
    return head + _digest(head)


def parse_value(value: bytes) -> tuple[int, int, int]:
    """(run, seq, index) of a value this writer made; ValueError if it is not one."""
    if len(value) < IDENT.size + DIGEST_BYTES:
        raise ValueError(f"value of {len(value)} bytes is too short")
    magic, run, seq, index, length = IDENT.unpack_from(value)
    if magic != MAGIC or len(value) != IDENT.size + length + DIGEST_BYTES:
        raise ValueError("not a crash-writer value")
    if _digest(value[:-DIGEST_BYTES]) != value[-DIGEST_BYTES:]:
        raise ValueError("value digest mismatch")
    return run, seq, index


def _value_size(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.55:
        return rng.randrange(0, 64)
    if r < 0.88:
        return rng.randrange(64, 2048)
    if r < 0.97:
        return rng.randrange(2048, 8192)
    return rng.randrange(8192, 24_000)


@lru_cache(maxsize=4096)
def batch_spec(seed: int, mode: str, run: int, seq: int) -> BatchSpec:
    """The exact batch that run ``run`` appends as its ``seq``-th append."""
    rng = random.Random(f"{seed}/{mode}/{run}/{seq}")
    count = rng.choice((1, 1, 1, 2, 3, 4, 6, 8, 16, 32))
    values: list[bytes] = []
    total = 0
    for index in range(count):
        size = _value_size(rng)
        if values and total + size > MAX_BATCH_VALUE_BYTES:
            break
        total += size
        values.append(make_value(run, seq, index, rng.randbytes(size)))
    if mode != "compact":
        return BatchSpec(tuple(values), None, None)
    keys: list[bytes] = []
    tombstones: list[bool] = []
    for index in range(len(values)):
        # Mostly a small key space (compaction removes a lot); sometimes a key used
        # exactly once, which compaction must never remove.
        if rng.random() < 0.1:
            keys.append(b"once-%d-%d-%d" % (run, seq, index))
        else:
            keys.append(b"key-%02d" % rng.randrange(KEY_SPACE))
        tombstones.append(rng.random() < 0.05)
    return BatchSpec(tuple(values), tuple(keys), tuple(tombstones))


def emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def run_writer(data_dir: Path, mode: str, run: int, seed: int, max_seconds: float) -> None:
    from headwater.engine.engine import Engine, EngineConfig, StreamSettings
    from headwater.errors import StreamNotFound

    engine = await Engine.open(data_dir, EngineConfig(maintenance_interval_ms=0))
    name = STREAM_NAMES[mode]
    try:
        stream = engine.stream_by_name(0, name)
    except StreamNotFound:
        settings = StreamSettings(
            segment_bytes=SEGMENT_BYTES,
            cleanup_policy="compact" if mode == "compact" else "delete",
        )
        info = await engine.create_stream(0, name, settings)
        stream = engine.stream(0, info.stream_id)
    emit(f"READY {stream.stream_id} {stream.log.end_offset}")

    next_seq = 0
    deadline = time.monotonic() + max_seconds
    rng = random.Random(f"{seed}/{mode}/{run}/maintenance")

    async def appender() -> None:
        nonlocal next_seq
        while time.monotonic() < deadline:
            seq = next_seq
            next_seq += 1
            spec = batch_spec(seed, mode, run, seq)
            if mode == "kafka":
                info = await append_kafka(engine, stream.stream_id, spec.values, seq)
            else:
                info = await engine.append(
                    0, stream.stream_id, spec.values, keys=spec.keys, tombstones=spec.tombstones
                )
            emit(f"ACK {info.base_offset} {info.count} {run} {seq}")

    async def maintenance() -> None:
        while time.monotonic() < deadline:
            emit("COMPACTING")
            result = await engine.run_maintenance()
            emit(f"COMPACTED {result['events_compacted']}")
            # Paced on purpose: a random pause between passes, so the parent's SIGKILLs
            # land before, inside and after compactions alike.
            await asyncio.sleep(rng.uniform(0, 0.02))

    tasks = [appender() for _ in range(APPENDERS)]
    if mode == "compact":
        tasks.append(maintenance())
    try:
        await asyncio.gather(*tasks)
    finally:
        await engine.close()
    emit("DONE")


async def append_kafka(engine: Any, stream_id: int, values: tuple[bytes, ...], seq: int) -> Any:
    """``values`` as one Kafka record batch (codec by ``seq``), stored in Kafka form."""
    from headwater.protocols.kafka.records import Compression, Record, build_batch
    from headwater.storage.kafka_batch import PREFIX_SIZE, check_section

    records = [Record(i, i, None, value) for i, value in enumerate(values)]
    now = int(time.time() * 1000)
    section = build_batch(records, base_timestamp=now, compression=Compression(seq % 5))[
        PREFIX_SIZE:
    ]
    header = check_section(section, 1 << 20)
    return await engine.append_encoded(
        0,
        stream_id,
        section,
        len(values),
        value_bytes=len(section),
        timestamp_ms=header.max_timestamp,
        kafka=True,
    )


def main(argv: list[str]) -> int:
    if len(argv) not in (5, 6):
        print(__doc__, file=sys.stderr)
        return 2
    data_dir, mode, run, seed = Path(argv[1]), argv[2], int(argv[3]), int(argv[4])
    max_seconds = float(argv[5]) if len(argv) == 6 else 60.0
    if mode not in STREAM_NAMES:
        print(f"unknown mode {mode!r}", file=sys.stderr)
        return 2
    asyncio.run(run_writer(data_dir, mode, run, seed, max_seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
