"""The one DuckDB database the SQL layer uses, locked down.

The database is in memory and empty: tables are Arrow data registered per query on a
short-lived cursor (connection), so they are read-only by construction and one tenant's
cursor never sees another tenant's tables. External access (files, network, extension
installs) and Python replacement scans (reading Python variables by name) are off, and
the configuration is locked so a query cannot turn them back on. DuckDB's memory is
capped (``memory_limit``); what does not fit spills to a temp directory the server names
(inside its data directory, bounded by ``max_temp_directory_size``), or nowhere when none
is given.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import duckdb

SAFE_CONFIG: dict[str, str | bool | int | float | list[str]] = {
    "enable_external_access": False,
    "python_enable_replacements": False,
    "temp_directory": "",
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "lock_configuration": True,
}


class Database:
    """A locked-down in-memory DuckDB database handing out one cursor per use."""

    def __init__(
        self,
        *,
        threads: int | None = None,
        memory_limit: str | None = None,
        spill_directory: Path | None = None,
        spill_limit: str | None = None,
    ) -> None:
        config = dict(SAFE_CONFIG)
        if threads is not None:
            config["threads"] = threads
        if memory_limit is not None:
            config["memory_limit"] = memory_limit
        if spill_directory is not None:
            config["temp_directory"] = str(spill_directory)
            if spill_limit is not None:
                config["max_temp_directory_size"] = spill_limit
        self._conn = duckdb.connect(":memory:", config=config)
        self._lock = threading.Lock()
        self._active: set[duckdb.DuckDBPyConnection] = set()
        self.closed = False

    def new_cursor(self) -> duckdb.DuckDBPyConnection:
        """A new connection to the database; the caller closes it (see :meth:`release`)."""
        with self._lock:
            if self.closed:
                raise RuntimeError("database is closed")
            cur = self._conn.cursor()
            self._active.add(cur)
            return cur

    def release(self, cur: duckdb.DuckDBPyConnection) -> None:
        with self._lock:
            self._active.discard(cur)
        with suppress(duckdb.Error):
            cur.close()

    @contextmanager
    def cursor(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A fresh connection to the database, closed afterwards (one thread at a time)."""
        cur = self.new_cursor()
        try:
            yield cur
        finally:
            self.release(cur)

    def interrupt_all(self) -> None:
        with self._lock:
            active = list(self._active)
        for cur in active:
            with suppress(duckdb.Error):
                cur.interrupt()

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self.interrupt_all()
        self._conn.close()
