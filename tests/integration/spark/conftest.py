"""One SparkSession for every Spark test (it takes seconds to start), and servers with the
HTTP API on, as ``headwater serve`` has by default: stream reads take its Arrow path (the
Kimberlite fallback is held to the same results in tests/integration/test_range_reads.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pyspark import cloudpickle
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
