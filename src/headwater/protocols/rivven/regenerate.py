"""Regenerate ``rivven_pb2.py`` and ``rivven_pb2.pyi`` from ``rivven.proto``.

``python -m headwater.protocols.rivven.regenerate`` (or ``make rivven-proto``) rewrites
both beside the schema; ``--out DIR`` writes them elsewhere (the test that the committed
code matches the schema compiles into a temporary directory). The compiler is protoc as
grpcio-tools ships it, the stubs come from mypy-protobuf's plugin: both are test extras,
never needed at run time.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from headwater.errors import UsageError

SCHEMA_DIR = Path(__file__).resolve().parent
SCHEMA = "rivven.proto"
GENERATED = ("rivven_pb2.py", "rivven_pb2.pyi")


def _mypy_plugin() -> str:
    """The mypy-protobuf plugin: beside the running interpreter (a venv), else on PATH."""
    beside = Path(sys.executable).parent / "protoc-gen-mypy"
    if beside.exists():
        return str(beside)
    found = shutil.which("protoc-gen-mypy")
    if found is None:
        raise UsageError("protoc-gen-mypy not found: install mypy-protobuf (the test extras)")
    return found


def compile_schema(out_dir: Path, *, descriptor_set: Path | None = None) -> None:
    """Run protoc on the schema: the Python module and its stubs into ``out_dir``, and
    with ``descriptor_set`` the compiled FileDescriptorSet there too."""
    from grpc_tools import protoc  # type: ignore[import-untyped]

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{SCHEMA_DIR}",
        f"--python_out={out_dir}",
        f"--plugin=protoc-gen-mypy={_mypy_plugin()}",
        f"--mypy_out={out_dir}",
    ]
    if descriptor_set is not None:
        args.append(f"--descriptor_set_out={descriptor_set}")
    args.append(str(SCHEMA_DIR / SCHEMA))
    status = protoc.main(args)
    if status != 0:
        raise UsageError(f"protoc failed on {SCHEMA} (exit {status})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=SCHEMA_DIR, help="where to write")
    options = parser.parse_args(argv)
    compile_schema(options.out)
    for name in GENERATED:
        print(options.out / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
