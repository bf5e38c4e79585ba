"""Internal streams (reserved names: headwater's own state) in the engine's lookups: absent
to every caller that does not pass internal=True, exactly as a stream that never existed,
and working for the components that do."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from headwater.engine.engine import Engine, EngineConfig
from headwater.engine.groups.offsets import (
    OFFSETS_STREAM,
    CommittedOffset,
    LogOffsetStore,
    OffsetKey,
)
from headwater.engine.transactions import TXN_STATE_STREAM, TenantTransactions, TxnState
from headwater.errors import InvalidRequest, StreamNotFound

CONFIG = EngineConfig(maintenance_interval_ms=0)


def run(tmp_path: Path, body: Callable[[Engine], Awaitable[None]]) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        try:
            await body(engine)
        finally:
            await engine.close()

    asyncio.run(main())


async def refusals(engine: Engine, stream_id: int) -> list[str]:
    """The message of each public operation on ``stream_id`` (each must refuse it)."""
    attempts: list[Callable[[], Awaitable[object]]] = [
        lambda: engine.append(0, stream_id, [b"x"]),
        lambda: engine.append(0, stream_id, [b"x"], keys=[b"k"], tombstones=[False]),
        lambda: engine.append_encoded(0, stream_id, b"\x01" + bytes(7) + b"x", 1),
        lambda: engine.append_partitioned(0, stream_id, [b"x"], keys=[b"k"]),
        lambda: engine.append_idempotent(0, stream_id, 7, 0, [b"x"]),
        lambda: engine.read(0, stream_id, 0),
        lambda: engine.read_events(0, stream_id, 0),
        lambda: engine.offset_for_timestamp(0, stream_id, 0),
        lambda: engine.alter_partitions(0, stream_id, 2),
        lambda: engine.delete_stream(0, stream_id),
    ]
    messages = []
    for attempt in attempts:
        with pytest.raises(StreamNotFound) as refused:
            await attempt()
        messages.append(str(refused.value))
    with pytest.raises(StreamNotFound) as refused:
        engine.read_now(0, stream_id, 0)
    messages.append(str(refused.value))
    with pytest.raises(StreamNotFound) as refused:
        engine.stream(0, stream_id)
    messages.append(str(refused.value))
    return messages


def test_internal_streams_are_absent_to_public_lookups(tmp_path: Path) -> None:
    async def body(engine: Engine) -> None:
        user = (await engine.create_stream(0, "orders")).stream_id
        txns = await TenantTransactions.open(engine, 0)
        store = await LogOffsetStore.open(engine, 0)
        producer = await txns.init_producer("t")
        await txns.append("t", producer, user, 0, [b"o1"])
        await txns.end_transaction("t", producer, commit=True)
        await store.commit({OffsetKey("g", "orders", 0): CommittedOffset(1, "", 0)})

        for name in (TXN_STATE_STREAM, OFFSETS_STREAM):
            stream = engine.stream_by_name(0, name, internal=True)
            assert stream.internal and stream.log.committed_offset > 0
            # By id: the same refusal, word for word, as an id never used.
            never_used = engine.tenant(0).next_stream_id + 100
            assert await refusals(engine, stream.stream_id) == [
                m.replace(str(never_used), str(stream.stream_id))
                for m in await refusals(engine, never_used)
            ]
            # By name: as a name never used.
            with pytest.raises(StreamNotFound) as hidden:
                engine.stream_by_name(0, name)
            with pytest.raises(StreamNotFound) as absent:
                engine.stream_by_name(0, "never_created")
            assert str(hidden.value) == str(absent.value).replace("never_created", name)
            # Creating one is refused for the name alone (as for any reserved name).
            with pytest.raises(InvalidRequest, match="reserved"):
                await engine.create_stream(0, name)
            # Nothing a refused operation did reached the stream.
            assert not stream.deleted and stream.partitions == 1

        assert [s.name for s in engine.list_streams(0)] == ["orders"]
        assert [s.name for s in engine.all_streams()] == ["orders"]
        assert {s.name for s in engine.all_streams(internal=True)} == {
            "orders",
            TXN_STATE_STREAM,
            OFFSETS_STREAM,
        }
        # A transaction cannot be pointed at the state stream by id either.
        state_id = engine.stream_by_name(0, TXN_STATE_STREAM, internal=True).stream_id
        other = await txns.init_producer("t2")
        with pytest.raises(StreamNotFound):
            await txns.append("t2", other, state_id, 0, [b"garbage"])

    run(tmp_path, body)


def test_internal_users_work_across_a_restart(tmp_path: Path) -> None:
    """The flag comes back from the name at recovery: still hidden, still the owners'."""
    key = OffsetKey("g", "orders", 0)

    async def before(engine: Engine) -> None:
        user = (await engine.create_stream(0, "orders")).stream_id
        txns = await TenantTransactions.open(engine, 0)
        producer = await txns.init_producer("t")
        await txns.append("t", producer, user, 0, [b"o1"])
        await txns.end_transaction("t", producer, commit=True)
        store = await LogOffsetStore.open(engine, 0)
        await store.commit({key: CommittedOffset(1, "m", 0)})

    async def after(engine: Engine) -> None:
        assert [s.name for s in engine.list_streams(0)] == ["orders"]
        for name in (TXN_STATE_STREAM, OFFSETS_STREAM):
            with pytest.raises(StreamNotFound):
                engine.stream_by_name(0, name)
            assert engine.stream_by_name(0, name, internal=True).internal
        txns = await TenantTransactions.open(engine, 0)
        assert txns.state("t") == TxnState.COMPLETE_COMMIT
        assert (await txns.init_producer("t")).epoch == 1
        store = await LogOffsetStore.open(engine, 0)
        assert (await store.load())[key].offset == 1
        # A user stream is never internal, whatever was created before it.
        assert not engine.stream_by_name(0, "orders").internal

    run(tmp_path, before)
    run(tmp_path, after)
