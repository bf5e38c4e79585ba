"""Property test: the kind engine's record fast path agrees with its general path.

A fixed-width kind's ASSERTs arrive two ways. A BATCH of whole records off the wire is
one ``AssertRecords`` op (``(entity_id, record)`` pairs, window entries kept as plain
tuples, committed state as tuples, notifications as columns); the same writes as
``assert_op`` objects take the general path (a ``_Work`` per entity, values decoded).
Random windows of ASSERT batches, PATCHes and RETRACTs from several sources, with
epochs, go through one engine each way; both must give the same notifications (as
StateChange objects, changed fields included), the same state and, after a restart,
the same state again.
"""

from __future__ import annotations

import asyncio
import struct
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from headwater.engine.engine import Engine, EngineConfig
from headwater.engine.kinds import (
    AssertRecords,
    KindsConfig,
    KindsEngine,
    StateChange,
    TenantKinds,
    WriteOp,
    assert_op,
    patch_op,
    retract_op,
)
from headwater.engine.kinds import commit as service
from headwater.protocols.convergedb import messages as wire
from headwater.protocols.convergedb.fields import FieldType
from headwater.protocols.convergedb.ops import from_wire
from headwater.storage.log import SyncPolicy

FIELDS = [("n", FieldType.U32), ("x", FieldType.F64)]
RECORD = struct.Struct("<Id")
SOURCES = 3
ENTITIES = 5

values = st.tuples(st.integers(0, 2), st.sampled_from([0.0, -0.0, 1.0]))
assert_batch = st.tuples(
    st.just("asserts"),
    st.integers(0, SOURCES - 1),
    st.lists(st.tuples(st.integers(0, ENTITIES - 1), values), min_size=1, max_size=6),
)
patch = st.tuples(
    st.just("patch"), st.integers(0, SOURCES - 1), st.tuples(st.integers(0, ENTITIES - 1), values)
)
retract = st.tuples(st.just("retract"), st.integers(0, SOURCES - 1), st.integers(0, ENTITIES - 1))
epoch = st.tuples(st.sampled_from(["begin", "end"]), st.integers(0, SOURCES - 1), st.none())
WINDOWS = st.lists(
    st.lists(st.one_of(assert_batch, assert_batch, patch, retract, epoch), max_size=8),
    min_size=1,
    max_size=5,
)


def eid(n: int) -> bytes:
    return bytes([n]) * 32


def as_tuple(change: StateChange) -> tuple[object, ...]:
    return (
        change.entity_id,
        int(change.change),
        change.version,
        change.source_set,
        change.changed_fields,
        change.record,
        change.previous,
    )


async def run(root: Path, windows: list[list[tuple]], fast: bool) -> tuple[list, list, list]:  # type: ignore[type-arg]
    config = EngineConfig(maintenance_interval_ms=0, sync=SyncPolicy("none"))
    engine = await Engine.open(root, config)
    kinds = await KindsEngine.open(engine, KindsConfig(coalesce_ms=60_000))
    tk = kinds.tenant(0)
    kind = await tk.create_kind("k", FIELDS)
    sources = [tk.connect(f"s{i}", source_id=i) for i in range(SOURCES)]
    sub = tk.subscribe(kind.kind_id, include_previous=True)
    await tk.flush()
    notes: list[tuple[object, ...]] = []
    took_fast = False
    for window in windows:
        for op_name, source_id, arg in window:
            source = sources[source_id]
            if op_name == "asserts":
                ops: list[WriteOp]
                if fast:
                    batch = wire.Batch(
                        [wire.Assert(kind.kind_id, eid(e), RECORD.pack(*v)) for e, v in arg]
                    )
                    decoded = wire.Batch.decode(batch.encode())
                    ops = from_wire(decoded.ops, tk.kind)
                    took_fast = took_fast or isinstance(ops[0], AssertRecords)
                else:
                    ops = [assert_op(kind, eid(e), list(v)) for e, v in arg]
                source.apply(ops)
            elif op_name == "patch":
                e, v = arg
                source.apply([patch_op(kind, eid(e), {0: v[0], 1: v[1]})])
            elif op_name == "retract":
                source.apply([retract_op(kind, eid(arg))])
            elif op_name == "begin":
                tk.begin_epoch(source)
            else:
                if source.source_id in tk.epochs:
                    tk.end_epoch(source)
        await tk.flush()
        notes.extend(as_tuple(n) for n in sub.take_buffered() if isinstance(n, StateChange))
    assert not fast or took_fast or not any(o[0] == "asserts" for w in windows for o in w)
    state = snapshot(tk, kind.kind_id)
    await kinds.close()
    await engine.close()
    engine = await Engine.open(root, config)
    kinds = await KindsEngine.open(engine, KindsConfig(coalesce_ms=60_000))
    reopened = snapshot(kinds.tenant(0), kind.kind_id)
    await kinds.close()
    await engine.close()
    return notes, state, reopened


def snapshot(tk: TenantKinds, kind_id: int) -> list[tuple[object, ...]]:
    return sorted(
        (s.entity_id, s.version, s.source_set, s.record, s.values) for s in tk.scan(kind_id)
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(WINDOWS)
def test_record_fast_path_agrees_with_general_path(windows: list[list[tuple]]) -> None:  # type: ignore[type-arg]
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        fast = asyncio.run(run(Path(a), windows, fast=True))
        general = asyncio.run(run(Path(b), windows, fast=False))
    assert fast[0] == general[0]  # notifications, in order
    assert fast[1] == general[1]  # state
    assert fast[2] == fast[1]  # state after a restart
    assert general[2] == general[1]


# Windows of whole-record ASSERTs only, after one that creates every entity: each window
# is then all updates (many of them no change at all, values being few), the shape the
# columnar flush (service._columnar_changes) takes instead of the per-entity pass.
UPDATE_WINDOWS = st.lists(st.lists(assert_batch, min_size=1, max_size=4), min_size=1, max_size=5)
CREATE_ALL = [("asserts", 0, [(e, (0, 0.0)) for e in range(ENTITIES)])]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(UPDATE_WINDOWS)
def test_columnar_flush_agrees_with_general_path(windows: list[list[tuple]]) -> None:  # type: ignore[type-arg]
    plans: list[object] = []
    real = service._columnar_changes

    def spy(state: Any, entities: Any, first: int) -> Any:
        plan = real(state, entities, first)
        if state.info.name == "k" and entities:  # not the presence kind, not empty
            plans.append(plan)
        return plan

    with (
        tempfile.TemporaryDirectory() as a,
        tempfile.TemporaryDirectory() as b,
        mock.patch.object(service, "_columnar_changes", spy),
    ):
        fast = asyncio.run(run(Path(a), [CREATE_ALL, *windows], fast=True))
        assert plans and None not in plans  # every window took the columnar flush
        plans.clear()
        general = asyncio.run(run(Path(b), [CREATE_ALL, *windows], fast=False))
        assert set(plans) == {None}  # _Work entries: the per-entity pass
    assert fast[0] == general[0]  # notifications, in order, changed fields included
    assert fast[1] == general[1]  # state
    assert fast[2] == fast[1]  # state after a restart: the changelog values are right
    assert general[2] == general[1]
