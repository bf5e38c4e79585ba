"""One member of a consumer group, run as its own process by test_sdk_group_kill.py.

``python sdk_group_member.py SERVER GROUP STREAM LOG``: consumes STREAM in GROUP with
the SDK's Consumer (auto-commit) until SIGTERM, and appends to LOG, flushed line by line:
``A p,p,...`` / ``V p,p,...`` when partitions are assigned / revoked, ``R p offset``
for each record returned (written before the next poll, so before any commit covers it)
and ``C p offset`` for each commit the server accepted.
"""

from __future__ import annotations

import signal
import sys
from typing import Any

from headwater.client.consumer import Consumer, TopicPartition


def main() -> None:
    server, group, stream, path = sys.argv[1:5]
    log = open(path, "a", buffering=1)  # noqa: SIM115 (open for the process's life)
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)

    def partitions(tps: list[TopicPartition]) -> str:
        return ",".join(str(tp.partition) for tp in sorted(tps))

    def committed(offsets: dict[TopicPartition, int], error: BaseException | None) -> None:
        if error is None:
            for tp, offset in sorted(offsets.items()):
                log.write(f"C {tp.partition} {offset}\n")

    consumer = Consumer(
        server,
        group_id=group,
        session_timeout_ms=6_000,
        heartbeat_interval_ms=100,
        auto_commit_interval_ms=100,
        fetch_max_wait_ms=100,
        max_poll_records=50,
        on_commit=committed,
    )
    consumer.subscribe(
        [stream],
        on_assign=lambda tps: log.write(f"A {partitions(tps)}\n"),
        on_revoke=lambda tps: log.write(f"V {partitions(tps)}\n"),
    )
    while not stopping:
        records = consumer.consume(50, 0.1)
        if records:
            log.write("".join(f"R {r.partition} {r.offset}\n" for r in records))
    consumer.close()
    log.write("closed\n")


if __name__ == "__main__":
    main()
