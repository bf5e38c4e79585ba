"""docs/sdk.md's Producer, Consumer and Transactions snippets (the ```` ```python sdk-test ````
blocks) run as written, in order, each in its own interpreter, against a fresh server: the
only change is the address (the snippets say the default 127.0.0.1:7404; this server's
Rivven listener is on a free port). Each must exit 0 with nothing on stderr."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import LOCAL, Server, serving

SDK_DOC = Path(__file__).resolve().parents[2] / "docs" / "sdk.md"
BLOCK = re.compile(r"^```python sdk-test\n(.*?)^```[ \t]*$", re.M | re.S)
SNIPPET_SECONDS = 120.0  # a bound for a stuck snippet, never a measurement


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("sdk_docs"), listen={"rivven": LOCAL, "kimberlite": ""}
    )


def test_sdk_doc_snippets_run_as_written(server: Server, tmp_path: Path) -> None:
    snippets = BLOCK.findall(SDK_DOC.read_text())
    assert len(snippets) == 5, "the Producer, Consumer and Transactions snippets"
    address = server.address_of("rivven")
    for index, code in enumerate(snippets):
        assert "127.0.0.1:7404" in code
        script = tmp_path / f"snippet{index}.py"
        script.write_text(code.replace("127.0.0.1:7404", address))
        done = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=SNIPPET_SECONDS,
            cwd=tmp_path,
        )
        assert done.returncode == 0 and not done.stderr, (
            f"snippet {index}:\n{code}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
        )
        if "consumer.consume(500" in code:
            # The consumer snippet read the producer snippet's records and was assigned.
            assert "assigned" in done.stdout and "customer-" in done.stdout, done.stdout
