"""One entity id form, JSON numbers and one set of error names on every surface (issue
21), against a real ``headwater serve``: the HTTP API, SQL, the SDKs and the CLI agree.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from servers import LOCAL, Server, serving

import headwater
from headwater import entities
from headwater.client.errors import http_api_error
from headwater.errors import KindNotFound, StreamNotFound, TableNotFound

LISTEN = {"http": LOCAL, "convergedb": LOCAL}


@dataclass
class Lab:
    site: str
    temp: float


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(tmp_path_factory.mktemp("surfaces"), listen=LISTEN)


@pytest.fixture
def name() -> str:
    return f"labs_{uuid.uuid4().hex[:8]}"


def call(server: Server, path: str, body: Any = None) -> tuple[int, Any, bytes]:
    """(status, parsed JSON, raw body) of a GET, or a POST when ``body`` is given."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://{server.address_of('http')}{path}",
        data=data,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw), raw
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        return exc.code, json.loads(raw), raw


def sql(server: Server, text: str) -> list[list[Any]]:
    status, body, _ = call(server, "/api/sql", {"sql": text})
    assert status == 200, body
    rows: list[list[Any]] = body["rows"]
    return rows


def cli(server: Server, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "headwater.cli.main", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


def test_http_and_sql_take_and_show_the_key_people_write(server: Server, name: str) -> None:
    long_key = "a key longer than thirty-two bytes, so its id is a SHA-256"
    with entities.connect(f"127.0.0.1:{server.ports['convergedb']}") as writer:
        kind = writer.create_kind(Lab, name)
        writer.assert_(kind, "lab-1", Lab("north", 21.5))
        writer.assert_(kind, long_key, Lab("south", 19.0))
        writer.flush()  # the writer stays connected: its entities live while it does

        lab_hex = entities.entity_id("lab-1").hex()
        status, by_key, _ = call(server, f"/api/kinds/{name}/entities/lab-1")
        assert status == 200, by_key
        assert by_key["key"] == "lab-1" and by_key["entity_id"] == lab_hex
        assert by_key["fields"] == {"site": "north", "temp": 21.5}
        # The hex id (what HTTP always took) and the CLI's 0x form reach the same entity.
        for ref in (lab_hex, "0x" + lab_hex, lab_hex.upper()):
            assert call(server, f"/api/kinds/{name}/entities/{ref}")[1] == by_key, ref

        long_hex = entities.entity_id(long_key).hex()
        page = call(server, f"/api/kinds/{name}/entities")[1]
        assert {e["key"]: e["entity_id"] for e in page["entities"]} == {
            "lab-1": lab_hex,
            "0x" + long_hex: long_hex,  # no short text key: shown as its id
        }
        quoted = urllib.request.quote(long_key)
        assert call(server, f"/api/kinds/{name}/entities/{quoted}")[1]["entity_id"] == long_hex

        status, missing, _ = call(server, f"/api/kinds/{name}/entities/lab-2")
        assert status == 404
        assert (missing["error"]["name"], missing["error"]["code"]) == ("EntityNotFound", 6)

        # SQL: the same key in entity_key, so WHERE entity_key = 'lab-1' finds it.
        assert sql(server, f"SELECT entity_id, site FROM {name} WHERE entity_key = 'lab-1'") == [
            [lab_hex, "north"]
        ]
        changes = sql(server, f"SELECT entity_key FROM hw_changes_{name} ORDER BY entity_key")
        assert sorted(r[0] for r in changes) == sorted(["lab-1", "0x" + long_hex])


def test_sql_numbers_are_json_numbers(server: Server) -> None:
    status, body, raw = call(
        server,
        "/api/sql",
        {
            "sql": "SELECT 1.5::DOUBLE, 0.1::FLOAT, 1.25::DECIMAL(10, 2), 42::INTEGER, "
            "9007199254740991::BIGINT, 9007199254740992::BIGINT, "
            "12345678901234567.89::DECIMAL(38, 2), 'nan'::DOUBLE, '-inf'::DOUBLE, "
            "NULL::DOUBLE, '1.5'"
        },
    )
    assert status == 200, body
    assert body["rows"] == [
        [
            1.5,
            0.1,
            1.25,
            42,
            9007199254740991,
            "9007199254740992",  # beyond 2^53 - 1: the exact digits, as text
            "12345678901234567.89",  # more digits than a double holds
            "NaN",
            "-Infinity",
            None,
            "1.5",  # a VARCHAR stays a string
        ]
    ]
    assert b"[1.5,0.1,1.25,42," in raw  # numbers in the JSON text, not quoted
    # An aggregate over a stream: a number too; and the server answers the next request.
    assert sql(server, "SELECT avg(x) FROM (VALUES (1), (2)) t(x)") == [[1.5]]


def test_error_names_are_one_set(server: Server, name: str, sdk_cli_env: dict[str, str]) -> None:
    """A missing stream and a missing kind have the same name in the HTTP JSON, the
    SDKs' exceptions and the CLI's message."""
    stream = f"nope_{name}"
    status, body, raw = call(server, f"/api/streams/{stream}")
    assert status == 404 and body["error"]["name"] == "StreamNotFound"
    with headwater.connect(server.address) as client, pytest.raises(StreamNotFound) as sdk:
        client.stream_info(stream)
    assert sdk.value.name == "StreamNotFound"
    shown = cli(server, sdk_cli_env, "stream", "describe", stream, "--server", server.address)
    assert shown.stderr.startswith("headwater: error: StreamNotFound: "), shown.stderr

    status, body, raw = call(server, f"/api/kinds/{name}")
    assert status == 404
    assert (body["error"]["name"], body["error"]["code"]) == ("KindNotFound", 6)
    from_http = http_api_error(status, raw, "/api/kinds")
    assert type(from_http) is KindNotFound and isinstance(from_http, TableNotFound)
    with (
        entities.connect(f"127.0.0.1:{server.ports['convergedb']}", read_only=True) as reader,
        pytest.raises(KindNotFound) as cdb,
    ):
        reader.get_kind(Lab, name)
    assert cdb.value.name == "KindNotFound" and cdb.value.wire_name == "KIND_NOT_FOUND"
    assert isinstance(cdb.value, entities.KindNotFound)
    http_address = ("--http", server.address_of("http"))
    cdb_address = ("--server", f"127.0.0.1:{server.ports['convergedb']}")
    shown = cli(server, sdk_cli_env, "kind", "describe", name, *http_address, *cdb_address)
    assert shown.stderr.startswith("headwater: error: KindNotFound: "), shown.stderr
    # None of it cost the server anything: it answers the next request.
    assert sql(server, "SELECT 1") == [[1]]
