"""A state machine of transactional and plain producers against a model: random
appends, commits, aborts, re-initialisations (fencing), retries and restarts. After
every step read_committed shows exactly the committed transactions' and plain events in
offset order, cut at the first open transaction; read_uncommitted shows every event
stored (markers never); a retried batch is stored once; a fenced producer is refused."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from headwater.engine.engine import Engine, EngineConfig, StreamSettings
from headwater.engine.transactions import ProducerIdentity, TenantTransactions
from headwater.errors import ProducerFenced
from headwater.storage.log import SyncPolicy

CONFIG = EngineConfig(maintenance_interval_ms=0, sync=SyncPolicy("none"))
PARTITIONS = [("a", 0), ("a", 1), ("b", 0)]
IDS = ["t0", "t1"]


@dataclass
class Record:
    value: bytes
    txn: str | None  # transactional id, None for a plain event
    state: str = "open"  # open | committed | aborted (plain: committed)


@dataclass
class Producer:
    identity: ProducerIdentity
    sequences: dict[tuple[str, int], int] = field(default_factory=dict)
    open: bool = False


class Transactions(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="hw-txn-model-"))
        self.loop = asyncio.new_event_loop()
        self.log: dict[tuple[str, int], list[Record]] = {p: [] for p in PARTITIONS}
        self.producers: dict[str, Producer] = {}
        self.fenced: list[tuple[str, ProducerIdentity]] = []
        self.counter = 0
        self.engine, self.txns = self.run(self.open(create=True))

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    async def open(self, create: bool = False) -> tuple[Engine, TenantTransactions]:
        engine = await Engine.open(self.dir, CONFIG)
        if create:
            await engine.create_stream(0, "a", StreamSettings(partitions=2))
            await engine.create_stream(0, "b")
        return engine, await TenantTransactions.open(engine, 0)

    def sid(self, name: str) -> int:
        return self.engine.stream_by_name(0, name).stream_id

    def next_value(self) -> bytes:
        self.counter += 1
        return str(self.counter).encode()

    @rule(tid=st.sampled_from(IDS))
    def init(self, tid: str) -> None:
        old = self.producers.get(tid)
        identity = self.run(self.txns.init_producer(tid))
        if old is not None:
            self.fenced.append((tid, old.identity))
            if old.open:
                self._end(tid, "aborted")
        self.producers[tid] = Producer(identity)

    @precondition(lambda self: bool(self.producers))
    @rule(data=st.data(), where=st.sampled_from(PARTITIONS), retry=st.booleans())
    def append(self, data: st.DataObject, where: tuple[str, int], retry: bool) -> None:
        tid = data.draw(st.sampled_from(sorted(self.producers)))
        producer = self.producers[tid]
        target = where
        sequence = producer.sequences.get(target, 0)
        value = self.next_value()
        name, partition = target
        first = self.run(
            self.txns.append(
                tid, producer.identity, self.sid(name), sequence, [value], partition=partition
            )
        )
        if retry:  # the same batch again: answered from the producer table
            again = self.run(
                self.txns.append(
                    tid, producer.identity, self.sid(name), sequence, [value], partition=partition
                )
            )
            assert (again.base_offset, again.count) == (first.base_offset, first.count)
        producer.sequences[target] = sequence + 1
        producer.open = True
        self.log[target].append(Record(value, tid))

    @rule(where=st.sampled_from(PARTITIONS))
    def plain(self, where: tuple[str, int]) -> None:
        target = where
        name, partition = target
        value = self.next_value()
        self.run(self.engine.append(0, self.sid(name), [value], partition=partition))
        self.log[target].append(Record(value, None, "committed"))

    @precondition(lambda self: any(p.open for p in self.producers.values()))
    @rule(data=st.data(), commit=st.booleans())
    def end(self, data: st.DataObject, commit: bool) -> None:
        tid = data.draw(st.sampled_from(sorted(t for t, p in self.producers.items() if p.open)))
        self.run(self.txns.end_transaction(tid, self.producers[tid].identity, commit))
        self._end(tid, "committed" if commit else "aborted")

    def _end(self, tid: str, state: str) -> None:
        for records in self.log.values():
            for record in records:
                if record.txn == tid and record.state == "open":
                    record.state = state
        self.producers[tid].open = False

    @precondition(lambda self: bool(self.fenced))
    @rule(data=st.data())
    def zombie(self, data: st.DataObject) -> None:
        tid, identity = data.draw(st.sampled_from(self.fenced))
        name, partition = PARTITIONS[0]
        with pytest.raises(ProducerFenced):
            self.run(
                self.txns.append(tid, identity, self.sid(name), 0, [b"zombie"], partition=partition)
            )

    @rule()
    def restart(self) -> None:
        """A restart: recovery aborts every open transaction and bumps its epoch (that
        producer is fenced and must init again); a producer between transactions
        carries on."""
        self.run(self.engine.close())
        self.engine, self.txns = self.run(self.open())
        for tid, producer in list(self.producers.items()):
            if producer.open:
                self._end(tid, "aborted")
                self.fenced.append((tid, producer.identity))
                del self.producers[tid]

    @invariant()
    def reads_match_the_model(self) -> None:
        for (name, partition), records in self.log.items():
            uncommitted = self.read(name, partition, "read_uncommitted")
            assert uncommitted == [r.value for r in records]
            expected = []
            for record in records:
                if record.state == "open":
                    break  # the last stable offset
                if record.state == "committed":
                    expected.append(record.value)
            assert self.read(name, partition, "read_committed") == expected

    def read(self, name: str, partition: int, isolation: str) -> list[bytes]:
        result = self.run(
            self.engine.read(
                0, self.sid(name), 0, 1 << 30, partition=partition, isolation=isolation
            )
        )
        return [e.value for e in result.events()]

    def teardown(self) -> None:
        self.run(self.engine.close())
        self.loop.close()
        shutil.rmtree(self.dir, ignore_errors=True)


Transactions.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_transactions_model = Transactions.TestCase
