"""replication-offset-checkpoint: written whole, read back; a damaged file is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from headwater.errors import StorageError
from headwater.storage.high_watermarks import (
    FILE_NAME,
    read_high_watermarks,
    write_high_watermarks,
)


def test_high_watermarks_round_trip(tmp_path: Path) -> None:
    assert read_high_watermarks(tmp_path) == {}
    marks = {(0, "orders", 1): 1200, (0, "hw_consumer_offsets", 0): 35, (3, "a.b-c", 0): 0}
    write_high_watermarks(tmp_path, marks)
    assert read_high_watermarks(tmp_path) == marks
    assert (tmp_path / FILE_NAME).read_text().splitlines()[:2] == ["0", "3"]
    write_high_watermarks(tmp_path, {(0, "orders", 1): 1300})
    assert read_high_watermarks(tmp_path) == {(0, "orders", 1): 1300}


@pytest.mark.parametrize(
    "text",
    ["1\n0\n", "0\n2\n0 orders 0 5\n", "0\n1\n0 orders 0\n", "0\n1\n0 orders x 5\n", ""],
)
def test_a_damaged_checkpoint_is_refused(tmp_path: Path, text: str) -> None:
    (tmp_path / FILE_NAME).write_text(text)
    with pytest.raises(StorageError, match="damaged"):
        read_high_watermarks(tmp_path)
