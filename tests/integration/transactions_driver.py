"""The writer the SIGKILL transaction test kills: an engine in this process running one
transaction after another over six partitions of two streams, each transaction one
event ``<k>`` per partition, two committed then one aborted, saying on stdout when it
starts and finishes ending each (``ending <k> commit|abort``, ``ended <k>``).

Run as ``python transactions_driver.py <data dir> <first k>``; it never stops by
itself."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from headwater.engine.engine import Engine, EngineConfig, StreamSettings
from headwater.engine.transactions import TenantTransactions
from headwater.errors import StreamAlreadyExists

STREAMS = {"out": 4, "audit": 2}
TARGETS = [(name, p) for name, count in STREAMS.items() for p in range(count)]


def commits(k: int) -> bool:
    return k % 3 != 2


async def drive(data_dir: Path, first: int) -> None:
    engine = await Engine.open(data_dir, EngineConfig(maintenance_interval_ms=0))
    ids = {}
    for name, count in STREAMS.items():
        try:
            info = await engine.create_stream(0, name, StreamSettings(partitions=count))
            ids[name] = info.stream_id
        except StreamAlreadyExists:
            ids[name] = engine.stream_by_name(0, name).stream_id
    txns = await TenantTransactions.open(engine, 0)
    producer = await txns.init_producer("driver")
    sequences = dict.fromkeys(TARGETS, 0)
    k = first
    while True:
        await asyncio.gather(
            *(
                txns.append(
                    "driver",
                    producer,
                    ids[name],
                    sequences[(name, p)],
                    [str(k).encode()],
                    partition=p,
                )
                for name, p in TARGETS
            )
        )
        for target in TARGETS:
            sequences[target] += 1
        print(f"ending {k} {'commit' if commits(k) else 'abort'}", flush=True)
        await txns.end_transaction("driver", producer, commits(k))
        print(f"ended {k}", flush=True)
        k += 1


if __name__ == "__main__":
    asyncio.run(drive(Path(sys.argv[1]), int(sys.argv[2])))
