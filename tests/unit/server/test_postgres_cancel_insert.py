"""A CancelRequest that reaches an INSERT once its append has started (in process: a
real postgres listener on a loopback port and psycopg, the append held by a hook so
the cancel arrives at that moment for certain). The row is stored whatever the client
is told, so it is told the truth, ``INSERT 0 1``, as PostgreSQL never reports a
committed INSERT as cancelled: a client that retried a "cancelled" INSERT stored it
twice. A cancel during the evaluation still cancels (test_postgres_server.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import psycopg
import pytest

from headwater.server.app import Server
from headwater.server.config import ServerConfig
from headwater.server.postgres import listener
from headwater.server.postgres.listener import start_postgres

LISTEN = {"http": "", "kimberlite": "", "convergedb": "", "ripple": "", "postgres": "127.0.0.1:0"}
WAIT_S = 15.0  # a bound, never a pace


def test_a_cancel_during_the_append_answers_the_insert(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        server = Server(tmp_path, ServerConfig(listen=LISTEN), None, {"postgres": start_postgres})
        await server.start()
        conn: psycopg.AsyncConnection[Any] | None = None
        try:
            await server.api.create_stream(0, "audit")
            engine = server.api._queries.engine
            appending, release = asyncio.Event(), asyncio.Event()
            append = engine.append

            async def held(*args: Any, **kwargs: Any) -> Any:
                info = await append(*args, **kwargs)  # stored ...
                appending.set()
                await release.wait()  # ... its answer held until the cancel is in
                return info

            monkeypatch.setattr(engine, "append", held)
            cancel = listener.PostgresConnection._cancel
            cancelled = asyncio.Event()
            statement_was_running: list[bool] = []

            def cancel_and_note(self: listener.PostgresConnection, event: Any) -> None:
                cancel(self, event)
                backend = self.state.backends.get(event.process_id)
                statement_was_running.append(backend is not None and backend.running is not None)
                cancelled.set()

            monkeypatch.setattr(listener.PostgresConnection, "_cancel", cancel_and_note)

            port = server.listeners[0].port
            conn = await psycopg.AsyncConnection.connect(
                f"host=127.0.0.1 port={port} user=me dbname=0 sslmode=disable", autocommit=True
            )
            insert = asyncio.ensure_future(conn.execute("INSERT INTO audit (data) VALUES ('once')"))
            await asyncio.wait_for(appending.wait(), WAIT_S)
            await conn.cancel_safe(timeout=WAIT_S)
            await asyncio.wait_for(cancelled.wait(), WAIT_S)
            assert statement_was_running == [True]  # the cancel reached the running INSERT
            release.set()
            cursor = await asyncio.wait_for(insert, WAIT_S)
            assert (cursor.statusmessage, cursor.rowcount) == ("INSERT 0 1", 1)
            counted = await conn.execute("SELECT count(*) FROM audit")
            assert await counted.fetchone() == (1,)
        finally:
            if conn is not None:
                await conn.close()
            await server.stop()

    asyncio.run(main())
