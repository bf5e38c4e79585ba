#!/usr/bin/env python3
"""A kind's follower applying its copied changelog: time and CPU per 10,000 records.

In one process, a leader's kinds take windows of several shapes; the follower copies
the changelogs byte for byte (as replication does) and applies them up to a high
watermark moved past one shape at a time. Per shape: wall time, the process's CPU
(the loop and the worker threads), the loop thread's CPU alone, and the longest the
event loop went without running a 5 ms ticker (a stall other connections would feel),
each per 10,000 records.

Shapes: ``create`` (windows of 1,000 new entities of a fixed-width kind, 5 numeric
fields), ``update`` (the same entities written again), ``mixed`` (windows of 900
updates and 100 retractions), ``text`` (windows of 1,000 new entities of a kind with a
string field) and ``small`` (windows of 10 updates).

Side by side: ``--src DIR`` (repeatable) runs the shapes in a child process per source
tree, alternating rounds, and reports the medians and each tree's ratio to the first:

    git worktree add /tmp/base <before> --detach
    .venv/bin/python benchmarks/kind_follower_bench.py --src /tmp/base/src --src src
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = ("create", "update", "mixed", "text", "small")
PER = 10_000


async def run(entities: int) -> dict[str, dict[str, float]]:
    from headwater.api.replication import Replicas
    from headwater.engine.engine import Engine, EngineConfig
    from headwater.engine.kinds import KindsConfig, KindsEngine, retract_op
    from headwater.engine.kinds.codec import codec_for
    from headwater.engine.kinds.model import AssertRecords, changelog_stream
    from headwater.errors import NotLeader
    from headwater.protocols.convergedb.fields import FieldType

    gc.freeze()
    gc.set_threshold(50_000, 10, 10)  # as `headwater serve`
    root = Path(tempfile.mkdtemp(prefix="kind-follower-bench-"))
    config = EngineConfig(maintenance_interval_ms=0, tenants={0: "default"})
    kinds_config = KindsConfig(coalesce_ms=1, default_liveness_ms=3_600_000)
    try:
        leader_engine = await Engine.open(root / "leader", config)
        follower_engine = await Engine.open(root / "follower", config)
        leader = await KindsEngine.open(leader_engine, kinds_config)
        follower = await KindsEngine.open(follower_engine, kinds_config)
        lt, ft = leader.tenant(0), follower.tenant(0)
        numbers = [(f"f{i}", FieldType.F64) for i in range(4)] + [("n", FieldType.I64)]
        text = [("temp", FieldType.F64), ("label", FieldType.STRING)]
        kinds = {}
        for name, fields in (("numbers", numbers), ("text", text)):
            kinds[name] = await lt.create_kind(name, fields)
            await ft.create_kind(name, fields)

        def refuse(_tenant: int, stream: str, _partition: int) -> None:
            raise NotLeader(f"another node leads {stream}")

        follower_engine.leader_check = refuse
        source = lt.connect("writer")
        ids = [i.to_bytes(32, "big") for i in range(entities)]
        encode_numbers = codec_for(kinds["numbers"].fields).encode
        encode_text = codec_for(kinds["text"].fields).encode

        async def windows(kind: str, size: int, count: int, version: int) -> None:
            info = kinds["text" if kind == "text" else "numbers"]
            for start in range(0, count, size):
                chunk = ids[start : start + size]
                if kind == "text":
                    pairs = [(e, encode_text([float(version), f"label {version} {e[-2:].hex()}"]))
                             for e in chunk]  # fmt: skip
                    ops: list[object] = [AssertRecords(info.kind_id, pairs)]
                elif kind == "mixed":
                    keep, drop = chunk[: size * 9 // 10], chunk[size * 9 // 10 :]
                    row = encode_numbers([1.0, 2.0, 3.0, float(version), version])
                    ops = [AssertRecords(kinds["numbers"].kind_id, [(e, row) for e in keep])]
                    ops += [retract_op(kinds["numbers"], e) for e in drop]
                else:
                    row = encode_numbers([1.0, 2.0, 3.0, float(version), version])
                    ops = [AssertRecords(info.kind_id, [(e, row) for e in chunk])]
                await lt.apply(source, ops).durable()  # type: ignore[arg-type]

        # The shapes' changelog ends, in order (the follower's high watermark steps).
        cuts: list[tuple[str, str, int, int]] = []
        for shape, kind, size, count, version in (
            ("create", "numbers", 1000, entities, 1),
            ("update", "numbers", 1000, entities, 2),
            ("mixed", "mixed", 1000, entities, 3),
            ("text", "text", 1000, entities // 2, 1),
            ("small", "numbers", 10, entities // 2, 4),
        ):
            stream = changelog_stream("text" if kind == "text" else "numbers")
            state = leader.changelogs.state(0, stream)
            before = state.log.committed_offset
            await windows(kind, size, count, version)
            cuts.append((shape, stream, before, state.log.committed_offset))

        source_replicas = Replicas(leader_engine, leader.changelogs)
        copy = Replicas(follower_engine, follower.changelogs)
        for stream in {c[1] for c in cuts}:
            offset = 0
            while True:
                data = await source_replicas.read_stored(0, stream, 0, offset, 8 << 20)
                if not data:
                    break
                offset = await copy.append_stored(0, stream, 0, data)

        high_watermarks = {stream: 0 for _, stream, _, _ in cuts}
        for stream in high_watermarks:
            follower.changelogs.limit(0, stream, lambda s=stream: high_watermarks[s])
        results: dict[str, dict[str, float]] = {}
        for shape, stream, start, end in cuts:
            state = follower.changelogs.state(0, stream)
            assert state.applied_offset == start
            gc.collect()
            stall = 0.0
            loop = asyncio.get_running_loop()
            wall0, cpu0, thread0 = time.perf_counter(), time.process_time(), time.thread_time()
            high_watermarks[stream] = end
            follower.changelogs.moved(0, stream)
            last = loop.time()
            while state.applied_offset < end:  # a 5 ms ticker: waits and measures stalls
                await asyncio.sleep(0.005)
                now = loop.time()
                stall = max(stall, now - last - 0.005)
                last = now
            wall = time.perf_counter() - wall0
            cpu, thread = time.process_time() - cpu0, time.thread_time() - thread0
            records = end - start
            scale = 1000 * PER / records
            results[shape] = {
                "records": records,
                "wall_ms": wall * scale,
                "cpu_ms": cpu * scale,
                "loop_cpu_ms": thread * scale,
                "max_stall_ms": stall * 1000,
            }
        for name in kinds:
            mine = sorted((e.entity_id, e.version, e.values) for e in ft.scan(kinds[name].kind_id))
            theirs = sorted(
                (e.entity_id, e.version, e.values) for e in lt.scan(kinds[name].kind_id)
            )
            assert mine == theirs, f"the follower's {name} differs from the leader's"
        await leader.close()
        await follower.close()
        await leader_engine.close()
        await follower_engine.close()
        return results
    finally:
        shutil.rmtree(root, ignore_errors=True)


def compare(args: argparse.Namespace) -> None:
    load = os.getloadavg()
    print(f"load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {args.entities} entities")
    taken: dict[str, list[dict[str, dict[str, float]]]] = {src: [] for src in args.src}
    for _ in range(args.rounds):
        for src in args.src:
            env = {**os.environ, "PYTHONPATH": str(Path(src).resolve())}
            out = subprocess.run(
                [sys.executable, __file__, "--child", "--entities", str(args.entities)],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            taken[src].append(json.loads(out.splitlines()[-1]))
    load = os.getloadavg()
    print(f"load after {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; medians of {args.rounds} rounds")
    base = args.src[0]
    metrics = ("wall_ms", "cpu_ms", "loop_cpu_ms", "max_stall_ms")
    print(f"{'shape':8} {'tree':28} " + " ".join(f"{m:>14}" for m in metrics))
    for shape in SHAPES:
        medians = {
            src: {m: statistics.median(r[shape][m] for r in taken[src]) for m in metrics}
            for src in args.src
        }
        for src in args.src:
            cells = []
            for m in metrics:
                value = medians[src][m]
                ratio = value / medians[base][m] if medians[base][m] else float("nan")
                cells.append(f"{value:8.1f}" + (f" {ratio:4.2f}x" if src != base else "      "))
            print(f"{shape:8} {src[-28:]:28} " + " ".join(f"{c:>14}" for c in cells))
    print("(per 10,000 records; ratios against the first tree)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entities", type=int, default=50_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--src", action="append", help="a source tree to run (repeatable)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child or not args.src:
        results = asyncio.run(run(args.entities))
        if not args.child:
            for shape, r in results.items():
                print(shape, {k: round(v, 1) for k, v in r.items()})
        print(json.dumps(results))
        return
    compare(args)


if __name__ == "__main__":
    main()
