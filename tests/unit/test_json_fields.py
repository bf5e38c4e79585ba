"""json_fields: a dataclass's fields as the JSON views show them."""

from __future__ import annotations

from dataclasses import dataclass

from headwater.json_fields import json_fields


@dataclass(frozen=True)
class Offsets:
    partition: int
    start_offset: int
    size_bytes: int
    nested: tuple[int, ...]


def test_fields_in_declaration_order_but_the_omitted() -> None:
    value = Offsets(3, 10, 4096, (1, 2))
    shown = json_fields(value, omit=("size_bytes",))
    assert list(shown.items()) == [("partition", 3), ("start_offset", 10), ("nested", (1, 2))]
    assert shown["nested"] is value.nested  # shallow: nothing copied
    assert list(json_fields(value)) == ["partition", "start_offset", "size_bytes", "nested"]
