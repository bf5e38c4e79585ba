"""``headwater serve --listen`` and a port in use, as real server processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from servers import START_SECONDS, STOP_SECONDS, Server

import headwater
from headwater.server.config import DEFAULT_LISTEN
from waiting import wait_until


def serve_command(root: Path, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "headwater.cli.main",
        "serve",
        "--data-dir",
        str(root / "data"),
        "--ports-file",
        str(root / "ports.json"),
        *flags,
    ]


@pytest.fixture
def occupied_port() -> Iterator[int]:
    """A port something else listens on for the test's length."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.fixture
def serve_process(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start ``headwater serve`` with flags; every process is stopped at teardown."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(*flags: str) -> subprocess.Popen[bytes]:
        log = (tmp_path / "server.log").open("wb")
        proc = subprocess.Popen(
            serve_command(tmp_path, *flags), stdout=log, stderr=subprocess.STDOUT
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(STOP_SECONDS)


def ports_of(root: Path, proc: subprocess.Popen[bytes]) -> dict[str, int]:
    def written() -> dict[str, int] | None:
        assert proc.poll() is None, (root / "server.log").read_text()
        try:
            ports: dict[str, int] = json.loads((root / "ports.json").read_text())
        except (OSError, ValueError):
            return None
        return ports

    return wait_until(written, START_SECONDS, "no ports file")


def test_listen_flags_override_the_config(
    tmp_path: Path, serve_process: Callable[..., subprocess.Popen[bytes]]
) -> None:
    config = tmp_path / "headwater.toml"
    # The config turns HTTP on at a fixed address; the flags move Kimberlite to a free
    # port and switch HTTP, ConvergeDB and Ripple off.
    config.write_text('[listen]\nhttp = "127.0.0.1:1"\nconvergedb = "127.0.0.1:1"\n')
    proc = serve_process(
        "--config",
        str(config),
        "--listen",
        "kimberlite=127.0.0.1:0",
        "--listen",
        "http=off",
        "--listen",
        "convergedb=",
        "--listen",
        "ripple=off",
        "--listen",
        "postgres=127.0.0.1:0",
        "--listen",
        "kafka=off",
        "--listen",
        "rivven=off",
    )
    ports = ports_of(tmp_path, proc)
    assert sorted(ports) == ["kimberlite", "postgres"]
    with headwater.connect(f"127.0.0.1:{ports['kimberlite']}") as hw:
        hw.create_stream("moved")
        assert hw.append("moved", [b"x"]).count == 1


def test_a_port_in_use_is_one_line_naming_the_flag(tmp_path: Path, occupied_port: int) -> None:
    proc = subprocess.run(
        serve_command(
            tmp_path,
            "--listen",
            "http=127.0.0.1:0",
            "--listen",
            f"kimberlite=127.0.0.1:{occupied_port}",
        ),
        capture_output=True,
        text=True,
        timeout=START_SECONDS + STOP_SECONDS,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    expected = (
        f"headwater: cannot listen for kimberlite on 127.0.0.1:{occupied_port}: address "
        "already in use (change it with --listen kimberlite=HOST:PORT or [listen] in the "
        "config)"
    )
    assert proc.stderr.splitlines()[-1] == expected
    assert not (tmp_path / "ports.json").exists()
    # The engine was closed as on a shutdown (its lock released): a server starts on the
    # same data directory at once.
    server = Server(tmp_path).start()
    try:
        with headwater.connect(server.address) as hw:
            hw.create_stream("after_refusal")
    finally:
        assert server.stop() == 0


def test_bad_listen_flags_are_refused_before_start(tmp_path: Path) -> None:
    for flag, message in (
        ("amqp=127.0.0.1:5672", "unknown listener 'amqp' (one of http, kimberlite"),
        ("http", "expected NAME=HOST:PORT, not 'http'"),
        ("http=localhost", "listen.http: expected host:port, got 'localhost'"),
    ):
        proc = subprocess.run(
            serve_command(tmp_path, "--listen", flag),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 2
        assert message in proc.stderr.splitlines()[-1]
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "data").exists()


def test_a_data_dir_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    command = serve_command(tmp_path)
    command[command.index("--data-dir") + 1] = str(blocker / "data")
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert f"cannot use {blocker / 'data'} as the data directory" in proc.stderr


def test_a_ports_file_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    # A ports file in a missing directory (or on a full disk) stopped serve with a
    # Python traceback after every listener was bound.
    command = serve_command(tmp_path)
    command[command.index("--ports-file") + 1] = str(tmp_path / "missing" / "ports.json")
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "error: No such file or directory" in proc.stderr
    assert str(tmp_path / "missing") in proc.stderr


def test_no_ports_file_is_left_naming_ports_no_server_listens_on(
    tmp_path: Path, occupied_port: int, serve_process: Callable[..., subprocess.Popen[bytes]]
) -> None:
    # The file stayed after a stop, and a start that failed left the previous run's:
    # a script waiting for it to appear connected to dead ports.
    stale = tmp_path / "ports.json"
    stale.write_text(json.dumps({"kimberlite": 1}))
    failed = subprocess.run(
        serve_command(tmp_path, "--listen", f"kimberlite=127.0.0.1:{occupied_port}"),
        capture_output=True,
        text=True,
        timeout=START_SECONDS + STOP_SECONDS,
        check=False,
    )
    assert failed.returncode == 2, failed.stderr
    assert not stale.exists()
    proc = serve_process("--listen", "kimberlite=127.0.0.1:0")
    assert ports_of(tmp_path, proc)["kimberlite"] != 1
    proc.terminate()
    assert proc.wait(STOP_SECONDS) == 0
    assert not stale.exists()


def test_a_second_server_refused_the_data_directory_leaves_the_ports_file(
    tmp_path: Path, serve_process: Callable[..., subprocess.Popen[bytes]]
) -> None:
    # The ports file was removed before the data directory's lock was taken: a mistaken
    # second serve on a live directory deleted the live server's file.
    live = serve_process("--listen", "kimberlite=127.0.0.1:0")
    ports = ports_of(tmp_path, live)
    second = subprocess.run(
        serve_command(tmp_path, "--listen", "kimberlite=127.0.0.1:0"),
        capture_output=True,
        text=True,
        timeout=START_SECONDS + STOP_SECONDS,
        check=False,
    )
    assert second.returncode == 1, second.stderr
    assert json.loads((tmp_path / "ports.json").read_text()) == ports


def test_check_refuses_a_directory_that_is_no_data_directory(tmp_path: Path) -> None:
    # It walked any directory and said "all ok" (an empty one, or /tmp), and --repair
    # left its lock file there.
    for flags in ((), ("--repair",)):
        command = [sys.executable, "-m", "headwater.cli.main", "check", str(tmp_path), *flags]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 2, proc.stdout
        assert "is not a headwater data directory (no tenants/, no segment files)" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_help_names_every_listener() -> None:
    """--listen's help lists the listener names a user may give (it had left kafka out)."""
    done = subprocess.run(
        [sys.executable, "-m", "headwater.cli.main", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    listen_help = " ".join(done.stdout.split("--listen NAME=HOST:PORT")[-1].split())
    assert [name for name in DEFAULT_LISTEN if name not in listen_help] == []


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("[limits]\nmax_conections = 5\n", "error: unknown key in [limits]: max_conections"),
        ("[limit]\nmax_connections = 5\n", "error: unknown key in the top level: limit"),
    ],
)
def test_a_misspelt_config_key_is_refused_naming_its_section(
    tmp_path: Path, config: str, message: str
) -> None:
    """A typo in a limit would otherwise drop the limit: start-up stops, naming the key
    and its section (which rich once took for markup and dropped)."""
    (tmp_path / "headwater.toml").write_text(config)
    proc = subprocess.run(
        [*serve_command(tmp_path), "--config", str(tmp_path / "headwater.toml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith(message), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "data").exists()
