"""The server's memory budget (``[limits] memory_mib``): what its anonymous resident
memory (RssAnon) holds, the share each part is given, and the check at start-up.

File pages (segment files, mapped projection files) are RssFile: the kernel reclaims
them under pressure, so they are not part of the budget. What is anonymous is the
interpreter and its libraries, DuckDB's buffer pool, the read buffers, per-connection
buffers and the caches; docs/operations.md ("Memory") says how each scales.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from headwater.server.config import ServerConfig

log = logging.getLogger(__name__)

MIB = 1 << 20
# The interpreter, Arrow, DuckDB, aiohttp and the thread stacks of an idle server
# (measured: about 65 MiB of RssAnon), with room for the engine's own tables.
BASE_MIB = 128
# Reads run in the engine's I/O threads (8), each holding at most one read chunk of a
# segment (9 MiB, storage/log.py; a direct read of a cold unit larger than a chunk takes
# a buffer widened to whole pages) plus one decompressed frame (256 KiB) at a time; up
# to 32 MiB of those chunks are kept for reuse (storage/segment.py).
IO_THREADS = 8
READ_CHUNK_MIB = 10
# An open connection's share: transport buffers, protocol state and a write queue
# that backpressure keeps to about this (an estimate for a connection in normal use).
CONNECTION_KIB = 16


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# Blocks this large or larger (read chunks, decompressed frames, responses) are mapped
# for themselves and unmapped when freed.
MMAP_THRESHOLD = 256 << 10
ARENA_MAX = 2
ARROW_DECAY_MS = 1000  # how long Arrow's pool keeps freed pages for reuse


def tune_malloc() -> bool:
    """Keep freed memory from staying resident (glibc; False where there is none).

    glibc raises its mmap threshold each time a large mapped block is freed (up to 32
    MiB), after which blocks of that size come from the heap, and each thread that
    allocates gets an arena of its own (up to 8 per core) that rarely gives pages back:
    with reads of 8 MiB chunks in eight I/O threads and projections built in others, a
    server that had taken 320 MiB of appends and read them back held 923 MiB of RssAnon;
    with this, 422 MiB. A fixed threshold maps every large block and unmaps it when freed;
    two arenas bound what the threads' arenas keep; a 1 MiB trim threshold returns a
    heap's free top. Call before any thread starts."""
    path = ctypes.util.find_library("c")
    if path is None:
        return False
    try:
        libc = ctypes.CDLL(path)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl has no mallopt)
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    done &= mallopt(_M_ARENA_MAX, ARENA_MAX)
    done &= mallopt(_M_TRIM_THRESHOLD, 1 << 20)
    # Arrow's default pool (mimalloc) keeps freed pages for reuse, resident and
    # anonymous. The system allocator, tuned as above, gives every large block back at
    # once, so each Arrow kernel's megabytes of output were freshly mapped, faulted in
    # and zeroed: a third of the server's CPU reading keyed records for Spark. jemalloc
    # with a decay keeps freed pages about ARROW_DECAY_MS, then gives them back (counted
    # on later allocations): a read's rounds reuse the last round's pages. The budget
    # tests' peaks are as before (tests/integration/test_memory_budget.py).
    try:
        pa.set_memory_pool(pa.jemalloc_memory_pool())
        pa.jemalloc_set_decay_ms(ARROW_DECAY_MS)
    except NotImplementedError:  # a pyarrow built without jemalloc
        pa.set_memory_pool(pa.system_memory_pool())
    return bool(done)


@dataclass(frozen=True)
class ProcessMemory:
    """A process's resident memory from /proc/<pid>/status, in bytes."""

    rss_anon: int
    rss_file: int
    rss_peak: int  # VmHWM: the most resident memory (anon and file) ever held


def process_memory(pid: int | str = "self") -> ProcessMemory | None:
    """The resident memory of ``pid`` (this process by default); None where the kernel
    does not report it (not Linux)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in ("RssAnon", "RssFile", "VmHWM"):
            fields[name] = int(rest.split()[0]) * 1024  # reported in kB
    if "RssAnon" not in fields:
        return None
    return ProcessMemory(fields["RssAnon"], fields.get("RssFile", 0), fields.get("VmHWM", 0))


def budget_shares(config: ServerConfig) -> dict[str, int]:
    """The fixed shares of the budget the configured limits claim, in MiB: what is left
    of ``memory_mib`` is what the caches that grow with streams and kinds may use."""
    limits = config.limits
    connections_mib = -(-limits.max_connections * CONNECTION_KIB // 1024)  # rounded up
    return {
        "base (interpreter, libraries, engine tables)": BASE_MIB,
        "SQL (sql_memory_mib x sql_concurrency)": limits.sql_memory_mib * limits.sql_concurrency,
        # A result's cost is counted against sql_result_mib; its answer being encoded
        # takes about half as much again (measured, docs/operations.md).
        "SQL results (sql_result_mib x sql_concurrency x 1.5)": (
            limits.sql_result_mib * limits.sql_concurrency * 3 // 2
        ),
        "segment reads (I/O threads x read chunk)": IO_THREADS * READ_CHUNK_MIB,
        "read answers held for their peers (read_answers_mib)": limits.read_answers_mib,
        "connections (max_connections x 16 KiB)": connections_mib,
    }


def check_budget(config: ServerConfig) -> list[str]:
    """Warnings for limits that cannot fit ``[limits] memory_mib`` (logged at start)."""
    budget = config.limits.memory_mib
    shares = budget_shares(config)
    claimed = sum(shares.values())
    if claimed <= budget:
        return []
    parts = ", ".join(f"{name} {mib} MiB" for name, mib in shares.items())
    return [
        f"the configured limits claim {claimed} MiB, more than limits.memory_mib = {budget}"
        f" ({parts}): lower sql_memory_mib, sql_result_mib, sql_concurrency,"
        " read_answers_mib or max_connections, or raise"
        " memory_mib"
    ]


def warn_if_over_budget(config: ServerConfig) -> None:
    for warning in check_budget(config):
        log.warning("%s", warning)
