"""The ``spark`` extra's pyspark floor is the newest ``versionadded`` among the pyspark APIs
the connector uses: the classes and functions it imports and the methods its readers and
writers override (read from the installed pyspark's docstrings)."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import tomllib
from pathlib import Path
from typing import Any

import pyspark  # noqa: F401  # the spark extra is required: without it the run fails

ROOT = Path(__file__).resolve().parents[3]
SOURCE = ROOT / "src" / "headwater" / "spark" / "source.py"
VERSIONADDED = re.compile(r"\.\. versionadded:: (\d+(?:\.\d+)*)")


def _version(text: str) -> tuple[int, ...]:
    parts = tuple(int(p) for p in text.split("."))
    return parts + (0,) * (3 - len(parts))


def _added(obj: Any) -> tuple[int, ...] | None:
    """The version a class or function says it was added in (the first marker of its
    docstring: later ones belong to parameters)."""
    match = VERSIONADDED.search(inspect.getdoc(obj) or "")
    return _version(match.group(1)) if match else None


def _spark_floor() -> tuple[int, ...]:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    (requirement,) = [r for r in extras["spark"] if r.startswith("pyspark")]
    match = re.fullmatch(r"pyspark>=(\d+(?:\.\d+)*)", requirement.replace(" ", ""))
    assert match, requirement
    return _version(match.group(1))


def _used_apis() -> dict[str, Any]:
    """name -> object: what source.py imports from pyspark, and every pyspark method that
    its classes override (Spark calls those, so they must exist in the floor version)."""
    used: dict[str, Any] = {}
    for node in ast.walk(ast.parse(SOURCE.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pyspark"):
            module = importlib.import_module(str(node.module))
            for alias in node.names:
                used[f"{node.module}.{alias.name}"] = getattr(module, alias.name)
    source = importlib.import_module("headwater.spark.source")
    for cls in vars(source).values():
        if not inspect.isclass(cls) or cls.__module__ != source.__name__:
            continue
        for base in cls.__mro__[1:]:
            if not base.__module__.startswith("pyspark"):
                continue
            for name, member in vars(base).items():
                if name in vars(cls) and callable(member) and not name.startswith("_"):
                    used[f"{base.__module__}.{base.__qualname__}.{name}"] = member
    return used


def test_spark_extra_requires_the_newest_api_the_connector_uses() -> None:
    added = {name: _added(obj) for name, obj in _used_apis().items()}
    dated = {name: v for name, v in added.items() if v is not None}
    # The APIs that set the floor are among those checked (admission control and
    # Trigger.AvailableNow in 4.2, the streaming Arrow writer in 4.1).
    assert dated["pyspark.sql.datasource.DataSourceStreamReader.latestOffset"] == (4, 2, 0)
    assert dated["pyspark.sql.datasource.DataSourceStreamReader.getDefaultReadLimit"] >= (4, 2)
    assert dated["pyspark.sql.datasource.DataSourceStreamArrowWriter"] == (4, 1, 0)
    newest = max(dated.values())
    floor = _spark_floor()
    too_new = sorted(name for name, v in dated.items() if v > floor)
    assert not too_new, f"pyspark>={'.'.join(map(str, floor))} lacks {too_new}"
    assert floor == newest, f"the floor could be {'.'.join(map(str, newest))}"
