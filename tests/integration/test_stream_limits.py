"""Stream metadata under concurrency and crashes, the data directory lock, the stream
quota (``[limits] max_streams_per_tenant``) and the bound on open segment files
(``[limits] open_files``), each against a real server process."""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic
from servers import LOCAL, Server, stop_cleanly
from test_rivven_server import Rivven

import headwater
from headwater.client import AsyncClient
from headwater.errors import InvalidRequest, StreamAlreadyExists
from headwater.protocols.rivven import rivven_pb2 as pb
from headwater.protocols.rivven.messages import ErrorCode as RivvenErrorCode

CREATORS = 16
OWN_NAMES = 3  # names only one creator asks for
SHARED_NAMES = 4  # names every creator races for two of


def check_cli(data_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "headwater.cli.main", "check", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )


# Generous: a server answering thousands of requests shares two cores with other tests.
TIMEOUT = 120


async def connect(server: Server, tenant_id: int = 0) -> AsyncClient:
    return await headwater.connect_async(server.address, tenant=tenant_id, timeout=TIMEOUT)


async def stream_names(server: Server, tenant_id: int = 0) -> dict[str, int]:
    async with await connect(server, tenant_id) as client:
        return {info.name: info.stream_id for info in await client.list_streams()}


async def race_creates(server: Server, label: str) -> dict[str, list[int | str]]:
    """16 creators, each on a connection of its own, all at once: each asks for names
    of its own and for two of the shared names. What each attempt of each name got: a
    stream id or the name of the error."""
    outcomes: dict[str, list[int | str]] = {}
    clients = [await connect(server) for _ in range(CREATORS)]
    start = asyncio.Event()

    async def attempt(client: AsyncClient, name: str) -> None:
        await start.wait()
        try:
            outcome: int | str = await client.create_stream(name)
        except StreamAlreadyExists:
            outcome = "StreamAlreadyExists"
        outcomes.setdefault(name, []).append(outcome)

    attempts = []
    for i, client in enumerate(clients):
        names = [f"{label}_own_{i}_{j}" for j in range(OWN_NAMES)]
        names += [f"{label}_shared_{k % SHARED_NAMES}" for k in (i, i + 1)]
        attempts += [attempt(client, name) for name in names]
    try:
        gathered = asyncio.gather(*attempts)
        start.set()
        await gathered
    finally:
        for client in clients:
            await client.close()
    return outcomes


def created(outcomes: dict[str, list[int | str]]) -> dict[str, int]:
    """Each name created exactly once, every other attempt StreamAlreadyExists; the
    names and their ids."""
    names: dict[str, int] = {}
    for name, results in outcomes.items():
        ids = [r for r in results if isinstance(r, int)]
        assert len(ids) == 1, f"{name}: {results}"
        assert results.count("StreamAlreadyExists") == len(results) - 1, f"{name}: {results}"
        names[name] = ids[0]
    return names


def test_sixteen_concurrent_creators_get_each_name_once_and_keep_it_over_restarts(
    tmp_path: Path,
) -> None:
    server = Server(tmp_path / "race").start()
    try:
        first = created(asyncio.run(race_creates(server, "a")))
        assert len(first) == CREATORS * OWN_NAMES + SHARED_NAMES
        assert len(set(first.values())) == len(first), "two names share a stream id"
        assert asyncio.run(stream_names(server)) == first

        server.restart()  # SIGTERM
        assert asyncio.run(stream_names(server)) == first

        second = created(asyncio.run(race_creates(server, "b")))
        server.kill()  # every create above was answered: each must be there, no more
        server.start()
        assert asyncio.run(stream_names(server)) == {**first, **second}
        stop_cleanly(server, clean_log=True)
        result = check_cli(server.data_dir)
        assert result.returncode == 0, result.stdout + result.stderr
    finally:
        server.kill()


def test_check_names_damaged_metadata_and_the_server_refuses_what_it_cannot_parse(
    tmp_path: Path,
) -> None:
    server = Server(tmp_path / "damaged").start()
    try:
        ids = {name: asyncio.run(_create(server, name)) for name in ("orders", "trades")}
        stop_cleanly(server)
        assert check_cli(server.data_dir).returncode == 0
        streams = server.data_dir / "tenants" / "0" / "streams"
        # What the old create race left: a second directory holding a taken name.
        twin = streams / "9"
        shutil.copytree(streams / str(ids["orders"]), twin)
        meta = json.loads((twin / "stream.json").read_text())
        (twin / "stream.json").write_text(json.dumps({**meta, "id": 9}))
        (streams / "12" / "partition-0").mkdir(parents=True)  # data without stream.json
        result = check_cli(server.data_dir)
        assert result.returncode == 1, result.stdout
        assert f"streams {ids['orders']}, 9 share the name 'orders'" in result.stdout
        assert "tenants/0/streams/12: stream directory without stream.json" in result.stdout
        assert "2 metadata problems" in result.stdout

        server.start()  # serves on: the older stream keeps the name, the twin is unlisted
        assert asyncio.run(stream_names(server)) == ids
        assert "both named 'orders'" in server.log_text()
        stop_cleanly(server)

        (server.data_dir / "tenants" / "0" / "tenant.json").write_text('{"id": 0, "na')
        result = check_cli(server.data_dir)
        assert result.returncode == 1
        assert "tenants/0/tenant.json: unparsable" in result.stdout
        with pytest.raises(AssertionError, match="exited with 1 during start-up"):
            server.start()
        assert "tenant.json cannot be read" in server.log_text()
        assert "Traceback" not in server.log_text()
    finally:
        server.kill()


def test_a_second_server_on_the_same_data_dir_is_refused(tmp_path: Path) -> None:
    server = Server(tmp_path / "first").start()
    try:
        asyncio.run(_create(server, "before"))
        config = tmp_path / "second.toml"
        config.write_text('[listen]\nkimberlite = "127.0.0.1:0"\nhttp = ""\n')
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "headwater.cli.main",
                "serve",
                "--data-dir",
                str(server.data_dir),
                "--config",
                str(config),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 1, second.stdout + second.stderr
        assert f"in use by another headwater process (pid {server.pid})" in second.stderr
        assert "Traceback" not in second.stderr
        # The first one serves on, with its data untouched.
        asyncio.run(_create(server, "after"))
        assert set(asyncio.run(stream_names(server))) == {"before", "after"}
        server.kill()  # a crash leaves no stale lock: the kernel drops it with the process
        server.start()
        assert set(asyncio.run(stream_names(server))) == {"before", "after"}
        stop_cleanly(server)
    finally:
        server.kill()


async def _create(server: Server, name: str, tenant_id: int = 0) -> int:
    async with await connect(server, tenant_id) as client:
        return await client.create_stream(name)


QUOTA = 5
QUOTA_CONFIG = f"""
[[tenants]]
id = 1
name = "other"
[limits]
max_streams_per_tenant = {QUOTA}
"""


def _http(server: Server, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"http://{server.address_of('http')}{path}",
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    return status, json.loads(text) if text.startswith(("{", "[")) else text


def _refusals(server: Server, listener: str) -> float:
    _, text = _http(server, "GET", "/metrics")
    prefix = (
        f'headwater_limit_refusals_total{{limit="max_streams_per_tenant",listener="{listener}"}}'
    )
    for line in str(text).splitlines():
        if line.startswith(prefix):
            return float(line.split()[-1])
    return 0.0


def test_streams_past_the_tenant_quota_are_refused_and_counted(tmp_path: Path) -> None:
    server = Server(tmp_path / "quota", config=QUOTA_CONFIG, listen={"http": LOCAL}).start()
    try:

        async def fill() -> list[int | str]:
            async with await connect(server) as client:
                await client.create_stream("first")
                await client.create_stream("second")

                async def one(name: str) -> int | str:
                    try:
                        return await client.create_stream(name)
                    except InvalidRequest as exc:
                        return str(exc)

                # Eight at once against three free places: creates under way count.
                return list(await asyncio.gather(*(one(f"race_{i}") for i in range(8))))

        results = asyncio.run(fill())
        refused = [r for r in results if isinstance(r, str)]
        assert len(refused) == 8 - (QUOTA - 2), results
        assert all("max_streams_per_tenant" in r for r in refused), refused
        assert len(asyncio.run(stream_names(server))) == QUOTA
        assert _refusals(server, "kimberlite") == len(refused)

        status, body = _http(server, "POST", "/api/streams", {"name": "over_http"})
        assert status == 400, body
        assert body["error"]["code"] == 2
        assert "max_streams_per_tenant" in body["error"]["message"]
        assert _refusals(server, "http") == 1

        # Another tenant's quota is its own; a delete makes room again; the count
        # survives a restart.
        asyncio.run(_create(server, "elsewhere", tenant_id=1))

        async def swap() -> None:
            async with await connect(server) as client:
                await client.delete_stream("first")
                await client.create_stream("replacement")
                with pytest.raises(InvalidRequest, match="max_streams_per_tenant"):
                    await client.create_stream("one_too_many")

        asyncio.run(swap())
        server.restart()
        assert len(asyncio.run(stream_names(server))) == QUOTA
        with pytest.raises(InvalidRequest, match="max_streams_per_tenant"):
            asyncio.run(_create(server, "still_too_many"))
        stop_cleanly(server, clean_log=True)
    finally:
        server.kill()


# ---- open files ------------------------------------------------------------------------

FD_LIMIT = 1024
MANY_STREAMS = 3_000
OPEN_FILES = 512  # the default of [limits] open_files


def _limit_open_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


SEGMENT_FILE = re.compile(r"/\d{20}\.log$")  # not the server's own server.log


def _open_fds(pid: int) -> tuple[int, int]:
    """(every descriptor, segment .log files) the process holds open now."""
    fd_dir = Path(f"/proc/{pid}/fd")
    targets = []
    for entry in fd_dir.iterdir():
        try:
            targets.append(os.readlink(entry))
        except FileNotFoundError:  # closed while we looked
            continue
    return len(targets), sum(bool(SEGMENT_FILE.search(t)) for t in targets)


async def _many(server: Server, names: list[str], create: bool, fd_peaks: list[int]) -> None:
    """Create (optionally), append one event to and read back every stream, over a few
    connections at once, sampling the server's descriptors as it goes."""
    clients = [await connect(server) for _ in range(4)]
    try:
        for start in range(0, len(names), 200):
            chunk = names[start : start + 200]
            if create:
                await asyncio.gather(
                    *(clients[i % 4].create_stream(n) for i, n in enumerate(chunk))
                )
            await asyncio.gather(
                *(clients[i % 4].append(n, [n.encode()]) for i, n in enumerate(chunk))
            )
            reads = await asyncio.gather(*(clients[i % 4].read(n, 0) for i, n in enumerate(chunk)))
            for name, (events, _) in zip(chunk, reads, strict=True):
                assert [e.value for e in events][-1] == name.encode()
            fd_peaks.append(_open_fds(server.pid)[0])
    finally:
        for client in clients:
            await client.close()


@pytest.mark.slow
def test_thousands_of_streams_under_ulimit_1024(tmp_path: Path) -> None:
    server = Server(
        tmp_path / "fds", config='[storage]\nsync = "none"\n', preexec_fn=_limit_open_files
    ).start()
    try:
        names = [f"s{i}" for i in range(MANY_STREAMS)]
        fd_peaks: list[int] = []
        asyncio.run(_many(server, names, True, fd_peaks))
        _, logs = _open_fds(server.pid)
        assert OPEN_FILES // 2 < logs <= OPEN_FILES, logs  # the bound is what holds it
        server.restart()  # recovers 3,000 logs within the same limit
        asyncio.run(_many(server, names, False, fd_peaks))
        _, logs = _open_fds(server.pid)
        assert OPEN_FILES // 2 < logs <= OPEN_FILES, logs  # the bound is what holds it
        assert max(fd_peaks) < FD_LIMIT, fd_peaks
        assert len(asyncio.run(stream_names(server))) == MANY_STREAMS

        async def every_stream_holds_two_events() -> None:
            async with await connect(server) as client:
                for name in names[:: MANY_STREAMS // 50]:
                    events, _ = await client.read(name, 0)
                    assert [e.value for e in events] == [name.encode()] * 2

        asyncio.run(every_stream_holds_two_events())
        stop_cleanly(server, clean_log=True)
    finally:
        server.kill()


def test_stream_quota_through_kafka_create_topics_and_rivven_create_topic(
    tmp_path: Path,
) -> None:
    """The same limit through the Kafka and Rivven front ends: a tenant at its quota is
    refused CreateTopics (POLICY_VIOLATION, the message naming the limit) and Rivven's
    CreateTopic (INVALID_REQUEST, so named), each counted for its listener, and nothing
    is created; a delete makes room for Kafka's create again."""
    listen = {"http": LOCAL, "kafka": LOCAL, "rivven": LOCAL}
    server = Server(tmp_path / "quota_wire", config=QUOTA_CONFIG, listen=listen).start()
    try:
        for index in range(QUOTA):
            asyncio.run(_create(server, f"full_{index}"))
        admin = AdminClient({"bootstrap.servers": server.address_of("kafka")})
        futures = admin.create_topics([NewTopic("kafka_over", num_partitions=1)])
        with pytest.raises(KafkaException) as refused:
            futures["kafka_over"].result(30)
        error = refused.value.args[0]
        assert error.code() == KafkaError.POLICY_VIOLATION, error
        assert "max_streams_per_tenant" in error.str(), error
        assert _refusals(server, "kafka") == 1

        with Rivven(server.ports["rivven"]) as rivven:
            answer = rivven.error(pb.CreateTopicRequest(name="rivven_over", partitions=1))
        assert answer.code == RivvenErrorCode.INVALID_REQUEST, answer
        assert "max_streams_per_tenant" in answer.message, answer
        assert _refusals(server, "rivven") == 1

        names = asyncio.run(stream_names(server))
        assert sorted(names) == sorted(f"full_{index}" for index in range(QUOTA))

        async def make_room() -> None:
            async with await connect(server) as client:
                await client.delete_stream("full_0")

        asyncio.run(make_room())
        futures = admin.create_topics([NewTopic("kafka_fits", num_partitions=1)])
        futures["kafka_fits"].result(30)
        assert "kafka_fits" in asyncio.run(stream_names(server))
        stop_cleanly(server, clean_log=True)
    finally:
        server.kill()
