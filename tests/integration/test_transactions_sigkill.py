"""A writer SIGKILLed in the middle of committing transactions, then a real server on
its data directory: every transaction is wholly visible or wholly absent.

The writer (transactions_driver.py) runs the engine and its transaction coordinator in a
process of its own (no front end speaks transactions yet: the Rivven and Kafka listeners
will map onto the same EngineAPI calls), and is killed the moment it says it is ending a
transaction, so the kill lands before the decision is stored, between the decision and
the markers, or among the markers. ``headwater serve`` then opens the directory (its
EngineAPI recovers the transactions before listening) and the partitions are read over
HTTP (read_committed). Rounds repeat until one kill has been seen to land after the
decision (the server's log says it finished a prepared transaction), so the recovery of
a half-written commit is shown, not assumed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from servers import LOCAL, Server
from transactions_driver import TARGETS, commits

DRIVER = Path(__file__).with_name("transactions_driver.py")
SRC = Path(__file__).resolve().parents[2] / "src"
MAX_ROUNDS = 12


def http_get(server: Server, path: str) -> Any:
    with urllib.request.urlopen(f"http://{server.address_of('http')}{path}", timeout=30) as r:
        return json.loads(r.read())


def run_until_ending(data_dir: Path, first: int, transactions: int) -> tuple[set[int], int]:
    """Start the writer, SIGKILL it as it starts ending its ``transactions``-th
    transaction; the transactions it finished ending, and the one it was ending."""
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, str(DRIVER), str(data_dir), str(first)],
        stdout=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None
    ended: set[int] = set()
    try:
        for raw in proc.stdout:
            word, k, *_ = raw.decode().split()
            if word == "ended":
                ended.add(int(k))
            elif int(k) >= first + transactions - 1:
                proc.kill()
                proc.wait()
                return ended, int(k)
        raise AssertionError(f"the writer exited with {proc.wait()} before its transactions")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def read_partitions(server: Server) -> dict[tuple[str, int], list[int]]:
    seen = {}
    for name, p in TARGETS:
        answer = http_get(server, f"/api/streams/{name}/events?partition={p}&limit=10000")
        seen[(name, p)] = [int(e["value"]) for e in answer["events"]]
    return seen


def test_sigkill_mid_commit_leaves_every_transaction_all_or_nothing(tmp_path: Path) -> None:
    server = Server(tmp_path, listen={"http": LOCAL})
    ended: set[int] = set()
    cut: list[int] = []
    finished_prepared = 0
    for round_ in range(MAX_ROUNDS):
        first = round_ * 1000
        done, ending = run_until_ending(server.data_dir, first, 3 + round_ % 4)
        ended |= done
        cut.append(ending)
        server.start()
        try:
            seen = read_partitions(server)
        finally:
            server.stop()
        everywhere = [set(values) for values in seen.values()]
        every_k = set().union(*everywhere)
        for values in seen.values():
            assert values == sorted(values), "a partition's committed events out of order"
            assert len(values) == len(set(values)), "an event stored twice"
        for k in every_k:
            assert all(k in values for values in everywhere), f"transaction {k} is partial"
            assert commits(k), f"aborted transaction {k} is visible"
        for k in ended:
            assert (k in every_k) == commits(k), f"transaction {k} lost or resurrected"
        finished_prepared = server.log_text().count("left PrepareCommit")
        finished_prepared += server.log_text().count("left PrepareAbort")
        if finished_prepared and round_ >= 1:
            break
    assert finished_prepared, (
        f"no kill in {MAX_ROUNDS} rounds landed after a decision was stored (cut at {cut})"
    )
    # The cut transactions went one way or the other, wholly: committed ones only if
    # their decision was stored, which the server's log shows it finished.
    assert server.log_text().count("Traceback") == 0
