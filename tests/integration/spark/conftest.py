"""One SparkSession for every Spark test (it takes seconds to start), and servers with the
HTTP API on, as ``headwater serve`` has by default: stream reads take its Arrow path (the
Kimberlite fallback is held to the same results in tests/integration/test_range_reads.py)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark import cloudpickle
from pyspark.sql import SparkSession
from servers import LOCAL, Server, server_factory, serving

import waiting

HTTP_ON = {"http": LOCAL}

# UDFs of the tests wait with waiting.wait_until in Spark's Python workers, where tests/
# is not importable: the module travels with them, by value.
cloudpickle.register_pickle_by_value(waiting)


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server (Kimberlite and HTTP) for every Spark test that does not restart it."""
    yield from serving(tmp_path_factory.mktemp("spark_server"), listen=HTTP_ON)


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """Servers of this test's own, the HTTP API on unless ``listen`` says otherwise."""
    yield from server_factory(tmp_path, HTTP_ON)


@pytest.fixture(scope="session")
def jvm_stdout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the shared session's JVM writes its standard output (the console sink)."""
    return tmp_path_factory.mktemp("spark_jvm") / "stdout.log"


@pytest.fixture(scope="session")
def spark(jvm_stdout: Path) -> Iterator[Any]:
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
