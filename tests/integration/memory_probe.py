"""The resident memory of a server process, sampled from outside while a test drives it.

:class:`RssSampler` reads ``/proc/<pid>/status`` in a thread of its own every few
milliseconds and keeps the highest RssAnon (anonymous memory: heap, Arrow buffers,
DuckDB) seen while it runs, with the phase the test was in at that moment, so a failure
says which step grew the server. File pages (RssFile: mapped segment and projection
files) are reclaimable and are reported, never bounded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType

from headwater.server.memory import ProcessMemory, process_memory

MIB = 1 << 20


class RssSampler:
    def __init__(self, pid: int | Callable[[], int], interval: float = 0.005) -> None:
        # A callable is asked for the pid at every sample: a restarted server is followed
        # from the moment its new process exists, its start-up included.
        self._pid = pid if callable(pid) else (lambda: pid)
        self.interval = interval
        self.phase = "start"
        self.peak_anon = 0
        self.peak_file = 0
        self.peaks: dict[str, int] = {}  # highest RssAnon per phase
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            memory = process_memory(self._pid())
            if memory is None:  # the process is gone (a restart): the next one is sampled
                self._stop.wait(self.interval)
                continue
            self._record(memory)
            self._stop.wait(self.interval)

    def _record(self, memory: ProcessMemory) -> None:
        self.samples += 1
        self.peak_anon = max(self.peak_anon, memory.rss_anon)
        self.peak_file = max(self.peak_file, memory.rss_file)
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), memory.rss_anon)

    def report(self) -> str:
        phases = ", ".join(f"{name} {peak / MIB:.0f}" for name, peak in self.peaks.items())
        return (
            f"peak RssAnon {self.peak_anon / MIB:.0f} MiB (per phase, MiB: {phases}); "
            f"peak RssFile {self.peak_file / MIB:.0f} MiB; {self.samples} samples"
        )

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        memory = process_memory(self._pid())  # one last sample: the end state counts too
        if memory is not None:
            self._record(memory)
