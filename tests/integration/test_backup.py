"""``headwater backup`` of a live server under write load, restored and compared.

A real server takes appends continuously from a writer thread while ``headwater backup``
copies its data directory; a second server then starts on the copy. Every event
acknowledged before the backup began must be there, byte for byte at its offset, the
rest of each restored log must be exactly what the live server holds at those offsets
(a prefix: nothing torn, nothing invented), and the streams (ids, names, settings,
tenants), kinds (schemas, entities) and consumer groups must be those of the original;
``headwater check`` passes on the copy. The refusals (a destination that is not empty or
inside the data directory, a directory that is not a data directory) leave nothing
behind.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servers import LOCAL, Server, headwater_cli

import headwater
from headwater import entities
from waiting import wait_until

LISTEN = {"convergedb": LOCAL, "http": LOCAL}
# Small segments, so the logs have sealed segments (and index files) as well as a tail
# being written while the copy runs; a long liveness grace (the source's own, kept in
# the copy, and the default), so the restored server, which the kind's source never
# connects to, still holds its entities when compared.
CONFIG = """
[storage]
segment_bytes = 65536

[convergedb]
default_liveness_ms = 600000

[[tenants]]
id = 7
name = "lab"
"""
WRITER_APPENDS_BEFORE_BACKUP = 200


@dataclass
class Sensor:
    site: str
    temp: float
    count: entities.U32 = 0


def http_get(server: Server, path: str, tenant: int = 0) -> Any:
    request = urllib.request.Request(f"http://{server.address_of('http')}{path}")
    request.add_header("X-Headwater-Tenant", str(tenant))
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def http_post(server: Server, path: str, body: Any, tenant: int = 0) -> Any:
    request = urllib.request.Request(
        f"http://{server.address_of('http')}{path}",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "X-Headwater-Tenant": str(tenant)},
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


class Writer(threading.Thread):
    """Appends batches of distinct events to ``stream`` until stopped; keeps every
    acknowledged append as (first offset, values), in acknowledgement order."""

    def __init__(self, server: Server, stream: str) -> None:
        super().__init__(daemon=True)
        self.client = headwater.connect(server.address)
        self.stream = stream
        self.acked: list[tuple[int, list[bytes]]] = []
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            seq = 0
            while not self.stopping.is_set():
                values = [f"load {seq} {i} ".encode() * (1 + (seq + i) % 7) for i in range(8)]
                first, _count = self.client.append(self.stream, values)
                self.acked.append((first, values))
                seq += 1
        except BaseException as exc:  # reported by the test, not lost in the thread
            self.error = exc

    def stop(self) -> None:
        self.stopping.set()
        self.join(60)
        self.client.close()
        assert self.error is None, f"the writer failed: {self.error!r}"


def stream_view(streams: list[dict[str, Any]]) -> dict[str, tuple[Any, ...]]:
    """What a stream's identity is: id, creation time, settings."""
    return {s["name"]: (s["stream_id"], s["created_ns"], s["settings"]) for s in streams}


def kind_view(server: Server, name: str) -> tuple[Any, list[Any]]:
    kinds = {k["name"]: k for k in http_get(server, "/api/kinds")["kinds"]}
    kind = kinds[name]
    entities_page = http_get(server, f"/api/kinds/{name}/entities")
    schema = (kind["kind_id"], kind["schema_version"], kind["fields"], kind["event_stream"])
    return schema, entities_page["entities"]


def test_backup_of_a_live_server_restores_everything_acknowledged_before_it(
    make_server: Callable[..., Server], tmp_path: Path
) -> None:
    source = make_server(config=CONFIG, listen=LISTEN)
    with headwater.connect(source.address) as client:
        client.create_stream("load")
        client.create_stream("orders")
        client.append("orders", [f"order {i}".encode() for i in range(500)])
        # Metadata a restore must keep: per-stream settings, another tenant's stream.
        http_post(
            source,
            "/api/streams",
            {"name": "audit", "settings": {"retention_ms": 86_400_000, "sync": "none"}},
        )
        http_post(source, "/api/streams", {"name": "lab_runs"}, tenant=7)
        http_post(source, "/api/streams/lab_runs/events", ["run 1", "run 2"], tenant=7)
        # A consumer group that read part of "orders" and left.
        with client.subscribe("orders", 0, group="billing", credits=100) as sub:
            got = 0
            while got < 300:
                got += len(sub.next_batch(timeout=30))
        committed = wait_until(
            lambda: next(
                (
                    g["committed_offset"]
                    for g in http_get(source, "/api/consumer-groups")["groups"]
                    if g["group"] == "billing" and g["committed_offset"] > 0
                ),
                None,
            ),
            message="the group never committed",
        )
        wait_until(
            lambda: any(
                json.loads(path.read_text()).get("billing") == committed
                for path in source.data_dir.glob("tenants/0/streams/*/groups.json")
            ),
            message="the group's position was never written",
        )

    with entities.connect(
        source.address_of("convergedb"), name="thermo", liveness_ms=600_000
    ) as writer:
        sensors = writer.create_kind(Sensor, "sensors")
        for site in ("a", "b", "c"):
            writer.assert_(sensors, site, Sensor(site, 20.5, 3))
        writer.flush()
        kind_before = kind_view(source, "sensors")
        assert len(kind_before[1]) == 3

        load = Writer(source, "load")
        load.start()
        wait_until(
            lambda: len(load.acked) >= WRITER_APPENDS_BEFORE_BACKUP or load.error,
            30,
            "the writer did not get going",
        )
        acked_before = list(load.acked)  # acknowledged before the backup began
        backup_dir = tmp_path / "restored" / "data"
        backup_dir.parent.mkdir()
        result = headwater_cli("backup", "--data-dir", str(source.data_dir), str(backup_dir))
        acked_during = len(load.acked)
        load.stop()
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"headwater check {backup_dir}: ok" in result.stdout
    assert acked_during > len(acked_before), "the backup did not run under write load"

    check = headwater_cli("check", str(backup_dir))
    assert check.returncode == 0, check.stdout + check.stderr
    assert not list(backup_dir.rglob("*.tmp")) and not (backup_dir / "headwater.lock").exists()

    restored = Server(tmp_path / "restored", listen=dict(LISTEN), config=CONFIG).start()
    try:
        # Streams, their settings and the other tenant's, as they were.
        before = stream_view(http_get(source, "/api/streams")["streams"])
        after = stream_view(http_get(restored, "/api/streams")["streams"])
        assert after == before
        assert stream_view(http_get(restored, "/api/streams", tenant=7)["streams"]) == (
            stream_view(http_get(source, "/api/streams", tenant=7)["streams"])
        )
        lab = http_get(restored, "/api/streams/lab_runs/events", tenant=7)["events"]
        assert [e["value"] for e in lab] == ["run 1", "run 2"]

        with headwater.connect(source.address) as live, headwater.connect(restored.address) as copy:
            assert [e.value for e in copy.scan("orders")] == [
                f"order {i}".encode() for i in range(500)
            ]
            # Every acknowledged-before event, at its offset, byte for byte ...
            copied = [(e.offset, e.value) for e in copy.scan("load")]
            expected_end = acked_before[-1][0] + len(acked_before[-1][1])
            assert len(copied) >= expected_end
            by_offset = dict(copied)
            for first, values in acked_before:
                assert [by_offset[first + i] for i in range(len(values))] == values
            # ... and past them only what the live server holds at those offsets.
            assert copied == [(e.offset, e.value) for e in live.scan("load", limit=len(copied))]
            # SQL on the restored server (projections rebuilt from the copied logs).
            assert copy.query("SELECT count(*) AS n FROM orders").rows == [(500,)]

        assert kind_view(restored, "sensors") == kind_before
        groups = {
            g["group"]: g["committed_offset"]
            for g in http_get(restored, "/api/consumer-groups")["groups"]
        }
        assert groups == {"billing": committed}

        # The restored server takes writes; the original still serves.
        http_post(restored, "/api/streams/orders/events", ["after restore"])
        assert http_get(source, "/api/streams/orders")["next_offset"] == 500
    finally:
        assert restored.stop() == 0, restored.log_tail()


def test_backup_refuses_a_destination_it_cannot_use(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "tenants").mkdir(parents=True)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")

    for destination, message in (
        (taken, "exists and is not an empty directory"),
        (data / "inside", "must be outside the data directory"),
    ):
        result = headwater_cli("backup", "--data-dir", str(data), str(destination))
        assert result.returncode == 2
        assert message in result.stderr
        assert "Traceback" not in result.stderr
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    assert not (data / "inside").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

    not_data = tmp_path / "empty"
    not_data.mkdir()
    result = headwater_cli("backup", "--data-dir", str(not_data), str(tmp_path / "copy"))
    assert result.returncode == 2
    assert "is not a headwater data directory" in result.stderr
    assert not (tmp_path / "copy").exists()

    # A destination whose directory takes no new entries (as a read-only mount or a
    # full disk fails the copy): one line, not a traceback.
    result = headwater_cli("backup", "--data-dir", str(data), "/proc/headwater-copy")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: no backup taken:"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


RETENTION_CONFIG = """
[storage]
maintenance_interval_ms = 20
"""


def test_backup_while_retention_deletes_segments_keeps_a_whole_log(
    make_server: Callable[..., Server], tmp_path: Path
) -> None:
    """Segments that retention deletes while the copy runs are left out; what is copied
    is one run of offsets, each event as acknowledged, through every event acknowledged
    before the backup began, and the copy passes ``headwater check``."""
    source = make_server(config=RETENTION_CONFIG, listen={"http": LOCAL})
    http_post(
        source,
        "/api/streams",
        {"name": "rolling", "settings": {"segment_bytes": 4096, "retention_bytes": 16384}},
    )
    load = Writer(source, "rolling")
    load.start()
    # Retention has dropped segments already, so it keeps dropping them during the copy.
    wait_until(
        lambda: http_get(source, "/api/streams/rolling")["start_offset"] > 0 or load.error,
        30,
        "retention never deleted a segment",
    )
    acked_before = list(load.acked)
    backup_dir = tmp_path / "copy" / "data"
    backup_dir.parent.mkdir()
    result = headwater_cli("backup", "--data-dir", str(source.data_dir), str(backup_dir))
    load.stop()
    assert result.returncode == 0, result.stdout + result.stderr
    assert headwater_cli("check", str(backup_dir)).returncode == 0

    acked = {first + i: value for first, values in load.acked for i, value in enumerate(values)}
    # The restored server runs retention at the default pace (every 30 s), not while
    # the log is read here.
    restored = Server(tmp_path / "copy", listen={"http": LOCAL}).start()
    try:
        start = http_get(restored, "/api/streams/rolling")["start_offset"]
        with headwater.connect(restored.address) as copy:
            copied = [(e.offset, e.value) for e in copy.scan("rolling", start)]
        offsets = [offset for offset, _ in copied]
        assert offsets == list(range(offsets[0], offsets[0] + len(offsets)))  # no gap
        assert all(acked[offset] == value for offset, value in copied)
        assert offsets[-1] + 1 >= acked_before[-1][0] + len(acked_before[-1][1])
    finally:
        assert restored.stop() == 0, restored.log_tail()
