#!/usr/bin/env python3
"""What the SQL projections cost the wire latency: ``wire_bench.py --only
latency,delivery`` against servers started with the projections as shipped, with their
background catch-up delay changed, or with no SQL service at all, variants alternated
round by round. A probe, not a supported setting: the server is changed through a
``sitecustomize`` module on its PYTHONPATH (environment variables HW_PROBE_NOSQL and
HW_PROBE_DELAY), which the benchmark's server process inherits.

    .venv/bin/python benchmarks/projection_probe.py --rounds 3
    .venv/bin/python benchmarks/projection_probe.py --variants default,nosql,delay=0.1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

SITECUSTOMIZE = """\
import os
if os.environ.get("HW_PROBE_NOSQL"):
    import headwater.sql.service as _service
    _service.SqlService.start = lambda self: None
if os.environ.get("HW_PROBE_DELAY"):
    import headwater.sql.projection as _projection
    _projection.CATCH_UP_DELAY = float(os.environ["HW_PROBE_DELAY"])
"""


def variant_env(name: str) -> dict[str, str]:
    if name == "default":
        return {}
    if name == "nosql":
        return {"HW_PROBE_NOSQL": "1"}
    if name.startswith("delay="):
        return {"HW_PROBE_DELAY": str(float(name.split("=", 1)[1]))}
    raise SystemExit(f"unknown variant {name!r}: default, nosql or delay=<seconds>")


def run(name: str, probe_dir: Path, out: Path, samples: int) -> dict[str, Any]:
    env = dict(os.environ, **variant_env(name))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(probe_dir), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, str(HERE / "wire_bench.py"), "--only", "latency,delivery"]
    cmd += ["--latency-samples", str(samples), "--out", str(out)]
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    results: dict[str, Any] = json.loads(out.read_text())
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="runs per variant, alternated")
    p.add_argument("--variants", default="default,nosql,delay=0.1")
    p.add_argument("--samples", type=int, default=2000, help="latency samples per run")
    args = p.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    for name in variants:
        variant_env(name)
    print(
        "| variant | load (1 min) | append p50 | append p99 | Redis p99 | delivery p50 "
        "| delivery p99 | Redis p99 | server CPU ms per append |"
    )
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    with tempfile.TemporaryDirectory() as tmp:
        probe_dir = Path(tmp)
        (probe_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
        for n in range(args.rounds):
            for name in variants:
                r = run(name, probe_dir, probe_dir / f"{name}-{n}.json", args.samples)
                a, d = r["append_latency"], r["delivery_latency"]
                h = a["headwater"]
                print(
                    f"| {name} | {r['environment']['loadavg_before'][0]:.2f} "
                    f"| {h['p50_ms']:.3f} | {h['p99_ms']:.3f} | {a['redis']['p99_ms']:.3f} "
                    f"| {d['headwater']['p50_ms']:.3f} | {d['headwater']['p99_ms']:.3f} "
                    f"| {d['redis']['p99_ms']:.3f} | {h['server_cpu_ms_per_sample']:.3f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
