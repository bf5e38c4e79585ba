"""A follower's apply of copied changelog records, a window at a time in columns
(engine/kinds/copied.py), against applying them one record at a time.

A leader takes random windows (ASSERTs, PATCHes and RETRACTs by three sources, source
epochs that retract what a source did not write again, an event kind's sequences) on
a fixed-width kind (the columnar window), a kind with a string field and an event
kind, all in one tenant so their versions interleave. A follower copies the
changelogs byte for byte and applies them below high watermarks cut at random
offsets (inside windows too), in chunks of a random size, with a hot set that may be
smaller than the kind (entities read back from its store). At every cut its committed
state (each entity's version, source set and record), its live and per-source counts
and an event kind's next sequence equal those of the records below the cut replayed
one at a time; at the end they equal the leader's, and its subscriber has had each
record's change (created, updated with the previous record and the changed fields,
deleted) in order."""

from __future__ import annotations

import asyncio
import functools
import random
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headwater.api.replication import Replicas
from headwater.engine.engine import Engine, EngineConfig
from headwater.engine.kinds import (
    ChangeType,
    KindsConfig,
    KindsEngine,
    KindsError,
    StateChange,
    WriteOp,
)
from headwater.engine.kinds import copied as copied_module
from headwater.engine.kinds import replicated as replicated_module
from headwater.engine.kinds.model import changelog_stream
from headwater.engine.kinds.ops import assert_op, patch_op, retract_op
from headwater.engine.kinds.state import SEQUENCE_KEY, SOURCE_SET, KindState
from headwater.engine.kinds.store import SOURCES
from headwater.errors import NotLeader
from headwater.protocols.convergedb.fields import FieldType
from waiting import wait_until_async

ENGINE = EngineConfig(maintenance_interval_ms=0, tenants={0: "default"})
KINDS = {
    "fixed": ([("temp", FieldType.F64), ("count", FieldType.I64)], False),
    "text": ([("temp", FieldType.F64), ("label", FieldType.STRING)], False),
    "ticks": ([("temp", FieldType.F64)], True),
}
SOURCE_NAMES = ("a", "b", "c")
ENTITIES = 12

Entities = dict[bytes, tuple[int, int, bytes]]

# One write: (source, kind, op, first entity, value, entities); op 0 assert, 1 patch,
# 2 retract (of ``entities`` entities from the first, in one apply), 3 epoch begin,
# 4 epoch end (kind, entities and value unused for epochs).
write = st.tuples(
    st.integers(0, len(SOURCE_NAMES) - 1),
    st.sampled_from(sorted(KINDS)),
    st.integers(0, 4),
    st.integers(0, ENTITIES - 1),
    st.integers(-3, 3),
    st.integers(1, 6),
)
windows = st.lists(st.lists(write, min_size=1, max_size=8), min_size=1, max_size=10)


def eid(n: int) -> bytes:
    return n.to_bytes(32, "big")


def values(kind: str, n: int) -> list[object]:
    return {"fixed": [float(n), n], "text": [float(n), "x" * (n + 3)], "ticks": [float(n)]}[kind]


def replay(state: KindState, upto: int) -> tuple[Entities, int]:
    """The changelog below ``upto``, one record at a time: each entity's last record
    (a tombstone removes it), and an event kind's last sequence."""
    entities: Entities = {}
    sequence = 0
    for event in state.log.events(0, upto):
        assert event.key is not None
        if event.key == SEQUENCE_KEY:
            sequence = SOURCE_SET.unpack_from(event.value)[0]
        elif event.tombstone:
            entities.pop(event.key, None)
        else:
            source_set = SOURCE_SET.unpack_from(event.value)[0]
            entities[event.key] = (event.position, source_set, bytes(event.value[8:]))
    return entities, sequence


def changes(state: KindState) -> list[tuple[bytes, int, int, int, bytes, bytes | None, int]]:
    """What a subscriber (with previous records) gets for the whole changelog, one
    record at a time: (entity, change, version, source set, record, previous record,
    changed fields)."""
    entities: Entities = {}
    everything = (1 << len(state.info.fields)) - 1
    out = []
    for event in state.log.events(0):
        key = event.key
        assert key is not None
        if key == SEQUENCE_KEY:
            continue
        before = entities.get(key)
        if event.tombstone:
            entities.pop(key, None)
            out.append((key, int(ChangeType.DELETED), event.position, 0, b"", None, 0))
            continue
        source_set, record = SOURCE_SET.unpack_from(event.value)[0], bytes(event.value[8:])
        entities[key] = (event.position, source_set, record)
        if before is None:
            change = (int(ChangeType.CREATED), None, everything)
        else:
            mask = state.codec.changed_fields([record], [before[2]])[0]
            change = (int(ChangeType.UPDATED), before[2], mask)
        out.append((key, change[0], event.position, source_set, record, change[1], change[2]))
    return out


def held(entities: Entities) -> list[int]:
    return [sum(1 for _, s, _ in entities.values() if s >> i & 1) for i in range(SOURCES)]


def applied_to(state: KindState, offset: int) -> bool:
    return state.applied_offset == offset


def committed(state: KindState) -> Entities:
    return dict(state.committed_items())


async def take_windows(tk: object, kinds: dict[str, object], drawn: list[list[tuple]]) -> None:
    """The drawn writes, a window each (every write of a window before any is awaited)."""
    from headwater.engine.kinds import TenantKinds

    assert isinstance(tk, TenantKinds)
    sources = [tk.connect(name) for name in SOURCE_NAMES]
    for window in drawn:
        last = None
        for source_index, kind_name, op, first, value, span in window:
            source = sources[source_index]
            kind = kinds[kind_name]
            ops: list[WriteOp]
            try:
                if op == 3:
                    tk.begin_epoch(source)  # writes nothing (ACKed at once by a server)
                    continue
                if op == 4:
                    _count, last = tk.end_epoch(source)
                    continue
                ids = [eid(n % ENTITIES) for n in range(first, first + span)]
                if op == 0:
                    ops = [assert_op(kind, e, values(kind_name, value)) for e in ids]  # type: ignore[arg-type]
                elif op == 1:
                    ops = [patch_op(kind, e, {0: float(value)}) for e in ids]  # type: ignore[arg-type]
                else:
                    ops = [retract_op(kind, e) for e in ids]  # type: ignore[arg-type]
                last = tk.apply(source, ops)
            except KindsError:
                continue  # refused as a client would be (no open epoch ...): nothing applied
        if last is not None:
            await last.durable()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    drawn=windows,
    seed=st.integers(0, 2**32 - 1),
    chunk=st.sampled_from([1, 3, 7, 4096]),
    hot=st.sampled_from([2, 1000]),
    small=st.sampled_from([0, 8, 32]),
)
def test_a_follower_applies_windows_as_the_records_one_at_a_time(
    drawn: list[list[tuple]], seed: int, chunk: int, hot: int, small: int
) -> None:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as patch:
        patch.setattr(replicated_module, "FOLLOW_CHUNK", chunk)
        # Windows below ``small`` records decoded record by record, the rest in numpy.
        patch.setattr(copied_module, "SMALL_WINDOW", small)
        asyncio.run(follow(Path(tmp), drawn, rng, hot))


async def follow(tmp: Path, drawn: list[list[tuple]], rng: random.Random, hot: int) -> None:
    leader_engine = await Engine.open(tmp / "leader", ENGINE)
    follower_engine = await Engine.open(tmp / "follower", ENGINE)
    leader = await KindsEngine.open(leader_engine, KindsConfig(coalesce_ms=1))
    follower = await KindsEngine.open(follower_engine, KindsConfig(coalesce_ms=1, hot_entities=hot))
    try:
        lt, ft = leader.tenant(0), follower.tenant(0)
        kinds = {}
        for name, (fields, events) in KINDS.items():
            kinds[name] = await lt.create_kind(name, fields, event_stream=events)
            await ft.create_kind(name, fields, event_stream=events)

        def refuse(_tenant: int, stream: str, _partition: int) -> None:
            raise NotLeader(f"another node leads {stream}")

        follower_engine.leader_check = refuse
        subscriptions = {
            name: ft.subscribe(kind.kind_id, include_previous=True, events=False)
            for name, kind in kinds.items()
        }
        await take_windows(lt, kinds, drawn)

        high_watermarks: dict[str, int] = {}
        source = Replicas(leader_engine, leader.changelogs)
        copy = Replicas(follower_engine, follower.changelogs)
        for name in KINDS:
            stream = changelog_stream(name)
            stored = await source.read_stored(0, stream, 0, 0, 1 << 24)
            end = await copy.append_stored(0, stream, 0, stored) if stored else 0
            mine = follower.changelogs.state(0, stream)
            theirs = leader.changelogs.state(0, stream)
            assert end == theirs.log.committed_offset
            cuts = [*sorted(rng.sample(range(end + 1), min(3, end + 1))), end]
            high_watermarks[stream] = 0
            follower.changelogs.limit(0, stream, functools.partial(high_watermarks.get, stream, 0))
            for cut in cuts:
                high_watermarks[stream] = cut
                follower.changelogs.moved(0, stream)
                await wait_until_async(functools.partial(applied_to, mine, cut))
                entities, sequence = replay(mine, cut)
                assert committed(mine) == entities, (name, cut)
                assert mine.count == len(entities)
                assert mine.held_counts == held(entities)
                if KINDS[name][1]:
                    assert mine.next_sequence == sequence
            assert committed(mine) == committed(theirs)
            assert (mine.count, mine.held_counts) == (theirs.count, theirs.held_counts)
            assert mine.next_sequence == theirs.next_sequence
            assert mine.applied_position == theirs.applied_position
            got = [
                (n.entity_id, int(n.change), n.version, n.source_set, n.record, n.previous,
                 n.changed_fields)
                for n in subscriptions[name].take_buffered()
                if isinstance(n, StateChange)
            ]  # fmt: skip
            assert got == changes(mine)
    finally:
        await leader.close()
        await follower.close()
        await leader_engine.close()
        await follower_engine.close()
