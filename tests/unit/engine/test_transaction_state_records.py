"""The transaction state stream's records name a transaction's partitions by stream
name (a stream's id is each node's own in a cluster), and records written before names
were stored (ids only) are still replayed and recovered."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from headwater.engine.engine import Engine, EngineConfig
from headwater.engine.transactions import TXN_STATE_STREAM, TenantTransactions, TxnState

CONFIG = EngineConfig(maintenance_interval_ms=0)


async def state_records(engine: Engine) -> list[dict[str, object]]:
    stream = engine.stream_by_name(0, TXN_STATE_STREAM, internal=True)
    result = await engine.read(0, stream.stream_id, 0, 1 << 20, internal=True)
    return [json.loads(e.value) for e in result.events()]


def test_partitions_are_stored_by_name_and_id_only_records_still_recover(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        try:
            orders = (await engine.create_stream(0, "orders")).stream_id
            txns = await TenantTransactions.open(engine, 0)
            producer = await txns.init_producer("t1")
            await txns.append("t1", producer, orders, 0, [b"open"])
            written = (await state_records(engine))[-1]["txn"]
            assert isinstance(written, dict)
            assert written["partition_names"] == [["orders", 0]]
            # As an older version wrote it: ids only (the open transaction's record).
            del written["partition_names"]
            state = engine.stream_by_name(0, TXN_STATE_STREAM, internal=True)
            record = {"next_producer_id": producer.producer_id + 1, "txn": written}
            await engine.append(
                0, state.stream_id, [json.dumps(record).encode()], keys=[b"t1"], internal=True
            )
        finally:
            await engine.close()

        engine = await Engine.open(tmp_path, CONFIG)
        try:
            # Replayed as Ongoing and aborted by the recovery (which stores it again,
            # now with names): nothing of it is read.
            txns = await TenantTransactions.open(engine, 0)
            assert txns.state("t1") == TxnState.COMPLETE_ABORT
            assert txns.recovered == 1
            read = await engine.read(0, orders, 0, 1 << 20, isolation="read_committed")
            assert [e.value for e in read.events()] == []
            last = (await state_records(engine))[-1]["txn"]
            assert isinstance(last, dict) and last["state"] == "CompleteAbort"
        finally:
            await engine.close()

    asyncio.run(main())
