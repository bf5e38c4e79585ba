"""Crash recovery with real processes, damaged files and a real server.

* A child process (``crash_writer.py``) appends through the engine with group commit and
  the default fsync policy, printing every acknowledged append; the test SIGKILLs it at
  random moments (during start-up recovery, right after a segment roll, in the middle of
  a compaction pass), restarts it on the same data directory, and checks that every
  acknowledged event is still there byte for byte, that nothing unchecked is served and
  that tenant log positions never go back.
* The tail segment is cut at many byte positions and has random bytes flipped; a sealed
  segment has a byte flipped: recovery keeps exactly the whole, valid batches, and a bad
  batch in a sealed segment is refused, never served, and reported by ``headwater check``.
* ``headwater serve`` stops cleanly on SIGTERM and leaves a data directory that reopens
  to the same streams and events.

Every random choice comes from a seed printed at the start of each test (shown with the
output of a failing test); set HEADWATER_CRASH_SEED to replay one. Kill moments depend on
timing and cannot be replayed exactly.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
from servers import LOCAL, Server

from headwater.engine.engine import Engine, EngineConfig, StreamSettings
from headwater.errors import CorruptBatchError
from headwater.storage.batch import Event, iter_batches
from headwater.storage.check import check_data_dir, check_partition
from headwater.storage.log import LogConfig, PartitionLog
from waiting import wait_until

HERE = Path(__file__).resolve().parent
WRITER = HERE / "crash_writer.py"


def _load_writer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("headwater_crash_writer", WRITER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


cw = _load_writer()

KILLS_PER_MODE = 22  # three modes: 66 SIGKILLs in all
# When each kill lands (besides two runs that just write): see provoke().
SCHEDULES = {
    "plain": ["startup"] * 5 + ["roll"] * 7 + ["acks"] * 8,
    "kafka": ["startup"] * 5 + ["roll"] * 7 + ["acks"] * 8,
    "compact": ["startup"] * 4 + ["roll"] * 5 + ["acks"] * 3 + ["compaction"] * 5 + ["rewrite"] * 3,
}
CHILD_MAX_SECONDS = 60  # a child left alone stops by itself
WAIT_SECONDS = 15.0  # generous: the machine is shared
ENGINE_CONFIG = EngineConfig(maintenance_interval_ms=0)


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("HEADWATER_CRASH_SEED", random.randrange(1 << 32)))
    print(f"HEADWATER_CRASH_SEED={value}")
    return value


# ---- the child process -------------------------------------------------------------------


@dataclass(frozen=True)
class Ack:
    first: int
    count: int
    run: int
    seq: int


class Child:
    """One crash_writer process and what it printed."""

    def __init__(self, data_dir: Path, mode: str, run: int, seed: int, stderr: Path) -> None:
        self.cond = threading.Condition()
        self.ready: tuple[int, int] | None = None  # (stream id, recovered end offset)
        self.acks: list[Ack] = []
        self.compactions_started = 0
        self.compacting = False  # the last marker printed was COMPACTING
        self.done = False
        self.eof = False
        self.stderr_path = stderr
        with open(stderr, "ab") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    str(WRITER),
                    str(data_dir),
                    mode,
                    str(run),
                    str(seed),
                    str(CHILD_MAX_SECONDS),
                ],
                stdout=subprocess.PIPE,
                stderr=err,
            )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for raw in self.proc.stdout:
                if not raw.endswith(b"\n"):
                    break  # a line torn by the kill: not an acknowledgement we saw
                word, *rest = raw.decode().split()
                with self.cond:
                    if word == "ACK":
                        self.acks.append(Ack(*map(int, rest)))
                    elif word == "READY":
                        self.ready = (int(rest[0]), int(rest[1]))
                    elif word == "COMPACTING":
                        self.compacting = True
                        self.compactions_started += 1
                    elif word == "COMPACTED":
                        self.compacting = False
                    elif word == "DONE":
                        self.done = True
                    self.cond.notify_all()
        finally:
            with self.cond:
                self.eof = True
                self.cond.notify_all()

    def wait_for(self, predicate: Callable[[], bool], timeout: float = WAIT_SECONDS) -> bool:
        with self.cond:
            self.cond.wait_for(lambda: predicate() or self.eof, timeout)
            return predicate()

    def kill(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        code = self.proc.wait(timeout=30)
        self.reader.join(timeout=30)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return code

    def stderr_tail(self, lines: int = 30) -> str:
        text = self.stderr_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


def partition_dir(data_dir: Path, stream_id: int) -> Path:
    return data_dir / "tenants" / "0" / "streams" / str(stream_id) / "partition-0"


def segment_count(directory: Path) -> int:
    return sum(1 for name in os.listdir(directory) if name.endswith(".log"))


def seen_within(predicate: Callable[[], bool], timeout: float) -> bool:
    """Whether ``predicate`` held within ``timeout``, polled closely (a kill should land
    right after it), returned as soon as it does."""
    try:
        return wait_until(predicate, timeout, interval=0.0003)
    except AssertionError:
        return False


def wait_for_roll(directory: Path, timeout: float) -> bool:
    """Return as soon as the partition has one more segment than now."""
    before = segment_count(directory)
    mtime = [os.stat(directory).st_mtime_ns]

    def rolled() -> bool:
        now = os.stat(directory).st_mtime_ns  # cheap; a roll creates files
        if now == mtime[0]:
            return False
        mtime[0] = now
        return segment_count(directory) > before

    return seen_within(rolled, timeout)


def wait_for_cleaned_file(directory: Path, timeout: float) -> bool:
    """Return as soon as compaction has a rewritten segment in flight."""
    return seen_within(
        lambda: any(name.endswith(".cleaned") for name in os.listdir(directory)), timeout
    )


def jitter(seconds: float) -> None:
    """Let the writer run on for a random moment before the kill, so kills do not all
    land at the event that was waited for (a sleep on purpose: the writer paces itself,
    and where in its work the SIGKILL lands is what the crash loop varies)."""
    time.sleep(seconds)  # on purpose: where the SIGKILL lands (see above)


# ---- checking a recovered stream ---------------------------------------------------------


def read_all(plog: PartitionLog) -> list[Event]:
    return list(plog.events(0))


def verify_stream(
    events: list[Event], acks: list[Ack], seed: int, mode: str, context: str
) -> dict[str, int]:
    """Check what a recovered stream serves against what the writer acknowledged."""
    # Every event served is one the writer made, byte for byte, at increasing offsets
    # and tenant log positions, and runs never go back (no stale data comes back).
    served: dict[int, tuple[int, int, int]] = {}
    last_key_offset: dict[bytes, int] = {}
    batch_base: dict[tuple[int, int], int] = {}
    prev_offset = prev_position = prev_run = -1
    for event in events:
        where = f"{context}: event at offset {event.offset}"
        assert event.offset > prev_offset, f"{where}: offsets go back"
        assert event.position > prev_position, f"{where}: tenant log positions go back"
        try:
            run, seq, index = cw.parse_value(event.value)
        except ValueError as exc:
            raise AssertionError(f"{where}: served a value the writer never made: {exc}") from None
        spec = cw.batch_spec(seed, mode, run, seq)
        assert index < len(spec.values) and spec.values[index] == event.value, where
        if mode == "compact":
            assert event.key == spec.keys[index], where
            assert event.tombstone == spec.tombstones[index], where
            last_key_offset[event.key] = event.offset
        else:
            assert event.key is None and not event.tombstone, where
        assert run >= prev_run, f"{where}: run {run} after run {prev_run}"
        # The events of one append sit at consecutive offsets from one base.
        base = batch_base.setdefault((run, seq), event.offset - index)
        assert event.offset - index == base, f"{where}: not at offset {base} + {index}"
        served[event.offset] = (run, seq, index)
        prev_offset, prev_position, prev_run = event.offset, event.position, run
    if mode in ("plain", "kafka"):
        # No append is served in part: a batch is whole or absent.
        counts = Counter((run, seq) for run, seq, _ in served.values())
        for (run, seq), count in counts.items():
            spec = cw.batch_spec(seed, mode, run, seq)
            assert count == len(spec.values), f"{context}: run {run} seq {seq} served in part"

    # Every acknowledged event is there, at the offset it was acknowledged with; with
    # compaction it may only be gone when a later event with the same key is served.
    expected: dict[int, tuple[int, int, int]] = {}
    for ack in acks:
        spec = cw.batch_spec(seed, mode, ack.run, ack.seq)
        assert ack.count == len(spec.values), f"{context}: {ack} count"
        for i in range(ack.count):
            ident = (ack.run, ack.seq, i)
            other = expected.setdefault(ack.first + i, ident)
            assert other == ident, f"{context}: offset {ack.first + i} acknowledged twice"
    compacted_away = 0
    for offset, ident in sorted(expected.items()):
        where = f"{context}: acknowledged offset {offset} (run, seq, index) {ident}"
        if offset in served:
            assert served[offset] == ident, f"{where}: serves {served[offset]} instead"
            continue
        assert mode == "compact", f"{where}: missing"
        spec = cw.batch_spec(seed, mode, ident[0], ident[1])
        key = spec.keys[ident[2]]
        assert last_key_offset.get(key, -1) > offset, (
            f"{where}: missing, and no later event has its key {key!r} "
            f"(latest served for that key: {last_key_offset.get(key)})"
        )
        compacted_away += 1
    if mode in ("plain", "kafka"):
        offsets = [e.offset for e in events]
        assert offsets == list(range(len(offsets))), f"{context}: offsets not contiguous"
    return {"served": len(events), "acknowledged": len(expected), "compacted": compacted_away}


def verify_partition(directory: Path, acks: list[Ack], seed: int, mode: str, context: str) -> int:
    """Recover ``directory`` (in place), verify it, close it and run the offline check."""
    plog = PartitionLog.open(directory)
    try:
        end = plog.end_offset
        verify_stream(read_all(plog), acks, seed, mode, context)
    finally:
        plog.close()
    report = check_partition(directory)
    damage = [(s.path.name, s.problems) for s in report.segments if s.problems]
    assert not damage, f"{context}: check after recovery: {damage}"
    return end


def verify_copy(
    data_dir: Path,
    stream_id: int,
    scratch: Path,
    acks: list[Ack],
    seed: int,
    mode: str,
    context: str,
) -> None:
    """Verify a copy, so the next child still recovers the data exactly as killed."""
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(partition_dir(data_dir, stream_id), scratch)
    verify_partition(scratch, acks, seed, mode, context)
    shutil.rmtree(scratch)


def verify_engine(data_dir: Path, name: str, acks: list[Ack], seed: int, mode: str) -> int:
    """Final check through the engine: the stream list, the events, then `check`."""

    async def main() -> tuple[list[Event], list[str]]:
        engine = await Engine.open(data_dir, ENGINE_CONFIG)
        try:
            names = [s.name for s in engine.list_streams(0)]
            stream = engine.stream_by_name(0, name)
            return read_all(stream.log), names
        finally:
            await engine.close()

    events, names = asyncio.run(main())
    assert names == [name]
    stats = verify_stream(events, acks, seed, mode, "final")
    damaged = [r for r in check_data_dir(data_dir) if r.damaged]
    assert not damaged, [(s.path, s.problems) for r in damaged for s in r.segments]
    return stats["acknowledged"]


# ---- the crash loop ------------------------------------------------------------------------


def provoke(
    child: Child,
    strategy: str,
    rng: random.Random,
    data_dir: Path,
    context: str,
    stats: Counter[str],
) -> None:
    """Let the child run until the moment ``strategy`` wants to kill it at."""
    if strategy == "startup":
        # Often lands in recovery: tail scan, index rewrites, tenant.json (which print
        # nothing to wait for).
        jitter(rng.uniform(0.05, 0.6))
        return
    assert child.wait_for(lambda: child.ready is not None), (
        f"{context}: writer not ready\n{child.stderr_tail()}"
    )
    assert child.ready is not None
    part = partition_dir(data_dir, child.ready[0])
    assert child.wait_for(lambda: len(child.acks) > 0), f"{context}: no acks\n{child.stderr_tail()}"
    if strategy == "acks":
        want = rng.randint(1, 400)
        child.wait_for(lambda: len(child.acks) >= want, timeout=5)
        jitter(rng.uniform(0, 0.03))
    elif strategy == "roll":
        # Right after a new segment appears: the roll's files, the first write into it.
        stats["kills right after a roll"] += wait_for_roll(part, timeout=5)
    elif strategy == "compaction":
        started = child.compactions_started
        child.wait_for(lambda: child.compactions_started > started, timeout=5)
        jitter(rng.uniform(0, 0.002))
    elif strategy == "rewrite":
        # A segment rewrite in flight: .cleaned written, not yet renamed over the original.
        stats["kills with a .cleaned file seen"] += wait_for_cleaned_file(part, timeout=5)


def crash_loop(tmp_path: Path, seed: int, mode: str) -> tuple[Counter[str], list[Ack]]:
    rng = random.Random(seed)
    data_dir = tmp_path / "data"
    stderr = tmp_path / "writer.stderr"
    # The first two runs must get going; after that, a shuffled mix of kill moments.
    mix = SCHEDULES[mode]
    schedule = ["acks", "acks", *rng.sample(mix, len(mix))]
    assert len(schedule) == KILLS_PER_MODE
    stats: Counter[str] = Counter()
    acks: list[Ack] = []
    stream_id: int | None = None
    acked_end = 0
    for run, strategy in enumerate(schedule):
        context = f"seed {seed}, {mode} run {run} ({strategy})"
        child = Child(data_dir, mode, run, seed, stderr)
        try:
            provoke(child, strategy, rng, data_dir, context, stats)
        finally:
            code = child.kill()
        assert code == -signal.SIGKILL, f"{context}: writer exited {code}\n{child.stderr_tail()}"
        stats["kills"] += 1
        stats[f"strategy {strategy}"] += 1
        stats["kills mid-compaction"] += child.compacting
        stats["acks"] += len(child.acks)
        if child.ready is None:
            stats["kills before recovery finished"] += 1
        else:
            stream_id = child.ready[0]
            # Recovery found at least everything acknowledged before.
            assert child.ready[1] >= acked_end, f"{context}: recovered end {child.ready}"
        acks.extend(child.acks)
        acked_end = max([acked_end, *(a.first + a.count for a in child.acks)])
        if stream_id is not None and (mode == "compact" or run % 7 == 6):
            verify_copy(data_dir, stream_id, tmp_path / "copy", acks, seed, mode, context)
            stats["intermediate checks"] += 1
    assert stream_id is not None
    stats["final acknowledged events"] = verify_engine(
        data_dir, cw.STREAM_NAMES[mode], acks, seed, mode
    )
    print(dict(stats))
    return stats, acks


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_loop_plain_stream(tmp_path: Path, seed: int) -> None:
    stats, acks = crash_loop(tmp_path, seed, "plain")
    assert stats["kills"] == KILLS_PER_MODE
    assert len(acks) > KILLS_PER_MODE
    assert stats["kills right after a roll"] >= 3, stats


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_loop_kafka_form_stream(tmp_path: Path, seed: int) -> None:
    # Kafka record batches of every codec, stored in Kafka form as a Produce stores
    # them: recovery keeps exactly the whole acknowledged batches.
    stats, acks = crash_loop(tmp_path, seed, "kafka")
    assert stats["kills"] == KILLS_PER_MODE
    assert len(acks) > KILLS_PER_MODE
    assert stats["kills right after a roll"] >= 3, stats


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_loop_compacted_stream(tmp_path: Path, seed: int) -> None:
    stats, acks = crash_loop(tmp_path, seed, "compact")
    assert stats["kills"] == KILLS_PER_MODE
    assert len(acks) > KILLS_PER_MODE
    assert stats["kills right after a roll"] >= 3, stats
    assert stats["kills mid-compaction"] >= 3, stats


# ---- damaged files: a torn or flipped tail, a flipped sealed segment -----------------------

TS0 = 1_700_000_000_000
BASE_OFFSET_FIELD = range(16, 24)  # bytes of a batch header


@dataclass(frozen=True)
class Stored:
    """One batch appended to the prepared log, with where it ended up on disk."""

    base: int
    values: tuple[bytes, ...]
    keys: tuple[bytes | None, ...]
    first_position: int
    timestamp_ms: int
    segment: int = -1  # base offset of its segment
    pos: int = -1  # byte position in the segment file
    length: int = -1

    @property
    def next(self) -> int:
        return self.base + len(self.values)

    def events(self) -> list[tuple[int, int, int, bytes | None, bytes]]:
        return [
            (self.base + i, self.first_position + i, self.timestamp_ms, key, value)
            for i, (key, value) in enumerate(zip(self.keys, self.values, strict=True))
        ]


def as_tuples(
    events: Iterator[Event] | list[Event],
) -> list[tuple[int, int, int, bytes | None, bytes]]:
    return [(e.offset, e.position, e.timestamp_ms, e.key, e.value) for e in events]


def expected_events(batches: list[Stored]) -> list[tuple[int, int, int, bytes | None, bytes]]:
    return [event for batch in batches for event in batch.events()]


def prepare_log(directory: Path, rng: random.Random) -> list[Stored]:
    """A closed log of four or more segments whose tail holds at least 30 batches."""
    plog = PartitionLog.open(directory, LogConfig(segment_bytes=32 << 10))
    appended: dict[int, Stored] = {}
    position = 5000
    seq = 0
    while True:
        count = rng.randint(1, 5)
        values = tuple(
            cw.make_value(7, seq, i, rng.randbytes(rng.choice((0, 3, 40, 100, 300, 900))))
            for i in range(count)
        )
        keys = tuple(None if rng.random() < 0.3 else b"k%d" % rng.randrange(12) for _ in values)
        info = plog.append(values, first_position=position, timestamp_ms=TS0 + seq, keys=keys)
        appended[info.base_offset] = Stored(info.base_offset, values, keys, position, TS0 + seq)
        position += count + rng.randrange(3)  # other streams of the tenant take positions too
        seq += 1
        if seq % 4 == 0:
            plog.sync()
        tail = plog.segments[-1]
        if len(plog.segments) >= 4 and sum(1 for b in appended if b >= tail.base_offset) >= 30:
            break
    plog.close()
    # Where each batch is, from the files themselves.
    located: list[Stored] = []
    for path in sorted(directory.glob("*.log")):
        pos = 0
        for batch in iter_batches(memoryview(path.read_bytes())):
            stored = appended.pop(batch.base_offset)
            located.append(
                Stored(
                    **{
                        **stored.__dict__,
                        "segment": int(path.stem),
                        "pos": pos,
                        "length": batch.length,
                    }
                )
            )
            pos += batch.length
    assert not appended
    return located


@pytest.fixture
def prepared(tmp_path: Path, seed: int) -> tuple[Path, list[Stored], random.Random]:
    rng = random.Random(seed)
    source = tmp_path / "prepared"
    batches = prepare_log(source, rng)
    return source, batches, rng


def fresh_copy(source: Path, tmp_path: Path, name: str) -> Path:
    target = tmp_path / "cases" / name
    shutil.copytree(source, target)
    return target


def seg_path(directory: Path, base: int) -> Path:
    return directory / f"{base:020d}.log"


def reopen_and_check(case: Path, keep: list[Stored], context: str) -> None:
    """The log serves exactly ``keep``, takes a new append, and both survive a reopen."""
    plog = PartitionLog.open(case)
    try:
        assert as_tuples(plog.events(0)) == expected_events(keep), context
        end = keep[-1].next if keep else 0
        assert plog.end_offset == end, context
        info = plog.append([b"after-recovery"], first_position=10**9, timestamp_ms=TS0 + 10**6)
        assert info.base_offset == end, context
    finally:
        plog.close()
    plog = PartitionLog.open(case)
    try:
        events = as_tuples(plog.events(0))
        assert events[:-1] == expected_events(keep), context
        assert events[-1] == (end, 10**9, TS0 + 10**6, None, b"after-recovery"), context
    finally:
        plog.close()
    report = check_partition(case)
    assert not report.damaged, (context, [s.problems for s in report.segments])


def test_truncated_tail_keeps_exactly_the_whole_batches(
    tmp_path: Path, prepared: tuple[Path, list[Stored], random.Random]
) -> None:
    source, batches, rng = prepared
    tail_base = max(b.segment for b in batches)
    tail = [b for b in batches if b.segment == tail_base]
    sealed = [b for b in batches if b.segment != tail_base]
    size = tail[-1].pos + tail[-1].length
    cuts = {0, 1, 63, 64, size - 1, size}
    for batch in rng.sample(tail, 12):
        cuts |= {
            batch.pos,
            batch.pos + 1,
            batch.pos + 8,
            batch.pos + 63,
            batch.pos + 64,
            batch.pos + batch.length - 1,
        }
    cuts |= {rng.randrange(size) for _ in range(20)}
    for n, cut in enumerate(sorted(cuts)):
        case = fresh_copy(source, tmp_path, f"cut-{n}")
        os.truncate(seg_path(case, tail_base), cut)
        keep = sealed + [b for b in tail if b.pos + b.length <= cut]
        reopen_and_check(case, keep, f"cut at byte {cut} of {size}")
        shutil.rmtree(case)


def test_flipped_byte_in_tail_truncates_at_the_bad_batch(
    tmp_path: Path, prepared: tuple[Path, list[Stored], random.Random]
) -> None:
    source, batches, rng = prepared
    tail_base = max(b.segment for b in batches)
    tail = [b for b in batches if b.segment == tail_base]
    sealed = [b for b in batches if b.segment != tail_base]
    for n in range(40):
        victim = rng.choice(tail)
        # Half the flips hit the header: length, CRC, offsets, section lengths.
        within = rng.randrange(64) if n % 2 else rng.randrange(victim.length)
        pos = victim.pos + within
        mask = rng.randrange(1, 256)
        case = fresh_copy(source, tmp_path, f"flip-{n}")
        flip_byte(seg_path(case, tail_base), pos, mask)
        keep = sealed + [b for b in tail if b.pos < victim.pos]
        reopen_and_check(case, keep, f"byte {pos} (batch at {victim.pos}) ^ {mask:#x}")
        shutil.rmtree(case)


def test_flipped_byte_in_sealed_segment_is_never_served(
    tmp_path: Path, prepared: tuple[Path, list[Stored], random.Random]
) -> None:
    source, batches, rng = prepared
    tail_base = max(b.segment for b in batches)
    sealed = [b for b in batches if b.segment != tail_base]
    for n in range(30):
        victim = rng.choice(sealed)
        within = rng.randrange(64) if n % 2 else rng.randrange(victim.length)
        pos = victim.pos + within
        mask = rng.randrange(1, 256)
        context = f"segment {victim.segment}, byte {pos} (batch at {victim.pos}) ^ {mask:#x}"
        case = fresh_copy(source, tmp_path, f"sealed-{n}")
        path = seg_path(case, victim.segment)
        flip_byte(path, pos, mask)

        plog = PartitionLog.open(case)
        try:
            with pytest.raises(CorruptBatchError):
                list(plog.events(victim.base, upto=victim.next))
            with pytest.raises(CorruptBatchError):
                plog.read(victim.base)
            with pytest.raises(CorruptBatchError):
                list(plog.events(0))
            for batch in batches:
                if batch is victim:
                    continue
                try:
                    got = as_tuples(plog.events(batch.base, upto=batch.next))
                except CorruptBatchError:
                    # Only a read that has to walk over the bad batch may fail.
                    assert batch.segment == victim.segment and batch.pos > victim.pos, context
                    continue
                assert got == batch.events(), f"{context}: batch at offset {batch.base}"
            # The rest of the log still works.
            info = plog.append([b"still-writable"], first_position=10**9)
            assert info.base_offset == batches[-1].next
        finally:
            plog.close()
        report = check_partition(case)
        damaged = [s.path.name for s in report.segments if s.problems]
        assert damaged == [path.name], context
        if n == 0:
            result = run_check_cli(case)
            assert result.returncode == 1, result.stdout + result.stderr
            assert path.name in result.stdout, result.stdout
            assert "1 of" in result.stdout and "segments damaged" in result.stdout
        shutil.rmtree(case)
    clean = run_check_cli(source)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "all CRCs and indexes ok" in clean.stdout


def run_check_cli(data_dir: Path, columns: int = 250) -> subprocess.CompletedProcess[str]:
    """The real ``headwater check`` (a wide terminal: rich cuts long cells to fit)."""
    return subprocess.run(
        [sys.executable, "-m", "headwater.cli.main", "check", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": str(columns)},
    )


def flip_byte(path: Path, pos: int, mask: int) -> None:
    data = bytearray(path.read_bytes())
    data[pos] ^= mask
    path.write_bytes(bytes(data))


def test_flipped_base_offset_in_sealed_segment_is_not_skipped_silently(
    tmp_path: Path, prepared: tuple[Path, list[Stored], random.Random]
) -> None:
    source, batches, _ = prepared
    tail_base = max(b.segment for b in batches)
    first_segment = [b for b in batches if b.segment == batches[0].segment]
    assert first_segment[0].segment != tail_base
    victim = first_segment[len(first_segment) // 2]
    case = fresh_copy(source, tmp_path, "base-offset")
    # The high byte of the batch's base offset: the batch fails its CRC.
    flip_byte(seg_path(case, victim.segment), victim.pos + BASE_OFFSET_FIELD.stop - 1, 0x01)
    plog = PartitionLog.open(case)
    try:
        with pytest.raises(CorruptBatchError):
            list(plog.events(victim.base, upto=victim.next))
        with pytest.raises(CorruptBatchError):
            plog.read(victim.base)
        with pytest.raises(CorruptBatchError):
            list(plog.events(0))  # not a silent gap from victim.base to the next segment
    finally:
        plog.close()


def test_check_cli_names_the_damaged_segment_in_80_columns(
    tmp_path: Path, prepared: tuple[Path, list[Stored], random.Random]
) -> None:
    source, batches, _ = prepared
    victim = batches[len(batches) // 3]
    case = fresh_copy(source, tmp_path, "narrow")
    path = seg_path(case, victim.segment)
    flip_byte(path, victim.pos + victim.length - 1, 0x40)
    result = run_check_cli(case, columns=80)
    assert result.returncode == 1
    assert path.name in result.stdout, result.stdout


def test_check_cli_names_an_unreadable_stream_json_without_a_traceback(tmp_path: Path) -> None:
    """The server refusing such a file says "run headwater check": check names it, and
    does not go on to check the SQL projection files by it (it ended in a traceback)."""

    async def main() -> None:
        engine = await Engine.open(tmp_path, ENGINE_CONFIG)
        try:
            info = await engine.create_stream(0, "orders")
            await engine.append(0, info.stream_id, [b"one", b"two"])
        finally:
            await engine.close()

    asyncio.run(main())
    (stream_json,) = tmp_path.glob("tenants/0/streams/*/stream.json")
    stream_json.write_text("{not json")
    result = run_check_cli(tmp_path)
    assert "stream.json: unparsable" in result.stdout, result.stdout
    assert "Traceback" not in result.stderr, result.stderr[-1500:]
    assert result.returncode == 1


# ---- an unfinished stream creation ----------------------------------------------------------


def test_crash_inside_create_stream_does_not_block_the_stream_id(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, ENGINE_CONFIG)
        await engine.close()
        # What a SIGKILL between create()'s mkdir/PartitionLog.open and its
        # write_json_atomic(stream.json) leaves behind.
        PartitionLog.open(tmp_path / "tenants/0/streams/1/partition-0").close()
        engine = await Engine.open(tmp_path, ENGINE_CONFIG)
        try:
            assert engine.list_streams(0) == []
            info = await engine.create_stream(0, "orders")
            await engine.append(0, info.stream_id, [b"x"])
        finally:
            await engine.close()
        engine = await Engine.open(tmp_path, ENGINE_CONFIG)
        try:
            assert [s.name for s in engine.list_streams(0)] == ["orders"]
        finally:
            await engine.close()

    asyncio.run(main())


# ---- graceful shutdown of the real server ----------------------------------------------------


def snapshot_engine(data_dir: Path) -> tuple[list[object], dict[str, list[Event]]]:
    async def main() -> tuple[list[object], dict[str, list[Event]]]:
        engine = await Engine.open(data_dir, ENGINE_CONFIG)
        try:
            infos = engine.list_streams(0)
            events = {i.name: read_all(engine.stream(0, i.stream_id).log) for i in infos}
            return list(infos), events
        finally:
            await engine.close()

    return asyncio.run(main())


def test_sigterm_stops_the_server_cleanly_and_keeps_the_data(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    data_dir = tmp_path / "data"

    async def populate() -> None:
        engine = await Engine.open(data_dir, ENGINE_CONFIG)
        orders = await engine.create_stream(0, "orders", StreamSettings(segment_bytes=4096))
        table = await engine.create_stream(
            0, "table", StreamSettings(segment_bytes=4096, cleanup_policy="compact")
        )
        for seq in range(60):
            values = [rng.randbytes(rng.randrange(300)) for _ in range(rng.randint(1, 4))]
            await engine.append(
                0,
                orders.stream_id,
                values,
                headers=[[(b"seq", b"%d" % seq)] for _ in values],
                timestamp_ms=TS0 + seq,
            )
            await engine.append(
                0, table.stream_id, values, keys=[b"k%d" % rng.randrange(5) for _ in values]
            )
        await engine.close()

    asyncio.run(populate())
    before_infos, before_events = snapshot_engine(data_dir)
    assert len(before_events["orders"]) > 60

    listen = {name: LOCAL for name in ("http", "convergedb", "ripple")}
    config = "[storage]\nmaintenance_interval_ms = 3600000\n"
    server = Server(tmp_path, config=config, listen=listen).start()  # on tmp_path / "data"
    try:
        ports = json.loads(server.ports_file.read_text())
        assert isinstance(ports, dict)
        assert all(isinstance(port, int) and port > 0 for port in ports.values()), ports
        started = time.monotonic()
        code = server.stop(timeout=10)
        stopped_in = time.monotonic() - started
    finally:
        server.kill()
    log_text = server.log_text()
    assert code == 0, log_text
    assert stopped_in < 5, (stopped_in, log_text)
    assert "headwater ready" in log_text, log_text
    assert "shutting down" in log_text, log_text
    assert "stopped cleanly" in log_text, log_text
    assert " ERROR " not in log_text and "Traceback" not in log_text, log_text

    after_infos, after_events = snapshot_engine(data_dir)
    assert after_infos == before_infos
    assert after_events == before_events
    assert not [r for r in check_data_dir(data_dir) if r.damaged]
