"""The CLI's operator tools against a real server (subprocesses): --version, info, ping,
stream create with settings, --format json, consumer groups, profiles, uncut tables, and
append with keys and headers."""

from __future__ import annotations

import base64
import json
import stat
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer as KafkaProducer
from servers import LOCAL, Server, serving

import headwater
from headwater.protocols.kimberlite import (
    AppendEventsResponse,
    AppendRecordsRequest,
    ErrorCode,
    ErrorResponse,
    EventBatch,
)
from headwater.storage.log import PartitionLog
from waiting import wait_until


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("cli_tools"),
        listen={"http": LOCAL, "rivven": LOCAL, "kafka": LOCAL},
    )


@pytest.fixture
def env(sdk_cli_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """No terminal, no $COLUMNS (tables must come out uncut), profiles of the test's own."""
    env = dict(sdk_cli_env)
    env.pop("COLUMNS")
    for name in ("HEADWATER_PROFILE", "HEADWATER_PROFILES", "HEADWATER_TENANT", "HEADWATER_TLS"):
        env.pop(name, None)
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")
    return env


def cli(
    *args: str, env: dict[str, str], stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "headwater.cli.main", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, input=stdin, timeout=60)


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    return proc.stdout


def failed(proc: subprocess.CompletedProcess[str], status: int) -> str:
    """The one stderr line of a command that failed with ``status``."""
    assert proc.returncode == status, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 or status == 2, proc.stderr  # argparse prints usage first
    return lines[-1]


def test_version(env: dict[str, str]) -> None:
    assert ok(cli("--version", env=env)).strip() == f"headwater {headwater.__version__}"


def test_info_and_ping(server: Server, env: dict[str, str]) -> None:
    shown = ok(cli("info", "--server", server.address, env=env))
    assert f"headwater {headwater.__version__}" in shown
    assert f"kimberlite 127.0.0.1:{server.port}" in shown
    assert f"http 127.0.0.1:{server.ports['http']}" in shown
    info = json.loads(ok(cli("info", "--json", "--server", server.address, env=env)))
    assert info["version"] == headwater.__version__
    assert info["listeners"] == {
        "kimberlite": server.port,
        "http": server.ports["http"],
        "rivven": server.ports["rivven"],
        "kafka": server.ports["kafka"],
    }
    assert info["uptime_seconds"] > 0

    pinged = ok(cli("ping", "-c", "3", "--server", server.address, env=env)).splitlines()
    assert pinged[0].startswith(f"connected to 127.0.0.1:{server.port} in ")
    assert [line.split(" time=")[0] for line in pinged[1:4]] == [
        f"reply from 127.0.0.1:{server.port}: seq={n}" for n in range(3)
    ]
    assert pinged[4].startswith("3 round trips: min ")


def test_unreachable_and_no_http_api(
    server: Server,
    shared_server: Server,
    env: dict[str, str],
    unused_port: int,
    sdk_stream_name: str,
) -> None:
    down = failed(cli("ping", "--server", f"127.0.0.1:{unused_port}", env=env), 2)
    assert down.startswith("headwater: error: ") and f"127.0.0.1:{unused_port}" in down
    # The shared server has no HTTP listener: a command that needs it says so.
    no_http = failed(cli("info", "--server", shared_server.address, env=env), 2)
    assert "does not advertise an HTTP API" in no_http and "[listen] http" in no_http
    # A keyed append cannot learn the partition count there: partition 0 (Kimberlite),
    # with a warning.
    with headwater.connect(shared_server.address) as hw:
        hw.create_stream(sdk_stream_name)
    at = ("--server", shared_server.address)
    keyed = cli("append", sdk_stream_name, "--key", "k", *at, env=env, stdin="v\n")
    assert ok(keyed).strip() == f"appended 1 event to {sdk_stream_name}: offsets 0..0"
    assert keyed.stderr.strip() == (
        f"headwater: warning: the server at {shared_server.address} does not advertise an "
        "HTTP API (http:<port>); keyed events go to partition 0 over Kimberlite"
    )
    ok(cli("ping", "-c", "1", "--server", server.address, env=env))  # still serving


def test_stream_create_with_settings(
    server: Server, env: dict[str, str], sdk_stream_name: str
) -> None:
    name = sdk_stream_name
    created = ok(
        cli(
            *("stream", "create", name, "--server", server.address),
            *("--retention-ms", "3600000", "--sync", "interval:50"),
            *("--cleanup-policy", "compact", "--segment-bytes", "1048576"),
            *("--compression", "zstd"),
            env=env,
        )
    )
    assert created.strip().startswith(f"created stream {name} (id ")
    assert "cleanup_policy=compact" in created and "retention_ms=3600000" in created
    described = ok(cli("stream", "describe", name, "--server", server.address, env=env))
    assert (
        "cleanup_policy=compact, compression=zstd, retention_ms=3600000, "
        "segment_bytes=1048576, sync=interval:50" in described
    )
    again = failed(
        cli("stream", "create", name, "--retention-ms", "5", "--server", server.address, env=env),
        1,
    )
    assert again.startswith("headwater: error: StreamAlreadyExists")
    bad = failed(cli("stream", "create", "x", "--sync", "sometimes", env=env), 2)
    assert "expected fsync, none or interval:<ms>, not 'sometimes'" in bad
    zero = failed(cli("stream", "create", "x", "--retention-ms", "0", env=env), 2)
    assert "--retention-ms: must be from 1 to 2**63-1" in zero
    # The refused creates changed nothing: the first stream is as it was, x does not exist.
    with headwater.connect(server.address) as hw:
        assert [s.name for s in hw.list_streams() if s.name in (name, "x")] == [name]


def test_read_and_sql_as_json(server: Server, env: dict[str, str], sdk_stream_name: str) -> None:
    name = sdk_stream_name
    with headwater.connect(server.address) as hw:
        hw.create_stream(name)
        hw.append(name, [b'{"px": 1}', b"plain", b"\xff\x00"])
    lines = ok(cli("read", name, "--format", "json", "--server", server.address, env=env))
    assert [json.loads(line) for line in lines.splitlines()] == [
        {"offset": 0, "value": '{"px": 1}'},
        {"offset": 1, "value": "plain"},
        {"offset": 2, "value": None, "value_b64": "/wA="},
    ]
    sql = f'SELECT "offset" FROM {name} ORDER BY 1'
    rows = ok(cli("sql", sql, "--format", "json-array", "--server", server.address, env=env))
    assert json.loads(rows) == [{"offset": 0}, {"offset": 1}, {"offset": 2}]
    per_line = ok(cli("sql", sql, "--format", "json", "--server", server.address, env=env))
    assert [json.loads(line) for line in per_line.splitlines()] == json.loads(rows)
    bad = failed(cli("read", name, "--format", "xml", env=env), 2)
    assert "invalid choice: 'xml'" in bad


def test_tables_are_not_cut_off_a_terminal(
    server: Server, env: dict[str, str], sdk_stream_name: str
) -> None:
    long_name = (sdk_stream_name + "_" + "x" * 120)[:150]
    with headwater.connect(server.address) as hw:
        hw.create_stream(long_name)
    listed = ok(cli("stream", "list", "--server", server.address, env=env))
    assert long_name in listed  # whole, on one line, though far past 80 columns
    assert any(len(line) > 150 for line in listed.splitlines())


def _group_at(server: Server, stream: str, group: str, consumed: int) -> None:
    """Leave ``group`` of ``stream`` with ``consumed`` events acknowledged or more."""
    with (
        headwater.connect(server.address) as hw,
        hw.subscribe(stream, 0, credits=2, group=group) as sub,
    ):
        events = iter(sub)  # ending a for loop would end the subscription
        for _ in range(consumed + 2):  # the grants after these acknowledge `consumed`
            next(events)


def test_consumer_groups(server: Server, env: dict[str, str], sdk_stream_name: str) -> None:
    stream, group = sdk_stream_name, f"billing_{sdk_stream_name[-8:]}"
    with headwater.connect(server.address) as hw:
        hw.create_stream(stream)
        hw.append(stream, [f"{i}".encode() for i in range(20)])
    _group_at(server, stream, group, 10)

    def listed() -> list[dict[str, Any]]:
        out = ok(
            cli("group", "list", "--stream", stream, "--json", "--server", server.address, env=env)
        )
        groups: list[dict[str, Any]] = json.loads(out)
        return [g for g in groups if not g["active"]]

    (entry,) = wait_until(listed, message="the group never went idle")
    assert entry["group"] == group and entry["end_offset"] == 20
    assert entry["committed_offset"] >= 10 and entry["lag"] == 20 - entry["committed_offset"]
    table = ok(cli("group", "list", "--server", server.address, env=env))
    assert group in table and "committed offset" in table
    described = ok(cli("group", "describe", group, "--server", server.address, env=env))
    assert stream in described and f"total lag {entry['lag']:,}" in described

    for flag, offset in (("--to-earliest", 0), ("--to-latest", 20)):
        moved = ok(
            cli(
                *("group", "reset-offsets", group, "--stream", stream, flag),
                *("--server", server.address),
                env=env,
            )
        )
        assert moved.strip().startswith(
            f"consumer group {group} of {stream} now at offset {offset}"
        )
    ok(
        cli(
            "group",
            "reset-offsets",
            group,
            "--stream",
            stream,
            "--to-offset",
            "7",
            "--server",
            server.address,
            env=env,
        )
    )
    with (
        headwater.connect(server.address) as hw,
        hw.subscribe(stream, "resume", credits=100, group=group) as sub,
    ):
        assert next(iter(sub)).offset == 7  # the group's next consumer resumes there

    past = failed(
        cli(
            *("group", "reset-offsets", group, "--stream", stream, "--to-offset", "999"),
            *("--server", server.address),
            env=env,
        ),
        1,
    )
    assert past.startswith("headwater: error: InvalidOffset: offset 999 is outside")
    unknown = failed(cli("group", "describe", "nobody", "--server", server.address, env=env), 1)
    assert unknown == "headwater: error: GroupNotFound: tenant 0 has no consumer group 'nobody'"
    both = failed(
        cli(
            "group",
            "reset-offsets",
            group,
            "--stream",
            stream,
            "--to-earliest",
            "--to-latest",
            env=env,
        ),
        2,
    )
    assert "not allowed with argument" in both
    # The refused resets moved nothing.
    after = json.loads(
        ok(cli("group", "describe", group, "--json", "--server", server.address, env=env))
    )
    assert after[0]["committed_offset"] >= 7


def test_profiles(
    server: Server, env: dict[str, str], tmp_path: Path, sdk_stream_name: str, unused_port: int
) -> None:
    added = ok(
        cli("profile", "add", "local", "--server", server.address, "--token", "t0k", env=env)
    )
    path = tmp_path / "config" / "headwater" / "profiles.toml"
    assert added.strip() == f"saved profile local in {path}"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    listed = ok(cli("profile", "list", env=env))
    assert "local" in listed and server.address in listed and "t0k" not in listed
    again = failed(cli("profile", "add", "local", "--server", "h:1", env=env), 1)
    assert again == "headwater: error: profile 'local' exists (--replace to overwrite it)"

    # The profile is used by name ...
    ok(cli("stream", "create", sdk_stream_name, "--profile", "local", env=env))
    # ... and loses to the environment, which loses to the flag.
    down = f"127.0.0.1:{unused_port}"
    via_env = failed(cli("ping", "--profile", "local", env={**env, "HEADWATER_SERVER": down}), 2)
    assert down in via_env
    ok(
        cli(
            *("ping", "-c", "1", "--profile", "local", "--server", server.address),
            env={**env, "HEADWATER_SERVER": down},
        )
    )
    # $HEADWATER_PROFILE chooses it too; a profile named default applies with no choice.
    ok(cli("stream", "describe", sdk_stream_name, env={**env, "HEADWATER_PROFILE": "local"}))
    ok(cli("profile", "add", "default", "--server", server.address, env=env))
    ok(cli("stream", "describe", sdk_stream_name, env=env))

    unknown = failed(cli("ping", "--profile", "prod", env=env), 2)
    assert unknown == f"headwater: error: no profile 'prod' in {path} (profiles: default, local)"
    ok(cli("profile", "remove", "local", env=env))
    assert "local" not in ok(cli("profile", "list", "--json", env=env))
    path.write_text("[profiles.bad]\nservr = 'x'\n")
    broken = failed(cli("ping", env=env), 2)
    assert "profile 'bad' has unknown key(s) servr" in broken


def test_keyed_append_lands_on_kafkas_partition_for_the_key(
    server: Server, env: dict[str, str]
) -> None:
    """A keyed CLI append to a stream of 6 partitions puts each event where a Kafka
    client (Java's partitioner: librdkafka's murmur2_random) puts the same key; keyless
    lines stay on partition 0, as before."""
    at = ("--server", server.address)
    api = f"http://127.0.0.1:{server.ports['http']}/api/streams"
    for name in ("placed", "placed_by_kafka"):
        body = json.dumps({"name": name, "settings": {"partitions": 6}}).encode()
        created = urllib.request.Request(api, body, {"Content-Type": "application/json"})
        urllib.request.urlopen(created, timeout=30).close()
    keys = [f"user-{i}" for i in range(40)]
    lines = "".join(f"{key}:v-{key}\n" for key in keys) + "no key\n"
    appended = ok(cli("append", "placed", "-K", ":", "-H", "src=cli", *at, env=env, stdin=lines))
    ok(cli("append", "placed", "--key", "user-7", *at, env=env, stdin="again\n"))

    kafka = KafkaProducer(
        {"bootstrap.servers": server.address_of("kafka"), "partitioner": "murmur2_random"}
    )
    by_kafka: dict[str, int] = {}

    def delivered(error: Any, message: Any) -> None:
        assert error is None, error
        by_kafka[message.key().decode()] = message.partition()

    for key in keys:
        kafka.produce("placed_by_kafka", b"v", key=key.encode(), on_delivery=delivered)
    assert kafka.flush(30) == 0

    stored: dict[int, list[tuple[str | None, str]]] = {}
    for partition in range(6):
        url = f"{api}/placed/events?partition={partition}"
        with urllib.request.urlopen(url, timeout=30) as response:
            events = json.load(response)["events"]
        stored[partition] = [(e.get("key"), e["value"]) for e in events]
        assert all(e["headers"][0]["value"] == "cli" for e in events if e["value"] != "again")
    expected: dict[int, list[tuple[str | None, str]]] = {p: [] for p in range(6)}
    for key in keys:
        expected[by_kafka[key]].append((key, f"v-{key}"))
    expected[0].insert(sum(by_kafka[key] == 0 for key in keys), (None, "no key"))
    expected[by_kafka["user-7"]].append(("user-7", "again"))
    assert stored == expected
    assert len(set(by_kafka.values())) == 6  # the keys spread over every partition
    counts = {p: sum(by_kafka[key] == p for key in keys) + (p == 0) for p in range(6)}
    assert appended.strip() == "appended 41 events to placed: " + ", ".join(
        f"partition {p} offsets 0..{counts[p] - 1}" for p in range(6)
    )


def test_append_with_keys_and_headers(
    make_server: Callable[..., Server], env: dict[str, str]
) -> None:
    server = make_server(listen={"http": LOCAL})
    at = ("--server", server.address)
    ok(cli("stream", "create", "keyed", *at, env=env))
    appended = ok(
        cli(
            *("append", "keyed", "-K", ":", "-H", "src=cli", "--header", "trace=a=b", *at),
            env=env,
            stdin="u1:hello\nno key here\n",
        )
    )
    assert appended.strip() == "appended 2 events to keyed: offsets 0..1"
    ok(cli("append", "keyed", "--key", "fixed", *at, env=env, stdin="x\n"))

    # Bad input: a clear line, exit 2 (usage) or 1 (the server's answer), nothing stored.
    both = failed(cli("append", "keyed", "-k", "a", "-K", ":", *at, env=env, stdin="y\n"), 2)
    assert "not allowed with argument" in both
    header = failed(cli("append", "keyed", "-H", "novalue", *at, env=env, stdin="y\n"), 2)
    assert "expected NAME=VALUE, not 'novalue'" in header
    missing = failed(cli("append", "nowhere", "-k", "a", *at, env=env, stdin="y\n"), 1)
    assert missing.startswith("headwater: error: StreamNotFound")
    with headwater.connect(server.address) as hw:
        stream_id = hw.stream_id("keyed")
    with server.client() as raw:
        refused = raw.call(
            AppendRecordsRequest(stream_id, [b"k1", b"k2"], [], EventBatch.of([b"one"]))
        )
        assert isinstance(refused, ErrorResponse) and refused.code == ErrorCode.INVALID_REQUEST
        assert refused.message == "AppendRecords: 2 keys for 1 events (none, or one per event)"
        served = raw.call(
            AppendRecordsRequest(stream_id, [], [[("h", b"v")]], EventBatch.of([b"z"]))
        )
        assert served == AppendEventsResponse(3, 1)

    url = f"http://127.0.0.1:{server.ports['http']}/api/streams/keyed/events"
    with urllib.request.urlopen(url, timeout=30) as response:
        events = json.load(response)["events"]
    assert [(e["value"], e.get("key_b64")) for e in events] == [
        ("hello", base64.b64encode(b"u1").decode()),
        ("no key here", None),
        ("x", base64.b64encode(b"fixed").decode()),
        ("z", None),
    ]

    # Headers are stored with the events (no reader shows them yet): read the log itself.
    assert server.stop() == 0
    plog = PartitionLog.open(server.data_dir / f"tenants/0/streams/{stream_id}/partition-0")
    try:
        stored = list(plog.read(0, 1 << 20).events())
    finally:
        plog.close()
    assert [(e.value, e.key, e.headers) for e in stored] == [
        (b"hello", b"u1", ((b"src", b"cli"), (b"trace", b"a=b"))),
        (b"no key here", None, ((b"src", b"cli"), (b"trace", b"a=b"))),
        (b"x", b"fixed", ()),
        (b"z", None, ((b"h", b"v"),)),
    ]


def test_partitioned_groups_are_listed(
    server: Server, env: dict[str, str], sdk_stream_name: str
) -> None:
    """A Kafka/Rivven/SDK group's committed partitions show in `group list` and
    `group describe`, one row per partition, beside the push subscriptions' groups."""
    stream, group = sdk_stream_name, f"ledger_{sdk_stream_name[-8:]}"
    rivven = server.address_of("rivven")
    with headwater.Producer(rivven) as producer:
        producer.create_stream(stream, partitions=3)
        for i in range(30):
            producer.send(stream, f"{i}", partition=i % 3)
    consumer = headwater.Consumer(
        rivven, group_id=group, auto_offset_reset="earliest", enable_auto_commit=False
    )
    try:
        consumer.subscribe([stream])
        seen = 0
        while seen < 30:
            seen += len(consumer.consume(30, timeout=5))
        consumer.commit({(stream, 0): 10, (stream, 1): 4})
    finally:
        consumer.close()

    rows = json.loads(
        ok(cli("group", "describe", group, "--json", "--server", server.address, env=env))
    )
    lags = {(r["partition"], r["committed_offset"], r["lag"]) for r in rows}
    assert lags == {(0, 10, 0), (1, 4, 6)}
    table = ok(cli("group", "list", "--stream", stream, "--server", server.address, env=env))
    assert group in table and "partition" in table
    described = ok(cli("group", "describe", group, "--server", server.address, env=env))
    assert "1 stream, total lag 6" in described
