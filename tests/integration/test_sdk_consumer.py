"""The SDK's group consumer against a real server's Rivven listener (docs/sdk.md,
"Consumer"): groups that rebalance as members leave (every partition owned by exactly
one member), commit and resume, auto-commit, seek and seek by time, sync and async."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from servers import AUTH_CONFIG, LOCAL, Server, serving

import headwater
from headwater.client.consumer import AsyncConsumer, Consumer, ConsumerRecord, TopicPartition
from headwater.client.errors import ServerUnavailable
from headwater.client.producer import AsyncProducer
from headwater.engine.groups.errors import IllegalGeneration, InvalidSessionTimeout
from headwater.errors import AuthenticationFailed, InvalidRequest, UsageError
from waiting import wait_until, wait_until_async

PARTITIONS = 6
# The server's smallest session timeout; heartbeats often, so rebalances are noticed fast.
GROUP = {"session_timeout_ms": 6_000, "heartbeat_interval_ms": 100, "fetch_max_wait_ms": 100}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("sdk_consumer"), listen={"rivven": LOCAL, "kimberlite": ""}
    )


def rivven(server: Server) -> str:
    return server.address_of("rivven")


def produce(server: Server, stream: str, count: int, partitions: int = PARTITIONS) -> None:
    """``count`` keyed records ``{stream}-{i}`` (key ``k{i}``) into a new stream."""
    with headwater.Producer(rivven(server)) as producer:
        producer.create_stream(stream, partitions=partitions)
        for i in range(count):
            producer.send(stream, f"{stream}-{i}".encode(), key=f"k{i}".encode())
        producer.flush()


def owners(
    consumers: list[Consumer], seen: list[ConsumerRecord] | None = None
) -> dict[TopicPartition, list[int]]:
    """Which consumers hold each partition (polling each once, so rebalances go on;
    the records polled go to ``seen``)."""
    held: dict[TopicPartition, list[int]] = {}
    for index, consumer in enumerate(consumers):
        seen_now = consumer.consume(100, 0.01)
        if seen is not None:
            seen.extend(seen_now)
        for tp in consumer.assignment():
            held.setdefault(tp, []).append(index)
    return held


def each_owned_once(
    consumers: list[Consumer], stream: str, seen: list[ConsumerRecord] | None = None
) -> bool:
    held = owners(consumers, seen)
    wanted = {TopicPartition(stream, p) for p in range(PARTITIONS)}
    return set(held) == wanted and all(len(by) == 1 for by in held.values())


@pytest.mark.parametrize("assignor", ["range", "roundrobin", "cooperative-sticky"])
def test_group_of_three_rebalances_as_members_leave(server: Server, assignor: str) -> None:
    stream = f"shared-{assignor}"
    produce(server, stream, 60)
    assigned: list[list[int]] = [[], [], []]
    seen: list[ConsumerRecord] = []  # what every member polled, all along
    consumers = [Consumer(rivven(server), group_id="three", **GROUP) for _ in range(3)]
    try:
        for index, consumer in enumerate(consumers):
            consumer.subscribe(
                [stream],
                on_assign=lambda tps, i=index: assigned[i].extend(tp.partition for tp in tps),
            )
        wait_until(
            lambda: (
                each_owned_once(consumers, stream, seen)
                and all(len(c.assignment()) == 2 for c in consumers)
            ),
            message=lambda: f"owners: {owners(consumers)}",
        )
        generation = consumers[0].generation
        consumers[2].close()  # leaves the group: the other two take its partitions at once
        survivors = consumers[:2]
        wait_until(
            lambda: (
                each_owned_once(survivors, stream, seen)
                and all(len(c.assignment()) == 3 for c in survivors)
            ),
            message=lambda: f"owners: {owners(survivors)}",
        )
        assert survivors[0].generation > generation
        survivors[1].close()
        wait_until(
            lambda: each_owned_once(survivors[:1], stream, seen),
            message=lambda: f"owners: {owners(survivors[:1])}",
        )
        assert sorted(set(assigned[0])) == list(range(PARTITIONS))
        # Every record was read, and once only: each member committed its positions
        # as it gave its partitions up, and the next owner went on from there.
        wait_until(lambda: survivors[0].consume(100, 0.01) == [] and len(seen) >= 60)
        assert sorted(r.value for r in seen) == sorted(f"{stream}-{i}".encode() for i in range(60))
    finally:
        for consumer in consumers:
            consumer.close()


def test_commit_and_resume(server: Server) -> None:
    produce(server, "resume", 40, partitions=1)
    tp = TopicPartition("resume", 0)
    options = {**GROUP, "enable_auto_commit": False}
    with Consumer(rivven(server), group_id="resumers", **options) as first:
        first.subscribe(["resume"])
        got: list[ConsumerRecord] = []
        wait_until(lambda: got.extend(first.consume(15 - len(got), 0.1)) or len(got) >= 15)
        assert [r.offset for r in got] == list(range(15))
        assert first.committed([tp]) == {tp: None}
        first.commit()
        assert first.committed([tp]) == {tp: 15}
        first.commit({tp: 12})  # explicit offsets: back to 12
        assert first.committed([tp]) == {tp: 12}
        # A member's commit names its generation: one that is over is refused.
        first.aio.generation -= 1
        with pytest.raises(IllegalGeneration):
            first.commit({tp: 1})
        first.aio.generation += 1
        assert first.committed([tp]) == {tp: 12}
    with Consumer(rivven(server), group_id="resumers", **options) as second:
        second.subscribe(["resume"])
        record = wait_until(lambda: second.poll(0.1))
        assert (record.offset, record.value) == (12, b"resume-12")


def test_auto_commit_commits_what_was_returned(server: Server) -> None:
    produce(server, "auto", 10, partitions=1)
    tp = TopicPartition("auto", 0)
    commits: list[dict[TopicPartition, int]] = []
    with Consumer(
        rivven(server),
        group_id="autos",
        auto_commit_interval_ms=50,
        on_commit=lambda offsets, error: commits.append(offsets) if error is None else None,
        **GROUP,
    ) as consumer:
        consumer.subscribe(["auto"])
        got: list[ConsumerRecord] = []
        wait_until(lambda: got.extend(consumer.consume(10, 0.1)) or len(got) >= 10)
        # The next polls commit the position of what was returned.
        wait_until(lambda: consumer.poll(0.01) is None and consumer.committed([tp])[tp] == 10)
        assert commits[-1] == {tp: 10}
    with headwater.Producer(rivven(server)) as producer:
        producer.send("auto", b"auto-10")
    # The next member of the group starts where the commits left off.
    with Consumer(rivven(server), group_id="autos", **GROUP) as again:
        again.subscribe(["auto"])
        record = wait_until(lambda: again.poll(0.1))
        assert (record.offset, record.value) == (10, b"auto-10")


def test_seek_and_seek_by_time(server: Server) -> None:
    async def main() -> None:
        async with AsyncProducer(rivven(server)) as producer:
            await producer.create_stream("timed", partitions=1)
            for i in range(10):  # records at 1,000 ms, 2,000 ms, ... 10,000 ms
                producer.send("timed", f"t{i}".encode(), timestamp=(i + 1) * 1_000)
            await producer.flush()
        tp = TopicPartition("timed", 0)
        async with AsyncConsumer(
            rivven(server), group_id="seekers", enable_auto_commit=False, **GROUP
        ) as consumer:
            consumer.subscribe(["timed"])
            assert await consumer.wait_for_assignment(timeout=15) == [tp]
            assert await consumer.offsets_for_times({tp: 4_500}) == {tp: 4}
            assert await consumer.offsets_for_times({tp: 11_000}) == {tp: None}
            await consumer.seek_to_time(4_500)
            record = await consumer.poll(5)
            assert record is not None
            assert (record.offset, record.value, record.timestamp) == (4, b"t4", 5_000)
            consumer.seek(tp, 1)
            record = await consumer.poll(5)
            assert record is not None and record.offset == 1
            assert consumer.position(tp) == 2
            consumer.seek(tp, 1_000)  # past the end: back to auto_offset_reset's earliest
            record = await consumer.poll(5)
            assert record is not None and record.offset == 0
            # A negative offset is the caller's mistake, said at once (it once surfaced
            # in the next poll or commit as the protobuf library's ValueError).
            for bad in (-1, 1 << 63, True):
                with pytest.raises(UsageError, match="from 0 to 2\\*\\*63-1"):
                    consumer.seek(tp, bad)  # type: ignore[arg-type]
                with pytest.raises(UsageError, match="from 0 to 2\\*\\*63-1"):
                    await consumer.commit({tp: bad})  # type: ignore[dict-item]
            assert consumer.position(tp) == 1  # the refused seek moved nothing
            assert await consumer.committed([tp]) == {tp: None}

    asyncio.run(main())


def test_async_group_reads_with_async_for_and_resumes(server: Server) -> None:
    produce(server, "aio", 24, partitions=3)

    async def main() -> None:
        assigned: list[TopicPartition] = []
        revoked: list[TopicPartition] = []

        async def on_assign(tps: list[TopicPartition]) -> None:
            assigned.extend(tps)

        async with AsyncConsumer(
            rivven(server), group_id="aio-group", auto_commit_interval_ms=50, **GROUP
        ) as consumer:
            consumer.subscribe(["aio"], on_assign=on_assign, on_revoke=revoked.extend)
            values = []
            async for record in consumer:
                values.append(record.value)
                if len(values) == 24:
                    break
            assert sorted(values) == sorted(f"aio-{i}".encode() for i in range(24))
            assert sorted(assigned) == [TopicPartition("aio", p) for p in range(3)]
        assert sorted(revoked) == sorted(assigned)  # close revokes, committing positions
        async with AsyncConsumer(rivven(server), group_id="aio-group", **GROUP) as again:
            committed = await again.committed([("aio", p) for p in range(3)])
            assert sum(offset or 0 for offset in committed.values()) == 24
            again.subscribe(["aio"])
            await wait_until_async(lambda: again.wait_for_assignment(timeout=15))
            # Everything was committed: nothing comes back once the group is joined.
            assert [again.position(tp) for tp in sorted(committed)] == [
                committed[tp] for tp in sorted(committed)
            ]

    asyncio.run(main())


def test_group_limits_are_refused_with_clear_errors(server: Server) -> None:
    async def main() -> None:
        # Below the server's least session timeout (6 s): the first poll raises it.
        async with AsyncConsumer(
            rivven(server), group_id="impatient", session_timeout_ms=1_000
        ) as consumer:
            consumer.subscribe(["shared-limits"])
            with pytest.raises(InvalidSessionTimeout):
                await consumer.poll(15)
        # A group name over 256 bytes: refused by the protocol's name limit.
        async with AsyncConsumer(rivven(server), group_id="g" * 257, **GROUP) as consumer:
            consumer.subscribe(["shared-limits"])
            with pytest.raises(InvalidRequest, match="256"):
                await consumer.poll(15)

    produce(server, "shared-limits", 1)
    asyncio.run(main())


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[Server, Path]]:
    """``[tls]`` (a trustme certificate) and required auth; the server and the CA file."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(
        str(tmp_path / "server.pem")
    )
    config = f"""{AUTH_CONFIG}
[tls]
cert = "{tmp_path / "server.pem"}"
key = "{tmp_path / "server.pem"}"
"""
    listen = {"rivven": LOCAL, "kimberlite": ""}
    for server in serving(tmp_path / "server", config=config, listen=listen):
        yield server, tmp_path / "ca.pem"


def test_tls_and_the_token_the_server_requires(secured: tuple[Server, Path]) -> None:
    server, ca = secured
    address = server.address_of("rivven")
    with pytest.raises(ServerUnavailable, match="tls=True"):
        headwater.Producer(address, token="s3cret", reconnect_attempts=1)  # plain TCP
    with pytest.raises(AuthenticationFailed):
        headwater.Producer(address, ca=ca, token="wrong")
    with pytest.raises(AuthenticationFailed):
        headwater.Producer(address, ca=ca)  # no token: every request is refused
    with headwater.Producer(address, ca=ca, token="s3cret") as producer:
        producer.create_stream("guarded", partitions=2)
        assert producer.send("guarded", b"in", key=b"k").result(15).offset == 0
    with Consumer(address, ca=ca, token="s3cret", group_id="guards", **GROUP) as consumer:
        consumer.subscribe(["guarded"])
        assert wait_until(lambda: consumer.poll(0.1)).value == b"in"


def test_producer_and_group_go_on_across_a_server_restart(tmp_path: Path) -> None:
    server = Server(tmp_path / "restarting", listen={"rivven": LOCAL, "kimberlite": ""}).start()
    try:
        address = server.address_of("rivven")
        producer = headwater.Producer(address)
        consumer = Consumer(address, group_id="restarts", auto_commit_interval_ms=50, **GROUP)
        try:
            producer.create_stream("lasting", partitions=3)
            for i in range(100):
                producer.send("lasting", f"before-{i}".encode(), key=f"k{i}".encode())
            producer.flush()
            consumer.subscribe(["lasting"])
            seen: list[ConsumerRecord] = []
            wait_until(lambda: seen.extend(consumer.consume(100, 0.1)) or len(seen) >= 100)
            consumer.commit()
            server.restart()  # same data and port; the group's members are forgotten
            # The consumer finds its member forgotten and rejoins as a new one, which
            # resumes from the commits (a record returned before the rejoin could come
            # again, its commit refused: docs/sdk.md, so nothing is sent until then).
            wait_until(
                lambda: seen.extend(consumer.consume(100, 0.1)) or consumer.rebalances >= 2,
                message=lambda: f"{consumer.rebalances} assignments, {len(seen)} records",
            )
            # The producer reconnects (its idempotent batches are safe to send again).
            sent = [
                producer.send("lasting", f"after-{i}".encode(), key=f"k{i}".encode())
                for i in range(100)
            ]
            producer.flush()
            assert all(future.result(15) for future in sent)
            wait_until(
                lambda: seen.extend(consumer.consume(100, 0.1)) or len(seen) >= 200,
                message=lambda: f"{len(seen)} records",
            )
            values = sorted(r.value for r in seen)
            assert values == sorted(
                [f"before-{i}".encode() for i in range(100)]
                + [f"after-{i}".encode() for i in range(100)]
            )
            assert producer.reconnects >= 1 and consumer.reconnects >= 1
        finally:
            consumer.close()
            producer.close()
    finally:
        server.stop()


def test_seek_from_on_assign(server: Server) -> None:
    produce(server, "rewound", 10, partitions=1)
    with Consumer(rivven(server), group_id="rewinders", **GROUP) as consumer:
        # confluent-kafka's habit: place the new partitions from the assignment callback
        consumer.subscribe(["rewound"], on_assign=lambda tps: [consumer.seek(tp, 7) for tp in tps])
        record = wait_until(lambda: consumer.poll(0.1))
        assert (record.offset, record.value) == (7, b"rewound-7")
    # and commit from on_revoke, without auto-commit, as Kafka applications do
    tp = TopicPartition("rewound", 0)
    with Consumer(
        rivven(server), group_id="revokers", enable_auto_commit=False, **GROUP
    ) as consumer:
        consumer.subscribe(["rewound"], on_revoke=lambda tps: consumer.commit())
        wait_until(lambda: (r := consumer.poll(0.1)) is not None and r.offset == 3)
    with Consumer(rivven(server), group_id="revokers", **GROUP) as again:
        assert again.committed([tp]) == {tp: 4}
