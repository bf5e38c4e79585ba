"""A kind source that is away keeps its name and liveness deadline over server restarts
(kinds/sources.json): the dashboard's sources table (GET /api/sources) showed it as
"(unnamed)" after a restart, and gave it the default 30 s deadline."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from servers import LOCAL, Server, serving

from headwater import entities

WEEK_MS = 7 * 24 * 3600 * 1000
HOUR_MS = 3600 * 1000


@dataclass
class Sensor:
    site: str
    temp: float


@pytest.fixture
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("source_names"), listen={"convergedb": LOCAL, "http": LOCAL}
    )


def sources(server: Server) -> dict[int, dict[str, Any]]:
    """GET /api/sources, what the dashboard's sources table shows, by slot."""
    url = f"http://127.0.0.1:{server.ports['http']}/api/sources"
    with urllib.request.urlopen(url, timeout=30) as answer:
        return {s["source_id"]: s for s in json.loads(answer.read())["sources"]}


def test_sources_keep_their_names_and_deadlines_over_restarts(server: Server) -> None:
    address = f"127.0.0.1:{server.ports['convergedb']}"
    # "ingest" writes and leaves before the restart (its presence entity is gone then);
    # "live" is still connected when the server stops.
    with entities.connect(address, name="ingest", source_id=1, liveness_ms=WEEK_MS) as src:
        kind = src.create_kind(Sensor, "sensor")
        src.assert_(kind, "lab-1", Sensor("lab", 21.5))
        src.flush()
    live = entities.connect(address, name="live", source_id=2, liveness_ms=HOUR_MS)
    live.assert_(live.create_kind(Sensor, "sensor"), "lab-2", Sensor("lab", 19.0))
    live.flush()
    try:
        server.restart()
    finally:
        live.close()
    for round_ in ("after a restart", "after a second restart"):
        shown = sources(server)
        assert shown[1]["name"] == "ingest", (round_, shown)
        assert shown[1]["liveness_deadline_ms"] == WEEK_MS, round_
        assert shown[2]["name"] == "live", (round_, shown)
        assert shown[2]["liveness_deadline_ms"] == HOUR_MS, round_
        assert not shown[1]["connected"] and not shown[2]["connected"]
        assert shown[1]["entities"] == 1 and shown[2]["entities"] == 1
        server.restart()
    # The same slot taken under another name: the new name is what is kept.
    with entities.connect(address, name="ingest-v2", source_id=1, liveness_ms=WEEK_MS) as src:
        src.flush()
        assert sources(server)[1]["name"] == "ingest-v2"
    server.restart()
    assert sources(server)[1]["name"] == "ingest-v2"
