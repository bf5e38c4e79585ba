"""Shared fixtures of the integration tests (the server process itself: servers.py).

``shared_server`` is one real ``headwater serve`` (Kimberlite only) for every test that
does not stop or restart it; ``make_server`` starts servers of a test's own.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from servers import Server, free_port, server_factory, serving


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for every SDK / CLI test that does not restart it."""
    yield from serving(tmp_path_factory.mktemp("shared_server"))


@pytest.fixture
def sdk_stream_name(request: pytest.FixtureRequest) -> str:
    """A fresh stream name for this test (valid: [A-Za-z0-9_], at most 256 chars)."""
    base = "".join(c if c.isalnum() else "_" for c in request.node.name)[:40]
    return f"t_{base}_{uuid.uuid4().hex[:8]}"


@pytest.fixture
def sdk_cli_env() -> dict[str, str]:
    """Environment for ``headwater`` subprocesses: wide tables, no colour."""
    env = dict(os.environ)
    env.update({"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"})
    env.pop("HEADWATER_SERVER", None)
    env.pop("HEADWATER_TOKEN", None)
    return env


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """Start servers of this test's own (stopped at teardown):
    ``make_server(port=0, config="", listen=None)``."""
    yield from server_factory(tmp_path)


@pytest.fixture
def unused_port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def jvm_stdout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the shared session's JVM writes its standard output (the console sink)."""
    return tmp_path_factory.mktemp("spark_jvm") / "stdout.log"


@pytest.fixture(scope="session")
def spark(jvm_stdout: Path) -> Iterator[Any]:
    """The one SparkSession of the run (tests/integration/spark and the cluster tests'
    Spark sink): pyspark keeps one JVM per process, and its standard output is fixed when
    it starts, so a second session made elsewhere first would send the console sink's
    output to pytest's capture instead of ``jvm_stdout``."""
    from pyspark.sql import SparkSession

    # Executors run this interpreter too, so they import the installed headwater.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    # The JVM inherits file descriptor 1 when it starts: a file of its own, which tests
    # read, instead of whatever pytest's capture held at that moment.
    saved = os.dup(1)
    log = os.open(jvm_stdout, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    try:
        session = (
            SparkSession.builder.master("local[2,2]")  # 2 cores, a failed task is tried twice
            .appName("headwater-tests")
            .config("spark.ui.enabled", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1")
            .config("spark.sql.session.timeZone", "UTC")
            .getOrCreate()
        )
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(log)
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()
