"""Shared fixtures of the integration tests.

SDK and CLI tests (``test_sdk_*``, ``test_cli_*``) use the ``sdk_``-prefixed fixtures: a
real ``headwater serve`` process with only the Kimberlite listener on.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sdk_server import SdkServer, running, sdk_free_port, server_factory


@pytest.fixture(scope="session")
def sdk_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SdkServer]:
    """One server for every SDK / CLI test that does not restart it."""
    yield from running(tmp_path_factory.mktemp("sdk_server"))


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
def sdk_make_server(tmp_path: Path) -> Iterator[Callable[..., SdkServer]]:
    """Start servers of this test's own (stopped at teardown): ``make(port=0)``."""
    yield from server_factory(tmp_path)


@pytest.fixture
def sdk_unused_port() -> int:
    return sdk_free_port()
