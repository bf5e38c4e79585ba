"""``headwater backup`` of a server that commits group offsets and transactions while
the copy runs (docs/operations.md, "Backup and restore").

The backup copies each log in turn, so what happens between two of them is in one and
not the other. Each test makes it happen exactly there, by running the backup in process
with ``copy_partition`` wrapped to act once a data topic is copied:

* a group's committed offset (in the tenant's ``hw_consumer_offsets`` log) must never be
  past the copied events it counts: the group resumes from the copy at or before where
  it was;
* a transaction committed after its partition was copied, before the coordinator's
  state was, once left that partition's last stable offset at its batch for good
  (read_committed readers stuck: no coordinator record ended it); the restored server
  now aborts it there, and never shows what was not committed when the copy was taken.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from servers import LOCAL, Server, http_json

import headwater.cli.backup as backup_module
from waiting import wait_until

LISTEN = {"http": LOCAL, "kafka": LOCAL}
TOPIC = "orders"
LATER_TOPIC = "payments"
INPUT_TOPIC = "requests"


def source_with_topic(make_server: Callable[..., Server]) -> Server:
    source: Server = make_server(listen=dict(LISTEN))
    admin = AdminClient({"bootstrap.servers": source.address_of("kafka")})
    for future in admin.create_topics([NewTopic(TOPIC, 1, 1)]).values():
        future.result(30)
    return source


def backup_acting_after_the_topic(
    source: Server,
    destination: Path,
    monkeypatch: pytest.MonkeyPatch,
    act: Callable[[], None],
) -> backup_module.BackupReport:
    """Back ``source`` up to ``destination``, calling ``act`` once the topic's log is
    copied, before the logs copied after it."""
    original = backup_module.copy_partition
    acted: list[bool] = []

    def copy_then_act(source_dir: Path, staging: Path, plan: Any, report: Any) -> None:
        original(source_dir, staging, plan, report)
        meta = source_dir / plan.relative.parent / "stream.json"
        if not acted and meta.exists() and json.loads(meta.read_text())["name"] == TOPIC:
            act()
            acted.append(True)

    monkeypatch.setattr(backup_module, "copy_partition", copy_then_act)
    destination.parent.mkdir()
    report = backup_module.backup(source.data_dir, destination)
    assert acted and report.ok
    return report


def read_up_to(consumer: Consumer, topic: str, last: bytes) -> list[bytes]:
    """The values of ``topic``'s partition 0 from its start up to ``last``."""
    consumer.assign([TopicPartition(topic, 0, 0)])
    values: list[bytes] = []

    def read_to_last() -> bool:
        for message in consumer.consume(10, 1):
            assert message.error() is None, message.error()
            values.append(message.value())
        return last in values

    wait_until(read_to_last, message=lambda: f"{topic}: read {values}")
    return values


@contextmanager
def restored(root: Path) -> Iterator[Server]:
    server = Server(root, listen=dict(LISTEN)).start()
    try:
        yield server
    finally:
        assert server.stop() == 0, server.log_tail()


def test_a_group_offset_committed_during_the_backup_has_its_events_in_the_copy(
    make_server: Callable[..., Server], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Events appended and an offset committed past them after the topic was copied:
    the offset (copied after the topic) once pointed past the copied log (15 against
    10); the topic is now copied again up to it."""
    source = source_with_topic(make_server)
    bootstrap = source.address_of("kafka")
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "billing", "enable.auto.commit": False}
    )

    def produce_and_commit(count: int) -> None:
        for i in range(count):
            producer.produce(TOPIC, value=f"order {i}".encode(), partition=0)
        assert producer.flush(30) == 0
        end = http_json(source, "GET", f"/api/streams/{TOPIC}")["next_offset"]
        consumer.commit(offsets=[TopicPartition(TOPIC, 0, end)], asynchronous=False)

    produce_and_commit(10)  # the offsets log exists (created after the topic)
    report = backup_acting_after_the_topic(
        source, tmp_path / "copy" / "data", monkeypatch, lambda: produce_and_commit(5)
    )
    consumer.close()
    assert len(report.settled) == 1, report.settled

    with restored(tmp_path / "copy") as server:
        end = http_json(server, "GET", f"/api/streams/{TOPIC}")["next_offset"]
        groups = http_json(server, "GET", "/api/consumer-groups")["partition_groups"]
        (billing,) = [g for g in groups if g["group"] == "billing"]
        assert billing["committed_offset"] == end == 15, (end, billing)


@pytest.mark.parametrize("commit", [True, False], ids=["committed", "aborted"])
@pytest.mark.parametrize("written", ["before", "during"])
def test_a_transaction_ending_during_the_backup_is_whole_in_the_copy(
    make_server: Callable[..., Server],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    commit: bool,
    written: str,
) -> None:
    """Its records written before the backup (TOPIC's copy holds them, open) or during
    it, after TOPIC was copied (its copy holds nothing of it); either way it ends
    before LATER_TOPIC is copied, whose copy holds it ended."""
    source = source_with_topic(make_server)
    bootstrap = source.address_of("kafka")
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(LATER_TOPIC, 1, 1)]).values():
        future.result(30)  # copied after TOPIC (a higher stream id)
    # Consume-transform-produce: the transaction also commits the input it consumed.
    http_json(source, "POST", "/api/streams", {"name": INPUT_TOPIC})
    http_json(source, "POST", f"/api/streams/{INPUT_TOPIC}/events", ["input"])
    pipeline = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "pipeline", "enable.auto.commit": False}
    )
    producer = Producer(
        {
            "bootstrap.servers": source.address_of("kafka"),
            "transactional.id": "backup-race",
            "transaction.timeout.ms": 3000,
            "linger.ms": 0,
        }
    )
    producer.init_transactions(30)
    producer.begin_transaction()

    def write() -> None:
        for topic in (TOPIC, LATER_TOPIC):
            producer.produce(topic, value=b"in the transaction", partition=0)
        assert producer.flush(30) == 0  # stored in both, the transaction open
        producer.send_offsets_to_transaction(
            [TopicPartition(INPUT_TOPIC, 0, 1)], pipeline.consumer_group_metadata(), 30
        )

    if written == "before":
        write()

    def end() -> None:  # TOPIC is copied without its marker, LATER_TOPIC with it
        if written == "during":
            write()
        if commit:
            producer.commit_transaction(30)
        else:
            producer.abort_transaction(30)

    report = backup_acting_after_the_topic(source, tmp_path / "copy" / "data", monkeypatch, end)
    # TOPIC's log, copied again up to the marker it lacked; LATER_TOPIC's had it.
    assert len(report.settled) == 1, report.settled

    expected = [b"in the transaction"] if commit else []
    with restored(tmp_path / "copy") as server:
        consumer = Consumer(
            {
                "bootstrap.servers": server.address_of("kafka"),
                "group.id": "after-restore",
                "isolation.level": "read_committed",
            }
        )
        for topic in (TOPIC, LATER_TOPIC):
            http_json(server, "POST", f"/api/streams/{topic}/events", ["after the restore"])
            # Whole at once: it once stayed open in TOPIC's copy for good, its last
            # stable offset at the batch (read_committed readers stuck there).
            (partition,) = http_json(server, "GET", f"/api/streams/{topic}")["partition_offsets"]
            assert partition["last_stable_offset"] == partition["next_offset"], partition
            values = read_up_to(consumer, topic, b"after the restore")
            # The same in both topics: committed in each, or in neither.
            assert values == [*expected, b"after the restore"], topic
        consumer.close()
        assert "no coordinator record ends" not in server.log_text()
        # Its input consumed with it, or not at all.
        groups = http_json(server, "GET", "/api/consumer-groups")["partition_groups"]
        committed = [g["committed_offset"] for g in groups if g["group"] == "pipeline"]
        assert committed == ([1] if commit else []), groups
    pipeline.close()
