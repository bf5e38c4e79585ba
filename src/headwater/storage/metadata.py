"""Small metadata files, replaced atomically: write a temp file, fsync it, rename it over
the old one, fsync the directory. A crash leaves either the old or the new file whole.

Each write has a temp file of its own (``<name>.<pid>.<n>.tmp``): two threads writing
the same file never write into one temp file, and the last rename leaves one of their
payloads whole. Files several writers update (a tenant's ``tenant.json``) go through a
:class:`MetadataWriter`, which serialises the writes of one file and takes the snapshot
to write inside that order, so an older snapshot never lands after a newer one.

:class:`DataDirLock` makes a server the only one on its data directory: a second process
would recover logs under the first one's feet and write the same metadata.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from headwater.errors import StorageError

LOCK_FILE = "headwater.lock"
TMP_SUFFIX = ".tmp"

_temp_numbers = itertools.count()


def temp_path(path: Path) -> Path:
    """A temp file name beside ``path`` that no other write (thread or process) uses."""
    return path.with_name(f"{path.name}.{os.getpid()}.{next(_temp_numbers)}{TMP_SUFFIX}")


def write_json_atomic(path: Path, data: Any) -> None:
    write_bytes_atomic(path, json.dumps(data, indent=2, sort_keys=True).encode() + b"\n")


def write_bytes_atomic(path: Path, payload: bytes) -> None:
    """``path`` holds ``payload`` or what it held before, never a mix: temp file, fsync,
    rename, fsync of the directory."""
    tmp = temp_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_json(path: Path) -> Any:
    with open(path, "rb") as f:
        return json.load(f)


def remove_temp_files(directory: Path) -> None:
    """Temp files a crash left in ``directory`` (never a whole metadata file)."""
    for leftover in directory.glob(f"*{TMP_SUFFIX}"):
        leftover.unlink(missing_ok=True)


class MetadataWriter:
    """The one writer of the shared metadata files of a data directory: writes of one
    file run one at a time, each writing the snapshot taken once its turn has come."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[Path, threading.Lock] = {}

    def write(self, path: Path, snapshot: Callable[[], Any]) -> None:
        """Write ``snapshot()`` to ``path`` atomically (worker thread: it fsyncs)."""
        with self._guard:
            lock = self._locks.setdefault(path, threading.Lock())
        with lock:
            write_json_atomic(path, snapshot())


class DataDirLock:
    """An exclusive ``flock`` on ``<data dir>/headwater.lock`` for the life of a server.

    The kernel drops the lock when the process exits, however it exits, so a crash
    never leaves a stale lock behind. The file holds the owner's pid for the error a
    second server prints."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / LOCK_FILE
        self._fd = -1

    def acquire(self) -> None:
        """Take the lock; StorageError naming the owner when another process has it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StorageError(
                f"data directory {self.path.parent} is in use by another headwater process "
                f"(pid {owner}); one server per data directory"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)  # closing the descriptor releases the flock
