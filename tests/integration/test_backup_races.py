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
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from servers import LOCAL, Server

import headwater.cli.backup as backup_module
from waiting import wait_until

LISTEN = {"http": LOCAL, "kafka": LOCAL}
TOPIC = "orders"


def http_get(server: Server, path: str) -> Any:
    with urllib.request.urlopen(f"http://{server.address_of('http')}{path}", timeout=30) as a:
        return json.loads(a.read())


def http_post(server: Server, path: str, body: Any) -> Any:
    request = urllib.request.Request(
        f"http://{server.address_of('http')}{path}",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


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
) -> None:
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


@contextmanager
def restored(root: Path) -> Iterator[Server]:
    server = Server(root, listen=dict(LISTEN)).start()
    try:
        yield server
    finally:
        assert server.stop() == 0, server.log_tail()


def test_a_group_offset_committed_during_the_backup_is_not_past_the_copied_log(
    make_server: Callable[..., Server], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
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
        end = http_get(source, f"/api/streams/{TOPIC}")["next_offset"]
        consumer.commit(offsets=[TopicPartition(TOPIC, 0, end)], asynchronous=False)

    produce_and_commit(10)  # the offsets log exists (created after the topic)
    backup_acting_after_the_topic(
        source, tmp_path / "copy" / "data", monkeypatch, lambda: produce_and_commit(5)
    )
    consumer.close()

    with restored(tmp_path / "copy") as server:
        end = http_get(server, f"/api/streams/{TOPIC}")["next_offset"]
        groups = http_get(server, "/api/consumer-groups")["partition_groups"]
        (billing,) = [g for g in groups if g["group"] == "billing"]
        assert 10 <= billing["committed_offset"] <= end, (end, billing)


def test_a_transaction_committed_during_the_backup_does_not_hang_in_the_copy(
    make_server: Callable[..., Server], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = source_with_topic(make_server)
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
    producer.produce(TOPIC, value=b"in the transaction", partition=0)
    assert producer.flush(30) == 0  # stored, the transaction open
    backup_acting_after_the_topic(
        source,
        tmp_path / "copy" / "data",
        monkeypatch,
        lambda: producer.commit_transaction(30),  # its marker is not in the copy
    )

    with restored(tmp_path / "copy") as server:
        http_post(server, f"/api/streams/{TOPIC}/events", ["after the restore"])
        # Ended by the server's start (before it listens), not by a timeout: stable at
        # once. It once stayed at the transaction's batch for good.
        (partition,) = http_get(server, f"/api/streams/{TOPIC}")["partition_offsets"]
        assert partition["last_stable_offset"] == partition["next_offset"], partition
        assert "no coordinator record ends" in server.log_text()

        consumer = Consumer(
            {
                "bootstrap.servers": server.address_of("kafka"),
                "group.id": "after-restore",
                "isolation.level": "read_committed",
            }
        )
        consumer.assign([TopicPartition(TOPIC, 0, 0)])
        values: list[bytes] = []

        def read_to_the_new_event() -> bool:
            for message in consumer.consume(10, 1):
                assert message.error() is None, message.error()
                values.append(message.value())
            return b"after the restore" in values

        wait_until(read_to_the_new_event, message=lambda: f"read_committed read {values}")
        consumer.close()
        # Not committed when its partition was copied: aborted there, never shown.
        assert values == [b"after the restore"]
