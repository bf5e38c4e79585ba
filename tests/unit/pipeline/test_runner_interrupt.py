"""Ctrl-C while a pipeline waits: the runner takes SIGINT itself and stops its queries at
a safe point, instead of PySpark's handler raising inside a py4j call (which py4j turned
into an error of its own: the command exited 1 and left the queries running)."""

from __future__ import annotations

import os
import signal
import threading

from headwater.pipeline.runner import _sigint_sets


def test_sigint_while_waiting_only_sets_the_flag_and_the_handler_comes_back() -> None:
    before = signal.getsignal(signal.SIGINT)
    interrupted = threading.Event()
    with _sigint_sets(interrupted):
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt may escape here
        assert interrupted.wait(2.0)
    assert signal.getsignal(signal.SIGINT) is before


def test_outside_the_main_thread_signals_are_left_alone() -> None:
    before = signal.getsignal(signal.SIGINT)
    seen: list[object] = []

    def body() -> None:
        with _sigint_sets(threading.Event()):
            seen.append(signal.getsignal(signal.SIGINT))

    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    assert seen == [before]
