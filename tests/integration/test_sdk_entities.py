"""headwater.entities against a real ``headwater serve`` (ConvergeDB and HTTP listeners on)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from convergedb_raw import CdbClient
from servers import LOCAL, Server, free_port, serving

from headwater import entities
from headwater.entities import Entity, ResubscribeMode
from headwater.entities import aio as entities_aio
from headwater.errors import UsageError

LISTEN = {"convergedb": LOCAL, "http": LOCAL}
WEEK_MS = 7 * 24 * 3600 * 1000
WAIT_SECONDS = 30.0  # a bound for waiting on a live subscription, not a measurement


@dataclass
class Sensor:
    site: str
    temp: float
    count: entities.U32 = 0
    ok: bool = True


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(tmp_path_factory.mktemp("entities"), listen=LISTEN)


def cdb(server: Server) -> str:
    return f"127.0.0.1:{server.ports['convergedb']}"


def http(server: Server) -> str:
    return f"127.0.0.1:{server.ports['http']}"


@pytest.fixture
def kind_name(request: pytest.FixtureRequest) -> str:
    base = "".join(c if c.isalnum() else "_" for c in request.node.name)[:30]
    return f"k_{base}_{uuid.uuid4().hex[:6]}"


def drain_until(
    sub: entities.EntitySubscription[Any], done: Callable[[], bool]
) -> list[Entity[Any]]:
    """Changes taken from ``sub`` until ``done()`` (bounded by WAIT_SECONDS)."""
    seen: list[Entity[Any]] = []
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        # The view and the queue change together on the client's loop: what made done()
        # true is in the queue, so take it once more after.
        finished = done()
        seen += sub.next_batch(timeout=0 if finished else 0.2)
        if finished:
            return seen
        assert time.monotonic() < deadline, f"gave up waiting; view: {sub.view}"


def test_two_writers_converge_on_one_entity(server: Server, kind_name: str) -> None:
    with (
        entities.connect(cdb(server), name="a") as a,
        entities.connect(cdb(server), name="b") as b,
        entities.connect(cdb(server), read_only=True) as reader,
    ):
        assert a.source_id is not None and b.source_id is not None
        assert a.source_id != b.source_id and reader.source_id is None
        kind_a = a.create_kind(Sensor, kind_name)
        kind_b = b.create_kind(Sensor, kind_name)  # identical: the same kind
        assert (kind_a.kind_id, kind_a.schema_version) == (kind_b.kind_id, 1)
        kind_r = reader.get_kind(Sensor, kind_name)

        a.assert_(kind_a, "x", Sensor("lab", 1.0, 1))
        a.flush()
        b.assert_(kind_b, "x", Sensor("roof", 2.0, 2))
        b.flush()
        a.patch(kind_a, "x", temp=3.5)
        a.flush()
        state = reader.get(kind_r, "x")
        assert state is not None
        assert state.value == Sensor("roof", 3.5, 2)
        assert sorted(state.sources) == sorted([a.source_id, b.source_id])
        first_version = state.version

        a.retract(kind_a, "x")
        a.flush()
        held_by_b = reader.get(kind_r, "x")
        assert held_by_b is not None and held_by_b.sources == [b.source_id]
        assert held_by_b.version > first_version
        b.retract(kind_b, "x")
        b.flush()
        assert reader.get(kind_r, "x") is None


def test_epoch_retracts_what_was_not_reasserted(server: Server, kind_name: str) -> None:
    with entities.connect(cdb(server), name="epochs") as src:
        kind = src.create_kind(Sensor, kind_name)
        for key in ("a", "b", "c", "d"):
            src.assert_(kind, key, Sensor(key, 0.0))
        src.flush()

        with pytest.raises(RuntimeError, match="boom"), src.epoch():
            src.assert_(kind, "a", Sensor("a", 1.0))
            raise RuntimeError("boom")
        assert {e.key for e in src.scan(kind)} == {"a", "b", "c", "d"}  # nothing retracted

        with src.epoch() as epoch:
            src.assert_(kind, "a", Sensor("a", 2.0))
            src.patch(kind, "b", count=9)
        assert epoch.retracted == 2
        # end_epoch waits for the retractions to be durable: visible at once.
        live = {e.key: e.value for e in src.scan(kind)}
        assert live == {"a": Sensor("a", 2.0), "b": Sensor("b", 0.0, 9)}


def test_an_idle_source_with_a_long_deadline_outlives_the_servers_idle_timeout(
    make_server: Callable[..., Server], kind_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server closes a connection silent for idle_timeout_s; a source heartbeats a
    third of its deadline, so one of a week's (the README's) went silent 300 s, lost
    its slot and its open epoch. It now heartbeats at least every HEARTBEAT_CEILING_S
    (made short here, with the server's timeout, to fit a test)."""
    monkeypatch.setattr(entities_aio, "HEARTBEAT_CEILING_S", 0.2)
    server = make_server(config="[limits]\nidle_timeout_s = 1\n", listen=LISTEN)
    with entities.connect(cdb(server), name="idle", liveness_ms=WEEK_MS) as src:
        kind = src.create_kind(Sensor, kind_name)
        for key in ("kept", "stale"):
            src.assert_(kind, key, Sensor(key, 0.0))
        src.flush()
        with src.epoch() as epoch:
            src.assert_(kind, "kept", Sensor("kept", 1.0))
            src.flush()
            # A connection silent after its CONNECT is closed once the timeout has passed:
            # the source was as quiet, but for its heartbeats.
            with CdbClient(server.ports["convergedb"], name="silent") as silent:
                silent.until_closed()
        assert epoch.retracted == 1
        assert {e.key for e in src.scan(kind)} == {"kept"}


def test_a_liveness_deadline_the_client_cannot_keep_is_refused() -> None:
    with pytest.raises(UsageError, match=r"liveness_ms is 0 .* or 150"):
        entities.connect("127.0.0.1:1", liveness_ms=30)


def test_flush_is_a_barrier_for_buffered_batches(server: Server, kind_name: str) -> None:
    # A long linger: nothing leaves the buffer until flush() or 60 ops (one BATCH).
    with (
        entities.connect(cdb(server), linger=60.0, batch_ops=60) as src,
        entities.connect(cdb(server), read_only=True) as reader,
    ):
        kind = src.create_kind(Sensor, kind_name)
        read_kind = reader.get_kind(Sensor, kind_name)
        for i in range(10):
            src.assert_(kind, f"e{i}", Sensor("s", float(i), i))
        assert reader.scan(read_kind) == []  # still in the client's buffer
        for i in range(10, 250):  # past batch_ops: several BATCH frames
            src.assert_(kind, f"e{i}", Sensor("s", float(i), i))
        src.flush()
        # Right after flush() returns, another connection sees every write.
        got = {e.key: e.value for e in reader.scan(read_kind)}
        assert got == {f"e{i}": Sensor("s", float(i), i) for i in range(250)}
        assert src.aio._sent == {} and src.aio._buffer == []


def test_subscribe_bootstrap_racing_live_writes(server: Server, kind_name: str) -> None:
    keys = [f"k{i}" for i in range(200)]
    with (
        entities.connect(cdb(server), name="racer") as src,
        entities.connect(cdb(server), read_only=True) as watcher,
    ):
        kind = src.create_kind(Sensor, kind_name)
        for key in keys:
            src.assert_(kind, key, Sensor(key, 0.0, 0))
        src.flush()
        stop = threading.Event()
        writes = [0]

        def write() -> None:
            rng = random.Random(7)
            while not stop.is_set() or writes[0] < 2000:
                key = rng.choice(keys)
                writes[0] += 1
                if writes[0] % 97 == 0:
                    src.retract(kind, key)
                else:
                    src.patch(kind, key, count=writes[0])
                if writes[0] % 200 == 0:
                    src.flush()
            src.flush()

        writer = threading.Thread(target=write)
        writer.start()
        try:
            sub = watcher.subscribe(watcher.get_kind(Sensor, kind_name)).start()
            changes = drain_until(sub, lambda: sub.bootstrapped)
        finally:
            stop.set()
            writer.join(60)
        assert not writer.is_alive()
        final = {e.entity_id: e for e in src.scan(kind)}
        changes += drain_until(
            sub,
            lambda: (
                {k: e.version for k, e in sub.view.items()}
                == {k: e.version for k, e in final.items()}
            ),
        )
        assert {k: e.value for k, e in sub.view.items()} == {k: e.value for k, e in final.items()}
        # Highest version wins: per entity the accepted changes only ever move forward.
        last: dict[bytes, int] = {}
        for change in changes:
            assert change.version > last.get(change.entity_id, -1)
            last[change.entity_id] = change.version
        assert any(c.change == "bootstrap" for c in changes)
        sub.close()


def test_read_only_client_refuses_writes(server: Server, kind_name: str) -> None:
    with entities.connect(cdb(server), name="w") as src:
        kind = src.create_kind(Sensor, kind_name)
        src.assert_(kind, "x", Sensor("lab", 1.0))
    with entities.connect(cdb(server), read_only=True) as reader:
        read_kind = reader.get_kind(Sensor, kind_name)
        with pytest.raises(entities.ReadOnly, match="connected read-only"):
            reader.assert_(read_kind, "y", Sensor("lab", 2.0))
        with pytest.raises(entities.ReadOnly):
            reader.retract(read_kind, "x")
        with pytest.raises(entities.ReadOnly), reader.epoch():
            pass
        # The server refuses too: CREATE_KIND is a write.
        with pytest.raises(entities.ReadOnly, match="read-only"):
            reader.create_kind(Sensor, kind_name + "_new")
        state = reader.get(read_kind, "x")
        assert state is not None and state.value == Sensor("lab", 1.0)


def test_bad_input_gets_clear_errors_and_loses_nothing(server: Server, kind_name: str) -> None:
    @dataclass
    class Other:
        site: int

    @dataclass
    class Longer:
        site: str
        temp: float
        extra: bytes

    with entities.connect(cdb(server), name="bad") as src:
        with pytest.raises(entities.KindNotFound):
            src.get_kind(Sensor, kind_name + "_missing")
        kind = src.create_kind(Sensor, kind_name)
        with pytest.raises(entities.SchemaIncompatible):
            src.get_kind(Other, kind_name)
        with pytest.raises(entities.SchemaConflict):
            src.create_kind(Other, kind_name)
        with pytest.raises(entities.ReservedName):
            src.create_kind(Sensor, "hw_" + kind_name)
        src.assert_(kind, "kept", Sensor("lab", 1.0))
        with pytest.raises(UsageError, match="cannot hold 'hot'"):
            src.assert_(kind, "bad", Sensor("lab", "hot"))  # type: ignore[arg-type]
        with pytest.raises(UsageError, match="has no field 'nope'"):
            src.patch(kind, "kept", nope=1)
        with pytest.raises(UsageError, match="takes Sensor values"):
            src.assert_(kind, "bad", Longer("a", 1.0, b""))  # type: ignore[arg-type]
        src.flush()
        # A kind the server does not know: the whole BATCH is refused, nothing applied.
        bogus = entities.Kind("ghost", 0xFFF0, 1, 4, Sensor, kind.fields)
        src.assert_(kind, "same_batch", Sensor("lab", 5.0))
        src.assert_(bogus, "ghost", Sensor("lab", 5.0))
        with pytest.raises(entities.KindNotFound, match=r"BATCH of 2 writes.*nothing of it"):
            src.flush()
        assert src.get(kind, "same_batch") is None
        state = src.get(kind, "kept")
        assert state is not None and state.value == Sensor("lab", 1.0)
        src.flush()  # the error was reported once


def test_kind_migration_keeps_old_readers_working(server: Server, kind_name: str) -> None:
    @dataclass
    class SensorV2:
        site: str
        temp: float
        count: entities.U32 = 0
        ok: bool = True
        note: str = ""

    with entities.connect(cdb(server)) as src:
        old = src.create_kind(Sensor, kind_name)
        new = src.create_kind(SensorV2, kind_name)
        assert (new.kind_id, new.schema_version, new.field_count) == (old.kind_id, 2, 5)
        src.assert_(new, "x", SensorV2("lab", 1.0, 2, False, "appended"))
        src.flush()
        reread = src.get_kind(Sensor, kind_name)  # a prefix of the migrated kind
        assert reread.field_count == 5
        state = src.get(reread, "x")
        assert state is not None and state.value == Sensor("lab", 1.0, 2, False)


def test_reconnect_after_restart_keeps_source_and_resubscribes(
    make_server: Callable[..., Server], kind_name: str
) -> None:
    srv = make_server(listen=LISTEN)
    with (
        entities.connect(cdb(srv), name="durable", backoff_base=0.05) as src,
        entities.connect(cdb(srv), read_only=True) as watcher,
    ):
        kind = src.create_kind(Sensor, kind_name)
        source_id = src.source_id
        src.assert_(kind, "a", Sensor("a", 1.0))
        src.assert_(kind, "b", Sensor("b", 1.0))
        src.flush()
        watch_kind = watcher.get_kind(Sensor, kind_name)
        full = watcher.subscribe(watch_kind).start()
        before = {entities.entity_id("a"), entities.entity_id("b")}
        drain_until(full, lambda: set(full.view) == before)

        srv.restart()

        # The writer reconnects on its next write, with its slot: "b" stays its own.
        src.assert_(kind, "c", Sensor("c", 3.0))
        src.retract(kind, "a")
        src.flush()
        assert src.reconnects >= 1 and src.source_id == source_id
        state = src.get(kind, "b")
        assert state is not None and state.sources == [source_id]

        want = {entities.entity_id("b"), entities.entity_id("c")}
        changes = drain_until(full, lambda: set(full.view) == want)
        assert full.resubscribes >= 1
        assert any(c.key == "a" and c.deleted for c in changes)
        assert full.view[entities.entity_id("c")].value == Sensor("c", 3.0)


def test_live_only_resubscribe_skips_the_bootstrap(
    make_server: Callable[..., Server], kind_name: str
) -> None:
    srv = make_server(listen=LISTEN)
    with (
        entities.connect(cdb(srv), name="w") as src,
        entities.connect(cdb(srv), read_only=True) as watcher,
    ):
        kind = src.create_kind(Sensor, kind_name)
        src.assert_(kind, "before", Sensor("x", 1.0))
        src.flush()
        sub = watcher.subscribe(
            watcher.get_kind(Sensor, kind_name),
            bootstrap=False,
            resubscribe=ResubscribeMode.LIVE_ONLY,
        ).start()
        srv.restart()
        deadline = time.monotonic() + WAIT_SECONDS
        while sub.resubscribes == 0:  # the watcher reconnects in the background
            assert time.monotonic() < deadline
            sub.next_batch(timeout=0.1)
        src.assert_(kind, "after", Sensor("y", 2.0))
        src.flush()
        changes = drain_until(sub, lambda: entities.entity_id("after") in sub.view)
        assert [c.key for c in changes] == ["after"]  # no bootstrap of "before"


def test_async_client(server: Server, kind_name: str) -> None:
    async def main() -> None:
        src = await entities.connect_async(cdb(server), name="aio")
        reader = await entities.connect_async(cdb(server), read_only=True)
        try:
            kind = await src.create_kind(Sensor, kind_name)
            read_kind = await reader.get_kind(Sensor, kind_name)
            await src.assert_(kind, "one", Sensor("a", 1.0))
            await src.flush()
            async with reader.subscribe(read_kind) as sub:
                async with src.epoch() as epoch:
                    await src.assert_(kind, "two", Sensor("b", 2.0))
                assert epoch.retracted == 1
                seen: list[tuple[str, str]] = []
                async for change in sub:
                    seen.append((change.change, change.key))
                    if ("deleted", "one") in seen and any(k == "two" for _, k in seen):
                        break
            assert seen[0] == ("bootstrap", "one")
            got = await reader.get(read_kind, "two")
            assert got is not None and got.value == Sensor("b", 2.0)
            assert await reader.get(read_kind, "one") is None
        finally:
            await src.close()
            await reader.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_include_previous_and_metadata_on_changes(server: Server, kind_name: str) -> None:
    key = entities.entity_id("p")
    with (
        entities.connect(cdb(server), name="prev") as src,
        entities.connect(cdb(server), read_only=True) as reader,
        entities.connect(cdb(server), read_only=True) as plain_reader,
    ):
        kind = src.create_kind(Sensor, kind_name)
        src.assert_(kind, "p", Sensor("lab", 1.0), metadata=b"first")
        src.flush()
        with_prev = reader.subscribe(reader.get_kind(Sensor, kind_name), include_previous=True)
        plain = plain_reader.subscribe(plain_reader.get_kind(Sensor, kind_name), bootstrap=False)
        with with_prev, plain:
            booted = drain_until(with_prev, lambda: key in with_prev.view)
            src.patch(kind, "p", temp=2.5, metadata=b"second")
            src.flush()
            changes = drain_until(with_prev, lambda: with_prev.view[key].change == "updated")
            plain_changes = drain_until(plain, lambda: key in plain.view)
        assert [(c.change, c.previous, c.metadata) for c in booted] == [
            ("bootstrap", None, b"")  # metadata is never stored: a bootstrap has none
        ]
        [updated] = changes
        assert updated.value == Sensor("lab", 2.5) and updated.changed_fields == 0b10
        assert updated.previous == Sensor("lab", 1.0)  # only with include_previous
        assert updated.metadata == b"second"
        [plain_updated] = plain_changes
        assert plain_updated.value == Sensor("lab", 2.5) and plain_updated.previous is None
        assert plain_updated.metadata == b"second"
        queried = src.get(kind, "p")
        assert queried is not None and queried.metadata == b"" and queried.previous is None


def test_events_of_an_event_stream_kind(server: Server, kind_name: str) -> None:
    with (
        entities.connect(cdb(server), name="ev") as src,
        entities.connect(cdb(server), name="ev2") as other,
        entities.connect(cdb(server), read_only=True) as reader,
    ):
        kind = src.create_kind(Sensor, kind_name, event_stream=True)
        other_kind = other.get_kind(Sensor, kind_name)
        src.assert_(kind, "a", Sensor("lab", 1.0))  # sequence 0, before the subscription
        src.flush()
        sub = reader.subscribe(reader.get_kind(Sensor, kind_name), events=True).start()
        sub.wait_bootstrapped(WAIT_SECONDS)
        assert [(c.change, c.key) for c in sub.next_batch(timeout=0)] == [("bootstrap", "a")]
        src.patch(kind, "a", temp=2.0, metadata=b"m")
        src.assert_(kind, "b", Sensor("x", 3.0, 7, False))
        src.flush()
        other.retract(other_kind, "a")  # not other's: changes nothing, still an EVENT
        other.flush()
        src.retract(kind, "b")
        src.flush()
        events: list[entities.EntityEvent] = []
        for event in sub.events():  # leaving the loop unsubscribes
            events.append(event)
            if len(events) == 4:
                break
        assert sub.closed
        assert [(e.op, e.key, e.source_id, e.sequence, e.fields) for e in events] == [
            ("patch", "a", src.source_id, 1, {"temp": 2.0}),
            ("assert", "b", src.source_id, 2, {"site": "x", "temp": 3.0, "count": 7, "ok": False}),
            ("retract", "a", other.source_id, 3, {}),
            ("retract", "b", src.source_id, 4, {}),
        ]
        assert (events[0].metadata, events[0].presence_mask) == (b"m", 0b10)
        # Events are not states: the view is the bootstrap, and no change came live.
        assert sub.next_batch(timeout=0) == []
        assert [(e.key, e.value) for e in sub.view.values()] == [("a", Sensor("lab", 1.0))]


def test_events_decode_the_fields_an_old_dataclass_knows(server: Server, kind_name: str) -> None:
    @dataclass
    class SensorV2:
        site: str
        temp: float
        count: entities.U32 = 0
        ok: bool = True
        note: str = ""

    with (
        entities.connect(cdb(server), name="v2") as src,
        entities.connect(cdb(server), read_only=True) as reader,
    ):
        src.create_kind(Sensor, kind_name, event_stream=True)
        new = src.create_kind(SensorV2, kind_name, event_stream=True)  # appends "note"
        old = reader.get_kind(Sensor, kind_name)  # knows the first four fields only
        with reader.subscribe(old, events=True, bootstrap=False) as sub:
            src.assert_(new, "k", SensorV2("s", 1.0, 2, False, "n"))
            src.patch(new, "k", note="only the new field")
            src.patch(new, "k", temp=4.0, note="both")
            src.flush()
            events: list[entities.EntityEvent] = []
            deadline = time.monotonic() + WAIT_SECONDS
            while len(events) < 3:
                assert time.monotonic() < deadline, events
                events += sub.next_events(timeout=0.2)
        assert [(e.op, e.fields, e.presence_mask) for e in events] == [
            ("assert", {"site": "s", "temp": 1.0, "count": 2, "ok": False}, 0b11111),
            ("patch", {}, 0b10000),
            ("patch", {"temp": 4.0}, 0b10010),
        ]


def test_events_on_a_kind_that_is_no_event_stream_are_changes(
    server: Server, kind_name: str
) -> None:
    with (
        entities.connect(cdb(server), name="noev") as src,
        entities.connect(cdb(server), read_only=True) as reader,
    ):
        kind = src.create_kind(Sensor, kind_name)
        with reader.subscribe(reader.get_kind(Sensor, kind_name), events=True) as sub:
            sub.wait_bootstrapped(WAIT_SECONDS)
            src.assert_(kind, "c", Sensor("c", 1.0))
            src.flush()
            changes = drain_until(sub, lambda: entities.entity_id("c") in sub.view)
            assert [(c.change, c.key) for c in changes] == [("created", "c")]
            assert sub.next_events(timeout=0.2) == []


def test_async_events_and_include_previous(server: Server, kind_name: str) -> None:
    async def main() -> None:
        src = await entities.connect_async(cdb(server), name="aio-ev")
        reader = await entities.connect_async(cdb(server), read_only=True)
        changes_reader = await entities.connect_async(cdb(server), read_only=True)
        try:
            kind = await src.create_kind(Sensor, kind_name, event_stream=True)
            read_kind = await reader.get_kind(Sensor, kind_name)
            async with (
                reader.subscribe(read_kind, events=True, bootstrap=False) as sub,
                changes_reader.subscribe(
                    await changes_reader.get_kind(Sensor, kind_name),
                    bootstrap=False,
                    include_previous=True,
                ) as changes,
            ):
                await src.assert_(kind, "e", Sensor("a", 1.0), metadata=b"x")
                await src.flush()  # a window each: created, then updated
                await src.patch(kind, "e", count=3)
                await src.flush()
                got: list[entities.EntityEvent] = []
                async for event in sub.events():
                    got.append(event)
                    if len(got) == 2:
                        break
                seen: list[Entity[Sensor]] = []
                async for change in changes:
                    seen.append(change)
                    if change.change == "updated":
                        break
            assert [(e.op, e.key, e.sequence, e.fields, e.metadata) for e in got] == [
                ("assert", "e", 0, {"site": "a", "temp": 1.0, "count": 0, "ok": True}, b"x"),
                ("patch", "e", 1, {"count": 3}, b""),
            ]
            assert [c.change for c in seen] == ["created", "updated"]
            assert seen[1].previous == Sensor("a", 1.0) and seen[1].value == Sensor("a", 1.0, 3)
            assert seen[0].previous is None and seen[0].metadata == b"x"
        finally:
            await src.close()
            await reader.close()
            await changes_reader.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_catalog_lists_and_describes_kinds(server: Server, kind_name: str) -> None:
    with entities.connect(cdb(server)) as src:
        kind = src.create_kind(Sensor, kind_name, event_stream=True)
        src.assert_(kind, "x", Sensor("lab", 1.0))
    kinds = {k.name: k for k in entities.list_kinds(http(server))}
    assert "convergedb_connections" in kinds and kinds["convergedb_connections"].internal
    described = entities.describe_kind(kind_name, http(server))
    assert kinds[kind_name] == described or kinds[kind_name].kind_id == described.kind_id
    assert described.event_stream and described.kind_id == kind.kind_id
    assert described.specs == [("site", 12), ("temp", 11), ("count", 4), ("ok", 1)]
    assert described.entities == 1
    with pytest.raises(entities.KindNotFound, match="no entity kind"):
        entities.describe_kind(kind_name + "_missing", http(server))


def test_catalog_answers_match_the_openapi_document(server: Server, kind_name: str) -> None:
    import json
    import urllib.error
    import urllib.request

    openapi = Path(__file__).parents[2] / "src" / "headwater" / "server" / "openapi.json"
    components = json.loads(openapi.read_text())["components"]

    def check(name: str, instance: Any) -> None:
        schema = {"$ref": f"#/components/schemas/{name}", "components": components}
        jsonschema.Draft202012Validator(schema).validate(instance)

    with entities.connect(cdb(server)) as src:
        src.create_kind(Sensor, kind_name)
    base = f"http://{http(server)}/api/kinds"
    with urllib.request.urlopen(base, timeout=10) as response:
        check("Kinds", json.load(response))
    with urllib.request.urlopen(f"{base}/{kind_name}", timeout=10) as response:
        kind = json.load(response)
    check("Kind", kind)
    assert kind["fields"][2] == {"name": "count", "type": "u32", "code": 4}
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{base}/{kind_name}_missing", timeout=10)
    assert refused.value.code == 404
    check("Error", json.load(refused.value))


def test_unreachable_server_is_one_clear_error(tmp_path: Path) -> None:

    with pytest.raises(entities.ServerUnavailable, match="connection refused"):
        entities.connect(f"127.0.0.1:{free_port()}", timeout=5)


def test_buffer_and_in_flight_limits_apply_backpressure(
    server: Server, kind_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from headwater.entities import aio

    # At most 2 unacknowledged batches: the third send waits for an ACK.
    monkeypatch.setattr(aio, "MAX_IN_FLIGHT_BATCHES", 2)
    with (
        entities.connect(cdb(server), linger=60.0, buffer_bytes=2000) as src,
        entities.connect(cdb(server), read_only=True) as reader,
    ):
        kind = src.create_kind(Sensor, kind_name)
        in_flight: list[int] = []
        transmit = src.aio._transmit

        def counting(*args: Any) -> None:
            transmit(*args)
            in_flight.append(len(src.aio._sent))

        monkeypatch.setattr(src.aio, "_transmit", counting)
        for i in range(300):  # ~90 bytes each: the 2000-byte buffer fills every ~22 ops
            src.assert_(kind, f"e{i}", Sensor("x" * 20, float(i)))
            assert src.aio._buffered_bytes < 2000  # a full buffer was handed over at once
        assert len(in_flight) > 10 and max(in_flight) <= 2
        src.flush()
        assert len(reader.scan(reader.get_kind(Sensor, kind_name))) == 300
