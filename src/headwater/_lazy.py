"""Attributes of a package imported on first use (a PEP 562 module ``__getattr__``), so
importing the package stays cheap for those who never touch the heavy parts."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``name`` is imported from the submodule
    ``package.<homes[name]>`` when first asked for and kept in the package's globals, so
    this runs once per name; any other name is an AttributeError, as without it."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{home}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
