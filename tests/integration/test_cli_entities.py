"""``headwater kind ...`` and ``headwater entity ...`` end to end (subprocesses)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from servers import AUTH_CONFIG, LOCAL, Server, free_port, serving

from headwater import entities
from headwater.errors import AuthenticationFailed

LISTEN = {"convergedb": LOCAL, "http": LOCAL}


@dataclass
class Reading:
    site: str
    temp: float
    count: entities.U32 = 0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(tmp_path_factory.mktemp("cli_entities"), listen=LISTEN)


@pytest.fixture
def name() -> str:
    return f"cli_{uuid.uuid4().hex[:10]}"


def addresses(server: Server) -> list[str]:
    return [
        *("--server", f"127.0.0.1:{server.ports['convergedb']}"),
        *("--http", f"127.0.0.1:{server.ports['http']}"),
    ]


def run(server: Server, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "headwater.cli.main", *args, *addresses(server)]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    return proc.stdout


def failed(proc: subprocess.CompletedProcess[str], status: int) -> str:
    assert proc.returncode == status, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    return proc.stderr


def test_kind_create_list_describe(server: Server, name: str, sdk_cli_env: dict[str, str]) -> None:
    env = sdk_cli_env
    created = ok(run(server, "kind", "create", name, "site:string", "temp:f64", env=env))
    assert created.strip().startswith(f"kind {name}: id ")
    assert created.strip().endswith("schema version 1, 2 fields")
    again = ok(run(server, "kind", "create", name, "site:string", "temp:f64", env=env))
    assert again == created  # identical: a no-op
    migrated = ok(run(server, "kind", "create", name, "site:string", "temp:f64", "n:u32", env=env))
    assert "schema version 2, 3 fields" in migrated
    conflict = failed(run(server, "kind", "create", name, "site:i64", env=env), 1)
    assert conflict.startswith("headwater: error: SchemaConflict: ")
    bad_type = failed(run(server, "kind", "create", name + "x", "a:float128", env=env), 2)
    assert "unknown field type 'float128'" in bad_type
    assert "at least one field" in failed(run(server, "kind", "create", name + "y", env=env), 2)
    reserved = failed(run(server, "kind", "create", "hw_" + name, "a:bool", env=env), 1)
    assert "ReservedName" in reserved

    listed = ok(run(server, "kind", "list", env=env))
    assert name in listed and "site:string, temp:f64, n:u32" in listed
    assert "convergedb_connections" not in listed
    rows = json.loads(ok(run(server, "kind", "list", "--json", "--all", env=env)))
    mine = next(r for r in rows if r["name"] == name)
    assert mine["schema_version"] == 2
    assert [f["type"] for f in mine["fields"]] == ["string", "f64", "u32"]
    assert any(r["name"] == "convergedb_connections" for r in rows)

    described = ok(run(server, "kind", "describe", name, env=env))
    for text in ("schema version", "site", "string", "temp", "f64", "u32"):
        assert text in described
    missing = failed(run(server, "kind", "describe", name + "_nope", env=env), 1)
    assert missing.strip() == f"headwater: error: KindNotFound: no entity kind '{name}_nope'"


def test_entity_get(server: Server, name: str, sdk_cli_env: dict[str, str]) -> None:
    with entities.connect(f"127.0.0.1:{server.ports['convergedb']}") as src:
        kind = src.create_kind(Reading, name)
        src.assert_(kind, "lab-1", Reading("lab", 21.5, 3))
    shown = ok(run(server, "entity", "get", name, "lab-1", env=sdk_cli_env))
    assert "21.5" in shown and "lab" in shown and "version " in shown
    doc = json.loads(ok(run(server, "entity", "get", name, "lab-1", "--json", env=sdk_cli_env)))
    assert doc["key"] == "lab-1" and doc["fields"] == {"site": "lab", "temp": 21.5, "count": 3}
    raw = "0x" + entities.entity_id("lab-1").hex()
    assert json.loads(ok(run(server, "entity", "get", name, raw, "--json", env=sdk_cli_env))) == doc
    missing = failed(run(server, "entity", "get", name, "nobody", env=sdk_cli_env), 1)
    assert "EntityNotFound" in missing and "nobody" in missing
    no_kind = failed(run(server, "entity", "get", name + "_x", "a", env=sdk_cli_env), 1)
    assert "KindNotFound" in no_kind


def test_entity_list(server: Server, name: str, sdk_cli_env: dict[str, str]) -> None:
    with entities.connect(f"127.0.0.1:{server.ports['convergedb']}") as src:
        kind = src.create_kind(Reading, name)
        for n in range(3):
            src.assert_(kind, f"lab-{n}", Reading("lab", 20.0 + n, n))
        src.flush()
        shown = ok(run(server, "entity", "list", name, env=sdk_cli_env))
        assert f"{name}: 3 of 3 entities" in shown
        for n in range(3):
            assert f"lab-{n}" in shown and f"2{n}.0" in shown
        lines = ok(run(server, "entity", "list", name, "--json", "--limit", "2", env=sdk_cli_env))
        docs = [json.loads(line) for line in lines.splitlines()]
        assert len(docs) == 2
        assert {d["key"] for d in docs} <= {"lab-0", "lab-1", "lab-2"}
        assert all(d["fields"]["site"] == "lab" for d in docs)
    missing = failed(run(server, "entity", "list", name + "_x", env=sdk_cli_env), 1)
    assert missing.strip() == f"headwater: error: KindNotFound: no entity kind '{name}_x'"
    too_many = failed(run(server, "entity", "list", name, "--limit", "10001", env=sdk_cli_env), 2)
    assert "at most 10000" in too_many


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _watch(server: Server, name: str, env: dict[str, str], *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "headwater.cli.main", "entity", "watch", name),
            *extra,
            *addresses(server),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        # A runner started in the background ignores SIGINT and Python keeps that: give
        # the command what a terminal user's shell gives it.
        preexec_fn=_default_sigint,
    )


def test_entity_watch_lines_and_ctrl_c(
    server: Server, name: str, sdk_cli_env: dict[str, str]
) -> None:
    with entities.connect(f"127.0.0.1:{server.ports['convergedb']}") as src:
        kind = src.create_kind(Reading, name)
        src.assert_(kind, "a", Reading("lab", 1.0))
        src.flush()
        proc = _watch(server, name, sdk_cli_env, "--format", "lines")
        try:
            assert proc.stdout is not None
            change, key, _, fields = proc.stdout.readline().decode().rstrip("\n").split("\t")
            assert (change, key) == ("bootstrap", "a")
            assert json.loads(fields) == {"site": "lab", "temp": 1.0, "count": 0}
            src.patch(kind, "a", count=5)
            src.flush()
            change, key, _, fields = proc.stdout.readline().decode().rstrip("\n").split("\t")
            assert (change, key, json.loads(fields)["count"]) == ("updated", "a", 5)
            src.retract(kind, "a")
            src.flush()
            assert proc.stdout.readline().decode().startswith("deleted\ta\t")
            proc.send_signal(signal.SIGINT)
            _, stderr = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, stderr.decode()
        assert b"Traceback" not in stderr and b"watching" in stderr


def test_entity_watch_live_table_and_ctrl_c(
    server: Server, name: str, sdk_cli_env: dict[str, str]
) -> None:
    with entities.connect(f"127.0.0.1:{server.ports['convergedb']}") as src:
        kind = src.create_kind(Reading, name)
        src.assert_(kind, "table-key", Reading("roof", 7.25))
        src.flush()
        proc = _watch(server, name, sdk_cli_env, "--format", "table")
        try:
            assert proc.stderr is not None
            assert b"watching" in proc.stderr.readline()  # subscribed
            src.assert_(kind, "second-key", Reading("cellar", 3.5))
            src.flush()
            proc.send_signal(signal.SIGINT)
            stdout, stderr = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, stderr.decode()
        assert b"Traceback" not in stderr
        text = stdout.decode()
        assert "table-key" in text and "roof" in text and "7.25" in text


def test_unreachable_server(sdk_cli_env: dict[str, str], name: str) -> None:
    port = free_port()
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "headwater.cli.main", "kind", "create", name, "a:bool"),
            *("--server", f"127.0.0.1:{port}"),
        ],
        capture_output=True,
        text=True,
        env=sdk_cli_env,
        timeout=60,
    )
    assert proc.returncode == 2 and "connection refused" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "headwater.cli.main", "kind", "list", "--http", f"127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        env=sdk_cli_env,
        timeout=60,
    )
    assert proc.returncode == 2 and "HTTP API" in proc.stderr


def test_token_is_required_and_passed_through(
    make_server: Any, name: str, sdk_cli_env: dict[str, str]
) -> None:
    srv = make_server(config=AUTH_CONFIG, listen=LISTEN)
    cdb = f"127.0.0.1:{srv.ports['convergedb']}"
    with pytest.raises(entities.AuthFailed):
        entities.connect(cdb)
    with pytest.raises(AuthenticationFailed, match="bearer token is required"):
        entities.list_kinds(f"127.0.0.1:{srv.ports['http']}")
    refused = failed(run(srv, "kind", "create", name, "a:bool", env=sdk_cli_env), 1)
    assert "AuthenticationFailed" in refused
    env = {**sdk_cli_env, "HEADWATER_TOKEN": "s3cret"}
    ok(run(srv, "kind", "create", name, "a:bool", env=env))
    assert name in ok(run(srv, "kind", "list", env=env))
    with entities.connect(cdb, token="s3cret") as src:
        kind = src.kind_from_schema(name, [("a", 1)])
        src.assert_(kind, "k", {"a": True})
    doc = json.loads(ok(run(srv, "entity", "get", name, "k", "--json", env=env)))
    assert doc["fields"] == {"a": True}
