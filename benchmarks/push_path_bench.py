#!/usr/bin/env python3
"""The subscription push path in one process, each stage against what it replaced
(median of ``--repeat`` alternated timings):

* cutting a read into Kimberlite pushes: the former per-event loop against
  ``split_pushes`` (numpy over record bounds), per read;
* a stream's Kiwi RESULTs: ``stream_results`` over decoded events against
  ``batch_results`` straight from the stored batch, per event (framing included);
* a SQL projection round of many single-event commits: the former build (pyarrow calls
  per stored batch) against ``ChunkBuilder.build`` (numpy over the round), per round;
* what a fan-out subscriber pays per message before its own work (what
  ``fanout_bench.py``'s clients do, without the WebSocket layer): a Kiwi RESULT per
  frame (``json.loads`` each), Kiwi RESULTs packed (``?pack=1``: one array), a NATS
  ``MSG`` parsed from a packed frame.

    .venv/bin/python benchmarks/push_path_bench.py
    .venv/bin/python benchmarks/run_all.py --bench push_path_bench
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import timeit
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from benchlib import cpu_model, git_revision, loadavg, report
from headwater.engine.subscriptions import split_pushes
from headwater.protocols.kiwi.frames import text_frame
from headwater.protocols.kiwi.results import batch_results, stream_results
from headwater.sql.duck import Database
from headwater.sql.projection import TS_TYPE, Chunk, ChunkBuilder, _Piece
from headwater.storage.batch import Batch, build_batch, encode_values
from headwater.storage.log import ReadResult, ReadSpan

# The former per-event push cut lives with the property test that holds the new one to
# it; the benchmark times the same reference.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "property"))
from test_subscription_pushes import per_event_split


def median_us(fn: Callable[[], object], number: int, repeat: int) -> float:
    return statistics.median(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def stamped(seq: int, size: int) -> bytes:
    """Like fanout_bench's payloads: ``seq:send_ns:`` padded to ``size`` ASCII bytes."""
    head = f"{seq}:{time.monotonic_ns()}:".encode()
    return head + b"x" * max(0, size - len(head))


def stored(values: Sequence[bytes], base: int) -> Batch:
    data = build_batch(
        encode_values(values), len(values), base_offset=base, first_position=base, timestamp_ms=1
    )
    return Batch(memoryview(data))


# ---- the former implementations (references) -------------------------------------------


def per_batch_build(builder: ChunkBuilder, pieces: Sequence[_Piece]) -> Chunk:
    """The projection build before 2026-11-24: pyarrow calls per stored batch."""

    def int64(value: int) -> pa.Scalar:
        return pa.scalar(value, pa.int64())

    offsets, positions, stamps, bounds = [], [], [], []
    sections: list[memoryview] = []
    shift = rows = 0
    for piece in pieces:
        batch = piece.batch
        n = piece.stop - piece.start
        offs = pc.add(
            pa.array(range(piece.start, piece.stop), pa.int64()), int64(batch.base_offset)
        )
        offsets.append(offs)
        positions.append(pc.add(offs, int64(batch.first_position - batch.base_offset)))
        stamps.append(pa.repeat(pa.scalar(batch.first_timestamp_ms * 1000, TS_TYPE), n))
        record = batch.value_bounds()
        lo, hi = record[piece.start], record[piece.stop]
        sections.append(batch.values_section()[lo:hi])
        starts = pa.array(record[piece.start : piece.stop], pa.int64())
        bounds.append(pc.add(starts, int64(shift - lo)))
        shift += hi - lo
        rows += n
    bounds.append(pa.array([shift], pa.int64()))
    record_bounds = pa.concat_arrays(bounds)
    longest = pc.max(pc.pairwise_diff(record_bounds)).as_py()
    records = pa.Array.from_buffers(
        pa.binary(),
        rows,
        [None, record_bounds.cast(pa.int32()).buffers()[1], pa.py_buffer(b"".join(sections))],
    )
    data = pc.binary_slice(records, 8, longest)
    return builder._chunk(
        pa.concat_arrays(offsets),
        pa.concat_arrays(positions),
        pa.concat_arrays(stamps),
        data,
        builder.json_validity(data),
    )


# ---- stages -----------------------------------------------------------------------------


def whole_read(batches: list[Batch]) -> ReadResult:
    spans = [ReadSpan(b, 0, b.count) for b in batches]
    count = sum(b.count for b in batches)
    end = batches[-1].next_offset
    return ReadResult(spans, count, 0, None, end)


def split_stage(repeat: int) -> list[dict[str, Any]]:
    reads = {
        "1 event": [stored([b"x" * 100], 0)],
        "10 single-event batches": [stored([b"x" * 100], i) for i in range(10)],
        "one batch of 4,096 x 100 B": [stored([b"x" * 100] * 4096, 0)],
        "one batch of 4,096 x 50-150 B": [
            stored([b"x" * (50 + (i * 37) % 101) for i in range(4096)], 0)
        ],
        "4 batches of 1,000 x 100 B": [stored([b"x" * 100] * 1000, i * 1000) for i in range(4)],
    }
    out = []
    for name, batches in reads.items():
        result = whole_read(batches)
        number = 2000 if result.count < 100 else 100
        old = median_us(lambda r=result: list(per_event_split(r, 64, 1 << 20)), number, repeat)
        new = median_us(lambda r=result: split_pushes(r, 64, 1 << 20), number, repeat)
        out.append({"read": name, "events": result.count, "per_event_us": old, "batch_us": new})
    return out


def encode_stage(repeat: int, events: int) -> dict[str, Any]:
    batch = stored([stamped(i, 100) for i in range(events)], 0)

    def old() -> list[bytes]:
        return [text_frame(p) for p in stream_results("fanout", batch.events())]

    def new() -> list[bytes]:
        return [text_frame(p) for p in batch_results("fanout", batch, 0, batch.count)]

    assert old() == new()
    return {
        "events": events,
        "stream_results_us_per_event": median_us(old, 20, repeat) / events,
        "batch_results_us_per_event": median_us(new, 20, repeat) / events,
    }


def round_stage(repeat: int, commits: int) -> dict[str, Any]:
    db = Database()
    builder = ChunkBuilder(db)
    try:
        pieces = [
            _Piece(stored([b'{"x":%d,"pad":"%s"}' % (i, b"y" * 80)], i), 0, 1)
            for i in range(commits)
        ]
        one = stored([b'{"x":%d,"pad":"%s"}' % (i, b"y" * 80) for i in range(commits)], 0)
        whole = [_Piece(one, 0, one.count)]
        per_batch = per_batch_build(builder, pieces).batch
        assert per_batch.equals(builder.build(pieces).batch)
        json_only = pa.array([b'{"x":1}'] * commits, pa.binary())
        return {
            "commits": commits,
            "per_batch_build_ms": median_us(lambda: per_batch_build(builder, pieces), 5, repeat)
            / 1000,
            "build_ms": median_us(lambda: builder.build(pieces), 5, repeat) / 1000,
            "one_batch_build_ms": median_us(lambda: builder.build(whole), 5, repeat) / 1000,
            "json_valid_ms": median_us(lambda: builder.json_validity(json_only), 5, repeat) / 1000,
        }
    finally:
        builder.close()
        db.close()


def client_stage(repeat: int, messages: int) -> dict[str, Any]:
    values = [stamped(i, 100) for i in range(messages)]
    results = stream_results("fanout_burst", stored(values, 0).events())
    packed = b"[" + b",".join(results) + b"]"
    nats = b"".join(b"MSG fanout 1 %d\r\n%s\r\n" % (len(v), v) for v in values)

    def sent(value: str | bytes) -> int:
        return int(value.split(":" if isinstance(value, str) else b":", 2)[1])

    def kiwi_frames() -> int:
        return sum(sent(json.loads(r)["data"]["value"]) > 0 for r in results)

    def kiwi_packed() -> int:
        return sum(sent(m["data"]["value"]) > 0 for m in json.loads(packed))

    def nats_msgs() -> int:
        got, pos = 0, 0
        while True:
            end = nats.find(b"\r\n", pos)
            if end < 0:
                return got
            size = int(nats[pos:end].rsplit(b" ", 1)[1])
            got += sent(nats[end + 2 : end + 2 + size]) > 0
            pos = end + 2 + size + 2

    assert kiwi_frames() == kiwi_packed() == nats_msgs() == messages
    return {
        "messages": messages,
        "kiwi_result_bytes": len(results[0]),
        "nats_msg_bytes": len(nats) // messages,
        "kiwi_per_frame_us": median_us(kiwi_frames, 10, repeat) / messages,
        "kiwi_packed_us": median_us(kiwi_packed, 10, repeat) / messages,
        "nats_us": median_us(nats_msgs, 10, repeat) / messages,
    }


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [
        f"{env['cpu']}; headwater {env['git']}; load average before/after "
        f"{env['loadavg_before']} / {env['loadavg_after']}; medians of "
        f"{results['config']['repeat']}.",
        "",
        "| read cut into pushes | events | per-event loop µs | split_pushes µs | speed-up |",
        "|---|--:|--:|--:|--:|",
    ]
    for row in results["split"]:
        lines.append(
            f"| {row['read']} | {row['events']:,} | {row['per_event_us']:.1f} "
            f"| {row['batch_us']:.1f} | {row['per_event_us'] / row['batch_us']:.1f}x |"
        )
    enc, rnd, cli = results["encode"], results["round"], results["client"]
    lines += [
        "",
        "| stage | before | after | speed-up |",
        "|---|--:|--:|--:|",
        f"| Kiwi RESULT + frame, µs per event ({enc['events']:,}-event batch) "
        f"| {enc['stream_results_us_per_event']:.2f} | {enc['batch_results_us_per_event']:.2f} "
        f"| {enc['stream_results_us_per_event'] / enc['batch_results_us_per_event']:.1f}x |",
        f"| projection round of {rnd['commits']:,} single-event commits, ms "
        f"| {rnd['per_batch_build_ms']:.2f} | {rnd['build_ms']:.2f} "
        f"| {rnd['per_batch_build_ms'] / rnd['build_ms']:.1f}x |",
        "",
        f"One {rnd['commits']:,}-event batch builds in {rnd['one_batch_build_ms']:.2f} ms; "
        f"DuckDB's json_valid alone takes {rnd['json_valid_ms']:.2f} ms per round.",
        "",
        "| subscriber decode, µs per message | Kiwi, a frame per RESULT | Kiwi packed "
        "(`?pack=1`) | NATS MSG |",
        "|---|--:|--:|--:|",
        f"| {cli['messages']:,} messages ({cli['kiwi_result_bytes']} B RESULT, "
        f"{cli['nats_msg_bytes']} B MSG) | {cli['kiwi_per_frame_us']:.2f} "
        f"| {cli['kiwi_packed_us']:.2f} | {cli['nats_us']:.2f} |",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=7, help="timings per stage; the median is kept")
    p.add_argument("--commits", type=int, default=150, help="single-event commits per round")
    p.add_argument("--quick", action="store_true", help="fewer repeats, for a smoke test")
    p.add_argument("--out", type=Path, help="write the results here as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.repeat = 3
    results: dict[str, Any] = {
        "config": {"repeat": args.repeat, "commits": args.commits},
        "environment": {"cpu": cpu_model(), "git": git_revision(), "loadavg_before": loadavg()},
    }
    results["split"] = split_stage(args.repeat)
    results["encode"] = encode_stage(args.repeat, 1000)
    results["round"] = round_stage(args.repeat, args.commits)
    results["client"] = client_stage(args.repeat, 1000)
    results["environment"]["loadavg_after"] = loadavg()
    report(results, markdown, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
