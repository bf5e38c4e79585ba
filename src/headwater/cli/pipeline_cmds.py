"""``headwater pipeline run FILE.yaml [--master URL]``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

err = Console(stderr=True)
out = Console(highlight=False)


def cmd_pipeline_run(args: argparse.Namespace) -> int:
    try:
        from headwater.pipeline.spec import (
            PipelineError,
            check_streams,
            load_pipeline,
            server_kind_columns,
        )
    except ImportError as exc:
        err.print(f"[red]error:[/] pipelines need: pip install 'headwater[spark]' ({exc})")
        return 2
    overrides: dict[str, str] = {}
    if args.server:
        overrides["server"] = args.server
    if args.checkpoint:
        overrides["checkpoint"] = str(args.checkpoint.resolve())
    try:
        spec = load_pipeline(args.file, server_kind_columns, overrides)
        check_streams(spec)
    except PipelineError as exc:
        err.print(f"[red]error:[/] {exc}", soft_wrap=True, highlight=False)
        return 2
    try:
        from headwater.pipeline.runner import run_pipeline
    except ImportError as exc:
        err.print(f"[red]error:[/] pipelines need Spark: pip install 'headwater[spark]' ({exc})")
        return 2
    out.print(
        f"pipeline {spec.name}: {len(spec.sources)} source(s), {len(spec.transforms)} "
        f"transform(s), {len(spec.sinks)} sink(s) on {args.master}",
        soft_wrap=True,
    )
    return run_pipeline(
        spec, args.master, lambda line: out.print(line, soft_wrap=True, markup=False)
    )


def add_pipeline_commands(sub: Any) -> None:
    pipeline = sub.add_parser("pipeline", help="run a YAML pipeline on Spark")
    commands = pipeline.add_subparsers(dest="pipeline_command", required=True)
    run = commands.add_parser("run", help="check a pipeline file and run it")
    run.add_argument("file", type=Path)
    run.add_argument("--master", default="local[*]", help="Spark master URL (default local[*])")
    run.add_argument("--server", help="the Kimberlite listener, instead of the file's server")
    run.add_argument(
        "--checkpoint", type=Path, help="checkpoint directory, instead of the file's checkpoint"
    )
    run.set_defaults(func=cmd_pipeline_run)
