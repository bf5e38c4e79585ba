"""The one way the tests run a real ``headwater serve`` process.

:class:`Server` starts ``python -m headwater.cli.main serve`` on a data directory of its
own, waits for the ports file (the server writes it once every listener is bound),
and stops it (SIGTERM), kills it (SIGKILL: a crash) and starts it again on the same
data directory and the same addresses. Fixtures build on two generator bodies:

* :func:`serving` holds one server for a module or a session: started, yielded, and at
  teardown it must still be running and must exit cleanly on SIGTERM (status 0; with
  ``clean_log``, also no ERROR or CRITICAL line and no traceback in its log);
* :func:`server_factory` makes servers of a test's own, stopped at teardown.

tests/integration/conftest.py has the shared fixtures (``shared_server``,
``make_server``, ``unused_port``); test files declare module servers of their own
configuration as ``yield from serving(tmp_path_factory.mktemp(...), ...)``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kimberlite_raw import RawClient

from waiting import wait_until

START_SECONDS = 30.0  # generous: the machine is shared
STOP_SECONDS = 30.0
LISTENERS = ("kimberlite", "convergedb", "ripple", "http", "postgres", "rivven", "kafka")
LOCAL = "127.0.0.1:0"  # a listener on, at a port the server picks


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Server:
    """A real ``headwater serve`` process on ``root/data``, restartable.

    Only the Kimberlite listener is on unless ``listen`` turns others on, e.g.
    ``{"convergedb": LOCAL, "http": LOCAL}`` (``""`` turns one off). ``port`` is the
    Kimberlite port (0: the server picks). ``config`` is TOML appended after the
    ``[listen]`` table. A port the server picked is kept for later starts, so a restarted
    server comes back on the same addresses (clients reconnect to them). ``preexec_fn``
    runs in the child before the server starts (e.g. to lower its ``RLIMIT_NOFILE``).
    """

    def __init__(
        self,
        root: Path,
        *,
        config: str = "",
        listen: dict[str, str] | None = None,
        port: int = 0,
        preexec_fn: Callable[[], None] | None = None,
    ) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.data_dir = root / "data"
        self.config_file = root / "headwater.toml"
        self.ports_file = root / "ports.json"
        self.log_path = root / "server.log"
        self.config = config
        self.listen = {name: "" for name in LISTENERS}
        self.listen["kimberlite"] = f"127.0.0.1:{port}"
        unknown = set(listen or {}) - set(LISTENERS)
        assert not unknown, f"unknown listeners {unknown}"
        self.listen.update(listen or {})
        self.ports: dict[str, int] = {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.preexec_fn = preexec_fn

    # -- addresses --

    @property
    def port(self) -> int:
        """The Kimberlite port."""
        return self.ports["kimberlite"]

    @property
    def address(self) -> str:
        """``host:port`` of the Kimberlite listener (what ``headwater.connect`` takes)."""
        return self.address_of("kimberlite")

    def address_of(self, listener: str) -> str:
        return f"127.0.0.1:{self.ports[listener]}"

    # -- the process --

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "never started"
        return self.proc.pid

    def start(self) -> Server:
        """Start the process and wait until every listener is bound."""
        assert not self.running, "already running"
        lines = "".join(f'{name} = "{addr}"\n' for name, addr in self.listen.items())
        self.config_file.write_text(f"[listen]\n{lines}\n{self.config}")
        self.ports_file.unlink(missing_ok=True)
        self.starts += 1
        with self.log_path.open("ab") as log:
            log.write(f"\n===== start {self.starts} =====\n".encode())
            log.flush()
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
                    str(self.config_file),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=self.preexec_fn,
            )
        try:
            bound = wait_until(
                self._bound_ports, START_SECONDS, "the server did not write its ports file"
            )
        except AssertionError as exc:
            self.kill()
            raise AssertionError(f"{exc}\n{self.log_tail()}") from None
        self.ports = {name: int(port) for name, port in bound.items() if port}
        for name, addr in self.listen.items():  # the same ports after a restart
            if addr.endswith(":0") and self.ports.get(name):
                self.listen[name] = f"{addr[:-2]}:{self.ports[name]}"
        return self

    def _bound_ports(self) -> dict[str, int] | None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"the server exited with {self.proc.returncode} during start-up")
        try:
            ports: dict[str, int] = json.loads(self.ports_file.read_text())
        except (OSError, ValueError):  # not there yet (or half written)
            return None
        return ports

    def stop(self, timeout: float = STOP_SECONDS) -> int | None:
        """SIGTERM and wait; the exit status (None if never started). A server that
        ignores SIGTERM for ``timeout`` seconds is killed and fails the test."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"the server ignored SIGTERM for {timeout}s:\n{self.log_tail()}"
            ) from None

    def kill(self) -> None:
        """SIGKILL (a crash) and reap."""
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def restart(self) -> Server:
        """Stop (SIGTERM) and start again on the same data and addresses."""
        self.stop()
        return self.start()

    # -- what it said --

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    # -- a raw Kimberlite client --

    def client(self, tenant_id: int = 0, **kwargs: object) -> RawClient:
        """A :class:`~kimberlite_raw.RawClient` connected to the Kimberlite listener."""
        return RawClient(self.port, tenant_id, **kwargs)  # type: ignore[arg-type]


def assert_clean_log(server: Server) -> None:
    """No ERROR or CRITICAL line and no traceback in the server's log."""
    bad = [
        line
        for line in server.log_text().splitlines()
        if re.match(r"^\S+ (ERROR|CRITICAL)\b", line) or "Traceback" in line
    ]
    assert not bad, "the server logged errors:\n" + "\n".join(bad[:20])


def stop_cleanly(server: Server, *, clean_log: bool = False) -> None:
    """SIGTERM: the server must exit with status 0 (and, with ``clean_log``, have logged
    no errors)."""
    status = server.stop()
    assert status == 0, f"the server exited with {status}:\n{server.log_tail()}"
    if clean_log:
        assert_clean_log(server)


def serving(
    root: Path,
    *,
    config: str = "",
    listen: dict[str, str] | None = None,
    clean_log: bool = False,
) -> Iterator[Server]:
    """Body of a fixture holding one server: started and yielded; at teardown it must
    still be running, and it must stop cleanly (:func:`stop_cleanly`)."""
    server = Server(root, config=config, listen=listen).start()
    try:
        yield server
        assert server.running, f"the server died:\n{server.log_tail()}"
        stop_cleanly(server, clean_log=clean_log)
    finally:
        server.kill()


def server_factory(
    tmp_path: Path, default_listen: dict[str, str] | None = None
) -> Iterator[Callable[..., Server]]:
    """Body of the ``make_server`` fixtures: ``make(port=0, config="", listen=None)``
    starts a server of the test's own (``listen`` over ``default_listen``); all of them
    are stopped when the generator closes (killed if SIGTERM does not do it)."""
    servers: list[Server] = []

    def make(port: int = 0, config: str = "", listen: dict[str, str] | None = None) -> Server:
        root = tmp_path / f"server{len(servers)}"
        listeners = {**(default_listen or {}), **(listen or {})}
        server = Server(root, config=config, listen=listeners, port=port)
        servers.append(server)
        return server.start()

    try:
        yield make
    finally:
        problems = []
        for server in servers:
            try:
                server.stop()
            except AssertionError as exc:  # killed by now; the others are stopped still
                problems.append(exc)
        if problems:
            raise problems[0]


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


def http_call(
    server: Server, method: str, path: str, body: Any = None, *, tenant: int = 0
) -> tuple[int, Any]:
    """A JSON request to the server's HTTP API: its status and its decoded JSON answer
    (error answers too)."""
    request = urllib.request.Request(
        f"http://{server.address_of('http')}{path}",
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={"Content-Type": "application/json", "X-Headwater-Tenant": str(tenant)},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def http_json(server: Server, method: str, path: str, body: Any = None) -> Any:
    """:func:`http_call`'s answer, which must be a success."""
    status, answer = http_call(server, method, path, body)
    assert 200 <= status < 300, f"{method} {path}: {status} {answer}"
    return answer


def headwater_cli(*args: str, columns: int = 250) -> subprocess.CompletedProcess[str]:
    """The real ``headwater`` command (a wide terminal: rich cuts long cells to fit)."""
    return subprocess.run(
        [sys.executable, "-m", "headwater.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": str(columns), "NO_COLOR": "1"},
    )
