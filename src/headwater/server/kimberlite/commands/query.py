"""Query and QueryAt through the SQL service (DuckDB, in worker threads)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from headwater.protocols.kimberlite import messages as m
from headwater.sql import values as sqlv

if TYPE_CHECKING:
    from headwater.server.kimberlite.listener import KimberliteConnection


def _params(params: Sequence[m.QueryParam]) -> list[object]:
    return [sqlv.Timestamp(p.ns) if isinstance(p, m.Timestamp) else p for p in params]


def _rows(rows: list[list[sqlv.QueryValue]]) -> list[list[m.QueryValue]]:
    return [
        [m.Timestamp(v.ns) if isinstance(v, sqlv.Timestamp) else v for v in row] for row in rows
    ]


async def query(
    conn: KimberliteConnection, request: m.Request, payload: m.QueryRequest
) -> m.ResponsePayload:
    result = await conn.api.query(request.tenant_id, payload.sql, _params(payload.params))
    return m.QueryResponse(result.columns, _rows(result.rows))


async def query_at(
    conn: KimberliteConnection, request: m.Request, payload: m.QueryAtRequest
) -> m.ResponsePayload:
    result = await conn.api.query_at(
        request.tenant_id, payload.sql, _params(payload.params), payload.position
    )
    return m.QueryAtResponse(result.columns, _rows(result.rows))
