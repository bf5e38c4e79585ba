"""PartitionLog and Segment: appends, rolls, index lookups, reads, reopen and recovery."""

from __future__ import annotations

import logging
import os
import random
import struct
from pathlib import Path

import pytest

from headwater.errors import CorruptBatchError, StorageError, UsageError
from headwater.storage.batch import HEADER_SIZE, encode_values
from headwater.storage.check import check_partition
from headwater.storage.log import LogConfig, PartitionLog, SyncPolicy
from headwater.storage.segment import segment_name

NONE = SyncPolicy("none")


def open_log(path: Path, **config: object) -> PartitionLog:
    config.setdefault("sync", NONE)
    return PartitionLog.open(path, LogConfig(**config))  # type: ignore[arg-type]


def all_events(plog: PartitionLog, start: int = 0) -> list[tuple[int, bytes]]:
    return [(e.offset, e.value) for e in plog.events(start)]


def seg_file(path: Path, base: int, suffix: str = ".log") -> Path:
    return path / segment_name(base, suffix)


class Written:
    """What a test appended: per batch its offsets, values, segment and file position."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, list[bytes], int, int, int]] = []

    def append(self, plog: PartitionLog, values: list[bytes], ts: int = 0, **kw: object) -> None:
        before = (plog.active.base_offset, plog.active.size)
        info = plog.append(values, first_position=plog.end_offset, timestamp_ms=ts, **kw)  # type: ignore[arg-type]
        seg = plog.active
        pos = before[1] if seg.base_offset == before[0] else 0
        self.batches.append((info.base_offset, values, seg.base_offset, pos, seg.size - pos))

    @property
    def events(self) -> list[tuple[int, bytes]]:
        return [(base + i, v) for base, vals, *_ in self.batches for i, v in enumerate(vals)]


def make_values(n: int, size: int, tag: str) -> list[bytes]:
    return [f"{tag}-{i}-".encode().ljust(size, b".") for i in range(n)]


# ---- appends and offsets -------------------------------------------------------------


def test_offsets_are_contiguous_across_appends(tmp_path: Path) -> None:
    plog = open_log(tmp_path)
    assert (plog.start_offset, plog.end_offset, plog.committed_offset) == (0, 0, 0)
    expected = []
    for n in (1, 3, 7, 1, 2):
        before = plog.end_offset
        values = make_values(n, 5, f"b{before}")
        info = plog.append(values, first_position=1000 + before, timestamp_ms=1)
        assert info.base_offset == before
        assert info.count == n
        assert info.next_offset == before + n == plog.end_offset
        assert info.first_position == 1000 + before
        expected += [(before + i, v) for i, v in enumerate(values)]
    events = list(plog.events())
    assert [(e.offset, e.value) for e in events] == expected
    assert [e.position for e in events] == [1000 + o for o, _ in expected]
    assert plog.last_position == 1000 + len(expected)
    plog.close()


def test_append_encoded_stores_the_section_as_given(tmp_path: Path) -> None:
    plog = open_log(tmp_path)
    section = encode_values([b"a", b"bb", b""])
    info = plog.append_encoded(section, 3, first_position=0, timestamp_ms=0)
    assert (info.base_offset, info.count) == (0, 3)
    result = plog.read(0)
    assert b"".join(bytes(c) for c in result.values_chunks()) == section
    assert all_events(plog) == [(0, b"a"), (1, b"bb"), (2, b"")]
    plog.close()


def test_append_misuse_and_closed_log(tmp_path: Path) -> None:
    plog = open_log(tmp_path, segment_bytes=256)
    with pytest.raises(UsageError):
        plog.append([], first_position=0)
    with pytest.raises(UsageError):
        plog.append([b"x" * 300], first_position=0)  # larger than a segment
    assert plog.end_offset == 0
    plog.close()
    with pytest.raises(StorageError):
        plog.append([b"x"], first_position=0)
    plog.close()  # idempotent


def test_log_config_validation() -> None:
    with pytest.raises(ValueError):
        LogConfig(segment_bytes=100)
    with pytest.raises(ValueError):
        LogConfig(cleanup_policy="archive")


# ---- rolling -------------------------------------------------------------------------


def test_roll_by_size(tmp_path: Path) -> None:
    plog = open_log(tmp_path, segment_bytes=300)
    w = Written()
    for i in range(10):
        w.append(plog, [b"%03d" % i + b"x" * 47])  # 64 + 8 + 50 = 122 bytes per batch
    # Two batches fit in 300 bytes, a third does not.
    assert [s.base_offset for s in plog.segments] == [0, 2, 4, 6, 8]
    assert all(s.size <= 300 for s in plog.segments)
    assert all(seg_file(tmp_path, b).exists() for b in (0, 2, 4, 6, 8))
    for prev, seg in zip(plog.segments, plog.segments[1:], strict=False):
        assert seg.base_offset == prev.next_offset
    assert all_events(plog) == w.events
    plog.close()


def test_roll_by_age_uses_event_timestamps(tmp_path: Path) -> None:
    plog = open_log(tmp_path, segment_ms=1000)
    for ts in (0, 500, 999, 1000, 1500, 1999, 2000, 5000):
        plog.append([b"t%d" % ts], first_position=0, timestamp_ms=ts)
    # A segment rolls when an append comes segment_ms or more after its first event.
    assert [s.base_offset for s in plog.segments] == [0, 3, 6, 7]
    plog.close()


def test_segment_ms_none_never_rolls_by_age(tmp_path: Path) -> None:
    plog = open_log(tmp_path, segment_ms=None)
    for ts in (0, 10**12, 2 * 10**12):
        plog.append([b"x"], first_position=0, timestamp_ms=ts)
    assert len(plog.segments) == 1
    plog.close()


def test_explicit_roll_and_empty_roll_is_a_no_op(tmp_path: Path) -> None:
    plog = open_log(tmp_path)
    plog.roll()
    assert len(plog.segments) == 1
    plog.append([b"a", b"b"], first_position=0, timestamp_ms=0)
    plog.roll()
    plog.roll()
    assert [s.base_offset for s in plog.segments] == [0, 2]
    plog.append([b"c"], first_position=2, timestamp_ms=0)
    assert all_events(plog) == [(0, b"a"), (1, b"b"), (2, b"c")]
    plog.close()


# ---- index lookups -------------------------------------------------------------------


def build_multi_segment(path: Path, index_interval_bytes: int) -> tuple[PartitionLog, Written]:
    plog = open_log(path, segment_bytes=700, index_interval_bytes=index_interval_bytes)
    w = Written()
    rng = random.Random(7)
    for b in range(40):
        n = rng.randint(1, 5)
        w.append(plog, make_values(n, rng.randint(1, 30), f"b{b}"), ts=b * 10)
    assert len(plog.segments) > 3
    return plog, w


@pytest.mark.parametrize("interval", [1, 150, 4096])
def test_read_from_every_offset(tmp_path: Path, interval: int) -> None:
    plog, w = build_multi_segment(tmp_path, interval)
    expected = w.events
    for start in range(len(expected)):
        got = [(e.offset, e.value) for e in plog.read(start, max_events=3).events()]
        assert got == expected[start : start + 3], start
        first = next(plog.events(start))
        assert (first.offset, first.value) == expected[start]
    # Index lookups reflect where batches were written.
    for seg in plog.segments:
        entries = seg.index_entries()
        assert entries
        for off, pos in entries:
            assert seg.position_for(off) == pos
    plog.close()


@pytest.mark.parametrize("interval", [1, 4096])
def test_events_with_upto(tmp_path: Path, interval: int) -> None:
    plog, w = build_multi_segment(tmp_path, interval)
    expected = w.events
    for start, upto in ((0, 5), (3, 17), (10, 11), (20, 20), (0, len(expected) + 5)):
        got = [(e.offset, e.value) for e in plog.events(start, upto)]
        assert got == expected[start:upto]
    plog.close()


# ---- read semantics ------------------------------------------------------------------


def model_read(
    events: list[tuple[int, bytes]], start: int, max_bytes: int, max_events: int | None
) -> list[tuple[int, bytes]]:
    """Longest prefix from ``start`` whose value bytes stay within max_bytes (at least one
    event), capped at max_events. Values here are never empty, so the prefix is unique."""
    avail = [e for e in events if e[0] >= start]
    out: list[tuple[int, bytes]] = []
    total = 0
    for off, value in avail:
        if max_events is not None and len(out) >= max_events:
            break
        if out and total + len(value) > max_bytes:
            break
        out.append((off, value))
        total += len(value)
    return out


def test_read_max_bytes_and_max_events_match_model(tmp_path: Path) -> None:
    plog, w = build_multi_segment(tmp_path, 150)
    expected = w.events
    end = plog.end_offset
    for start in range(0, end + 2, 3):
        for max_bytes in (1, 7, 20, 45, 100, 1 << 20):
            for max_events in (None, 1, 4):
                result = plog.read(start, max_bytes, max_events=max_events)
                got = [(e.offset, e.value) for e in result.events()]
                want = model_read(expected, start, max_bytes, max_events)
                assert got == want, (start, max_bytes, max_events)
                assert result.count == len(want)
                assert result.value_bytes == sum(len(v) for _, v in want)
                assert result.value_bytes <= max_bytes or result.count == 1
                assert result.first_offset == (want[0][0] if want else None)
                assert result.end_offset == (want[-1][0] + 1 if want else start)
                chunks = b"".join(bytes(c) for c in result.values_chunks())
                assert chunks == encode_values([v for _, v in want])
                if want and want[-1][0] + 1 < end:
                    assert result.next_offset == want[-1][0] + 1
                else:
                    assert result.next_offset is None
    plog.close()


def test_read_at_least_one_event_even_if_larger_than_max_bytes(tmp_path: Path) -> None:
    plog = open_log(tmp_path)
    plog.append([b"x" * 100, b"y"], first_position=0, timestamp_ms=0)
    result = plog.read(0, max_bytes=10)
    assert [e.value for e in result.events()] == [b"x" * 100]
    assert result.next_offset == 1
    result = plog.read(1, max_bytes=0)
    assert [e.value for e in result.events()] == [b"y"]
    assert result.next_offset is None
    plog.close()


def test_read_from_end_or_beyond_is_empty(tmp_path: Path) -> None:
    plog = open_log(tmp_path)
    empty = plog.read(0)
    assert (empty.count, empty.spans, empty.next_offset, empty.value_bytes) == (0, [], None, 0)
    plog.append([b"a", b"b"], first_position=0, timestamp_ms=0)
    for start in (2, 3, 1000):
        result = plog.read(start)
        assert (result.count, result.spans, result.next_offset) == (0, [], None)
        assert list(plog.events(start)) == []
    with pytest.raises(UsageError):
        plog.read(-1)
    plog.close()


def test_paging_with_next_offset_visits_every_event_once(tmp_path: Path) -> None:
    plog, w = build_multi_segment(tmp_path, 150)
    got: list[tuple[int, bytes]] = []
    offset: int | None = 0
    pages = 0
    while offset is not None:
        result = plog.read(offset, max_bytes=33)
        assert result.count >= 1
        got += [(e.offset, e.value) for e in result.events()]
        offset = result.next_offset
        pages += 1
    assert got == w.events
    assert pages > 5
    plog.close()


# ---- offset_for_timestamp ------------------------------------------------------------


def test_offset_for_timestamp(tmp_path: Path) -> None:
    plog = open_log(tmp_path, segment_bytes=300, index_interval_bytes=1)
    stamps = [10, 20, 20, 15, 40, 40, 50, 45, 90]
    bases = []
    for ts in stamps:
        bases.append(plog.append([b"x" * 40, b"y"], first_position=0, timestamp_ms=ts).base_offset)
    assert len(plog.segments) > 2

    def expect(t: int) -> int | None:
        return next((b for b, s in zip(bases, stamps, strict=True) if s >= t), None)

    for t in range(0, 100):
        assert plog.offset_for_timestamp(t) == expect(t), t
    plog.close()
    plog = open_log(tmp_path, segment_bytes=300, index_interval_bytes=1)
    for t in range(0, 100, 5):
        assert plog.offset_for_timestamp(t) == expect(t), t
    plog.close()


# ---- reopen --------------------------------------------------------------------------


def test_reopen_gives_identical_events(tmp_path: Path) -> None:
    plog = open_log(tmp_path, segment_bytes=400, index_interval_bytes=100)
    for i in range(30):
        plog.append(
            [b"v%d" % i, b"w%d" % i],
            first_position=10 * i,
            timestamp_ms=1000 + i,
            keys=[b"k%d" % (i % 4), None],
            tombstones=[i % 5 == 0, False],
            headers=[[(b"h", b"%d" % i)], []],
        )
    before = list(plog.events())
    state = (plog.start_offset, plog.end_offset, len(plog.segments), plog.last_position)
    plog.close()
    plog = open_log(tmp_path, segment_bytes=400, index_interval_bytes=100)
    assert list(plog.events()) == before
    assert (plog.start_offset, plog.end_offset, len(plog.segments), plog.last_position) == state
    assert plog.committed_offset == plog.end_offset
    info = plog.append([b"after"], first_position=999, timestamp_ms=5000)
    assert info.base_offset == before[-1].offset + 1
    plog.close()
    assert not check_partition(tmp_path, 100).damaged


def test_reopen_empty_log_and_empty_tail_after_roll(tmp_path: Path) -> None:
    open_log(tmp_path).close()
    plog = open_log(tmp_path)
    assert (plog.start_offset, plog.end_offset, plog.last_position) == (0, 0, None)
    plog.append([b"a"], first_position=0, timestamp_ms=0)
    plog.roll()
    plog.close()
    plog = open_log(tmp_path)
    assert [s.base_offset for s in plog.segments] == [0, 1]
    assert plog.end_offset == 1
    plog.append([b"b"], first_position=1, timestamp_ms=0)
    assert all_events(plog) == [(0, b"a"), (1, b"b")]
    plog.close()


# ---- damaged or missing indexes ------------------------------------------------------


def index_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.index")) + sorted(path.glob("*.timeindex"))


def test_deleted_index_files_are_rebuilt(tmp_path: Path) -> None:
    plog, w = build_multi_segment(tmp_path, 150)
    plog.close()
    files = index_files(tmp_path)
    # Sealed segments have index files; the active one's indexes live in memory.
    assert len(files) == 2 * (len(list(tmp_path.glob("*.log"))) - 1)
    originals = {f: f.read_bytes() for f in files}
    for f in files:
        f.unlink()
    plog = open_log(tmp_path, segment_bytes=700, index_interval_bytes=150)
    assert all_events(plog) == w.events
    for start in range(0, len(w.events), 7):
        assert all_events(plog, start) == w.events[start:]
    # Batch b was written with timestamp 10 * b.
    assert plog.offset_for_timestamp(200) == w.batches[20][0]
    assert plog.offset_for_timestamp(391) is None
    plog.close()
    # Rebuilt exactly as they were written.
    assert {f: f.read_bytes() for f in files} == originals


@pytest.mark.parametrize("seed", range(6))
def test_garbage_index_files_are_rebuilt(tmp_path: Path, seed: int) -> None:
    plog, w = build_multi_segment(tmp_path, 150)
    stamps = {b[0]: i * 10 for i, b in enumerate(w.batches)}
    plog.close()
    rng = random.Random(seed)
    for f in index_files(tmp_path):
        entry = 8 if f.suffix == ".index" else 12
        n = rng.choice([1, 3, 7, entry, entry * 3, entry * 10])
        f.write_bytes(rng.randbytes(n))
    plog = open_log(tmp_path, segment_bytes=700, index_interval_bytes=150)
    assert all_events(plog) == w.events
    for start in range(0, len(w.events), 5):
        assert all_events(plog, start)[:3] == w.events[start : start + 3]
    for t in (0, 55, 200, 390, 391):
        want = next((b for b, s in stamps.items() if s >= t), None)
        assert plog.offset_for_timestamp(t) == want, t
    plog.close()
    assert not check_partition(tmp_path, 150).damaged


def test_plausible_but_wrong_offset_index_entry_is_rebuilt(tmp_path: Path) -> None:
    # An index entry that is well formed (increasing, inside the file) but points into
    # the middle of a batch is damage too: it must not make a healthy log unreadable.
    plog = open_log(tmp_path, segment_bytes=10_000, index_interval_bytes=1)
    w = Written()
    for i in range(6):
        w.append(plog, make_values(3, 4, f"b{i}"))
    plog.roll()
    plog.append([b"tail"], first_position=18, timestamp_ms=0)
    plog.close()
    index = seg_file(tmp_path, 0, ".index")
    raw = bytearray(index.read_bytes())
    entries = list(struct.iter_unpack("<II", raw[:-16]))  # 16-byte trailer after entries
    assert [rel for rel, _ in entries] == [0, 3, 6, 9, 12, 15]
    rel, pos = entries[2]
    struct.pack_into("<II", raw, 16, rel, pos + 1)  # now points one byte into batch 2
    index.write_bytes(bytes(raw))
    assert check_partition(tmp_path, 1).damaged  # the checker does see the damage
    plog = open_log(tmp_path, segment_bytes=10_000, index_interval_bytes=1)
    assert all_events(plog, 6) == [*w.events[6:], (18, b"tail")]
    plog.close()


def test_garbage_time_index_does_not_mislead_offset_for_timestamp(tmp_path: Path) -> None:
    plog = open_log(tmp_path, segment_bytes=10_000, index_interval_bytes=1)
    for i in range(6):
        plog.append([b"x", b"y", b"z"], first_position=0, timestamp_ms=100 + 10 * i)
    plog.roll()
    plog.append([b"tail"], first_position=0, timestamp_ms=500)
    plog.close()
    # Whole entries (so the length check passes) but nonsense content.
    seg_file(tmp_path, 0, ".timeindex").write_bytes(
        struct.pack("<qI", 10**12, 7) + struct.pack("<qI", 5, 3)
    )
    plog = open_log(tmp_path, segment_bytes=10_000, index_interval_bytes=1)
    assert plog.offset_for_timestamp(115) == 6
    assert plog.offset_for_timestamp(100) == 0
    assert plog.offset_for_timestamp(151) == 18
    assert plog.offset_for_timestamp(501) is None
    plog.close()


# ---- torn tail -----------------------------------------------------------------------


TEAR_BATCH = HEADER_SIZE + 2 * (8 + 6)  # write_for_tear: 2 values of 6 bytes per batch


def torn_tail_cuts() -> list[int]:
    cuts = []
    for boundary in range(0, 5 * TEAR_BATCH, TEAR_BATCH):
        cuts += [boundary, boundary + 1, boundary + 4, boundary + 8, boundary + 63]
        cuts += [boundary + 64, boundary + 70, boundary + TEAR_BATCH - 1]
    return sorted(cuts)


def write_for_tear(path: Path) -> PartitionLog:
    plog = open_log(path)
    for i in range(5):
        plog.append([b"%06d" % i, b"%06d" % (i + 100)], first_position=0, timestamp_ms=i)
    return plog


@pytest.mark.parametrize("cut", torn_tail_cuts())
def test_torn_tail_is_truncated_to_whole_batches(tmp_path: Path, cut: int) -> None:
    plog = write_for_tear(tmp_path)
    assert plog.size_bytes == 5 * TEAR_BATCH
    full = all_events(plog)
    plog.close()
    log_path = seg_file(tmp_path, 0)
    with open(log_path, "r+b") as f:
        f.truncate(cut)
    whole = cut // TEAR_BATCH
    plog = open_log(tmp_path)
    assert plog.end_offset == 2 * whole
    assert all_events(plog) == full[: 2 * whole]
    assert log_path.stat().st_size == TEAR_BATCH * whole
    info = plog.append([b"new"], first_position=0, timestamp_ms=9)
    assert info.base_offset == 2 * whole
    assert all_events(plog) == [*full[: 2 * whole], (2 * whole, b"new")]
    plog.close()
    assert not check_partition(tmp_path).damaged


def test_torn_tail_with_garbage_appended_is_truncated(tmp_path: Path) -> None:
    plog = write_for_tear(tmp_path)
    full = all_events(plog)
    plog.close()
    with open(seg_file(tmp_path, 0), "ab") as f:
        f.write(b"\xff" * 100)
    plog = open_log(tmp_path)
    assert all_events(plog) == full
    plog.close()


def test_corrupt_last_batch_of_tail_is_dropped_on_open(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plog = write_for_tear(tmp_path)
    full = all_events(plog)
    plog.close()
    log_path = seg_file(tmp_path, 0)
    raw = bytearray(log_path.read_bytes())
    raw[4 * TEAR_BATCH + 70] ^= 0x01
    log_path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="headwater.storage.segment"):
        plog = open_log(tmp_path)
    assert all_events(plog) == full[:8]
    assert plog.end_offset == 8
    plog.close()
    # The operator is told which events went, not only how many bytes.
    (warning,) = [r.getMessage() for r in caplog.records if "truncating" in r.getMessage()]
    assert "its events from offset 8 on" in warning, warning


# ---- corruption in a sealed segment --------------------------------------------------


def build_sealed(path: Path) -> tuple[PartitionLog, Written]:
    plog = open_log(path, segment_bytes=10_000, index_interval_bytes=1)
    w = Written()
    for i in range(6):
        w.append(plog, make_values(3, 4, f"b{i}"))
    plog.roll()
    w.append(plog, [b"tail-1", b"tail-2"])
    return plog, w


def flip(path: Path, pos: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0x20]))


@pytest.mark.parametrize("reopen", [False, True])
def test_flipped_byte_in_sealed_segment(tmp_path: Path, reopen: bool) -> None:
    plog, w = build_sealed(tmp_path)
    expected = w.events
    base, _values, seg_base, pos, length = w.batches[2]
    assert (base, seg_base) == (6, 0)
    if reopen:
        plog.close()
    flip(seg_file(tmp_path, 0), pos + length - 2)
    if reopen:
        plog = open_log(tmp_path, segment_bytes=10_000, index_interval_bytes=1)
    # The damaged batch is never served.
    with pytest.raises(CorruptBatchError):
        plog.read(6)
    with pytest.raises(CorruptBatchError):
        plog.read(7)
    with pytest.raises(CorruptBatchError):
        list(plog.events(0))
    # Everything else still is.
    assert all_events(plog, 9) == expected[9:]
    first_two = sum(len(v) for _, v in expected[:6])
    assert [(e.offset, e.value) for e in plog.read(0, first_two).events()] == expected[:6]
    assert [(e.offset, e.value) for e in plog.read(18).events()] == expected[18:]
    plog.close()
    report = check_partition(tmp_path, 1)
    assert report.damaged
    assert report.segments[0].problems and not report.segments[1].problems


@pytest.mark.parametrize("reopen", [False, True])
def test_any_flipped_header_byte_in_sealed_segment_is_reported(
    tmp_path: Path, reopen: bool
) -> None:
    # Whatever header byte of a sealed batch is damaged (here bit 7 of each in turn),
    # reading through that batch must fail; it must never quietly end the segment early
    # and go on with the next one, which would hand a reader a gap as if it were data.
    plog, w = build_sealed(tmp_path)
    expected = w.events
    _base, _values, _seg, pos, _length = w.batches[2]
    plog.close()
    log_path = seg_file(tmp_path, 0)
    pristine = log_path.read_bytes()
    silent: dict[int, list[int]] = {}
    for byte in range(HEADER_SIZE):
        raw = bytearray(pristine)
        raw[pos + byte] ^= 0x80
        if not reopen:
            plog = open_log(tmp_path, segment_bytes=10_000, index_interval_bytes=1)
        log_path.write_bytes(bytes(raw))
        if reopen:
            plog = open_log(tmp_path, segment_bytes=10_000, index_interval_bytes=1)
        try:
            got = all_events(plog)
        except CorruptBatchError:
            got = None
        if got is not None and got != expected:
            silent[byte] = [o for o, _ in got]
        plog.close()
        log_path.write_bytes(pristine)
    assert silent == {}, f"header bytes whose damage was served silently: {sorted(silent)}"


def test_events_before_a_corrupt_batch_are_readable_with_upto(tmp_path: Path) -> None:
    # Reading [0, 6) must not need the (damaged) batch that starts at offset 6.
    plog, w = build_sealed(tmp_path)
    _base, _values, _seg, pos, length = w.batches[2]
    flip(seg_file(tmp_path, 0), pos + length - 2)
    assert all_events_upto(plog, 0, 6) == w.events[:6]
    plog.close()


def all_events_upto(plog: PartitionLog, start: int, upto: int) -> list[tuple[int, bytes]]:
    return [(e.offset, e.value) for e in plog.events(start, upto)]


def test_corrupt_sealed_segment_without_index_skips_only_the_bad_batch(tmp_path: Path) -> None:
    plog, w = build_sealed(tmp_path)
    plog.close()
    _base, _values, _seg, pos, length = w.batches[3]
    flip(seg_file(tmp_path, 0), pos + 30)
    seg_file(tmp_path, 0, ".index").unlink()
    plog = open_log(tmp_path, segment_bytes=10_000, index_interval_bytes=1)
    # The sealed segment is not truncated: later batches stay reachable.
    assert seg_file(tmp_path, 0).stat().st_size == 6 * length
    assert all_events(plog, 12) == w.events[12:]
    with pytest.raises(CorruptBatchError):
        list(plog.events(9))
    plog.close()


# ---- leftovers -----------------------------------------------------------------------


def test_cleaned_and_tmp_leftovers_are_removed_at_open(tmp_path: Path) -> None:
    plog, w = build_sealed(tmp_path)
    plog.close()
    cleaned = tmp_path / (segment_name(0, ".log") + ".cleaned")
    cleaned.write_bytes(b"half-written compaction output")
    tmp = tmp_path / (segment_name(0, ".index") + ".tmp")
    tmp.write_bytes(b"junk")
    plog = open_log(tmp_path, segment_bytes=10_000, index_interval_bytes=1)
    assert not cleaned.exists()
    assert not tmp.exists()
    assert all_events(plog) == w.events
    plog.close()


def test_files_on_disk_are_named_by_base_offset(tmp_path: Path) -> None:
    plog = open_log(tmp_path, segment_bytes=300)
    for _ in range(5):
        plog.append([b"x" * 50], first_position=0, timestamp_ms=0)
    names = sorted(p.name for p in tmp_path.glob("*.log"))
    assert names == [segment_name(b, ".log") for b in (0, 2, 4)]
    assert names[1] == "00000000000000000002.log"
    assert plog.describe()["segment_files"] == names
    plog.close()
    assert os.path.getsize(tmp_path / names[0]) == 2 * 122


def test_paging_through_the_log_returns_every_event_once(tmp_path: Path) -> None:
    """A reader paging from each read's next offset (what consumers do) sees the log
    exactly once, whatever its page sizes: batches cut by one read resume in the next."""
    plog, w = build_multi_segment(tmp_path, 150)
    rng = random.Random(3)
    for _ in range(20):
        got: list[tuple[int, bytes]] = []
        offset: int | None = 0
        while offset is not None:
            result = plog.read(offset, rng.choice((1, 5, 17, 40, 90)))
            got += [(e.offset, e.value) for e in result.events()]
            assert b"".join(bytes(c) for c in result.values_chunks()) == encode_values(
                [v for _, v in got[len(got) - result.count :]]
            )
            offset = result.next_offset
        assert got == w.events
    plog.close()


def test_an_append_that_cannot_start_a_new_segment_fails_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The disk has no room for the next segment's file: the append that needed it is
    # refused as a storage error (what every front end answers), and what was stored
    # stays readable and appendable once there is room again.
    plog = open_log(tmp_path, segment_bytes=300)
    plog.append([b"a" * 100], first_position=0, timestamp_ms=0)
    plog.append([b"b" * 100], first_position=1, timestamp_ms=0)

    def no_space(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("headwater.storage.log.Segment.create", no_space)
    with pytest.raises(StorageError, match=r"new segment failed.*No space left"):
        plog.append([b"c" * 100], first_position=2, timestamp_ms=0)
    assert plog.end_offset == 2
    assert [e.value[:1] for e in plog.events()] == [b"a", b"b"]
    monkeypatch.undo()
    assert plog.append([b"c" * 100], first_position=2, timestamp_ms=0).base_offset == 2
    plog.close()
    plog = open_log(tmp_path, segment_bytes=300)
    assert [e.value[:1] for e in plog.events()] == [b"a", b"b", b"c"]
    plog.close()
