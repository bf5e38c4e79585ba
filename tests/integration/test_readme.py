"""The README's newcomer path, run as written, twice, against a fresh server.

The steps are the README's own fenced blocks, so the two cannot drift:

* ```` ```sh readme-test ```` runs in bash (``-e -o pipefail``), ```` ```python readme-test ````
  in this interpreter, in order, from a scratch directory whose ``.venv`` is the venv
  running the tests (the README's commands say ``.venv/bin/headwater``);
* ```` ```text readme-output ```` after a step lists lines its stdout must have (compared
  with runs of whitespace made one space, so tables and tabs compare as shown).

Blocks without the marker (``make run``, ``tail``, ``watch``) are the by-hand ones. The
only change made to a step is where the server is: the README's addresses are the
server's defaults (127.0.0.1:7400..7405), and this server listens on free ports, so
every default address in a step is rewritten to this server's, and the CLI finds it
through the variables it honours ($HEADWATER_SERVER, $HEADWATER_CONVERGEDB,
$HEADWATER_HTTP). Every step must exit 0 with nothing on stderr, in both runs: the
second run is what a newcomer who follows the README again does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from servers import LOCAL, Server, serving

import headwater
from headwater.server.config import DEFAULT_LISTEN

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCK = re.compile(r"^```(\w+) (readme-test|readme-output)\n(.*?)^```[ \t]*$", re.M | re.S)
ADDRESS = re.compile(r"127\.0\.0\.1:\d+")
RUNNERS = ("sh", "python")
STEP_SECONDS = 120.0  # a bound for a stuck step, never a measurement


@dataclass
class Step:
    language: str
    code: str
    expected: list[str] = field(default_factory=list)

    def title(self) -> str:
        return f"{self.language} block starting {self.code.splitlines()[0]!r}"


def readme_steps(text: str) -> list[Step]:
    """The README's readme-test blocks in order, each with its readme-output lines."""
    steps: list[Step] = []
    for match in BLOCK.finditer(text):
        language, role, body = match.groups()
        if role == "readme-test":
            assert language in RUNNERS, f"readme-test block in {language!r}: not runnable"
            steps.append(Step(language, body))
        else:
            assert steps and not steps[-1].expected, (
                f"a readme-output block must follow a readme-test block: {body!r}"
            )
            steps[-1].expected = [squeeze(line) for line in body.splitlines() if line.strip()]
    return steps


def squeeze(line: str) -> str:
    return " ".join(line.split())


def at_server(code: str, server: Server) -> str:
    """``code`` with each default address (127.0.0.1:7401 ...) made this server's."""
    by_default = {address: name for name, address in DEFAULT_LISTEN.items()}

    def rewrite(match: re.Match[str]) -> str:
        name = by_default.get(match.group())
        assert name is not None, f"{match.group()} is not a default listener address"
        return server.address_of(name)

    return ADDRESS.sub(rewrite, code)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    listen = {"convergedb": LOCAL, "http": LOCAL, "postgres": LOCAL}
    yield from serving(tmp_path_factory.mktemp("readme_server"), listen=listen, clean_log=True)


def newcomer_env(home: Path, server: Server) -> dict[str, str]:
    """A clean environment: no headwater or libpq settings of whoever runs the tests, the
    package under test first on the path, the CLI pointed at this server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HEADWATER_", "PG", "COLUMNS"))}
    env.update(
        HOME=str(home),
        NO_COLOR="1",
        TERM="dumb",
        PYTHONPATH=str(Path(headwater.__file__).resolve().parents[1]),
        HEADWATER_SERVER=server.address_of("kimberlite"),
        HEADWATER_CONVERGEDB=server.address_of("convergedb"),
        HEADWATER_HTTP=server.address_of("http"),
    )
    return env


def run_step(step: Step, code: str, cwd: Path, env: dict[str, str]) -> str:
    command = (
        ["bash", "-e", "-o", "pipefail", "-c", code]
        if step.language == "sh"
        else [sys.executable, "-c", code]
    )
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=STEP_SECONDS
    )
    said = f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode == 0, f"exit status {done.returncode}\n{said}"
    assert done.stderr == "", f"something on stderr\n{said}"
    return done.stdout


def test_readme_steps_are_found() -> None:
    steps = readme_steps(README.read_text())
    languages = {step.language for step in steps}
    assert languages == set(RUNNERS), languages
    assert any("connect_async" in step.code for step in steps), "the asyncio SDK step"
    assert any("psql" in step.code for step in steps), "the psql step"
    assert sum(bool(step.expected) for step in steps) >= 5


@pytest.mark.slow  # two runs of every step, each a process: ~25 s on a shared machine
def test_readme_runs_twice_as_written(server: Server, tmp_path: Path) -> None:
    steps = readme_steps(README.read_text())
    workdir = tmp_path / "newcomer"
    workdir.mkdir()
    (workdir / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    env = newcomer_env(tmp_path / "home", server)
    for round_ in (1, 2):
        for number, step in enumerate(steps, 1):
            where = f"run {round_}, step {number} ({step.title()})"
            try:
                stdout = run_step(step, at_server(step.code, server), workdir, env)
            except AssertionError as exc:
                raise AssertionError(f"{where}: {exc}") from None
            lines = {squeeze(line) for line in stdout.splitlines()}
            missing = [line for line in step.expected if line not in lines]
            assert not missing, f"{where}: missing {missing} in its output:\n{stdout}"
