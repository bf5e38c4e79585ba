"""fdatasync through Linux AIO: the kernel runs it, the event loop hears of it on an
eventfd.

Why: an fsync in one of :mod:`group_commit`'s threads crosses the GIL about three
times (taking the job, after ``fdatasync``, reporting to the loop), and on two cores
each crossing costs the event loop's thread a wake-up of the other
(``pthread_cond_signal`` and the scheduler were 12-14% of the loop's CPU under a
four-partition Kafka produce, whose appends start two fsyncs a request). Here the loop
submits ``IOCB_CMD_FDSYNC`` (one ``io_submit``), a kernel worker runs the same
``vfs_fsync(datasync)`` as ``fdatasync(2)``, and the completion lands on an eventfd the
loop already polls: no Python thread, no GIL crossing (docs/benchmarks.md, "fsyncs
through Linux AIO").

Linux 4.18+ on x86-64 and arm64 only. Where the kernel or a sandbox refuses (no AIO,
``aio-max-nr`` reached, a file system without AIO fsync), :meth:`AioFsync.acquire`
answers None or :meth:`AioFsync.fdatasync` False, and the caller uses its threads: the
outcome of a sync is the same either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import logging
import os
import platform
import sys
from collections.abc import Callable
from typing import ClassVar

log = logging.getLogger(__name__)

# Syscall numbers by machine (glibc has no wrappers for the kernel's AIO calls).
_SYSCALLS = {
    "x86_64": (206, 207, 208, 209),  # io_setup, io_destroy, io_getevents, io_submit
    "aarch64": (0, 1, 4, 2),
}
_IOCB_CMD_FDSYNC = 3
_IOCB_FLAG_RESFD = 1  # signal the eventfd in aio_resfd on completion
RING_EVENTS = 128  # syncs in flight per loop; past it a sync goes to a thread

# A sync completed with ``res``: 0, or minus the errno of the failed fdatasync.
SyncDone = Callable[[int], None]


class _Iocb(ctypes.Structure):  # struct iocb (linux/aio_abi.h), little-endian
    _fields_ = [
        ("aio_data", ctypes.c_uint64),
        ("aio_key", ctypes.c_uint32),
        ("aio_rw_flags", ctypes.c_int32),
        ("aio_lio_opcode", ctypes.c_uint16),
        ("aio_reqprio", ctypes.c_int16),
        ("aio_fildes", ctypes.c_uint32),
        ("aio_buf", ctypes.c_uint64),
        ("aio_nbytes", ctypes.c_uint64),
        ("aio_offset", ctypes.c_int64),
        ("aio_reserved2", ctypes.c_uint64),
        ("aio_flags", ctypes.c_uint32),
        ("aio_resfd", ctypes.c_uint32),
    ]


class _IoEvent(ctypes.Structure):  # struct io_event
    _fields_ = [
        ("data", ctypes.c_uint64),
        ("obj", ctypes.c_uint64),
        ("res", ctypes.c_int64),
        ("res2", ctypes.c_int64),
    ]


def _find_syscall() -> tuple[Callable[..., int], tuple[int, int, int, int]] | None:
    """libc's ``syscall`` and this machine's AIO syscall numbers, or None."""
    numbers = _SYSCALLS.get(platform.machine())
    if not sys.platform.startswith("linux") or numbers is None:
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    return call, numbers


_SYSCALL = _find_syscall()


class AioFsync:
    """One AIO context and eventfd per event loop, shared by every committer on it
    (:meth:`acquire` / :meth:`release`); used on the loop's thread only."""

    _by_loop: ClassVar[dict[asyncio.AbstractEventLoop, AioFsync]] = {}
    # Set once a submit failed for a reason other than a full ring: AIO cannot be
    # relied on here, every later sync uses the threads.
    disabled: ClassVar[bool] = _SYSCALL is None

    def __init__(self, loop: asyncio.AbstractEventLoop, context: ctypes.c_ulong, efd: int) -> None:
        self.loop = loop
        self._context = context
        self._efd = efd
        self._users = 0
        # aio_data -> (its iocb, kept alive until done; the callback)
        self._pending: dict[int, tuple[_Iocb, SyncDone]] = {}
        self._next = 1
        self._events = (_IoEvent * RING_EVENTS)()
        self._closed = False
        loop.add_reader(efd, self._completed)

    @classmethod
    def acquire(cls, loop: asyncio.AbstractEventLoop) -> AioFsync | None:
        """The loop's AIO fsyncs (made on first use), or None where there are none."""
        if cls.disabled or _SYSCALL is None:
            return None
        fsync = cls._by_loop.get(loop)
        if fsync is None:
            call, (io_setup, _, _, _) = _SYSCALL
            context = ctypes.c_ulong(0)
            if call(io_setup, RING_EVENTS, ctypes.byref(context)) != 0:
                code = ctypes.get_errno()
                log.info("fsyncs run in threads: io_setup: %s", os.strerror(code))
                if code != errno.EAGAIN:  # EAGAIN: aio-max-nr reached for now
                    cls.disabled = True
                return None
            efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            fsync = cls._by_loop[loop] = AioFsync(loop, context, efd)
        fsync._users += 1
        return fsync

    def release(self) -> None:
        """One user less; the last one closes the context (its syncs all ended)."""
        self._users -= 1
        if self._users <= 0 and not self._pending:
            self._close()

    def fdatasync(self, fd: int, done: SyncDone) -> bool:
        """Start an fdatasync of ``fd`` (open until ``done``): ``done(res)`` is called on
        the loop once it ends. False: not started (ring full, or AIO refused), nothing
        will be called; the caller syncs another way."""
        if self._closed or AioFsync.disabled or _SYSCALL is None:
            return False
        call, (_, _, _, io_submit) = _SYSCALL
        iocb = _Iocb()
        key = self._next
        self._next += 1
        iocb.aio_data = key
        iocb.aio_lio_opcode = _IOCB_CMD_FDSYNC
        iocb.aio_fildes = fd
        iocb.aio_flags = _IOCB_FLAG_RESFD
        iocb.aio_resfd = self._efd
        pointers = (ctypes.POINTER(_Iocb) * 1)(ctypes.pointer(iocb))
        self._pending[key] = (iocb, done)
        if call(io_submit, self._context, 1, pointers) == 1:
            return True
        del self._pending[key]
        code = ctypes.get_errno()
        if code != errno.EAGAIN:
            # EINVAL: this kernel or file system has no AIO fsync; anything else is not
            # worth finding out: the threads' fdatasync raises it properly.
            log.warning("fsyncs run in threads from now on: io_submit: %s", os.strerror(code))
            AioFsync.disabled = True
        return False

    def _completed(self) -> None:
        """The eventfd is readable: call back every sync that ended."""
        with contextlib.suppress(BlockingIOError):
            os.read(self._efd, 8)
        assert _SYSCALL is not None
        call, (_, _, getevents, _) = _SYSCALL
        while self._pending:
            count = call(getevents, self._context, 0, RING_EVENTS, self._events, None)
            if count <= 0:
                break
            for event in self._events[:count]:
                found = self._pending.pop(event.data, None)
                if found is None:  # not ours (never expected): the others still end
                    log.error("an AIO completion for no pending fsync (%d)", event.data)
                    continue
                _, done = found
                try:
                    done(event.res)
                except Exception:  # one committer's bug must not keep the others waiting
                    log.exception("an fsync's callback failed")
        if self._users <= 0 and not self._pending:
            self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if AioFsync._by_loop.get(self.loop) is self:
            del AioFsync._by_loop[self.loop]
        with contextlib.suppress(RuntimeError, ValueError):  # the loop closed first
            self.loop.remove_reader(self._efd)
        os.close(self._efd)
        assert _SYSCALL is not None
        call, (_, io_destroy, _, _) = _SYSCALL
        call(io_destroy, self._context)


def _forget_contexts() -> None:
    """In a forked child: the parent's AIO contexts are not there (they belong to its
    memory), and neither are its loops; the child opens its own."""
    AioFsync._by_loop = {}


os.register_at_fork(after_in_child=_forget_contexts)
