"""The consume-transform-produce application the Kafka SIGKILL transaction test runs
against a real server it kills: confluent-kafka, exactly-once as a Kafka user writes it.

It resumes the group ``GROUP`` at its committed offset of ``INPUT``/0 and, for each input
record ``k``, runs one transaction that writes ``k`` to every partition of ``OUTPUTS`` and
commits the group's offset ``k + 1`` inside it (``send_offsets_to_transaction``). Before
every third record's committed transaction comes one that writes ``a<k>`` and is aborted.

Each transaction is flushed (every record acknowledged, every partition added), then the
driver says ``flushed <k> commit|abort`` and waits for a line on stdin before ending it,
so the test knows the state of the server at that instant; ``ended <k> commit|abort``
follows once commit_transaction / abort_transaction returned. Run as
``python kafka_txn_driver.py <bootstrap> <transactional id>``; it stops at the end of
the input."""

from __future__ import annotations

import sys

from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

INPUT = "txn_in"
GROUP = "txn_group"
OUTPUTS = {"txn_out": 16, "txn_audit": 8}
TARGETS = [(topic, p) for topic, count in OUTPUTS.items() for p in range(count)]
DEADLINE_S = 30.0


def aborted_first(k: int) -> bool:
    """Whether record ``k`` is first written by a transaction that is aborted."""
    return k % 3 == 2


def main(bootstrap: str, transactional_id: str) -> None:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": GROUP,
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
        }
    )
    (committed,) = consumer.committed([TopicPartition(INPUT, 0)], DEADLINE_S)
    start = max(committed.offset, 0)  # OFFSET_INVALID (-1001) before the first commit
    consumer.assign([TopicPartition(INPUT, 0, start)])
    producer = Producer(
        {"bootstrap.servers": bootstrap, "transactional.id": transactional_id, "linger.ms": 5}
    )
    producer.init_transactions(DEADLINE_S)
    print(f"start {start}", flush=True)
    while True:
        message = consumer.poll(DEADLINE_S)
        if message is None:
            raise SystemExit("no input record within the deadline")
        error = message.error()
        if error is not None:
            if error.code() == KafkaError._PARTITION_EOF:
                return
            raise SystemExit(f"consume failed: {error}")
        value, offset = message.value(), message.offset()
        assert value is not None and offset is not None
        k = int(value)
        outcomes = [False, True] if aborted_first(k) else [True]
        for commit in outcomes:
            producer.begin_transaction()
            output = str(k).encode() if commit else f"a{k}".encode()
            for topic, partition in TARGETS:
                producer.produce(topic, output, partition=partition)
            producer.send_offsets_to_transaction(
                [TopicPartition(INPUT, 0, offset + 1)],
                consumer.consumer_group_metadata(),
                DEADLINE_S,
            )
            if producer.flush(DEADLINE_S):
                raise SystemExit("records still unacknowledged after the deadline")
            word = "commit" if commit else "abort"
            print(f"flushed {k} {word}", flush=True)
            sys.stdin.readline()  # the test's go-ahead
            if commit:
                producer.commit_transaction(DEADLINE_S)
            else:
                producer.abort_transaction(DEADLINE_S)
            print(f"ended {k} {word}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
