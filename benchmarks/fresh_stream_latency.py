"""Single-event append latency on a fresh server's fresh stream, by sample window.

The slow samples of `wire_bench --only latency` came in the first second of a stream's
life, when its SQL projection's first catch-up round ran (0.5 s after the first append).
This benchmark shows where in a stream's life they fall: N single-event appends, one at
a time over Kimberlite, the latency (send to ack) reported per window of samples, and the
server's RssAnon after them. Several ``--src`` checkouts run side by side, alternating,
each a fresh server on a fresh data directory per round.

    .venv/bin/python benchmarks/fresh_stream_latency.py --src /tmp/wt-before/src --src src
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchlib import HeadwaterServer, HelpFormatter, default_root, loadavg, pct
from headwater.protocols.kimberlite.messages import AppendEventsRequest, EventBatch
from wire_bench import KimberliteClient

WINDOWS = ((0, 100), (100, 2_000), (2_000, None))


def rss_anon_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise RuntimeError("no RssAnon in /proc/<pid>/status")


def one_side(src: Path, root: Path, appends: int) -> dict[str, object]:
    server = HeadwaterServer(src=src.resolve())
    server.start(root)
    try:
        time.sleep(1.0)  # start-up settles: the first append starts the stream's life
        client = KimberliteClient(server.port)
        stream_id = client.create_stream("fresh")
        one = EventBatch.of([b"x" * 100])
        latencies: list[float] = []
        for _ in range(appends):
            _, data = client.conn.send_request(AppendEventsRequest(stream_id, one))
            started = time.perf_counter()
            client.sock.sendall(data)
            while not client.conn.receive_data(client.sock.recv(65536)):
                pass
            latencies.append((time.perf_counter() - started) * 1000)
        client.close()
        result: dict[str, object] = {"rss_anon_mib": rss_anon_kib(server.pid) / 1024}
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
    print("| round | src | " + " | ".join(windows) + " | RssAnon MiB |")
    print("|---|---|" + "--:|" * (len(WINDOWS) + 1))
    for rnd in range(1, args.rounds + 1):
        for src in args.src:
            got = one_side(src, default_root("headwater-fresh-"), args.appends)
            cells = []
            for lo, hi in WINDOWS:
                p50, p99 = got[f"{lo}-{hi or args.appends}"]  # type: ignore[misc]
                cells.append(f"{p50:.3f} / {p99:.3f}")
            print(f"| {rnd} | {src} | " + " | ".join(cells) + f" | {got['rss_anon_mib']:.0f} |")
    print(f"load average after: {loadavg()}")


if __name__ == "__main__":
    main()
