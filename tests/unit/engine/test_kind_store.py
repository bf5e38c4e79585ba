"""A kind's entity store (engine/kinds/store.py): what a restart reads, what it rebuilds.

A clean close checkpoints everything, so the next open replays nothing; a crash after
the last checkpoint replays only the changelog after it; a store that is missing,
unreadable or ahead of its changelog is rebuilt from the changelog (logged) and answers
as before. A kind with more entities than its hot set serves the rest from the store.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from headwater.engine.engine import Engine, EngineConfig
from headwater.engine.kinds import KindsConfig, KindsEngine, TenantKinds, assert_op, retract_op
from headwater.engine.kinds.service import KINDS_DIR
from headwater.engine.kinds.store import STORE_DIR, KindStore
from headwater.protocols.convergedb.fields import FieldType
from headwater.storage.log import PartitionLog, SyncPolicy

ENGINE = EngineConfig(maintenance_interval_ms=0, sync=SyncPolicy("none"))
FIELDS = [("n", FieldType.I64), ("label", FieldType.STRING)]
HOT = 16
KIND_ID = 2  # the tenant's first kind (its presence kind took id 1)


def eid(n: int) -> bytes:
    return n.to_bytes(32, "big")


async def write(tk: TenantKinds, numbers: range, value: int) -> None:
    kind = await tk.create_kind("k", FIELDS)
    source = tk.connect("w", source_id=1)
    window = source.apply([assert_op(kind, eid(n), [n * value, f"e{n}"]) for n in numbers])
    await window.durable()


def state_of(tk: TenantKinds) -> dict[bytes, tuple[object, ...]]:
    kind_id = tk.get_kind("k").kind_id
    return {s.entity_id: (s.version, s.source_set, s.values) for s in tk.scan(kind_id)}


async def session(root: Path, hot: int = HOT) -> tuple[Engine, KindsEngine, TenantKinds]:
    engine = await Engine.open(root, ENGINE)
    kinds = await KindsEngine.open(engine, KindsConfig(coalesce_ms=5, hot_entities=hot))
    return engine, kinds, kinds.tenant(0)


async def end(engine: Engine, kinds: KindsEngine) -> None:
    await kinds.close()
    await engine.close()


def store_dir(root: Path, tk: TenantKinds) -> Path:
    kind_id = tk.get_kind("k").kind_id
    return root / "tenants" / "0" / KINDS_DIR / str(kind_id) / STORE_DIR


@pytest.fixture
def replayed_from(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The offsets kind ``k``'s changelog is read from (the first: replay at open)."""
    starts: list[int] = []
    events = PartitionLog.events

    def recording(self: PartitionLog, from_offset: int = 0, upto: int | None = None) -> Iterator:  # type: ignore[type-arg]
        if self.directory.parent.name == str(KIND_ID):
            starts.append(from_offset)
        return events(self, from_offset, upto)

    monkeypatch.setattr(PartitionLog, "events", recording)
    return starts


def test_a_clean_restart_replays_nothing_and_reads_cold_entities(
    tmp_path: Path, replayed_from: list[int]
) -> None:
    async def main() -> None:
        engine, kinds, tk = await session(tmp_path)
        await write(tk, range(200), 1)
        assert tk.get_kind("k").kind_id == KIND_ID
        before = state_of(tk)
        await end(engine, kinds)

        replayed_from.clear()
        engine, kinds, tk = await session(tmp_path)
        kind_id = tk.get_kind("k").kind_id
        state = tk.kind_state(kind_id)
        changelog_end = state.log.end_offset
        assert replayed_from[0] == changelog_end  # the checkpoint is the whole changelog
        assert not state.complete and len(state.hot) == 0  # 200 entities > 16 hot
        assert state_of(tk) == before
        assert len(state.hot) <= HOT  # the scan streamed from the store
        assert tk.entity_count(kind_id) == 200
        assert tk.source_entity_count(1) == 200
        got = tk.get(kind_id, eid(150))
        assert got is not None and got.values == (150, "e150")
        first = list(itertools.islice(state.scan_entities(ordered=True), 3))
        assert [s.entity_id for s in first] == [eid(0), eid(1), eid(2)]
        await end(engine, kinds)

    asyncio.run(main())


def test_a_crash_after_the_checkpoint_replays_only_the_tail(
    tmp_path: Path, replayed_from: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        engine, kinds, tk = await session(tmp_path, hot=1_000)
        await write(tk, range(100), 1)
        await end(engine, kinds)  # checkpointed: the store is at the changelog's end

        async def no_checkpoint(self: TenantKinds) -> None:
            return None  # as a SIGKILL: the store never hears of what follows

        with monkeypatch.context() as patch:
            patch.setattr(TenantKinds, "checkpoint", no_checkpoint)
            engine, kinds, tk = await session(tmp_path, hot=1_000)
            kind_id = tk.get_kind("k").kind_id
            checkpointed = tk.kind_state(kind_id).log.end_offset
            kind = tk.get_kind("k")
            source = tk.connect("w", source_id=1)
            ops = [assert_op(kind, eid(n), [n * 7, f"e{n}"]) for n in range(90, 110)]
            await source.apply([*ops, retract_op(kind, eid(5))]).durable()
            after = state_of(tk)
            await end(engine, kinds)
        assert KindStore(store_dir(tmp_path, tk)).meta().offset == checkpointed  # type: ignore[union-attr]

        replayed_from.clear()
        engine, kinds, tk = await session(tmp_path, hot=1_000)
        assert replayed_from[0] == checkpointed  # only what came after the checkpoint
        assert state_of(tk) == after
        assert tk.entity_count(kind_id) == 109
        await end(engine, kinds)

    asyncio.run(main())


def test_a_new_kind_is_checkpointed_at_creation(tmp_path: Path) -> None:
    """A new kind's store has a first (empty) checkpoint from its creation, so a crash
    before its first real one replays the changelog into it instead of rebuilding it."""

    async def main() -> None:
        engine, kinds, tk = await session(tmp_path)
        kind = await tk.create_kind("k", FIELDS)
        meta = tk.kind_state(kind.kind_id).store.meta()
        assert meta is not None and meta.offset == 0 and meta.count == 0
        await end(engine, kinds)

    asyncio.run(main())


@pytest.mark.parametrize("damage", ["missing", "garbage", "ahead"])
def test_a_damaged_store_is_rebuilt_from_the_changelog(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        engine, kinds, tk = await session(tmp_path)
        await write(tk, range(100), 3)
        before = state_of(tk)
        await end(engine, kinds)
        directory = store_dir(tmp_path, tk)
        if damage == "missing":
            shutil.rmtree(directory)
        elif damage == "garbage":
            data = directory / "data.mdb"
            data.write_bytes(b"\xa5" * data.stat().st_size)
        else:  # a store from a changelog that has since lost its tail
            store = KindStore(directory)
            meta = store.meta()
            assert meta is not None
            meta.offset += 1_000
            store.write([], [], meta)
            store.close()

        with caplog.at_level(logging.INFO, logger="headwater.engine.kinds"):
            engine, kinds, tk = await session(tmp_path)
        assert state_of(tk) == before
        assert tk.entity_count(tk.get_kind("k").kind_id) == 100
        messages = [r.getMessage() for r in caplog.records]
        assert any("rebuild" in m or "building the entity store" in m for m in messages)
        await end(engine, kinds)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="headwater.engine.kinds"):
            engine, kinds, tk = await session(tmp_path)  # rebuilt once, then opened
        assert state_of(tk) == before
        assert not any("build" in r.getMessage() for r in caplog.records)
        await end(engine, kinds)

    asyncio.run(main())
