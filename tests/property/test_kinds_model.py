"""Property test: the kind engine agrees with a plain model of §2's rules.

Random windows of ops (ASSERT with a prefix of fields, PATCH of some fields, RETRACT,
epoch BEGIN/END) from several sources over two kinds go through the real engine, with a
window boundary forced between windows. A model applies the same rules to a dict and
derives each window's net change per entity. Both must agree on the final state, on
the notification stream a subscriber gets (created / updated with changed fields /
deleted, in entity order per window), on epoch retraction counts, and after a restart.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from headwater.engine.engine import Engine, EngineConfig
from headwater.engine.kinds import (
    ChangeType,
    KindInfo,
    KindsConfig,
    KindsEngine,
    NoEpoch,
    StateChange,
    assert_op,
    patch_op,
    retract_op,
)
from headwater.engine.kinds.codec import codec_for
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

VALUE_N = st.integers(min_value=0, max_value=3)
VALUE_S = st.sampled_from(["", "a", "b"])
OP = st.one_of(
    st.tuples(
        st.just("assert"),
        st.integers(0, SOURCES - 1),
        st.integers(0, KINDS - 1),
        st.integers(0, ENTITIES - 1),
        st.one_of(st.tuples(), st.tuples(VALUE_N), st.tuples(VALUE_N, VALUE_S)),
    ),
    st.tuples(
        st.just("patch"),
        st.integers(0, SOURCES - 1),
        st.integers(0, KINDS - 1),
        st.integers(0, ENTITIES - 1),
        st.fixed_dictionaries({}, optional={0: VALUE_N, 1: VALUE_S}),
    ),
    st.tuples(
        st.just("retract"),
        st.integers(0, SOURCES - 1),
        st.integers(0, KINDS - 1),
        st.integers(0, ENTITIES - 1),
        st.none(),
    ),
    st.tuples(st.just("begin"), st.integers(0, SOURCES - 1), st.none(), st.none(), st.none()),
    st.tuples(st.just("end"), st.integers(0, SOURCES - 1), st.none(), st.none(), st.none()),
)
WINDOWS = st.lists(st.lists(OP, max_size=12), min_size=1, max_size=6)


def eid(n: int) -> bytes:
    return bytes([n]) * 32


@dataclass
class Entity:
    source_set: int
    values: tuple[object, ...]


class Model:
    """§2's rules on a dict, and the net change of each window."""

    def __init__(self) -> None:
        self.state: dict[tuple[int, int], Entity] = {}
        self.epochs: dict[int, set[tuple[int, int]]] = {}

    def apply(self, op: tuple[object, ...]) -> int | None:
        name, source = op[0], op[1]
        assert isinstance(source, int)
        bit = 1 << source
        if name == "begin":
            self.epochs[source] = {k for k, e in self.state.items() if e.source_set & bit}
            return None
        if name == "end":
            stale = self.epochs.pop(source, None)
            if stale is None:
                return -1
            count = 0
            for key in sorted(stale):
                entity = self.state.get(key)
                if entity is not None and entity.source_set & bit:
                    self._retract(key, bit)
                    count += 1
            return count
        kind, n = op[2], op[3]
        assert isinstance(kind, int) and isinstance(n, int)
        key = (kind, n)
        entity = self.state.get(key)
        if name == "assert":
            values = op[4]
            assert isinstance(values, tuple)
            full = values + DEFAULTS[len(values) :]
            self.state[key] = Entity((entity.source_set if entity else 0) | bit, full)
        elif name == "patch":
            present = op[4]
            assert isinstance(present, dict)
            base = list(entity.values) if entity else list(DEFAULTS)
            for i, v in present.items():
                base[i] = v
            self.state[key] = Entity((entity.source_set if entity else 0) | bit, tuple(base))
        else:
            if entity is not None and entity.source_set & bit:
                self._retract(key, bit)
            return None
        if source in self.epochs:
            self.epochs[source].discard(key)
        return None

    def _retract(self, key: tuple[int, int], bit: int) -> None:
        entity = self.state[key]
        remaining = entity.source_set & ~bit
        if remaining:
            self.state[key] = Entity(remaining, entity.values)
        else:
            del self.state[key]

    @staticmethod
    def net(
        before: dict[tuple[int, int], Entity], after: dict[tuple[int, int], Entity], kind: int
    ) -> set[tuple[object, ...]]:
        out: set[tuple[object, ...]] = set()
        for key in set(before) | set(after):
            if key[0] != kind:
                continue
            old, new = before.get(key), after.get(key)
            if new is None and old is not None:
                out.add((key[1], "deleted"))
            elif new is not None and old is None:
                out.add((key[1], "created", new.source_set, new.values, 0b11))
            elif (
                new is not None
                and old is not None
                and (new.source_set != old.source_set or new.values != old.values)
            ):
                changed = sum(1 << i for i in range(2) if old.values[i] != new.values[i])
                out.add((key[1], "updated", new.source_set, new.values, changed))
        return out


def as_tuple(note: StateChange, kinds: list[KindInfo]) -> tuple[object, ...]:
    n = note.entity_id[0]
    if note.change is ChangeType.DELETED:
        return (n, "deleted")
    name = "created" if note.change is ChangeType.CREATED else "updated"
    values = tuple(decode_record(FIELDS, note.record))
    return (n, name, note.source_set, values, note.changed_fields)


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
    for window in windows:
        before = dict(model.state)
        for op in window:
            expected = model.apply(op)
            name, source = op[0], sources[op[1]]  # type: ignore[index]
            if name == "begin":
                tk.begin_epoch(source)
            elif name == "end":
                try:
                    count, _ = tk.end_epoch(source)
                except NoEpoch:
                    count = -1
                assert count == expected
            else:
                kind = kinds[op[2]]  # type: ignore[index]
                entity = eid(op[3])  # type: ignore[arg-type]
                if name == "assert":
                    engine_op = assert_op(kind, entity, op[4])  # type: ignore[arg-type]
                elif name == "patch":
                    engine_op = patch_op(kind, entity, op[4])  # type: ignore[arg-type]
                else:
                    engine_op = retract_op(kind, entity)
                tk.apply(source, [engine_op])
        await tk.flush()
        for k, (kind, sub) in enumerate(zip(kinds, subs, strict=True)):
            notes = sub.take_buffered()
            got = [as_tuple(n, kinds) for n in notes if isinstance(n, StateChange)]
            assert len(got) == len(set(got)), "one net change per entity per window"
            assert set(got) == Model.net(before, model.state, k)
            for note in notes:
                assert isinstance(note, StateChange)
                key = (kind.kind_id, note.entity_id)
                assert note.version > versions.get(key, -1)  # strictly increasing
                versions[key] = note.version
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


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
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
