"""Transactions in the engine: markers, read_committed, fencing, offsets, recovery."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from headwater.engine.engine import Engine, EngineConfig, StreamSettings
from headwater.engine.groups.errors import OffsetMetadataTooLarge
from headwater.engine.groups.offsets import CommittedOffset, LogOffsetStore, OffsetKey
from headwater.engine.transactions import (
    FIRST_PRODUCER_ID,
    TRANSACTIONAL_ID_EXPIRATION_MS,
    ProducerIdentity,
    TenantTransactions,
    TransactionCoordinator,
    TxnState,
)
from headwater.errors import InvalidTxnState, OutOfOrderSequence, ProducerFenced

CONFIG = EngineConfig(maintenance_interval_ms=0)


def run(tmp_path: Path, body: Callable[[Engine], Awaitable[None]]) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        try:
            await body(engine)
        finally:
            await engine.close()

    asyncio.run(main())


async def values(
    engine: Engine, stream_id: int, partition: int = 0, isolation: str = "read_committed"
) -> list[tuple[int, bytes]]:
    result = await engine.read(0, stream_id, 0, 1 << 30, partition=partition, isolation=isolation)
    return [(e.offset, e.value) for e in result.events()]


def test_the_seeds_read_committed_example(tmp_path: Path) -> None:
    """Offsets 0-5: 0 plain, 1 of a transaction later aborted, 2 of one later committed,
    3 and 4 their markers, 5 plain. read_uncommitted sees {0,1,2,5}, read_committed
    {0,2,5}; before the markers read_committed stops at the open transaction (LSO 1)."""

    async def body(engine: Engine) -> None:
        sid = (await engine.create_stream(0, "s")).stream_id
        txns = await TenantTransactions.open(engine, 0)
        aborting = await txns.init_producer("t1")
        committing = await txns.init_producer("t2")
        await engine.append(0, sid, [b"p0"])
        await txns.append("t1", aborting, sid, 0, [b"a1"])
        await txns.append("t2", committing, sid, 0, [b"c2"])
        assert await values(engine, sid) == [(0, b"p0")]
        assert engine.stream(0, sid).log.last_stable_offset == 1
        await txns.end_transaction("t1", aborting, commit=False)
        assert await values(engine, sid) == [(0, b"p0")]  # t2 still open at 2
        await txns.end_transaction("t2", committing, commit=True)
        await engine.append(0, sid, [b"p5"])
        assert engine.stream(0, sid).log.end_offset == 6
        uncommitted = await values(engine, sid, isolation="read_uncommitted")
        assert [o for o, _ in uncommitted] == [0, 1, 2, 5]
        committed = await values(engine, sid)
        assert committed == [(0, b"p0"), (2, b"c2"), (5, b"p5")]

    run(tmp_path, body)


def test_the_last_stable_offset_never_falls_below_the_start_retention_leaves(
    tmp_path: Path,
) -> None:
    """Retention may remove an open transaction's first batch: read_committed's end
    (ListOffsets latest) must not point below the kept start, as Kafka clamps it, or a
    consumer starting at the end is sent to an offset that is gone."""

    async def body(engine: Engine) -> None:
        settings = StreamSettings(segment_bytes=1024, retention_bytes=2048, sync="none")
        sid = (await engine.create_stream(0, "s", settings)).stream_id
        log = engine.stream(0, sid).log
        txns = await TenantTransactions.open(engine, 0)
        producer = await txns.init_producer("open")
        await txns.append("open", producer, sid, 0, [b"t0"])
        for i in range(100):
            await engine.append(0, sid, [b"plain-%03d" % i])
        assert log.enforce_retention() > 0
        start = log.start_offset
        assert start > 0 and log.last_stable_offset == start
        assert await values(engine, sid) == []  # nothing past it until the end
        await txns.end_transaction("open", producer, commit=True)
        assert log.last_stable_offset == log.end_offset
        assert [o for o, _ in await values(engine, sid)] == list(range(start, 101))

    run(tmp_path, body)


def test_commit_spans_streams_and_partitions_and_abort_leaves_nothing(tmp_path: Path) -> None:
    async def body(engine: Engine) -> None:
        a = (await engine.create_stream(0, "a", StreamSettings(partitions=3))).stream_id
        b = (await engine.create_stream(0, "b")).stream_id
        txns = await TenantTransactions.open(engine, 0)
        producer = await txns.init_producer("job")
        targets = [(a, 0), (a, 2), (b, 0)]
        for k, (sid, part) in enumerate(targets):
            await txns.append("job", producer, sid, 0, [f"x{k}".encode()], partition=part)
        for sid, part in targets:
            assert await values(engine, sid, part) == []
        await txns.end_transaction("job", producer, commit=True)
        assert [await values(engine, sid, part) for sid, part in targets] == [
            [(0, b"x0")],
            [(0, b"x1")],
            [(0, b"x2")],
        ]
        # The next transaction of the same producer (sequences go on) is aborted.
        for sid, part in targets:
            await txns.append("job", producer, sid, 1, [b"gone"], partition=part)
        await txns.end_transaction("job", producer, commit=False)
        await engine.append(0, b, [b"after"])
        for sid, part in targets:
            seen = [v for _, v in await values(engine, sid, part)]
            assert b"gone" not in seen
            every = [v for _, v in await values(engine, sid, part, "read_uncommitted")]
            assert b"gone" in every
        assert [v for _, v in await values(engine, b)] == [b"x2", b"after"]
        assert txns.state("job") == TxnState.COMPLETE_ABORT

    run(tmp_path, body)


def test_offsets_committed_inside_a_transaction_come_with_it(tmp_path: Path) -> None:
    async def body(engine: Engine) -> None:
        src = (await engine.create_stream(0, "in")).stream_id
        out = (await engine.create_stream(0, "out")).stream_id
        await engine.append(0, src, [b"e0", b"e1"])
        txns = await TenantTransactions.open(engine, 0)
        producer = await txns.init_producer("ctp")
        await txns.append("ctp", producer, out, 0, [b"E0"])
        await txns.add_offsets("ctp", producer, "g", {("in", 0): (1, "m")})
        await txns.end_transaction("ctp", producer, commit=False)
        store = await LogOffsetStore.open(engine, 0)
        assert await store.load() == {}
        await txns.append("ctp", producer, out, 1, [b"E0"])
        await txns.add_offsets("ctp", producer, "g", {("in", 0): (1, "m")})
        await txns.end_transaction("ctp", producer, commit=True)
        loaded = await store.load()
        assert {k: v.offset for k, v in loaded.items()} == {OffsetKey("g", "in", 0): 1}
        assert [v for _, v in await values(engine, out)] == [b"E0"]
        assert src != out

    run(tmp_path, body)


def test_a_new_instance_fences_the_old_and_aborts_its_transaction(tmp_path: Path) -> None:
    async def body(engine: Engine) -> None:
        sid = (await engine.create_stream(0, "s")).stream_id
        txns = await TenantTransactions.open(engine, 0)
        old = await txns.init_producer("app")
        await txns.append("app", old, sid, 0, [b"zombie"])
        new = await txns.init_producer("app")
        assert new == ProducerIdentity(old.producer_id, old.epoch + 2)  # abort bumped too
        with pytest.raises(ProducerFenced):
            await txns.append("app", old, sid, 1, [b"late"])
        with pytest.raises(ProducerFenced):
            await txns.end_transaction("app", old, commit=True)
        # Even straight at the partition, the old epoch is refused (the abort marker
        # carried the bumped epoch).
        with pytest.raises(ProducerFenced):
            await engine.append(
                0, sid, [b"direct"], producer=(old.producer_id, 1), producer_epoch=old.epoch
            )
        await txns.append("app", new, sid, 0, [b"fresh"])
        await txns.end_transaction("app", new, commit=True)
        assert [v for _, v in await values(engine, sid)] == [b"fresh"]

    run(tmp_path, body)


def test_a_producer_near_kafkas_last_epoch_gets_a_new_id(tmp_path: Path) -> None:
    """Kafka's producer epoch is an int16: the epoch never passes 32,767. At 32,766 an
    InitProducerId hands out a new producer id at epoch 0 (the last bump is fencing's),
    and the old identity is fenced. Before, epochs went on to 2**32 - 1: past 32,767 a
    Kafka client's InitProducerId got no answer (it could not be encoded), and every
    Fetch of a partition holding the transaction's batches failed."""

    async def body(engine: Engine) -> None:
        sid = (await engine.create_stream(0, "s")).stream_id
        txns = await TenantTransactions.open(engine, 0)
        first = await txns.init_producer("app")
        txns.transactions["app"].epoch = 32_765  # as after 32,765 restarts
        near = await txns.init_producer("app")
        assert near == ProducerIdentity(first.producer_id, 32_766)
        await txns.append("app", near, sid, 0, [b"open"])  # fencing bumps once more
        new = await txns.init_producer("app")
        assert new.producer_id != first.producer_id and new.epoch == 0
        with pytest.raises(InvalidTxnState, match="not transactional id 'app''s"):
            await txns.append("app", near, sid, 1, [b"late"])
        await txns.append("app", new, sid, 0, [b"fresh"])
        await txns.end_transaction("app", new, commit=True)
        assert [v for _, v in await values(engine, sid)] == [b"fresh"]
        everything = await values(engine, sid, isolation="read_uncommitted")
        assert [v for _, v in everything] == [b"open", b"fresh"]

    run(tmp_path, body)


def test_an_idle_transactional_id_expires_and_stays_forgotten(tmp_path: Path) -> None:
    """As Kafka's transactional.id.expiration.ms: an id idle for 7 days is forgotten (a
    producer taking a fresh id per run grew the coordinator for good), durably (its
    record tombstoned: a restart does not bring it back), and its next InitProducerId
    starts anew. An id in use, or used within the 7 days, is kept."""
    now = [1_000_000]

    async def body(engine: Engine) -> None:
        sid = (await engine.create_stream(0, "s")).stream_id
        txns = await TenantTransactions.open(engine, 0, clock_ms=lambda: now[0])
        old = await txns.init_producer("old-job")
        await txns.append("old-job", old, sid, 0, [b"done"])
        await txns.end_transaction("old-job", old, commit=True)
        now[0] += TRANSACTIONAL_ID_EXPIRATION_MS // 2
        recent = await txns.init_producer("recent-job")
        busy = await txns.init_producer("busy-job")
        await txns.append("busy-job", busy, sid, 0, [b"open"])  # open: never expired
        assert await txns.expire_idle() == []
        now[0] += TRANSACTIONAL_ID_EXPIRATION_MS // 2 + 1
        assert await txns.expire_idle() == ["old-job"]
        assert txns.state("old-job") is None
        # After the tombstone, a record of the producer id counter: compaction may take
        # the expired ids' records, which were the only ones holding it (a restart then
        # handed their producer ids out again).
        state = await engine.read(0, txns.stream_id, 0, 1 << 30, internal=True)
        last = list(state.events())[-1]
        counter = json.loads(last.value)["next_producer_id"]
        assert not last.tombstone and counter > max(old.producer_id, busy.producer_id)
        assert txns.state("recent-job") is not None and txns.state("busy-job") is not None
        reopened = await TenantTransactions.open(engine, 0, clock_ms=lambda: now[0])
        assert reopened.state("old-job") is None
        assert reopened.state("recent-job") is not None
        again = await reopened.init_producer("old-job")
        assert again.producer_id not in (old.producer_id, recent.producer_id, busy.producer_id)
        assert again.epoch == 0
        assert [v for _, v in await values(engine, sid)] == [b"done"]

    run(tmp_path, body)


def test_the_coordinators_expiry_tells_the_front_ends_which_ids_went(tmp_path: Path) -> None:
    # What a front end keeps per transactional id (Rivven's binding) is let go with it.
    now = [5_000]

    async def body(engine: Engine) -> None:
        coordinator = TransactionCoordinator(engine, clock_ms=lambda: now[0])
        heard: list[tuple[int, str]] = []
        coordinator.expiry_listeners.append(lambda t, tid: heard.append((t, tid)))
        txns = await coordinator.tenant(0)
        await txns.init_producer("nightly-1")
        await coordinator.expire()
        assert heard == []
        now[0] += TRANSACTIONAL_ID_EXPIRATION_MS + 1
        await coordinator.expire()
        assert heard == [(0, "nightly-1")] and txns.state("nightly-1") is None

    run(tmp_path, body)


def test_retried_batches_are_stored_once_and_gaps_refused(tmp_path: Path) -> None:
    async def body(engine: Engine) -> None:
        sid = (await engine.create_stream(0, "s")).stream_id
        txns = await TenantTransactions.open(engine, 0)
        producer = await txns.init_producer("r")
        first = await txns.append("r", producer, sid, 0, [b"a", b"b"])
        again = await txns.append("r", producer, sid, 0, [b"a", b"b"])
        assert (again.base_offset, again.count) == (first.base_offset, first.count)
        with pytest.raises(OutOfOrderSequence):
            await txns.append("r", producer, sid, 2, [b"skip"])
        await txns.end_transaction("r", producer, commit=True)
        assert [v for _, v in await values(engine, sid)] == [b"a", b"b"]
        # An idempotent producer without a transactional id: ids from the coordinator.
        plain = await txns.init_producer()
        assert plain.producer_id >= FIRST_PRODUCER_ID and plain.epoch == 0
        columns = {"producer_epoch": plain.epoch}
        one = await engine.append(0, sid, [b"i"], producer=(plain.producer_id, 0), **columns)
        two = await engine.append(0, sid, [b"i"], producer=(plain.producer_id, 0), **columns)
        assert one.base_offset == two.base_offset
        assert [v for _, v in await values(engine, sid)] == [b"a", b"b", b"i"]

    run(tmp_path, body)


def test_misuse_is_refused(tmp_path: Path) -> None:
    async def body(engine: Engine) -> None:
        sid = (await engine.create_stream(0, "s")).stream_id
        txns = await TenantTransactions.open(engine, 0)
        with pytest.raises(InvalidTxnState):
            await txns.append("nobody", ProducerIdentity(1, 0), sid, 0, [b"x"])
        producer = await txns.init_producer("t")
        with pytest.raises(InvalidTxnState):
            await txns.append("t", ProducerIdentity(producer.producer_id + 1, 0), sid, 0, [b"x"])
        await txns.end_transaction("t", producer, commit=True)  # empty: a no-op
        await txns.append("t", producer, sid, 0, [b"x"])
        await txns.end_transaction("t", producer, commit=False)
        await txns.end_transaction("t", producer, commit=False)  # a retried end
        with pytest.raises(InvalidTxnState):
            await txns.end_transaction("t", producer, commit=True)
        assert await values(engine, sid) == []

    run(tmp_path, body)


def test_timeout_aborts_and_fences(tmp_path: Path) -> None:
    async def body(engine: Engine) -> None:
        sid = (await engine.create_stream(0, "s")).stream_id
        now = [1_000]
        txns = await TenantTransactions.open(engine, 0, clock_ms=lambda: now[0])
        producer = await txns.init_producer("slow", timeout_ms=500)
        await txns.append("slow", producer, sid, 0, [b"x"])
        now[0] += 500
        assert await txns.abort_expired() == []
        now[0] += 1
        assert await txns.abort_expired() == ["slow"]
        assert engine.stream(0, sid).log.last_stable_offset == 2  # data and marker
        with pytest.raises(ProducerFenced):
            await txns.end_transaction("slow", producer, commit=True)
        assert await values(engine, sid) == []

    run(tmp_path, body)


def test_restart_finishes_prepared_and_aborts_open_transactions(tmp_path: Path) -> None:
    """What a SIGKILL leaves: one transaction whose commit decision is stored but no
    marker written, one open. After the restart the first is wholly visible, the second
    wholly absent, and producer ids go on from where they were."""

    async def before(engine: Engine) -> None:
        sid = (await engine.create_stream(0, "s", StreamSettings(partitions=2))).stream_id
        txns = await TenantTransactions.open(engine, 0)
        deciding = await txns.init_producer("deciding")
        hanging = await txns.init_producer("hanging")
        for part in (0, 1):
            await txns.append("deciding", deciding, sid, 0, [b"kept"], partition=part)
            await txns.append("hanging", hanging, sid, 0, [b"dropped"], partition=part)
        txn = txns.transactions["deciding"]
        txn.state = TxnState.PREPARE_COMMIT
        await txns._store(txn)  # the decision, then the crash before any marker

    async def after(engine: Engine) -> None:
        sid = engine.stream_by_name(0, "s").stream_id
        for part in (0, 1):
            assert await values(engine, sid, part) == []  # both still open in the log
        txns = await TenantTransactions.open(engine, 0)
        assert txns.recovered == 2
        assert txns.state("deciding") == TxnState.COMPLETE_COMMIT
        assert txns.state("hanging") == TxnState.COMPLETE_ABORT
        for part in (0, 1):
            assert [v for _, v in await values(engine, sid, part)] == [b"kept"]
        assert (await txns.init_producer()).producer_id == FIRST_PRODUCER_ID + 2

    run(tmp_path, before)
    run(tmp_path, after)


def test_a_start_aborts_a_transaction_no_coordinator_record_ends(tmp_path: Path) -> None:
    """A partition holding a transaction open whose coordinator state says it ended
    (a copy taken as it ended, its marker not copied): nothing would ever end it, its
    last stable offset stuck at the batch. The start aborts it there."""

    async def before(engine: Engine) -> None:
        sid = (await engine.create_stream(0, "s")).stream_id
        txns = await TenantTransactions.open(engine, 0)
        producer = await txns.init_producer("t")
        await txns.append("t", producer, sid, 0, [b"left open"])
        txn = txns.transactions["t"]
        txn.state = TxnState.COMPLETE_COMMIT  # the state as copied, the marker not
        txn.partitions.clear()
        await txns._store(txn)

    async def after(engine: Engine) -> None:
        sid = engine.stream_by_name(0, "s").stream_id
        log = engine.stream(0, sid).log
        assert log.last_stable_offset == 0  # stuck at the open batch
        txns = await TenantTransactions.open(engine, 0)
        assert txns.recovered == 1
        assert log.last_stable_offset == log.end_offset
        await engine.append(0, sid, [b"after"])
        assert [v for _, v in await values(engine, sid)] == [b"after"]

    run(tmp_path, before)
    run(tmp_path, after)


def test_the_aborted_index_survives_restart(tmp_path: Path) -> None:
    async def before(engine: Engine) -> None:
        sid = (await engine.create_stream(0, "s")).stream_id
        txns = await TenantTransactions.open(engine, 0)
        producer = await txns.init_producer("t")
        await txns.append("t", producer, sid, 0, [b"no"])
        await txns.end_transaction("t", producer, commit=False)
        await engine.append(0, sid, [b"yes"])

    async def after(engine: Engine) -> None:
        sid = engine.stream_by_name(0, "s").stream_id
        assert [v for _, v in await values(engine, sid)] == [b"yes"]
        aborted = engine.stream(0, sid).log.producers.aborted_between(0, 10)
        assert [(r.first_offset, r.last_offset) for r in aborted] == [(0, 1)]

    run(tmp_path, before)
    run(tmp_path, after)


def test_group_offsets_sink_is_pluggable(tmp_path: Path) -> None:
    async def body(engine: Engine) -> None:
        sid = (await engine.create_stream(0, "s")).stream_id
        got: list[dict[OffsetKey, CommittedOffset]] = []

        async def sink(tenant_id: int, offsets: dict[OffsetKey, CommittedOffset]) -> None:
            got.append(dict(offsets))

        txns = await TenantTransactions.open(engine, 0, offsets_sink=sink)
        producer = await txns.init_producer("t")
        await txns.append("t", producer, sid, 0, [b"x"])
        # Metadata past Kafka's offset.metadata.max.bytes is refused here too, and the
        # transaction's offsets are as they were (TxnOffsetCommit had no such check).
        with pytest.raises(OffsetMetadataTooLarge):
            await txns.add_offsets("t", producer, "g", {("s", 0): (4, "m" * 4097)})
        await txns.add_offsets("t", producer, "g", {("s", 0): (5, "")})
        await txns.end_transaction("t", producer, commit=True)
        assert [{k: v.offset for k, v in batch.items()} for batch in got] == [
            {OffsetKey("g", "s", 0): 5}
        ]

    run(tmp_path, body)


def test_compaction_keeps_the_committed_value_over_an_aborted_one(tmp_path: Path) -> None:
    async def body(engine: Engine) -> None:
        settings = StreamSettings(cleanup_policy="compact", segment_bytes=4096)
        sid = (await engine.create_stream(0, "c", settings)).stream_id
        txns = await TenantTransactions.open(engine, 0)
        producer = await txns.init_producer("t")
        await engine.append(0, sid, [b"committed"], keys=[b"k"])
        await txns.append("t", producer, sid, 0, [b"aborted"], keys=[b"k"])
        await txns.end_transaction("t", producer, commit=False)
        plog = engine.stream(0, sid).log
        while len(plog.segments) < 2:  # fill up to a sealed segment
            await engine.append(0, sid, [b"x" * 512], keys=[b"filler"])
        result = await asyncio.get_running_loop().run_in_executor(None, plog.compact)
        assert result.events_removed > 0
        seen = {e.key: e.value for e in (await engine.read_events(0, sid, 0, 10_000))}
        assert seen[b"k"] == b"committed"
        every = await engine.read(0, sid, 0, 1 << 30, isolation="read_uncommitted")
        assert b"aborted" not in [e.value for e in every.events()]  # removed by compaction

    run(tmp_path, body)


def test_a_foreign_record_in_the_state_stream_is_skipped(tmp_path: Path) -> None:
    async def before(engine: Engine) -> None:
        sid = (await engine.create_stream(0, "s")).stream_id
        txns = await TenantTransactions.open(engine, 0)
        producer = await txns.init_producer("t")
        await txns.append("t", producer, sid, 0, [b"x"])
        await txns.end_transaction("t", producer, commit=True)
        # Front ends can no longer reach the stream; a data directory may still hold
        # what an older version let them write.
        state = engine.stream_by_name(0, "hw_transaction_state", internal=True).stream_id
        await engine.append(0, state, [b"not json"], keys=[b"t"], internal=True)
        await engine.append(0, state, [b"{}"], keys=[b"u"], internal=True)

    async def after(engine: Engine) -> None:
        txns = await TenantTransactions.open(engine, 0)
        assert txns.state("t") == TxnState.COMPLETE_COMMIT
        assert txns.state("u") is None
        again = await txns.init_producer("t")
        assert again.epoch == 1

    run(tmp_path, before)
    run(tmp_path, after)
