"""A dataclass's fields as a JSON object: the one piece of code behind the HTTP API's,
the dashboard's and the CLI's views that show a value's fields under their own names."""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def json_fields(value: DataclassInstance, *, omit: tuple[str, ...] = ()) -> dict[str, Any]:
    """``value``'s fields but ``omit``, in declaration order, values as they are (shallow:
    unlike ``dataclasses.asdict`` nothing nested is copied)."""
    return {f.name: getattr(value, f.name) for f in fields(value) if f.name not in omit}
