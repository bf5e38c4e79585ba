"""Shared fixtures of the integration tests (the server process itself: servers.py).

``shared_server`` is one real ``headwater serve`` (Kimberlite only) for every test that
does not stop or restart it; ``make_server`` starts servers of a test's own.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

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
