"""A consumer group of three SDK processes over a 6-partition stream while a producer
writes; one member is SIGKILLed half-way. Afterwards every produced record was consumed
(none lost) and every record consumed twice is at or past the killed member's last
commit of its partition: the survivors take over from the committed positions.

The members are ``sdk_group_member.py`` processes, each logging its assignments, the
records it was returned and the commits the server accepted (docs/sdk.md, "Consumer")."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import LOCAL, Server, serving

import headwater
from headwater.client.producer import RecordMetadata
from waiting import wait_until

PARTITIONS = 6
RECORDS = 3_000  # each half: 1,500
MEMBER = Path(__file__).with_name("sdk_group_member.py")
# The dead member is noticed at its 6 s session timeout, then the group rebalances.
TAKEOVER_SECONDS = 60.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("sdk_group_kill"), listen={"rivven": LOCAL, "kimberlite": ""}
    )


class Member:
    def __init__(self, server: Server, log: Path) -> None:
        self.log = log
        self.stderr = log.with_suffix(".err")
        with self.stderr.open("wb") as stderr:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    str(MEMBER),
                    server.address_of("rivven"),
                    "killers",
                    "kill",
                    str(log),
                ],
                stderr=stderr,
            )

    def lines(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        # A line cut short by a SIGKILL has no newline: it was never finished.
        text = self.log.read_text()
        return [line.split() for line in text.splitlines(keepends=True) if line.endswith("\n")]

    def held(self) -> set[int]:
        """The partitions it holds now, from its assign and revoke lines."""
        held: set[int] = set()
        for line in self.lines():
            if line[0] in ("A", "V") and len(line) > 1:
                change = {int(p) for p in line[1].split(",")}
                held = held | change if line[0] == "A" else held - change
        return held

    def consumed(self) -> list[tuple[int, int]]:
        return [
            (int(p), int(o))
            for kind, p, o in (x for x in self.lines() if len(x) == 3)
            if kind == "R"
        ]

    def commits(self, *, since_assignment: bool = False) -> dict[int, int]:
        """Its last accepted commit of each partition (``since_assignment``: of those
        after its latest assignment)."""
        last: dict[int, int] = {}
        for line in self.lines():
            if line[0] == "C":
                last[int(line[1])] = int(line[2])
            elif line[0] == "A" and since_assignment:
                last.clear()
        return last


def each_partition_held_once(members: list[Member]) -> bool:
    held = [p for member in members for p in member.held()]
    return sorted(held) == list(range(PARTITIONS))


def produce(server: Server, first: int, count: int) -> list[RecordMetadata]:
    with headwater.Producer(server.address_of("rivven"), linger_ms=5) as producer:
        futures = [
            producer.send("kill", f"record-{i}".encode(), key=f"key-{i}".encode())
            for i in range(first, first + count)
        ]
        producer.flush()
        return [future.result() for future in futures]


@pytest.mark.slow
def test_a_killed_member_loses_nothing_and_repeats_only_past_its_commits(
    server: Server, tmp_path: Path
) -> None:
    with headwater.Producer(server.address_of("rivven")) as producer:
        producer.create_stream("kill", partitions=PARTITIONS)
    members = [Member(server, tmp_path / f"member{i}.log") for i in range(3)]
    try:
        wait_until(
            lambda: each_partition_held_once(members) and all(m.held() for m in members),
            TAKEOVER_SECONDS,
            lambda: f"held: {[sorted(m.held()) for m in members]}",
        )
        produced = produce(server, 0, RECORDS // 2)
        victim, survivors = members[0], members[1:]
        victim_partitions = victim.held()
        # Killed once it has committed records of every partition it holds.
        wait_until(
            lambda: (
                (commits := victim.commits(since_assignment=True)).keys() >= victim_partitions
                and all(offset > 0 for offset in commits.values())
            ),
            TAKEOVER_SECONDS,
        )
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        produced += produce(server, RECORDS // 2, RECORDS // 2)
        wanted = set(produced)
        wait_until(
            lambda: wanted <= {r for m in members for r in m.consumed()},
            TAKEOVER_SECONDS,
            lambda: f"missing {len(wanted - {r for m in members for r in m.consumed()})}",
        )
        # The survivors hold every partition between them, each exactly once (one may
        # still be taking its new assignment in when the other has read the last record).
        wait_until(
            lambda: each_partition_held_once(survivors),
            TAKEOVER_SECONDS,
            lambda: f"held: {[sorted(m.held()) for m in survivors]}",
        )
        assert victim_partitions & set().union(*(m.held() for m in survivors))
    finally:
        for member in members:
            if member.proc.poll() is None:
                member.proc.send_signal(signal.SIGTERM)
        for member in members:
            member.proc.wait(30)
    for member in members[1:]:
        assert member.proc.returncode == 0, member.stderr.read_text()
        assert member.lines()[-1] == ["closed"]

    consumed = Counter(r for m in members for r in m.consumed())
    assert set(consumed) == set(produced)  # none lost, none made up
    last_commit = victim.commits()
    duplicates = {record for record, times in consumed.items() if times > 1}
    for partition, offset in duplicates:
        # Read twice only where the victim read past its last commit of the partition.
        assert partition in last_commit, (partition, offset)
        assert offset >= last_commit[partition], (partition, offset, last_commit)
        assert (partition, offset) in set(victim.consumed())
    assert all(times <= 2 for times in consumed.values())
    print(
        f"consumed {sum(consumed.values())} for {len(produced)} produced, {len(duplicates)} "
        f"twice; the victim's last commits {last_commit}"
    )
