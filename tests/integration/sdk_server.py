"""A real ``headwater serve`` process for SDK, CLI and HTTP integration tests.

A module of its own (not conftest.py) so test files can import it by a name no other
directory's conftest shadows.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

SDK_START_SECONDS = 30.0  # generous: the machine is shared


def sdk_free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class SdkServer:
    """A real ``headwater serve`` process (Kimberlite only) on a data directory.

    ``port=0`` lets the server pick; after the first start the port is kept, so
    :meth:`restart` comes back on the same address (clients reconnect to it). ``listen``
    turns other listeners on, e.g. ``{"convergedb": "127.0.0.1:0"}``; their ports are
    kept across restarts too (:attr:`ports`).
    """

    def __init__(
        self,
        root: Path,
        port: int = 0,
        extra_config: str = "",
        listen: dict[str, str] | None = None,
    ) -> None:
        self.root = root
        self.data_dir = root / "data"
        self.config = root / "headwater.toml"
        self.ports_file = root / "ports.json"
        self.log = root / "server.log"
        self.port = port
        self.extra_config = extra_config
        self.listen = {"http": "", "convergedb": "", "ripple": "", **(listen or {})}
        self.ports: dict[str, int] = {}
        self.proc: subprocess.Popen[bytes] | None = None
        root.mkdir(parents=True, exist_ok=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> SdkServer:
        others = "".join(f'{name} = "{addr}"\n' for name, addr in self.listen.items())
        self.config.write_text(
            f'[listen]\nkimberlite = "127.0.0.1:{self.port}"\n{others}{self.extra_config}'
        )
        self.ports_file.unlink(missing_ok=True)
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "headwater.cli.main",
                    "serve",
                    "--data-dir",
                    str(self.data_dir),
                    "--ports-file",
                    str(self.ports_file),
                    "--config",
                    str(self.config),
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        deadline = time.monotonic() + SDK_START_SECONDS
        while not self.ports_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.log_text()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"server did not start:\n{self.log_text()}")
            time.sleep(0.02)
        bound = json.loads(self.ports_file.read_text())
        self.ports = {k: int(v) for k, v in bound.items() if v}
        self.port = self.ports["kimberlite"]
        for name, addr in self.listen.items():
            if addr.endswith(":0") and self.ports.get(name):
                self.listen[name] = f"{addr[:-2]}:{self.ports[name]}"
        return self

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM and wait (SIGKILL after ``timeout``); returns the exit status."""
        proc = self.proc
        if proc is None:
            return None
        self.proc = None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self) -> SdkServer:
        self.stop()
        return self.start()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def server_factory(
    tmp_path: Path, default_listen: dict[str, str] | None = None
) -> Iterator[Callable[..., SdkServer]]:
    """Body of the ``sdk_make_server`` fixtures: ``make(port=0, extra_config, listen)``
    starts a server of the test's own (``listen`` over ``default_listen``); all are
    stopped when the generator closes."""
    servers: list[SdkServer] = []

    def make(
        port: int = 0, extra_config: str = "", listen: dict[str, str] | None = None
    ) -> SdkServer:
        root = tmp_path / f"server{len(servers)}"
        server = SdkServer(root, port, extra_config, {**(default_listen or {}), **(listen or {})})
        servers.append(server)
        return server.start()

    try:
        yield make
    finally:
        for server in servers:
            server.stop()


def running(root: Path, listen: dict[str, str] | None = None) -> Iterator[SdkServer]:
    """Body of a fixture holding one server: started, then stopped, and it must have
    exited cleanly (status 0)."""
    server = SdkServer(root, listen=listen).start()
    try:
        yield server
    finally:
        status = server.stop()
        assert status == 0, f"server exited {status}:\n{server.log_text()}"


AUTH_CONFIG = """
[auth]
required = true
[[auth.tokens]]
token = "s3cret"
tenants = [0]
"""
"""Auth required; the token ``s3cret`` grants tenant 0."""

RETENTION_CONFIG = """
[storage]
sync = "none"
segment_bytes = 4096
retention_bytes = 8192
maintenance_interval_ms = 100
"""
"""Small segments and a byte limit: retention drops whole old segments within 100 ms."""
