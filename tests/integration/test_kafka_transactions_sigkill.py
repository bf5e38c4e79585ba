"""A real ``headwater serve`` SIGKILLed while a confluent-kafka transactional producer
commits consume-transform-produce transactions through its Kafka listener, then started
again on the same data directory: every transaction is wholly visible or wholly absent,
every transaction whose commit_transaction() returned is visible, and the group offset
committed inside a transaction is visible exactly when its records are.

The application (kafka_txn_driver.py, a process of its own) turns input record ``k``
into one transaction writing ``k`` to 24 partitions of two topics plus the group offset
``k + 1`` (and, for every third ``k``, an aborted transaction before it). It stops after
flushing each transaction until the test lets it end it, so each round's kill lands at a
chosen point of the chosen transaction:

* ``before_end``: the transaction flushed, EndTxn never sent (recovery aborts it);
* ``decision``: EndTxn sent, killed the moment the coordinator's state stream grows (the
  PrepareCommit record is written, no marker yet, or a few);
* ``markers``: killed the moment the first of the 24 markers lands in an output
  partition.

After each kill the server is started again and the outputs are read read_committed
three ways (a confluent-kafka consumer, HTTP, SQL) and the group's offset two ways
(confluent-kafka, HTTP). With exactly-once, every output partition must hold exactly
``0, 1, ..., C-1`` where C is the committed offset: a transaction visible without its
offset (or the reverse) shows as a duplicate or a gap after the application resumes
from C. Rounds repeat until the server's log shows it finished a transaction left
PrepareCommit, so the recovery of a half-written commit is shown, not assumed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from kafka_txn_driver import GROUP, INPUT, OUTPUTS, TARGETS
from servers import LOCAL, Server

DRIVER = Path(__file__).with_name("kafka_txn_driver.py")
INPUT_RECORDS = 400
MAX_ROUNDS = 30  # stops once both were seen (3-6 rounds so far)
MIN_ROUNDS = 3  # every kill point at least once
KILL_POINTS = ("before_end", "decision", "markers")
DEADLINE_S = 30.0

pytestmark = pytest.mark.slow


def bootstrap(server: Server) -> str:
    return server.address_of("kafka")


def http(server: Server, path: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://{server.address_of('http')}{path}",
        data=data,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=DEADLINE_S) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{path}: {exc.code} {exc.read().decode()}") from None


def stream_dirs(server: Server) -> dict[str, Path]:
    """Each stream's directory in tenant 0, by name (read from its stream.json)."""
    streams = server.data_dir / "tenants" / "0" / "streams"
    return {
        json.loads((d / "stream.json").read_text())["name"]: d
        for d in streams.iterdir()
        if (d / "stream.json").exists()
    }


def log_sizes(paths: list[Path]) -> dict[Path, int]:
    return {f: f.stat().st_size for d in paths for f in d.glob("partition-*/*.log")}


def kill_when_grown(server: Server, paths: list[Path], go: Callable[[], None]) -> int:
    """Call ``go``, then SIGKILL the server the moment the logs under ``paths`` grow
    (polled without pause: the window is milliseconds wide); how many of the partition
    logs had grown by the time it died."""
    before = log_sizes(paths)
    total = sum(before.values())
    go()
    while sum(log_sizes(paths).values()) <= total:
        if not server.running:
            raise AssertionError(f"the server died by itself:\n{server.log_tail()}")
    server.kill()
    after = log_sizes(paths)
    return sum(1 for f, size in after.items() if size > before.get(f, 0))


def run_round(
    server: Server, transactional_id: str, kill_at: int, point: str
) -> tuple[set[int], int]:
    """Run the application until the ``kill_at``-th committing transaction of this run
    has flushed, kill the server at ``point`` of its end, then the application; the
    records whose commit_transaction() returned, and how many of the watched partition
    logs had grown when the server died."""
    proc = subprocess.Popen(
        [sys.executable, str(DRIVER), bootstrap(server), transactional_id],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdin is not None and proc.stdout is not None
    stdin = proc.stdin

    def go() -> None:
        stdin.write(b"go\n")
        stdin.flush()

    committed: set[int] = set()
    commits_flushed = 0
    try:
        for raw in proc.stdout:
            word, *args = raw.decode().split()
            if word == "ended" and args[1] == "commit":
                committed.add(int(args[0]))
            if word != "flushed":
                continue
            outcome = args[1]
            commits_flushed += outcome == "commit"
            if commits_flushed < kill_at or outcome != "commit":
                go()
            elif point == "before_end":
                server.kill()
                return committed, 0
            else:
                # The coordinator's state stream exists once a transaction began.
                dirs = stream_dirs(server)
                names = ["hw_transaction_state"] if point == "decision" else list(OUTPUTS)
                return committed, kill_when_grown(server, [dirs[n] for n in names], go)
        raise AssertionError(f"the application exited with {proc.wait()} before the kill")
    finally:
        proc.kill()
        proc.wait()


def committed_offset(server: Server) -> int:
    """The group's offset of the input, asked over Kafka and over HTTP (they agree)."""
    consumer = Consumer({"bootstrap.servers": bootstrap(server), "group.id": GROUP})
    try:
        (found,) = consumer.committed([TopicPartition(INPUT, 0)], DEADLINE_S)
    finally:
        consumer.close()
    over_kafka = max(found.offset, 0)
    groups = http(server, "/api/consumer-groups")["partition_groups"]
    over_http = [g["committed_offset"] for g in groups if g["group"] == GROUP]
    assert over_http == ([over_kafka] if over_kafka else []), (over_kafka, groups)
    return over_kafka


def read_over_kafka(server: Server) -> dict[tuple[str, int], list[str]]:
    """Every output partition read_committed to its end by a confluent-kafka consumer."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap(server),
            "group.id": "txn_checker",
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            "enable.auto.commit": False,
        }
    )
    seen: dict[tuple[str, int], list[str]] = {target: [] for target in TARGETS}
    at_end: set[tuple[str, int]] = set()
    try:
        consumer.assign([TopicPartition(topic, p, 0) for topic, p in TARGETS])
        while len(at_end) < len(TARGETS):
            message = consumer.poll(DEADLINE_S)
            assert message is not None, f"no end of partitions seen; ended {sorted(at_end)}"
            topic, partition, value = message.topic(), message.partition(), message.value()
            assert topic is not None and partition is not None
            error = message.error()
            if error is not None:
                assert error.code() == KafkaError._PARTITION_EOF, error
                at_end.add((topic, partition))
            else:
                assert value is not None
                seen[(topic, partition)].append(value.decode())
    finally:
        consumer.close()
    return seen


def read_over_http(server: Server) -> dict[tuple[str, int], list[str]]:
    seen = {}
    for topic, p in TARGETS:
        answer = http(server, f"/api/streams/{topic}/events?partition={p}&limit=10000")
        seen[(topic, p)] = [e["value"] for e in answer["events"]]
    return seen


def read_over_sql(server: Server) -> dict[tuple[str, int], list[str]]:
    seen: dict[tuple[str, int], list[str]] = {target: [] for target in TARGETS}
    for topic in OUTPUTS:
        answer = http(
            server,
            "/api/sql",
            {"sql": f'SELECT "partition", data FROM {topic} ORDER BY "partition", "offset"'},
        )
        for partition, data in answer["rows"]:
            seen[(topic, partition)].append(bytes.fromhex(data).decode())
    return seen


def create_topics(server: Server) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap(server)})
    topics = [NewTopic(INPUT, 1)] + [NewTopic(t, count) for t, count in OUTPUTS.items()]
    for future in admin.create_topics(topics).values():
        future.result(DEADLINE_S)
    producer = Producer({"bootstrap.servers": bootstrap(server), "linger.ms": 5})
    for k in range(INPUT_RECORDS):
        producer.produce(INPUT, str(k).encode(), partition=0)
    assert producer.flush(DEADLINE_S) == 0


def test_sigkilled_server_leaves_every_kafka_transaction_all_or_nothing(tmp_path: Path) -> None:
    server = Server(tmp_path, listen={"kimberlite": "", "http": LOCAL, "kafka": LOCAL})
    server.start()
    try:
        create_topics(server)
        committed: set[int] = set()
        finished_prepared = partial_markers = 0
        for round_ in range(MAX_ROUNDS):
            point = KILL_POINTS[round_ % len(KILL_POINTS)]
            done, grown = run_round(server, "txn_app", 2 + round_ % 3, point)
            committed |= done
            if point == "markers" and grown < len(TARGETS):
                partial_markers += 1  # killed with some markers written, not all
            server.start()
            offset = committed_offset(server)
            expected = [str(k) for k in range(offset)]
            readers = {
                "kafka": read_over_kafka(server),
                "http": read_over_http(server),
                "sql": read_over_sql(server),
            }
            for how, seen in readers.items():
                for target, values in seen.items():
                    # All of 0..offset-1 once each in order: no transaction partial (a
                    # gap on some partition), none aborted visible, none past the
                    # offset visible (it would be written again: a duplicate) and none
                    # below it missing.
                    assert values == expected, (
                        f"round {round_} ({point}), {how} {target}: committed offset "
                        f"{offset}, read {values}"
                    )
            lost = sorted(k for k in committed if k >= offset)
            assert not lost, f"round {round_} ({point}): committed transactions {lost} lost"
            log = server.log_text()
            finished_prepared = log.count("left PrepareCommit")
            if finished_prepared and partial_markers and round_ + 1 >= MIN_ROUNDS:
                break
        assert finished_prepared, (
            f"no kill in {MAX_ROUNDS} rounds landed after a commit decision was stored"
        )
        assert partial_markers, f"no kill in {MAX_ROUNDS} rounds landed among the markers"
        assert committed, "no commit_transaction() ever returned"
        assert "aborting transaction 'txn_app' left open by a restart" in log
        assert "Traceback" not in log
    finally:
        server.kill()
