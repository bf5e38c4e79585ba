"""Single-event append latency on a fresh server's fresh stream, by sample window.

The slow samples of `wire_bench --only latency` came in the first second of a stream's
life, when its SQL projection's first catch-up round ran (0.5 s after the first append).
This benchmark shows where in a stream's life they fall: N single-event appends, one at
a time over Kimberlite, the latency (send to ack) reported per window of samples, and the
server's RssAnon after them, and its CPU per append (user and system, every thread)
over the samples after the first window. Several ``--src`` checkouts run side by side,
alternating, each a fresh server on a fresh data directory per round.

    .venv/bin/python benchmarks/fresh_stream_latency.py --src /tmp/wt-before/src --src src
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import cast

from benchlib import HeadwaterServer, HelpFormatter, default_root, loadavg, pct
from headwater.protocols.kimberlite.messages import AppendEventsRequest, EventBatch
from wire_bench import KimberliteClient

WINDOWS = ((0, 100), (100, 2_000), (2_000, None))


def rss_anon_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise RuntimeError("no RssAnon in /proc/<pid>/status")


def user_system_s(pid: int) -> tuple[float, float]:
    """CPU seconds (user, system) used so far by every thread of process ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def one_side(src: Path, root: Path, appends: int) -> dict[str, object]:
    server = HeadwaterServer(src=src.resolve())
    server.start(root)
    try:
        time.sleep(1.0)  # start-up settles: the first append starts the stream's life
        client = KimberliteClient(server.port)
        stream_id = client.create_stream("fresh")
        one = EventBatch.of([b"x" * 100])
        latencies: list[float] = []
        cpu_from = WINDOWS[1][0]
        cpu_before = (0.0, 0.0)
        for n in range(appends):
            if n == cpu_from:
                cpu_before = user_system_s(server.pid)
            _, data = client.conn.send_request(AppendEventsRequest(stream_id, one))
            started = time.perf_counter()
            client.sock.sendall(data)
            while not client.conn.receive_data(client.sock.recv(65536)):
                pass
            latencies.append((time.perf_counter() - started) * 1000)
        user, system = user_system_s(server.pid)
        client.close()
        timed = max(1, appends - cpu_from)
        result: dict[str, object] = {
            "rss_anon_mib": rss_anon_kib(server.pid) / 1024,
            "cpu_us": (
                (user - cpu_before[0]) * 1e6 / timed,
                (system - cpu_before[1]) * 1e6 / timed,
            ),
        }
        for lo, hi in WINDOWS:
            window = latencies[lo:hi]
            name = f"{lo}-{hi or appends}"
            result[name] = (pct(window, 50), pct(window, 99))
        return result
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--src", type=Path, action="append", required=True, help="a checkout's src/")
    p.add_argument("--appends", type=int, default=4_000)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    print(f"load average before: {loadavg()}")
    windows = [f"samples {lo}-{hi or args.appends}: p50 / p99 ms" for lo, hi in WINDOWS]
    cpu = f"server CPU µs per append {WINDOWS[1][0]}-{args.appends}: user / system"
    print("| round | src | " + " | ".join(windows) + f" | RssAnon MiB | {cpu} |")
    print("|---|---|" + "--:|" * (len(WINDOWS) + 2))
    for rnd in range(1, args.rounds + 1):
        for src in args.src:
            got = one_side(src, default_root("headwater-fresh-"), args.appends)
            cells = []
            for lo, hi in WINDOWS:
                p50, p99 = cast(tuple[float, float], got[f"{lo}-{hi or args.appends}"])
                cells.append(f"{p50:.3f} / {p99:.3f}")
            user, system = cast(tuple[float, float], got["cpu_us"])
            print(
                f"| {rnd} | {src} | "
                + " | ".join(cells)
                + f" | {got['rss_anon_mib']:.0f} | {user:.0f} / {system:.0f} |"
            )
    print(f"load average after: {loadavg()}")


if __name__ == "__main__":
    main()
