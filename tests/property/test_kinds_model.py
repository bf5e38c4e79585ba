"""Property test: the kind engine agrees with a plain model of §2's rules.

Random windows go through the real engine, with a window boundary forced between
windows. A window holds multi-op BATCHes (one ``apply`` call each: ASSERTs with a prefix
of fields, PATCHes of some fields and RETRACTs over two kinds, in any mix, sometimes with
a sub-op of an unknown kind that must make the whole BATCH refused) and epoch BEGIN/END,
from several sources. A model applies the same rules to a dict. Both must agree on the
final state, on epoch retraction counts, after a restart, and on each window's
notifications per kind, in order: one net change per entity (created / updated / deleted
with source set, values, changed_fields, the previous values and the metadata of the
window's last op on it), delivered in the order the window first touched each entity
(the order the versions are handed out in), with versions above every earlier window's.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from headwater.engine.engine import Engine, EngineConfig
from headwater.engine.kinds import (
    ChangeType,
    KindInfo,
    KindNotFound,
    KindsConfig,
    KindsEngine,
    NoEpoch,
    StateChange,
    assert_op,
    patch_op,
    retract_op,
)
from headwater.engine.kinds.codec import codec_for
from headwater.engine.kinds.model import RetractOp, WriteOp
from headwater.protocols.convergedb.fields import (
    FieldSpec,
    FieldType,
    decode_fields,
    decode_record,
    encode_fields,
)
from headwater.storage.log import SyncPolicy

FIELDS = [("n", FieldType.U8), ("s", FieldType.STRING)]
DEFAULTS = (0, "")
SOURCES = 3
KINDS = 2
ENTITIES = 4
UNKNOWN_KIND = 999

VALUE_N = st.integers(min_value=0, max_value=3)
VALUE_S = st.sampled_from(["", "a", "b"])
KIND = st.integers(0, KINDS - 1)
ENTITY = st.integers(0, ENTITIES - 1)
SUB_OP = st.one_of(
    st.tuples(
        st.just("assert"),
        KIND,
        ENTITY,
        st.one_of(st.tuples(), st.tuples(VALUE_N), st.tuples(VALUE_N, VALUE_S)),
    ),
    st.tuples(
        st.just("patch"), KIND, ENTITY, st.fixed_dictionaries({}, optional={0: VALUE_N, 1: VALUE_S})
    ),
    st.tuples(st.just("retract"), KIND, ENTITY, st.none()),
)
SOURCE = st.integers(0, SOURCES - 1)
ITEM = st.one_of(
    # A BATCH: its sub-ops, and whether an unknown kind's op ends it (refused as a whole).
    st.tuples(
        st.just("batch"),
        SOURCE,
        st.lists(SUB_OP, min_size=1, max_size=6),
        st.sampled_from([False, False, False, False, True]),
    ),
    st.tuples(st.just("begin"), SOURCE, st.none(), st.none()),
    st.tuples(st.just("end"), SOURCE, st.none(), st.none()),
)
WINDOWS = st.lists(st.lists(ITEM, max_size=6), min_size=1, max_size=6)

Key = tuple[int, int]  # (kind index, entity number)


def eid(n: int) -> bytes:
    return bytes([n]) * 32


@dataclass
class Entity:
    source_set: int
    values: tuple[object, ...]


class Model:
    """§2's rules on a dict. Within a window it also records, per entity, when the window
    first touched it (an op that changed its working state, even if the window's net
    change ends up nothing) and the metadata of the last such op."""

    def __init__(self) -> None:
        self.state: dict[Key, Entity] = {}
        self.epochs: dict[int, set[Key]] = {}
        self.touched: dict[Key, int] = {}  # -> rank of the first touch in this window
        self.metadata: dict[Key, bytes] = {}
        self.rank = 0

    def new_window(self) -> dict[Key, Entity]:
        self.touched, self.metadata = {}, {}
        return dict(self.state)

    def begin(self, source: int) -> None:
        bit = 1 << source
        self.epochs[source] = {k for k, e in self.state.items() if e.source_set & bit}

    def end(self, source: int) -> int | None:
        """The retracted count, None without an epoch. Its retractions share one rank:
        the order among them is not specified."""
        stale = self.epochs.pop(source, None)
        if stale is None:
            return None
        self.rank += 1
        count = 0
        for key in stale:
            if self._retract(key, 1 << source, b""):
                count += 1
        return count

    def op(self, source: int, op: tuple[object, ...], metadata: bytes) -> None:
        name, kind, n, payload = op
        assert isinstance(kind, int) and isinstance(n, int)
        self.rank += 1
        key, bit = (kind, n), 1 << source
        entity = self.state.get(key)
        if name == "retract":
            self._retract(key, bit, metadata)
            return
        if name == "assert":
            assert isinstance(payload, tuple)
            values = payload + DEFAULTS[len(payload) :]
        else:
            assert isinstance(payload, dict)
            base = list(entity.values) if entity else list(DEFAULTS)
            for i, v in payload.items():
                base[i] = v
            values = tuple(base)
        self.state[key] = Entity((entity.source_set if entity else 0) | bit, values)
        self._touch(key, metadata)
        if source in self.epochs:
            self.epochs[source].discard(key)

    def _retract(self, key: Key, bit: int, metadata: bytes) -> bool:
        entity = self.state.get(key)
        if entity is None or not entity.source_set & bit:
            return False  # changes nothing (and is no touch)
        remaining = entity.source_set & ~bit
        if remaining:
            self.state[key] = Entity(remaining, entity.values)
        else:
            del self.state[key]
        self._touch(key, metadata)
        return True

    def _touch(self, key: Key, metadata: bytes) -> None:
        self.touched.setdefault(key, self.rank)
        self.metadata[key] = metadata

    def notes(self, before: dict[Key, Entity], kind: int) -> list[list[tuple[object, ...]]]:
        """The window's net changes of ``kind``, grouped by first-touch rank in order
        (a group has more than one change only for one epoch END's retractions)."""
        groups: dict[int, list[tuple[object, ...]]] = {}
        for key, rank in sorted(self.touched.items(), key=lambda item: item[1]):
            if key[0] != kind:
                continue
            old, new = before.get(key), self.state.get(key)
            meta = self.metadata[key]
            note: tuple[object, ...]
            if new is None and old is not None:
                note = (key[1], "deleted", 0, None, 0, None, meta)
            elif new is not None and old is None:
                note = (key[1], "created", new.source_set, new.values, 0b11, None, meta)
            elif (
                new is not None
                and old is not None
                and (new.source_set, new.values)
                != (
                    old.source_set,
                    old.values,
                )
            ):
                changed = sum(1 << i for i in range(2) if old.values[i] != new.values[i])
                note = (key[1], "updated", new.source_set, new.values, changed, old.values, meta)
            else:
                continue  # no net change: no notification
            groups.setdefault(rank, []).append(note)
        return list(groups.values())


def as_tuple(note: StateChange) -> tuple[object, ...]:
    n = note.entity_id[0]
    if note.change is ChangeType.DELETED:
        return (n, "deleted", note.source_set, None, note.changed_fields, None, note.metadata)
    if note.change is ChangeType.CREATED:
        return (
            n,
            "created",
            note.source_set,
            tuple(decode_record(FIELDS, note.record)),
            note.changed_fields,
            None,
            note.metadata,
        )
    assert note.previous is not None
    return (
        n,
        "updated",
        note.source_set,
        tuple(decode_record(FIELDS, note.record)),
        note.changed_fields,
        tuple(decode_record(FIELDS, note.previous)),
        note.metadata,
    )


def check_in_order(got: list[tuple[object, ...]], groups: list[list[tuple[object, ...]]]) -> None:
    """``got`` is the groups' notes in group order (any order inside a group)."""
    assert len(got) == sum(map(len, groups)), (got, groups)
    at = 0
    for group in groups:
        part = got[at : at + len(group)]
        assert sorted(part, key=repr) == sorted(group, key=repr), (got, groups)
        at += len(group)


def engine_op(kinds: list[KindInfo], op: tuple[object, ...], metadata: bytes) -> WriteOp:
    name, kind_index, n, payload = op
    kind, entity = kinds[kind_index], eid(n)  # type: ignore[index, arg-type]
    if name == "assert":
        return assert_op(kind, entity, payload, metadata)  # type: ignore[arg-type]
    if name == "patch":
        return patch_op(kind, entity, payload, metadata)  # type: ignore[arg-type]
    return retract_op(kind, entity, metadata)


async def run_engine(data_dir: Path, windows: list[list[tuple[object, ...]]]) -> None:
    config = EngineConfig(maintenance_interval_ms=0, sync=SyncPolicy("none"))
    engine = await Engine.open(data_dir, config)
    kinds_engine = await KindsEngine.open(engine, KindsConfig(coalesce_ms=60_000))
    tk = kinds_engine.tenant(0)
    kinds = [await tk.create_kind(f"k{i}", FIELDS) for i in range(KINDS)]
    sources = [tk.connect(f"s{i}", source_id=i) for i in range(SOURCES)]
    subs = [tk.subscribe(k.kind_id) for k in kinds]
    await tk.flush()
    model = Model()
    versions: dict[tuple[int, bytes], int] = {}
    last_version = -1
    for w, window in enumerate(windows):
        before = model.new_window()
        for i, (name, source_index, sub_ops, refused) in enumerate(window):
            source = sources[source_index]  # type: ignore[index]
            assert isinstance(source_index, int)
            if name == "begin":
                tk.begin_epoch(source)
                model.begin(source_index)
            elif name == "end":
                expected = model.end(source_index)
                try:
                    count, _ = tk.end_epoch(source)
                except NoEpoch:
                    assert expected is None
                else:
                    assert count == expected
            else:
                assert isinstance(sub_ops, list)
                # Every sub-op has metadata of its own, so the notification shows which
                # op was the last on its entity.
                metas = [f"w{w}i{i}o{j}".encode() for j in range(len(sub_ops))]
                ops = [engine_op(kinds, op, meta) for op, meta in zip(sub_ops, metas, strict=True)]
                if refused:
                    with pytest.raises(KindNotFound):
                        tk.apply(source, [*ops, RetractOp(UNKNOWN_KIND, eid(0))])
                    continue  # nothing of it applied: the model skips it as well
                tk.apply(source, ops)
                for op, meta in zip(sub_ops, metas, strict=True):
                    model.op(source_index, op, meta)
        await tk.flush()
        window_versions: list[int] = []
        for k, (kind, sub) in enumerate(zip(kinds, subs, strict=True)):
            notes = sub.take_buffered()
            assert all(isinstance(n, StateChange) for n in notes)
            changes = [n for n in notes if isinstance(n, StateChange)]
            check_in_order([as_tuple(n) for n in changes], model.notes(before, k))
            kind_versions = [n.version for n in changes]
            assert kind_versions == sorted(set(kind_versions))  # handed out in order
            for note in changes:
                key = (kind.kind_id, note.entity_id)
                assert note.version > versions.get(key, -1)  # strictly increasing
                versions[key] = note.version
            window_versions += kind_versions
        if window_versions:
            assert min(window_versions) > last_version  # after every earlier window
            last_version = max(window_versions)
    current = {
        (k, e.entity_id[0]): Entity(e.source_set, e.values)
        for k, kind in enumerate(kinds)
        for e in tk.scan(kind.kind_id)
    }
    assert current == model.state
    await kinds_engine.close()
    await engine.close()
    # A restart rebuilds the same state.
    engine = await Engine.open(data_dir, config)
    kinds_engine = await KindsEngine.open(engine, KindsConfig(coalesce_ms=60_000))
    tk = kinds_engine.tenant(0)
    again = {
        (k, e.entity_id[0]): Entity(e.source_set, e.values)
        for k, kind in enumerate(kinds)
        for e in tk.scan(kind.kind_id)
    }
    assert again == model.state
    await kinds_engine.close()
    await engine.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(WINDOWS)
def test_engine_matches_model(windows: list[list[tuple[object, ...]]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(run_engine(Path(tmp), windows))


NUMERIC = [t for t in FieldType if t not in (FieldType.BOOL, FieldType.STRING, FieldType.BYTES)]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from(list(FieldType)), min_size=1, max_size=6),
    st.randoms(use_true_random=False),
)
def test_record_codec_matches_the_general_codec(types: list[FieldType], rnd: object) -> None:
    """The struct fast path gives exactly the general decoder's values and bytes."""
    assert isinstance(rnd, random.Random)
    fields = tuple(FieldSpec(f"f{i}", t) for i, t in enumerate(types))
    values = [_random_value(t, rnd) for t in types]
    data = encode_fields(fields, values)
    codec = codec_for(fields)
    assert codec.decode_assert(data) == tuple(decode_fields(fields, data, complete=True))
    assert codec.encode(codec.decode_assert(data)) == data
    prefix = encode_fields(fields, values[:-1])
    assert codec.decode_assert(prefix) == tuple(decode_fields(fields, prefix, complete=True))
    assert codec.is_complete(data) == all(t in NUMERIC for t in types)


def _random_value(t: FieldType, rnd: random.Random) -> object:
    if t is FieldType.BOOL:
        return rnd.random() < 0.5
    if t is FieldType.STRING:
        return "s" * rnd.randrange(4)
    if t is FieldType.BYTES:
        return b"b" * rnd.randrange(4)
    if t in (FieldType.F32, FieldType.F64):
        return rnd.uniform(-1e6, 1e6)
    bits = {FieldType.U8: 8, FieldType.U16: 16, FieldType.U32: 32, FieldType.U64: 64}.get(t)
    if bits is not None:
        return rnd.randrange(1 << bits)
    bits = {FieldType.I8: 8, FieldType.I16: 16, FieldType.I32: 32}.get(t, 64)
    return rnd.randrange(-(1 << (bits - 1)), 1 << (bits - 1))
