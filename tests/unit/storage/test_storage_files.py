"""The bounded set of open segment files (``FileCache``), the metadata writer, the data
directory lock and the metadata checks of ``headwater check``."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from headwater.errors import StorageError
from headwater.storage.check import check_metadata
from headwater.storage.files import FileCache
from headwater.storage.log import LogConfig, PartitionLog, SyncPolicy
from headwater.storage.metadata import DataDirLock, MetadataWriter, read_json, write_json_atomic

NO_SYNC = LogConfig(sync=SyncPolicy("none"), segment_bytes=1024)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_many_logs_share_a_bound_and_reopen_files_for_reads_and_appends(tmp_path: Path) -> None:
    files = FileCache(4)
    baseline = open_fds()
    logs = [PartitionLog.open(tmp_path / f"p{i}", NO_SYNC, files) for i in range(20)]
    for round_ in range(3):  # every round reopens each log's active segment to append
        for i, plog in enumerate(logs):
            plog.append([b"%d-%d" % (i, round_) * 150], first_position=0, timestamp_ms=0)
            assert files.open_count <= 4
            assert open_fds() - baseline <= 4
    for i, plog in enumerate(logs):
        assert len(plog.segments) > 1  # 1 KiB segments: reads span sealed ones too
        got = [e.value for e in plog.events(0)]
        assert got == [b"%d-%d" % (i, r) * 150 for r in range(3)]
        assert files.open_count <= 4
    assert files.evictions > 0
    for plog in logs:
        plog.sync()
        plog.close()
    assert files.open_count == 0
    assert open_fds() == baseline
    reopened = [PartitionLog.open(tmp_path / f"p{i}", NO_SYNC, files) for i in range(20)]
    assert [len(list(p.events(0))) for p in reopened] == [3] * 20
    for plog in reopened:
        plog.close()


def test_a_pinned_file_stays_open_past_the_bound_until_released(tmp_path: Path) -> None:
    files = FileCache(2)
    paths = [tmp_path / f"f{i}" for i in range(4)]
    handles = [files.create(p) for p in paths]
    assert files.open_count == 2
    with files.pinned(handles[0]) as fd0:
        os.pwrite(fd0, b"zero", 0)
        with files.pinned(handles[1]), files.pinned(handles[2]):
            assert files.open_count == 3  # all three in use: none may close
            os.fstat(fd0)  # still the same open file
        assert files.open_count == 2  # the surplus closed on release
        assert handles[0].fd == fd0
    assert paths[0].read_bytes() == b"zero"
    for handle in handles:
        files.close(handle)


def test_room_is_made_before_a_file_is_opened_so_the_bound_holds_at_every_instant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Closing the least recently used file after opening the next one held capacity + 1
    # descriptors for a moment at every reopen: a server with thousands of streams was
    # seen with 513 segment files open under open_files = 512.
    files = FileCache(3)
    open_before_each_open: list[int] = []
    real_open = os.open

    def counting_open(path: str | Path, flags: int, mode: int = 0o777) -> int:
        open_before_each_open.append(files.open_count)
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", counting_open)
    handles = [files.create(tmp_path / f"f{i}") for i in range(6)]  # creates past the bound
    for handle in handles * 2:  # every pin a reopen of the least recently used
        with files.pinned(handle):
            assert files.open_count <= 3
    monkeypatch.undo()
    assert len(open_before_each_open) == 6 + 12
    assert max(open_before_each_open) == 2  # one place free before each open
    for handle in handles:
        files.close(handle)


def test_a_retired_file_keeps_its_old_bytes_after_its_path_is_replaced(tmp_path: Path) -> None:
    files = FileCache(1)
    path = tmp_path / "seg.log"
    handle = files.create(path)
    with files.pinned(handle) as fd:
        os.pwrite(fd, b"old bytes", 0)
    files.close(files.create(tmp_path / "other"))  # evicts seg.log
    assert handle.fd < 0
    files.retire(handle)  # as compaction does before its rename
    replacement = tmp_path / "new"
    replacement.write_bytes(b"NEW")
    os.replace(replacement, path)
    with files.pinned(handle) as fd:
        assert os.pread(fd, 9, 0) == b"old bytes"
    files.close(handle)
    with pytest.raises(StorageError, match="removed"), files.pinned(handle):
        pass


def test_a_retired_file_stays_open_for_every_read_until_closed(tmp_path: Path) -> None:
    # A reader holding a segment that retention retired reads it a batch at a time: the
    # first read's release must not close the file under the reads that follow.
    files = FileCache(4)
    path = tmp_path / "seg.log"
    handle = files.create(path)
    with files.pinned(handle) as fd:
        os.pwrite(fd, b"old bytes", 0)
    files.retire(handle)
    path.unlink()  # as retention does after retiring
    for _read in range(3):
        with files.pinned(handle) as fd:
            assert os.pread(fd, 9, 0) == b"old bytes"
    baseline = open_fds()
    files.close(handle)
    assert open_fds() == baseline - 1


def test_concurrent_writes_of_one_metadata_file_never_collide(tmp_path: Path) -> None:
    path = tmp_path / "tenant.json"
    errors: list[BaseException] = []
    start = threading.Barrier(16)

    def write(n: int) -> None:
        start.wait()
        try:
            for i in range(20):
                write_json_atomic(path, {"writer": n, "i": i})
        except BaseException as exc:  # pragma: no cover - the failure this test is about
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert read_json(path)["i"] == 19
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tenant.json"]  # no temp left


def test_the_metadata_writer_writes_the_snapshot_taken_in_its_turn(tmp_path: Path) -> None:
    writer = MetadataWriter()
    path = tmp_path / "tenant.json"
    counter = {"n": 0}

    def snapshot() -> dict[str, int]:
        counter["n"] += 1
        return {"n": counter["n"]}

    threads = [threading.Thread(target=writer.write, args=(path, snapshot)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert read_json(path) == {"n": 8}  # the last write carries the newest snapshot


def test_a_second_lock_on_a_data_dir_is_refused_until_released(tmp_path: Path) -> None:
    first, second = DataDirLock(tmp_path), DataDirLock(tmp_path)
    first.acquire()
    with pytest.raises(
        StorageError, match=f"in use by another headwater process .pid {os.getpid()}"
    ):
        second.acquire()
    first.release()
    second.acquire()
    second.release()


# ---- metadata checks ---------------------------------------------------------------------


def make_data_dir(root: Path, streams: dict[int, str]) -> Path:
    tenant = root / "tenants" / "0"
    (tenant / "streams").mkdir(parents=True)
    write_json_atomic(tenant / "tenant.json", {"id": 0, "name": "default", "next_stream_id": 9})
    for stream_id, name in streams.items():
        directory = tenant / "streams" / str(stream_id)
        (directory / "partition-0").mkdir(parents=True)
        meta = {"id": stream_id, "name": name, "created_ns": 1, "partitions": 1}
        write_json_atomic(directory / "stream.json", meta)
    return root


def problems(root: Path) -> list[str]:
    return [f"{p.path.relative_to(root)}: {p.problem}" for p in check_metadata(root)]


def test_sound_metadata_has_no_problems(tmp_path: Path) -> None:
    root = make_data_dir(tmp_path, {1: "a", 2: "b"})
    (root / "tenants/0/streams/.creating-3").mkdir()  # the server removes these on start
    assert problems(root) == []


def test_two_streams_of_one_name_are_named(tmp_path: Path) -> None:
    root = make_data_dir(tmp_path, {1: "orders", 2: "b", 7: "orders"})
    assert problems(root) == ["tenants/0/streams: streams 1, 7 share the name 'orders'"]


def test_damaged_metadata_is_named_file_by_file(tmp_path: Path) -> None:
    root = make_data_dir(tmp_path, {1: "a", 2: "b", 3: "c", 4: "d"})
    streams = root / "tenants/0/streams"
    (root / "tenants/0/tenant.json").write_text('{"id": 0, "name": "default", "next_')
    (streams / "1/stream.json").unlink()
    (streams / "2/stream.json").write_text(json.dumps([1, 2]))
    (streams / "3/partition-0").rmdir()
    (streams / "4/stream.json").write_text(json.dumps({"id": 5, "name": "d", "created_ns": 1}))
    found = problems(root)
    assert len(found) == 5, found
    assert found[0].startswith("tenants/0/tenant.json: unparsable")
    assert found[1:] == [
        "tenants/0/streams/1: stream directory without stream.json: the server ignores its data",
        "tenants/0/streams/2/stream.json: not a JSON object",
        "tenants/0/streams/3/stream.json: metadata without its partition-0/ directory (no data)",
        "tenants/0/streams/4/stream.json: says stream 5, in 4/",
    ]


def test_a_tenant_without_tenant_json_is_named(tmp_path: Path) -> None:
    root = make_data_dir(tmp_path, {1: "a"})
    (root / "tenants/0/tenant.json").unlink()
    assert problems(root) == ["tenants/0/tenant.json: missing"]
