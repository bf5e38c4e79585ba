"""The kind engine's rules: registry, multi-source state, windows, epochs, liveness,
subscriptions, event-stream kinds, persistence across restarts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from failing_windows import FailingWrites
from headwater.engine.engine import Engine, EngineConfig
from headwater.engine.kinds import (
    PRESENCE_KIND,
    BadFieldData,
    ChangeType,
    EventNote,
    KindInfo,
    KindLimitExceeded,
    KindNotFound,
    KindsConfig,
    KindsEngine,
    NoEpoch,
    NoFreeSource,
    ReservedName,
    SchemaConflict,
    SchemaIncompatible,
    SourceConflict,
    StateChange,
    SubscriptionOverflow,
    TenantKinds,
    assert_op,
    patch_op,
    presence_entity_id,
    retract_op,
)
from headwater.errors import NotLeader, StorageError, StreamAlreadyExists
from headwater.protocols.convergedb import messages as wire
from headwater.protocols.convergedb.fields import FieldType, decode_record
from headwater.protocols.convergedb.ops import from_wire
from waiting import scheduled_callbacks_run, wait_until_async

ENGINE = EngineConfig(maintenance_interval_ms=0, tenants={0: "default", 7: "seven"})
FIELDS = [("temp", FieldType.F64), ("label", FieldType.STRING)]


def eid(n: int) -> bytes:
    return n.to_bytes(32, "big")


Body = Callable[[Engine, KindsEngine, TenantKinds], Awaitable[None]]


def run(tmp_path: Path, body: Body, config: KindsConfig | None = None) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, ENGINE)
        kinds = await KindsEngine.open(engine, config or KindsConfig(coalesce_ms=5))
        try:
            await body(engine, kinds, kinds.tenant(0))
        finally:
            await kinds.close()
            await engine.close()

    asyncio.run(main())


async def sensor(tk: TenantKinds, *, event_stream: bool = False) -> KindInfo:
    return await tk.create_kind("sensor", FIELDS, event_stream=event_stream)


def test_registry_rules(tmp_path: Path) -> None:
    async def body(engine: Engine, kinds: KindsEngine, tk: TenantKinds) -> None:
        kind = await sensor(tk)
        assert (kind.schema_version, kind.field_count) == (1, 2)
        assert await sensor(tk) == kind  # identical: no-op, same id
        wider = await tk.create_kind("sensor", [*FIELDS, ("ok", FieldType.BOOL)])
        assert (wider.kind_id, wider.schema_version, wider.field_count) == (kind.kind_id, 2, 3)
        with pytest.raises(SchemaConflict):
            await tk.create_kind("sensor", [("temp", FieldType.F32)])
        with pytest.raises(SchemaConflict):
            await tk.create_kind("sensor", FIELDS)  # dropping a field is no migration
        with pytest.raises(SchemaConflict):
            await tk.create_kind("sensor", [*FIELDS, ("ok", FieldType.BOOL)], event_stream=True)
        with pytest.raises(ReservedName):
            await tk.create_kind("hw_things", FIELDS)
        with pytest.raises(KindLimitExceeded):
            await tk.create_kind("wide", [(f"f{i}", FieldType.U8) for i in range(65)])
        assert await tk.create_kind("wide", [(f"f{i}", FieldType.U8) for i in range(64)])
        assert tk.get_kind("sensor", FIELDS[:1]) == wider
        with pytest.raises(SchemaIncompatible):
            tk.get_kind("sensor", [("label", FieldType.STRING)])
        with pytest.raises(KindNotFound):
            tk.get_kind("nope")
        # Kinds and streams share one namespace, and the refusal says which took it.
        with pytest.raises(StreamAlreadyExists, match="'sensor' is an entity kind"):
            await engine.create_stream(0, "sensor")
        await engine.create_stream(0, "orders")
        with pytest.raises(SchemaConflict):
            await tk.create_kind("orders", FIELDS)
        # Tenants are separate.
        assert await kinds.tenant(7).create_kind("sensor", FIELDS[:1])

    run(tmp_path, body)

    async def reopened(engine: Engine, kinds: KindsEngine, tk: TenantKinds) -> None:
        kind = tk.get_kind("sensor")
        with pytest.raises(StreamAlreadyExists, match="'sensor' is an entity kind"):
            await engine.create_stream(0, "sensor")
        assert (kind.schema_version, kind.field_count) == (2, 3)
        assert tk.get_kind(PRESENCE_KIND).internal
        assert kinds.tenant(7).get_kind("sensor").field_count == 1

    run(tmp_path, reopened)


def test_a_kind_and_a_stream_created_at_once_cannot_share_a_name(tmp_path: Path) -> None:
    """Each create awaits its files in a worker thread: the one started second must see
    the name taken by the one under way, whichever it is."""

    async def body(engine: Engine, kinds: KindsEngine, tk: TenantKinds) -> None:
        for first in ("stream", "kind"):
            name = f"race_{first}_first"
            stream = engine.create_stream(0, name)
            kind = tk.create_kind(name, FIELDS)
            both = (stream, kind) if first == "stream" else (kind, stream)
            outcomes = await asyncio.gather(*both, return_exceptions=True)
            refused = [o for o in outcomes if isinstance(o, BaseException)]
            assert len(refused) == 1, outcomes
            streams = [s.name for s in engine.list_streams(0)]
            if first == "stream":
                assert isinstance(refused[0], SchemaConflict), outcomes
                assert name in streams
                with pytest.raises(KindNotFound):
                    tk.get_kind(name)
            else:
                assert isinstance(refused[0], StreamAlreadyExists), outcomes
                assert tk.get_kind(name).name == name and name not in streams

    run(tmp_path, body)


def test_multi_source_rules_and_versions(tmp_path: Path) -> None:
    async def body(engine: Engine, kinds: KindsEngine, tk: TenantKinds) -> None:
        kind = await sensor(tk)
        a, b = tk.connect("a", source_id=1), tk.connect("b", source_id=2)
        await a.apply([assert_op(kind, eid(1), [20.0, "x"])]).durable()
        first = tk.get(kind.kind_id, eid(1))
        assert first is not None and first.source_set == 0b10 and first.values == (20.0, "x")
        await b.apply([patch_op(kind, eid(1), {0: 21.0})]).durable()
        second = tk.get(kind.kind_id, eid(1))
        assert second is not None and second.source_set == 0b110
        assert second.values == (21.0, "x") and second.version > first.version
        await a.apply([retract_op(kind, eid(1))]).durable()
        third = tk.get(kind.kind_id, eid(1))
        assert third is not None and third.source_set == 0b100 and third.version > second.version
        await b.apply([retract_op(kind, eid(1))]).durable()
        assert tk.get(kind.kind_id, eid(1)) is None
        # PATCH of an absent entity creates it with defaults; ASSERT of a prefix too.
        await a.apply([patch_op(kind, eid(2), {1: "p"}), assert_op(kind, eid(3), [1.5])]).durable()
        assert tk.get(kind.kind_id, eid(2)).values == (0.0, "p")  # type: ignore[union-attr]
        assert tk.get(kind.kind_id, eid(3)).values == (1.5, "")  # type: ignore[union-attr]
        # Versions are tenant log positions: the next stream append comes after them.
        stream = await engine.create_stream(0, "s")
        info = await engine.append(0, stream.stream_id, [b"x"])
        assert info.first_position > tk.get(kind.kind_id, eid(3)).version  # type: ignore[union-attr]

    run(tmp_path, body)


def test_bad_ops_apply_nothing(tmp_path: Path) -> None:
    async def body(engine: Engine, kinds: KindsEngine, tk: TenantKinds) -> None:
        kind = await sensor(tk)
        src = tk.connect("a")
        with pytest.raises(BadFieldData):
            assert_op(kind, eid(1), ["not a float"])
        with pytest.raises(BadFieldData):
            assert_op(kind, b"short", [1.0])
        good = wire.Assert.of(kind.fields, kind.kind_id, eid(1), [1.0])
        bad = wire.Assert(kind.kind_id, eid(2), b"\x01\x02")
        with pytest.raises(BadFieldData):
            from_wire([good, bad], tk.kind)
        with pytest.raises(KindNotFound):
            from_wire([wire.Retract(999, eid(1))], tk.kind)
        ops = from_wire([good], tk.kind)
        with pytest.raises(KindNotFound):
            tk.apply(src, [*ops, retract_op(KindInfo(0, 999, "x", ()), eid(1))])
        await tk.barrier()
        assert tk.get(kind.kind_id, eid(1)) is None  # the good op was not applied either

    run(tmp_path, body)


def test_sources_slots_and_presence(tmp_path: Path) -> None:
    async def body(engine: Engine, kinds: KindsEngine, tk: TenantKinds) -> None:
        presence = tk.get_kind(PRESENCE_KIND)
        a = tk.connect("alpha", source_id=5, deadline_ms=60_000)
        with pytest.raises(SourceConflict):
            tk.connect("again", source_id=5)
        auto = tk.connect("auto")
        assert auto.source_id == 0
        reader = tk.connect("reader", read_only=True)
        assert reader.source_id is None
        await tk.barrier()
        row = tk.get(presence.kind_id, presence_entity_id(5))
        assert row is not None and row.values[:2] == (5, "alpha") and row.values[3] == 60_000
        others = [tk.connect(f"s{i}") for i in range(62)]
        with pytest.raises(NoFreeSource):
            tk.connect("one too many")
        a.disconnect()
        await tk.barrier()
        assert tk.get(presence.kind_id, presence_entity_id(5)) is None
        # In its grace period the slot is not handed out to others, but its owner may
        # take it back.
        with pytest.raises(NoFreeSource):
            tk.connect("x")
        assert tk.connect("alpha", source_id=5).source_id == 5
        assert len(others) == 62

    run(tmp_path, body)


def test_coalescing_and_notifications(tmp_path: Path) -> None:
    async def body(engine: Engine, kinds: KindsEngine, tk: TenantKinds) -> None:
        kind = await sensor(tk)
        src = tk.connect("a", source_id=3)
        sub = tk.subscribe(kind.kind_id, include_previous=True)
        # One window: created then updated then ... nets to CREATED with the last values.
        src.apply([assert_op(kind, eid(1), [1.0, "a"]), patch_op(kind, eid(1), {0: 2.0})])
        src.apply([assert_op(kind, eid(2), [1.0]), retract_op(kind, eid(2))])  # nets to nothing
        await tk.barrier()
        notes = await sub.next_batch()
        assert len(notes) == 1
        note = notes[0]
        assert isinstance(note, StateChange) and note.change is ChangeType.CREATED
        assert note.changed_fields == 0b11 and note.source_set == 1 << 3
        # Re-asserting the same values is no change at all: no notification, same version.
        version = note.version
        src.apply([assert_op(kind, eid(1), [2.0, "a"], metadata=b"m")])
        await tk.barrier()
        assert not sub.buffer and tk.get(kind.kind_id, eid(1)).version == version  # type: ignore[union-attr]
        src.apply([patch_op(kind, eid(1), {1: "b"}, metadata=b"meta")])
        await tk.barrier()
        [upd] = await sub.next_batch()
        assert isinstance(upd, StateChange) and upd.change is ChangeType.UPDATED
        assert upd.changed_fields == 0b10 and upd.metadata == b"meta"
        assert upd.previous == note.record and upd.version > version
        src.apply([retract_op(kind, eid(1))])
        await tk.barrier()
        [gone] = await sub.next_batch()
        assert isinstance(gone, StateChange) and gone.change is ChangeType.DELETED

    run(tmp_path, body)


def test_epoch_retracts_stale(tmp_path: Path) -> None:
    async def body(engine: Engine, kinds: KindsEngine, tk: TenantKinds) -> None:
        kind = await sensor(tk)
        other = await tk.create_kind("other", FIELDS[:1])
        a, b = tk.connect("a", source_id=1), tk.connect("b", source_id=2)
        a.apply([assert_op(kind, eid(i), [float(i)]) for i in range(5)])
        a.apply([assert_op(other, eid(9), [9.0])])
        b.apply([assert_op(kind, eid(4), [4.0])])
        with pytest.raises(NoEpoch):
            tk.end_epoch(a)
        tk.begin_epoch(a)
        a.apply([assert_op(kind, eid(0), [0.0]), patch_op(kind, eid(1), {0: 1.5})])
        count, window = tk.end_epoch(a)
        await window.durable()
        assert count == 4  # 2, 3, 4 of sensor and 9 of other
        assert [e.entity_id for e in tk.scan(kind.kind_id)] == [eid(0), eid(1), eid(4)]
        assert tk.get(kind.kind_id, eid(4)).source_set == 0b100  # type: ignore[union-attr]
        assert tk.get(other.kind_id, eid(9)) is None
        # A new BEGIN abandons the open epoch; a disconnect does as well.
        tk.begin_epoch(a)
        tk.begin_epoch(a)
        assert tk.end_epoch(a)[0] == 2
        tk.begin_epoch(b)
        b.disconnect()
        with pytest.raises(NoEpoch):
            tk.end_epoch(b)  # the disconnect abandoned it
        assert tk.get(kind.kind_id, eid(4)) is not None

    run(tmp_path, body)


def test_liveness_retracts_sole_owned(tmp_path: Path) -> None:
    async def body(engine: Engine, kinds: KindsEngine, tk: TenantKinds) -> None:
        kind = await sensor(tk)
        dead_calls: list[int] = []
        a = tk.connect("a", source_id=1, deadline_ms=400, on_dead=lambda: dead_calls.append(1))
        b = tk.connect("b", source_id=2, deadline_ms=60_000)
        a.apply([assert_op(kind, eid(1), [1.0]), assert_op(kind, eid(2), [2.0])])
        b.apply([assert_op(kind, eid(2), [2.0])])
        await tk.barrier()
        # A canary with the same deadline, silent from the moment a drops: once its
        # entity is retracted, a's deadline has passed as well.
        canary = tk.connect("canary", source_id=5, deadline_ms=400)
        a.disconnect()
        canary.apply([assert_op(kind, eid(9), [9.0])])
        # Reconnecting in time keeps everything.
        a2 = tk.connect("a", source_id=1, deadline_ms=400)

        def canary_gone() -> bool:
            a2.touch()  # touching every 100 ms meanwhile
            return tk.get(kind.kind_id, eid(9)) is None

        await wait_until_async(canary_gone, 5, "the canary outlived its deadline", interval=0.1)
        assert tk.get(kind.kind_id, eid(1)) is not None
        a2.disconnect()
        await wait_until_async(
            lambda: tk.get(kind.kind_id, eid(1)) is None, 5, "a's entity outlived its deadline"
        )
        assert tk.get(kind.kind_id, eid(2)).source_set == 0b100  # type: ignore[union-attr]
        assert 1 not in tk.sources and not dead_calls  # it was not connected any more
        # A connected source that goes silent is dead too, and its owner is told.
        c = tk.connect("c", source_id=3, deadline_ms=100, on_dead=lambda: dead_calls.append(3))
        c.apply([assert_op(kind, eid(3), [3.0])])
        await wait_until_async(lambda: dead_calls, 5, "the silent source never died")
        await tk.barrier()
        assert dead_calls == [3] and tk.get(kind.kind_id, eid(3)) is None

    run(tmp_path, body, KindsConfig(coalesce_ms=5, liveness_check_ms=10))


async def away_holding(tk: TenantKinds, kind: KindInfo, deadlines: dict[str, int]) -> None:
    """Sources named as ``deadlines``' keys, in slots 1, 2, ... with those deadlines, each
    asserting the entity of its slot's number (durable), then gone away."""
    sources = [
        tk.connect(name, source_id=n, deadline_ms=deadline)
        for n, (name, deadline) in enumerate(deadlines.items(), 1)
    ]
    for n, source in enumerate(sources, 1):
        source.apply([assert_op(kind, eid(n), [float(n)])])
    await tk.barrier()
    for source in sources:
        source.disconnect()


def test_a_dead_sources_retraction_lost_with_its_window_is_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The window holding a dead source's retractions fails (a full disk): its entities
    # keep its bit. The slot used to be gone with it, so nothing retracted them again
    # until a restart; it is held again as away, and its next deadline retracts them.
    async def body(engine: Engine, kinds: KindsEngine, tk: TenantKinds) -> None:
        kind = await sensor(tk)
        await away_holding(tk, kind, {"a": 60_000})
        writes = FailingWrites(tk, monkeypatch)
        writes.failing = True
        assert [s.source_id for s in tk.check_liveness(time.monotonic() + 3600)] == [1]
        with pytest.raises(StorageError):
            await tk.barrier()
        assert tk.get(kind.kind_id, eid(1)).source_set == 0b10  # type: ignore[union-attr]
        await wait_until_async(lambda: 1 in tk.sources, 5, "the dead slot was not held again")
        assert tk.sources[1].name == "a" and not tk.sources[1].connected
        writes.failing = False
        assert [s.source_id for s in tk.check_liveness(time.monotonic() + 3600)] == [1]
        await tk.barrier()
        assert tk.get(kind.kind_id, eid(1)) is None and 1 not in tk.sources

    run(tmp_path, body, KindsConfig(coalesce_ms=5, liveness_check_ms=3_600_000))


def test_a_lost_retraction_holds_again_only_the_slots_it_retracted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Source a dies and the window with its retractions fails while source b, dead in a
    # later sweep, has its retractions in the next window (durable): a's slot is held
    # again, b's is not. Every slot whose bit committed entities still carried was held
    # again, b's too (its retraction not yet durable): an "away" source, unnamed, kept
    # in sources.json and its slot taken, for a deadline after its entities were gone.
    async def body(engine: Engine, kinds: KindsEngine, tk: TenantKinds) -> None:
        kind = await sensor(tk)
        await away_holding(tk, kind, {"a": 60_000, "b": 120_000})
        writes = FailingWrites(tk, monkeypatch)
        writes.failing = writes.hold = True
        now = time.monotonic()
        assert [s.source_id for s in tk.check_liveness(now + 90)] == [1]
        await asyncio.wait_for(writes.refused.wait(), 5)  # a's retraction, held
        writes.failing = False
        assert [s.source_id for s in tk.check_liveness(now + 3600)] == [2]
        writes.release.set()  # a's window fails
        await tk.barrier()  # b's is durable
        assert tk.get(kind.kind_id, eid(2)) is None
        await wait_until_async(lambda: 1 in tk.sources, 5, "the dead slot was not held again")
        assert tk.sources[1].name == "a" and tk.sources[1].deadline_ms == 60_000
        assert 2 not in tk.sources

    run(tmp_path, body, KindsConfig(coalesce_ms=5, liveness_check_ms=3_600_000))


def test_event_stream_kind(tmp_path: Path) -> None:
    async def body(engine: Engine, kinds: KindsEngine, tk: TenantKinds) -> None:
        kind = await sensor(tk, event_stream=True)
        src = tk.connect("a", source_id=4)
        events = tk.subscribe(kind.kind_id, events=True)
        states = tk.subscribe(kind.kind_id)
        src.apply(
            [assert_op(kind, eid(1), [1.0], metadata=b"m1"), patch_op(kind, eid(1), {0: 2.0})]
        )
        src.apply([retract_op(kind, eid(1))])
        await tk.barrier()
        notes = await events.next_batch()
        assert all(isinstance(n, EventNote) for n in notes)
        assert [(n.op, n.sequence, n.presence_mask) for n in notes] == [  # type: ignore[union-attr]
            (0x02, 0, 0b11),
            (0x08, 1, 0b01),
            (0x03, 2, 0),
        ]
        assert notes[0].metadata == b"m1"
        assert not states.buffer  # the net change was nothing
        src.apply([assert_op(kind, eid(2), [5.0])])
        await tk.barrier()
        [note] = await events.next_batch()
        assert isinstance(note, EventNote) and note.sequence == 3

    run(tmp_path, body)

    async def reopened(engine: Engine, kinds: KindsEngine, tk: TenantKinds) -> None:
        kind = tk.get_kind("sensor")
        src = tk.connect("a", source_id=4)
        events = tk.subscribe(kind.kind_id, events=True)
        src.apply([patch_op(kind, eid(2), {0: 6.0})])
        await tk.barrier()
        [note] = await events.next_batch()
        assert isinstance(note, EventNote) and note.sequence == 4  # survives a restart

    run(tmp_path, reopened)


def test_overflow_ends_a_live_subscription(tmp_path: Path) -> None:
    async def body(engine: Engine, kinds: KindsEngine, tk: TenantKinds) -> None:
        kind = await sensor(tk)
        src = tk.connect("a")
        sub = tk.subscribe(kind.kind_id)
        src.apply([assert_op(kind, eid(i), [1.0]) for i in range(8)])
        await tk.barrier()
        src.apply([assert_op(kind, eid(i), [2.0]) for i in range(3)])
        await tk.barrier()  # 8 + 3 > 10: overflow
        with pytest.raises(SubscriptionOverflow):
            await sub.next_batch()
        assert sub not in tk.kind_state(kind.kind_id).subscribers

    run(tmp_path, body, KindsConfig(coalesce_ms=5, live_buffer=10))


def test_restart_rebuilds_identical_state(tmp_path: Path) -> None:
    snapshot: dict[bytes, object] = {}

    async def body(engine: Engine, kinds: KindsEngine, tk: TenantKinds) -> None:
        kind = await sensor(tk)
        a, b = tk.connect("a", source_id=1), tk.connect("b", source_id=2)
        for round_ in range(5):
            a.apply([assert_op(kind, eid(i), [float(i + round_), f"r{round_}"]) for i in range(50)])
            b.apply([patch_op(kind, eid(i), {1: "b"}) for i in range(0, 50, 3)])
            a.apply([retract_op(kind, eid(i)) for i in range(0, 50, 5)])
            await tk.barrier()
        await tk.create_kind("sensor", [*FIELDS, ("extra", FieldType.I32)])
        snapshot.update({e.entity_id: e for e in tk.scan(kind.kind_id)})
        assert snapshot

    run(tmp_path, body)

    async def reopened(engine: Engine, kinds: KindsEngine, tk: TenantKinds) -> None:
        kind = tk.get_kind("sensor")
        assert {e.entity_id: e for e in tk.scan(kind.kind_id)} == snapshot
        assert tk.sources[1].connected is False  # in its grace period after the restart
        # The tenant log goes on after the kinds' positions.
        stream = await engine.create_stream(0, "after")
        info = await engine.append(0, stream.stream_id, [b"x"])
        assert info.first_position > max(e.version for e in tk.scan(kind.kind_id))  # type: ignore[attr-defined]

    run(tmp_path, reopened)


def test_migration_while_a_window_is_open(tmp_path: Path) -> None:
    async def body(engine: Engine, kinds: KindsEngine, tk: TenantKinds) -> None:
        kind = await sensor(tk)
        src = tk.connect("a")
        events_kind = await tk.create_kind("ev", FIELDS, event_stream=True)
        sub = tk.subscribe(kind.kind_id)
        events = tk.subscribe(events_kind.kind_id, events=True)
        src.apply([assert_op(kind, eid(1), [1.0, "old"])])
        await tk.flush()
        # Written under the old schema, flushed under the new one.
        src.apply([assert_op(kind, eid(2), [2.0]), assert_op(events_kind, eid(1), [3.0])])
        wider = [*FIELDS, ("n", FieldType.I32)]
        grown = await tk.create_kind("sensor", wider)
        await tk.create_kind("ev", wider, event_stream=True)
        await tk.flush()
        assert grown.schema_version == 2
        old = tk.get(kind.kind_id, eid(1))
        new = tk.get(kind.kind_id, eid(2))
        assert old is not None and old.values == (1.0, "old", 0)
        assert new is not None and new.values == (2.0, "", 0)
        notes = [n for n in await sub.next_batch() if isinstance(n, StateChange)]
        assert len(notes) == 2  # the first CREATED, then eid(2)'s
        assert decode_record(wider, notes[-1].record) == [2.0, "", 0]
        assert decode_record(wider, old.record) == [1.0, "old", 0]
        [event] = await events.next_batch()
        assert isinstance(event, EventNote) and event.presence_mask == 0b111

    # A window that never closes on its own: the test decides where windows end.
    run(tmp_path, body, KindsConfig(coalesce_ms=60_000))


def test_a_waiting_reader_takes_a_window_larger_than_the_buffer(tmp_path: Path) -> None:
    async def body(engine: Engine, kinds: KindsEngine, tk: TenantKinds) -> None:
        kind = await sensor(tk)
        src = tk.connect("a")
        sub = tk.subscribe(kind.kind_id)
        reader = asyncio.ensure_future(sub.next_batch())
        await wait_until_async(lambda: sub.waiting, message="the reader is not waiting")
        src.apply([assert_op(kind, eid(i), [1.0]) for i in range(25)])
        await tk.barrier()
        assert len(await reader) == 25  # one window, 2.5 times the buffer
        # A reader that is not waiting is held to the limit.
        src.apply([assert_op(kind, eid(i), [2.0]) for i in range(11)])
        await tk.barrier()
        with pytest.raises(SubscriptionOverflow):
            await sub.next_batch()

    run(tmp_path, body, KindsConfig(coalesce_ms=5, live_buffer=10))


def test_concurrent_create_kind_gives_each_kind_its_own_id(tmp_path: Path) -> None:
    names = [f"k{i}" for i in range(6)]

    async def body(engine: Engine, kinds: KindsEngine, tk: TenantKinds) -> None:
        created = await asyncio.gather(*(tk.create_kind(n, FIELDS) for n in names))
        assert len({k.kind_id for k in created}) == len(names)
        for name, kind in zip(names, created, strict=True):
            assert tk.get_kind(name) == kind

    run(tmp_path, body)

    async def reopened(engine: Engine, kinds: KindsEngine, tk: TenantKinds) -> None:
        ids = {tk.get_kind(n).kind_id for n in names}
        assert len(ids) == len(names)

    run(tmp_path, reopened)


def test_writes_that_change_nothing_are_acknowledged(tmp_path: Path) -> None:
    async def body(engine: Engine, kinds: KindsEngine, tk: TenantKinds) -> None:
        kind = await sensor(tk)
        src = tk.connect("a", source_id=1)
        await tk.barrier()  # the presence write is out of the way: a quiet tenant
        # A retract of what the source does not hold, an empty batch, an epoch with
        # nothing stale: nothing to flush, and each must still be acknowledged.
        for window in (
            src.apply([retract_op(kind, eid(1))]),
            src.apply([]),
            tk.end_epoch(src)[1] if tk.begin_epoch(src) else None,
        ):
            assert window is not None
            await asyncio.wait_for(window.durable(), 1.0)
        # Behind a write that is still being made durable, a no-op waits for it.
        written = src.apply([assert_op(kind, eid(2), [1.0])])
        noop = src.apply([retract_op(kind, eid(3))])
        assert noop is written
        await asyncio.wait_for(noop.durable(), 1.0)
        assert tk.get(kind.kind_id, eid(2)) is not None

    run(tmp_path, body)


def test_event_stream_kind_sends_an_event_for_a_retract_that_changes_nothing(
    tmp_path: Path,
) -> None:
    async def body(engine: Engine, kinds: KindsEngine, tk: TenantKinds) -> None:
        kind = await sensor(tk, event_stream=True)
        src = tk.connect("a", source_id=2)
        events = tk.subscribe(kind.kind_id, events=True)
        src.apply([retract_op(kind, eid(9))])  # never held: still an op of the stream
        await tk.barrier()
        [note] = await asyncio.wait_for(events.next_batch(), 1.0)
        assert isinstance(note, EventNote) and (note.op, note.sequence) == (0x03, 0)

    run(tmp_path, body)


def test_a_kind_found_by_name_while_being_created_is_usable(tmp_path: Path) -> None:
    """GET_KIND answered while CREATE_KIND awaits the registry's save (another client;
    in a cluster, the tick making a kind another node created) finds a kind its reads
    and writes find too."""

    async def body(engine: Engine, kinds: KindsEngine, tk: TenantKinds) -> None:
        creating = asyncio.ensure_future(sensor(tk))
        seen = 0
        while not creating.done():
            if "sensor" in tk.registry.by_name:
                kind = tk.get_kind("sensor")
                assert tk.entity_count(kind.kind_id) == 0  # KindNotFound before
                seen += 1
            await scheduled_callbacks_run()
        await creating
        assert seen > 0  # the window was there to look into

    run(tmp_path, body)


def test_a_window_over_two_kinds_whose_one_changelog_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One window writes two kinds; one kind's changelog append is failed while waiting
    for its fsync (a cut replica, NotLeader). The writers are told; the other kind's
    records are durable, so its state moves on with its log (the next window is planned
    against it); the failed kind's state does not show what its log lost."""

    async def body(engine: Engine, kinds: KindsEngine, tk: TenantKinds) -> None:
        kind = await sensor(tk)
        meter = await tk.create_kind("meter", [("kwh", FieldType.F64)])
        src = tk.connect("a", source_id=1)
        real = tk.kinds[kind.kind_id].committer.committed

        async def cut(next_offset: int) -> None:
            await real(next_offset)
            raise NotLeader("no longer the leader of kind sensor")

        monkeypatch.setattr(tk.kinds[kind.kind_id].committer, "committed", cut)
        replicated: list[str] = []

        class Acks:
            """acks=all: the meter's records are shown only once the replicas hold them."""

            def check_min_isr(self, tenant_id: int, stream: str, partition: int) -> None:
                pass

            async def replicated(
                self, tenant_id: int, stream: str, partition: int, end: int, timeout_s: float
            ) -> None:
                assert tk.get(meter.kind_id, eid(2)) is None
                replicated.append(stream)

        monkeypatch.setattr(engine, "replica_acks", Acks())
        with pytest.raises(NotLeader):
            await src.apply(
                [assert_op(kind, eid(1), [1.0, "a"]), assert_op(meter, eid(2), [5.0])]
            ).durable()
        assert tk.get(kind.kind_id, eid(1)) is None
        assert replicated == ["hw_kind_meter"]
        kept = tk.get(meter.kind_id, eid(2))
        assert kept is not None and kept.values == (5.0,)
        monkeypatch.undo()
        await src.apply([patch_op(meter, eid(2), {0: 6.0})]).durable()
        later = tk.get(meter.kind_id, eid(2))
        assert later is not None and later.values == (6.0,) and later.version > kept.version

    run(tmp_path, body)


# How the second kind's changelog refuses a window's records: the methods failing, the
# error they raise. A refused write (a StorageError), or a new segment's file that cannot
# be made (an OSError from the roll, not a HeadwaterError).
REFUSALS = {
    "write": (("append", "append_encoded"), StorageError("write failed: no space left")),
    "roll": (("_maybe_roll",), OSError(28, "No space left on device")),
}


@pytest.mark.parametrize("refusal", sorted(REFUSALS))
def test_a_window_over_two_kinds_whose_second_changelog_refuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: str
) -> None:
    """One window writes two kinds; the second kind's changelog refuses the append after
    the first kind's took its records. The writers are told; the first kind's records
    are in its log and become durable, so its state moves on with it (the next window is
    planned against it); the refusing kind shows nothing of the window."""
    methods, error = REFUSALS[refusal]

    async def body(engine: Engine, kinds: KindsEngine, tk: TenantKinds) -> None:
        kind = await sensor(tk)
        meter = await tk.create_kind("meter", [("kwh", FieldType.F64)])
        src = tk.connect("a", source_id=1)
        called: list[int] = []
        for state in (tk.kinds[kind.kind_id], tk.kinds[meter.kind_id]):
            for name in methods:
                real = getattr(state.log, name)

                def refuse_second(
                    *args: Any, _real: Any = real, _kind: int = state.info.kind_id, **kw: Any
                ) -> Any:
                    # (append_encoded may call append: the same kind's calls go on)
                    if called and called[0] != _kind:
                        raise error
                    called.append(_kind)
                    return _real(*args, **kw)

                monkeypatch.setattr(state.log, name, refuse_second)
        with pytest.raises(type(error), match=r"(?i)no space left"):
            await src.apply(
                [assert_op(kind, eid(1), [1.0, "a"]), assert_op(meter, eid(2), [5.0])]
            ).durable()
        assert len(set(called)) == 1
        took, refused = (kind, meter) if called[0] == kind.kind_id else (meter, kind)
        took_eid, refused_eid = (eid(1), eid(2)) if took is kind else (eid(2), eid(1))
        kept = tk.get(took.kind_id, took_eid)
        assert kept is not None
        assert tk.get(refused.kind_id, refused_eid) is None
        took_state = tk.kinds[took.kind_id]
        assert took_state.applied_offset == took_state.log.end_offset > 0
        monkeypatch.undo()
        await src.apply(
            [assert_op(kind, eid(1), [2.0, "b"]), assert_op(meter, eid(2), [7.0])]
        ).durable()
        assert tk.get(refused.kind_id, refused_eid) is not None
        again = tk.get(took.kind_id, took_eid)
        assert again is not None and again.version > kept.version
        assert took_state.applied_offset == took_state.log.end_offset

    run(tmp_path, body)
