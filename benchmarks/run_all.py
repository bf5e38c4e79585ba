#!/usr/bin/env python3
"""Run every benchmark (``benchmarks/*_bench.py``) with its default sizes, keep the JSON
under benchmarks/results/ (gitignored) and print the markdown tables.

    .venv/bin/python benchmarks/run_all.py                        # everything, defaults
    .venv/bin/python benchmarks/run_all.py --quick                # smoke-test sizes
    .venv/bin/python benchmarks/run_all.py --bench storage_bench  # a subset
    .venv/bin/python benchmarks/run_all.py --bench storage_bench -- --repeat 5

Each benchmark is a script taking ``--out FILE`` (and ``--quick``) whose module has a
``markdown(results) -> str`` function; arguments after ``--`` go to every selected one.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def discover() -> list[str]:
    return sorted(p.stem for p in HERE.glob("*_bench.py"))


def main(argv: list[str]) -> int:
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(description="Run the benchmarks and print their tables.")
    p.add_argument("--bench", default=",".join(discover()), help="comma-separated names")
    p.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    args = p.parse_args(argv)
    names = [n for n in args.bench.split(",") if n]
    unknown = sorted(set(names) - set(discover()))
    if unknown:
        p.error(f"no such benchmark: {', '.join(unknown)} (have {', '.join(discover())})")
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    sys.path.insert(0, str(HERE))
    failed: list[str] = []
    for name in names:
        out = RESULTS / f"{name}-{stamp}.json"
        cmd = [sys.executable, str(HERE / f"{name}.py"), *extra, "--out", str(out)]
        if args.quick:
            cmd.append("--quick")
        print(f"$ {' '.join(cmd)}", file=sys.stderr, flush=True)
        # Each benchmark prints its own table on stdout; progress goes to stderr.
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, check=False)
        if proc.returncode != 0 or not out.exists():
            print(f"{name} failed with exit code {proc.returncode}", file=sys.stderr)
            failed.append(name)
            continue
        (RESULTS / f"{name}-latest.json").write_text(out.read_text())
        module = importlib.import_module(name)
        print(f"## {name}\n")
        print(f"Results: {out.relative_to(HERE.parent)}\n")
        print(module.markdown(json.loads(out.read_text())))
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
