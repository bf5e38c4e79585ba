"""Sealed projection files: full chunks are written beside the log and mapped from disk,
only the unsealed tail stays in memory; a restart opens the files and replays only the
tail; a damaged or missing file is rebuilt from the log; retention and stream deletion
remove files. A small seal size (``SEAL_ROWS``) makes a few hundred events several
files."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from pathlib import Path

import pyarrow as pa
import pytest
from sqlkit import js, running

from headwater.engine.engine import Engine, StreamSettings
from headwater.sql import SqlService
from headwater.sql import projection as projection_module
from headwater.sql.check import verify_projections
from headwater.sql.projection import ChunkBuilder, StreamProjection
from headwater.sql.sealed import (
    SealedFileError,
    list_sealed,
    open_sealed,
    projection_directory,
    sealed_name,
)
from waiting import wait_until_async

SEAL = 50
EVENTS = 300  # a few sealed files of 50 (or more) rows and an unsealed tail


@pytest.fixture(autouse=True)
def small_seals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(projection_module, "SEAL_ROWS", SEAL)
    monkeypatch.setattr(projection_module, "ROUND_ROWS", 30)


def built_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of every chunk built from the log from now on."""
    built: list[int] = []
    build = ChunkBuilder.build

    def counting(self: ChunkBuilder, pieces: list[projection_module._Piece]) -> object:
        chunk = build(self, pieces)
        built.append(chunk.rows)
        return chunk

    monkeypatch.setattr(ChunkBuilder, "build", counting)
    return built


def value(i: int) -> bytes:
    return b"\xffnot json" if i % 7 == 0 else js(i=i)


async def fill(engine: Engine, name: str = "s", events: int = EVENTS) -> list[int]:
    """Appends ``events`` events in batches of 10, interleaved with another stream's (so
    positions skip); returns each event's position."""
    s = await engine.create_stream(0, name)
    other = await engine.create_stream(0, f"{name}_other")
    positions: list[int] = []
    for first in range(0, events, 10):
        info = await engine.append(0, s.stream_id, [value(i) for i in range(first, first + 10)])
        positions += range(info.first_position, info.first_position + 10)
        await engine.append(0, other.stream_id, [b"x"])
    return positions


QUERY = (
    "SELECT count(*), sum(\"offset\"), count(json), sum((json->>'i')::INT), "
    "sum(octet_length(data)) FROM s"
)


def expected(offsets: range) -> list[list[object]]:
    kept = list(offsets)
    json_ones = [i for i in kept if i % 7]
    return [
        [
            len(kept),
            sum(kept) if kept else None,
            len(json_ones),
            sum(json_ones) if json_ones else None,
            sum(len(value(i)) for i in kept) if kept else None,
        ]
    ]


def projection_of(sql: SqlService, name: str = "s") -> StreamProjection:
    projection = sql.streams.projection(0, name)
    assert projection is not None
    return projection


def identities(paths: list[Path]) -> dict[str, tuple[int, int]]:
    return {p.name: (os.stat(p).st_ino, os.stat(p).st_mtime_ns) for p in paths}


def test_full_chunks_are_sealed_and_only_the_tail_stays_in_memory(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            positions = await fill(engine)
            assert (await sql.query(0, QUERY)).rows == expected(range(EVENTS))
            projection = projection_of(sql)
            files = projection.files
            assert len(files) >= 2
            in_memory = [c for c in projection.chunks if c.path is None]
            assert all(c.small for c in in_memory)  # below the seal size, merged later
            assert sum(c.rows for c in in_memory) < 2 * SEAL
            assert all(c.path is not None for c in projection.chunks[: len(files)])
            # Under sync "none" the log is fsynced before a file may hold its events.
            durable = engine.stream_by_name(0, "s").log.durable_offset
            assert all(c.last_offset < durable for c in projection.chunks if c.path)
            # Files are named by their offsets, hold them in order, one after another.
            found = list_sealed(projection.directory)
            assert [p for _, _, p in found] == files
            assert found[0][0] == 0
            for (_, last, _), (first, _, _) in itertools.pairwise(found):
                assert first == last + 1
            batch, meta = open_sealed(files[1])
            assert batch.column(0).to_pylist() == list(
                range(meta.first_offset, meta.last_offset + 1)
            )
            assert batch.column(4).to_pylist()[0:3] == [
                None if i % 7 == 0 else value(i).decode()
                for i in range(meta.first_offset, meta.first_offset + 3)
            ]
            # As of positions inside files and inside the tail.
            for cut in (0, 17, 100, 201, EVENTS - 1):
                result = await sql.query_at(0, QUERY, [], positions[cut])
                assert result.rows == expected(range(cut)), cut
            # Range reads cross files and the tail.
            batches = await sql.stream_range(0, "s", 45, 212)
            table = pa.Table.from_batches(batches)
            assert table.column("offset").to_pylist() == list(range(45, 212))
            assert table.column("data").to_pylist() == [value(i) for i in range(45, 212)]

    asyncio.run(main())


def test_restart_opens_the_files_and_replays_only_the_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            await fill(engine)
            assert (await sql.query(0, QUERY)).rows == expected(range(EVENTS))
            before = identities(projection_of(sql).files)
            tail = sum(c.rows for c in projection_of(sql).chunks if c.path is None)
        built = built_rows(monkeypatch)
        async with running(tmp_path) as (engine, sql):
            assert (await sql.query(0, QUERY)).rows == expected(range(EVENTS))
            projection = projection_of(sql)
            assert identities(projection.files) == before  # the very same files, unwritten
            # The other stream (21 one-event batches) has no files: all of it is replayed.
            assert sum(built) == tail + EVENTS // 10

    asyncio.run(main())


@pytest.mark.parametrize("damage", ["truncated", "garbled footer", "missing", "misnamed"])
def test_a_damaged_or_missing_file_is_rebuilt_from_the_log(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            positions = await fill(engine)
            await sql.query(0, "SELECT 1 FROM s")
            files = projection_of(sql).files
        assert len(files) >= 3
        victim = misnamed = files[1]  # a file with files after it
        others = identities([f for f in files if f != victim])
        if damage == "truncated":
            os.truncate(victim, victim.stat().st_size // 2)
        elif damage == "garbled footer":
            with open(victim, "r+b") as f:
                f.seek(-20, os.SEEK_END)
                f.write(b"\x00" * 10)
        elif damage == "missing":
            victim.unlink()
        else:  # a file whose rows are not the offsets of its name
            first, last = int(victim.name[:20]), int(victim.name[21:41])
            misnamed = victim.rename(victim.with_name(sealed_name(first + 1, last + 1)))
        if damage != "missing":
            with pytest.raises(SealedFileError):
                open_sealed(misnamed if damage == "misnamed" else victim)
        caplog.set_level(logging.INFO, "headwater.sql.projection")
        async with running(tmp_path) as (engine, sql):
            assert (await sql.query(0, QUERY)).rows == expected(range(EVENTS))
            assert (await sql.query_at(0, QUERY, [], positions[120])).rows == expected(range(120))
            projection = projection_of(sql)
            assert identities([f for f in projection.files if f.name in others]) == others
            rebuilt = [f for f in projection.files if f.name not in others]
            assert rebuilt and rebuilt[0].name == victim.name  # the same offsets again
            open_sealed(rebuilt[0])
            if damage == "misnamed":
                assert not misnamed.exists()
        assert "rebuilding offsets" in caplog.text
        if damage != "missing":
            assert "dropped, rebuilt from the log" in caplog.text

    asyncio.run(main())


def test_retention_deletes_expired_files(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            info = await engine.create_stream(
                0, "s", StreamSettings(segment_bytes=1024, retention_bytes=3000)
            )
            for first in range(0, EVENTS, 10):
                await engine.append(0, info.stream_id, [value(i) for i in range(first, first + 10)])
            await sql.query(0, "SELECT 1 FROM s")
            projection = projection_of(sql)
            before = projection.files
            stream = engine.stream_by_name(0, "s")
            assert stream.log.enforce_retention() > 0
            start = stream.log.start_offset
            assert (await sql.query(0, QUERY)).rows == expected(range(start, EVENTS))
            gone = [f for f in before if int(f.name[21:41]) < start]
            assert gone and not any(f.exists() for f in gone)
            assert all(f.exists() for f in before if f not in gone)
            assert projection.files == [f for f in before if f not in gone]

    asyncio.run(main())


def test_deleting_a_stream_deletes_its_files(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            await fill(engine)
            await sql.query(0, "SELECT 1 FROM s")
            directory = projection_of(sql).directory
            assert list_sealed(directory)
            stream = engine.stream_by_name(0, "s")
            assert directory == projection_directory(stream.directory)
            await engine.delete_stream(0, stream.stream_id)
            assert not directory.exists()
            # A new stream of the same name starts from nothing.
            await engine.create_stream(0, "s")
            assert (await sql.query(0, "SELECT count(*) FROM s")).rows == [[0]]

    asyncio.run(main())


def test_check_compares_files_with_the_log_and_repairs_them(tmp_path: Path) -> None:
    async def write() -> None:
        async with running(tmp_path) as (engine, sql):
            await fill(engine)
            await sql.query(0, "SELECT 1 FROM s")

    asyncio.run(write())
    reports = {r.name: r for r in verify_projections(tmp_path)}
    assert set(reports) == {"s", "s_other"}
    assert not reports["s"].damaged and reports["s"].files >= 3
    assert reports["s_other"].files == 0  # too small to seal anything
    files = [p for _, _, p in list_sealed(projection_directory(reports["s"].stream_dir))]
    # A changed value keeps the file well-formed (the server's open cannot tell); the
    # check holds it against the log. A removed file leaves logged events in no file.
    first = int(files[0].name[:20])
    raw = files[0].read_bytes()
    assert raw.count(value(first + 1)) == 1
    files[0].write_bytes(raw.replace(value(first + 1), value(first + 1).replace(b"i", b"j")))
    open_sealed(files[0])
    files[1].unlink()
    (report,) = [r for r in verify_projections(tmp_path) if r.name == "s"]
    assert [p.split(":")[0] for p in report.problems] == [
        files[0].name,
        f"offsets {files[1].name[:20].lstrip('0')}..{int(files[1].name[21:41])}",
    ]
    assert "column data differs from the log" in report.problems[0]
    (report,) = [r for r in verify_projections(tmp_path, repair=True) if r.name == "s"]
    assert len(report.repaired) == 2
    assert not [r for r in verify_projections(tmp_path) if r.damaged]
    assert files[0].exists() and files[1].exists()

    async def read() -> None:
        async with running(tmp_path) as (_engine, sql):
            assert (await sql.query(0, QUERY)).rows == expected(range(EVENTS))

    asyncio.run(read())


def test_compaction_rewrites_the_log_not_the_sealed_files(tmp_path: Path) -> None:
    """SQL over a compacted stream keeps every event it projected (as before sealed
    files: compaction does not rewrite the projection); after a restart the sealed files
    still hold them and only the replayed tail reads the log as compaction left it."""

    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            info = await engine.create_stream(
                0, "s", StreamSettings(cleanup_policy="compact", segment_bytes=1024)
            )
            for first in range(0, EVENTS, 10):
                batch = range(first, first + 10)
                keys = [f"k{i % 3}".encode() for i in batch]
                await engine.append(0, info.stream_id, [value(i) for i in batch], keys=keys)
            assert (await sql.query(0, QUERY)).rows == expected(range(EVENTS))
            stream = engine.stream_by_name(0, "s")
            assert stream.log.compact().events_removed > 0
            assert (await sql.query(0, QUERY)).rows == expected(range(EVENTS))
            sealed_upto = projection_of(sql).files[-1].name[21:41]
        async with running(tmp_path) as (engine, sql):
            stream = engine.stream_by_name(0, "s")
            tail = [e.offset for e in stream.log.events(int(sealed_upto) + 1)]
            kept = range(int(sealed_upto) + 1)
            result = await sql.query(0, 'SELECT "offset" FROM s ORDER BY 1')
            assert [row[0] for row in result.rows] == [*kept, *tail]
        assert not [r for r in verify_projections(tmp_path) if r.damaged]

    asyncio.run(main())


def test_tails_past_their_budget_are_sealed_early(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each stream's tail stays below a seal, but many streams' tails add up: past
    ``TAIL_BUDGET_BYTES`` the largest are written to (small) files."""

    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            sizes = {"a": 40, "b": 30, "c": 5}  # all below SEAL rows: no file of its own
            for name, events in sizes.items():
                info = await engine.create_stream(0, name)
                await engine.append(0, info.stream_id, [value(i) for i in range(events)])
            counts = "SELECT (SELECT count(*) FROM a), (SELECT count(*) FROM b), " + (
                "(SELECT count(*) FROM c)"
            )
            assert (await sql.query(0, counts)).rows == [[40, 30, 5]]
            tails = {name: projection_of(sql, name).tail_bytes for name in sizes}
            assert not any(projection_of(sql, name).files for name in sizes)
            # A budget the three tails together exceed, and "a" alone does not.
            monkeypatch.setattr(projection_module, "TAIL_BUDGET_BYTES", sum(tails.values()) - 1)
            more = await engine.append(0, engine.stream_by_name(0, "c").stream_id, [value(5)])
            assert more.base_offset == 5
            assert (await sql.query(0, counts)).rows == [[40, 30, 6]]
            a = projection_of(sql, "a")
            await wait_until_async(lambda: a.files, message="the largest tail was not sealed")
            assert a.tail_bytes == 0 and projection_of(sql, "c").tail_bytes > 0
            assert [c.rows for c in a.chunks] == [40]
            assert (await sql.query(0, "SELECT sum((json->>'i')::INT) FROM a")).rows == [
                [sum(i for i in range(40) if i % 7)]
            ]
        async with running(tmp_path) as (engine, sql):
            assert (await sql.query(0, counts)).rows == [[40, 30, 6]]
            assert projection_of(sql, "a").files == a.files

    asyncio.run(main())


def test_headwater_check_reports_and_repairs_projection_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from headwater.cli.main import main

    async def write() -> None:
        async with running(tmp_path) as (engine, sql):
            await fill(engine)
            await sql.query(0, "SELECT 1 FROM s")

    asyncio.run(write())
    assert main(["check", str(tmp_path)]) == 0
    # rich wraps the summary at the console's width (80 columns without a terminal)
    assert "SQL projection files match the log" in " ".join(capsys.readouterr().out.split())
    (report,) = [r for r in verify_projections(tmp_path) if r.name == "s"]
    files = [p for _, _, p in list_sealed(projection_directory(report.stream_dir))]
    files[1].unlink()
    assert main(["check", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "logged but in no file" in out and "--repair" in out
    assert main(["check", "--repair", str(tmp_path)]) == 0
    assert "repaired" in capsys.readouterr().out
    assert files[1].exists()
    assert main(["check", str(tmp_path)]) == 0


def test_headwater_check_repair_refuses_a_running_servers_data_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from headwater.cli.main import main
    from headwater.storage.metadata import DataDirLock

    lock = DataDirLock(tmp_path)
    lock.acquire()  # as a running server holds it
    try:
        assert main(["check", "--repair", str(tmp_path)]) == 2
        assert "needs the server stopped" in capsys.readouterr().err
    finally:
        lock.release()


def test_start_up_reads_the_tail_budget_a_bounded_number_of_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every projection progresses once at start; the budget check that reads all their
    tails must not run per progress (quadratic in streams: 3,000 streams took over a
    minute to serve)."""
    streams = 150

    async def write() -> None:
        async with running(tmp_path) as (engine, _sql):
            for i in range(streams):
                info = await engine.create_stream(0, f"s{i}")
                await engine.append(0, info.stream_id, [value(i)])

    asyncio.run(write())
    reads = itertools.count()
    monkeypatch.setattr(
        StreamProjection, "tail_bytes", property(lambda self: next(reads) * 0 + self._tail_bytes)
    )

    async def restart() -> None:
        async with running(tmp_path) as (_engine, sql):
            projections = [projection_of(sql, f"s{i}") for i in range(streams)]
            await wait_until_async(
                lambda: all(p.next_offset == 1 for p in projections),
                message="the projections did not catch up",
            )
            await sql.query(0, "SELECT count(*) FROM s0")

    asyncio.run(restart())
    assert next(reads) < 20 * streams  # a few checks of every tail, not one per progress
