#!/usr/bin/env python3
"""The ConvergeDB write path in one process, without sockets: server CPU per assert.

BATCH payloads of 1,000 ASSERTs (32-byte ids, 5 numeric fields, as kinds_bench) go
through the codec (``Batch.decode`` + ``from_wire``), the engine (``apply``, then one
``flush`` per 16 frames, fsync included) and the listener's encoder (every window framed
for ``--subscribers`` subscription streams). CPU time (``time.process_time``) per stage
and per assert; then rounds of updates over the same entities (creates vs updates), and
the memory the committed state takes per entity (RSS before / after).

    .venv/bin/python benchmarks/kinds_inproc_bench.py
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import struct
import tempfile
import time
from pathlib import Path

from headwater.engine.engine import Engine, EngineConfig
from headwater.engine.kinds import KindsConfig, KindsEngine
from headwater.protocols.convergedb import messages as m
from headwater.protocols.convergedb.fields import FieldType
from headwater.protocols.convergedb.notifications import encode_window
from headwater.protocols.convergedb.ops import from_wire

FIELDS = [
    ("batch", FieldType.U64),
    ("bid", FieldType.F64),
    ("ask", FieldType.F64),
    ("last", FieldType.F64),
    ("volume", FieldType.I64),
]
RECORD = struct.Struct("<QdddQ")


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024
    return 0


async def run(args: argparse.Namespace) -> None:
    gc.freeze()
    gc.set_threshold(50_000, 10, 10)  # as `headwater serve`
    root = Path(tempfile.mkdtemp(prefix="kinds-inproc-"))
    engine = await Engine.open(root, EngineConfig(maintenance_interval_ms=0))
    # One writer that never touches its source: no liveness deadline during the run.
    config = KindsConfig(
        coalesce_ms=60_000, hot_entities=args.hot_entities, default_liveness_ms=3_600_000
    )
    kinds = await KindsEngine.open(engine, config)
    tk = kinds.tenant(0)
    kind = await tk.create_kind("bench", FIELDS)
    source = tk.connect("writer")
    ids = [hashlib.blake2b(b"%d" % i, digest_size=32).digest() for i in range(args.keys)]
    subs = [tk.subscribe(kind.kind_id) for _ in range(args.subscribers)]
    before = rss()  # the payloads of round 0 are freed before it is read again
    for round_ in range(args.rounds):
        payloads = [
            m.Batch(
                [
                    m.Assert(
                        kind.kind_id, ids[n % args.keys], RECORD.pack(f, 1.0 + n % 97, 2, 3, n)
                    )
                    for n in range(start, start + 1000)
                ]
            ).encode()
            for f, start in enumerate(range(0, args.updates, 1000))
        ]
        spent = {"decode": 0.0, "apply": 0.0, "flush": 0.0, "frames": 0.0}
        for i, payload in enumerate(payloads):
            t0 = time.process_time()
            ops = from_wire(m.Batch.decode(payload).ops, tk.kind)
            t1 = time.process_time()
            source.apply(ops)
            spent["decode"] += t1 - t0
            spent["apply"] += time.process_time() - t1
            if (i + 1) % 16 == 0 or i == len(payloads) - 1:
                for sub in subs:
                    sub.waiting = True  # as the server's pump: waiting for the window
                t2 = time.process_time()
                await tk.flush()
                t3 = time.process_time()
                for sub in subs:
                    for window in sub.buffer:
                        # Stream 2 on every connection, as kinds_bench's subscribers (and
                        # any client numbering its streams from 1: CONNECT, then SUBSCRIBE).
                        encode_window(2, window, False)
                    sub.buffer.clear()
                    sub.buffered = 0
                spent["flush"] += t3 - t2
                spent["frames"] += time.process_time() - t3
        per = {k: v / args.updates * 1e6 for k, v in spent.items()}
        cells = ", ".join(f"{k} {v:.2f}" for k, v in per.items())
        print(f"round {round_}: us per assert: {cells}, total {sum(per.values()):.2f}")
        if args.gc_stats:  # does the process grow from round to round?
            collections = [s["collections"] for s in gc.get_stats()]
            print(
                f"  tracked objects {len(gc.get_objects()):,}, RSS {rss() >> 20} MiB, "
                f"GC collections by generation {collections}"
            )
        if round_ == 0:
            del payloads
            gc.collect()
            entities = tk.kind_state(kind.kind_id).count
            print(f"{entities} entities: {(rss() - before) / entities:.0f} bytes of RSS each")
    await kinds.close()
    await engine.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--updates", type=int, default=300_000, help="asserts per round")
    p.add_argument("--keys", type=int, default=100_000, help="distinct entities")
    p.add_argument("--subscribers", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3, help="round 0 creates, later ones update")
    p.add_argument(
        "--hot-entities",
        type=int,
        default=KindsConfig.hot_entities,
        help="entities kept in memory (the rest are read from the kind's store)",
    )
    p.add_argument("--gc-stats", action="store_true", help="print heap and GC figures per round")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
