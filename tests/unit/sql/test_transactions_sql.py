"""SQL over transactional writes: only committed transactions are projected, an open
one holds the view at its first event, and QueryAt answers a position the same way
before and after a commit (or refuses while it could still change)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlkit import CONFIG, running

from headwater.engine.transactions import TenantTransactions
from headwater.errors import ProjectionLag


def test_sql_sees_committed_transactions_only(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path, CONFIG, read_timeout=5) as (engine, sql):
            s = (await engine.create_stream(0, "s")).stream_id
            txns = await TenantTransactions.open(engine, 0)
            kept = await txns.init_producer("kept")
            dropped = await txns.init_producer("dropped")
            await engine.append(0, s, [b'"p0"'])
            before_txn = engine.tenant(0).committed_position
            first = await txns.append("kept", kept, s, 0, [b'"t1"'])
            await txns.append("dropped", dropped, s, 0, [b'"a2"'])
            await engine.append(0, s, [b'"p3"'])
            head = engine.tenant(0).committed_position

            async def rows(at: int | None = None) -> list[str]:
                query = 'SELECT data FROM s ORDER BY "offset"'
                result = await (
                    sql.query(0, query) if at is None else sql.query_at(0, query, [], at)
                )
                return [bytes.fromhex(str(r[0])).decode() for r in result.rows]  # data is hex

            # Open transactions: the view stops at the first one's first event.
            assert await rows() == ['"p0"']
            assert await rows(before_txn) == ['"p0"']
            # Everything below the transaction's first event is answered (the
            # coordinator's own record of the transaction lies between).
            assert await rows(first.first_position) == ['"p0"']
            with pytest.raises(ProjectionLag):
                await rows(head)  # could still change: refused, not answered wrongly
            await txns.end_transaction("dropped", dropped, commit=False)
            await txns.end_transaction("kept", kept, commit=True)
            assert await rows() == ['"p0"', '"t1"', '"p3"']
            assert await rows(head) == ['"p0"', '"t1"', '"p3"']
            assert await rows(before_txn) == ['"p0"']
            # Spark's range reads come from the same projection.
            batches = await sql.stream_range(0, "s", 0, 1 << 20)
            assert sum(b.num_rows for b in batches) == 3

    asyncio.run(main())
