"""A whole cluster on one machine: one etcd and N ``headwater serve`` nodes.

``make cluster`` runs ``python -m headwater.cluster.local`` (docs/cluster.md): etcd
(Debian's etcd-server) on free ports, then three nodes, each with its own data
directory, config and ports under ``--dir``, every listener on a free port; it prints
where each node listens and runs until Ctrl-C, which stops the nodes (SIGTERM) and etcd.
The tests start etcd with the same :class:`EtcdProcess`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from headwater.server.config import DEFAULT_LISTEN

START_SECONDS = 30.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class EtcdProcess:
    """A single-member etcd on 127.0.0.1, data in ``root``; restartable on the same
    ports and data (``kill`` then ``start``: what etcd going away looks like)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> EtcdProcess:
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd is not installed (Debian: apt-get install etcd-server)")
        self.root.mkdir(parents=True, exist_ok=True)
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        with (self.root / "etcd.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    binary,
                    "--name=headwater",
                    f"--data-dir={self.root / 'etcd-data'}",
                    f"--listen-client-urls={client}",
                    f"--advertise-client-urls={client}",
                    f"--listen-peer-urls={peer}",
                    f"--initial-advertise-peer-urls={peer}",
                    f"--initial-cluster=headwater={peer}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + START_SECONDS
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                log_text = (self.root / "etcd.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"etcd did not start:\n{log_text}")
            time.sleep(0.05)
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as answer:
                return bool(json.loads(answer.read()).get("health") == "true")
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def node_config(node_id: int, etcd: str, listen: dict[str, str], extra: str = "") -> str:
    """The TOML of one node: its listeners and its [cluster] table."""
    lines = "".join(f'{name} = "{address}"\n' for name, address in listen.items())
    return (
        f"[listen]\n{lines}\n[cluster]\nnode_id = {node_id}\n"
        f'etcd = ["{etcd}"]\nadvertise_host = "127.0.0.1"\n{extra}'
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="etcd and N headwater nodes on this machine")
    parser.add_argument("--dir", type=Path, default=Path("./cluster-data"))
    parser.add_argument("--nodes", type=int, default=3)
    args = parser.parse_args(argv)
    root: Path = args.dir.resolve()
    etcd = EtcdProcess(root / "etcd").start()
    print(f"etcd: {etcd.endpoint}", flush=True)
    nodes: list[subprocess.Popen[bytes]] = []
    # Every listener on a port of its own: the defaults would collide between nodes.
    listen = {name: "127.0.0.1:0" for name in DEFAULT_LISTEN}
    try:
        for node_id in range(1, args.nodes + 1):
            home = root / f"node{node_id}"
            home.mkdir(parents=True, exist_ok=True)
            (home / "headwater.toml").write_text(node_config(node_id, etcd.endpoint, listen))
            ports = home / "ports.json"
            ports.unlink(missing_ok=True)
            with (home / "server.log").open("ab") as log:
                nodes.append(
                    subprocess.Popen(
                        [
                            *(sys.executable, "-m", "headwater.cli.main", "serve"),
                            *("--data-dir", str(home / "data"), "--ports-file", str(ports)),
                            *("--config", str(home / "headwater.toml")),
                        ],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
            deadline = time.monotonic() + START_SECONDS
            while not ports.exists():
                if nodes[-1].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"node {node_id} did not start: see {home}/server.log")
                time.sleep(0.1)
            print(f"node {node_id}: {ports.read_text()} (log: {home}/server.log)", flush=True)
        print(
            f"status: headwater cluster status --etcd {etcd.endpoint}   (Ctrl-C stops all)",
            flush=True,
        )
        # Blocked only now: the nodes, started before, keep their own signals.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    except KeyboardInterrupt:
        pass
    finally:
        for node in nodes:
            if node.poll() is None:
                node.send_signal(signal.SIGTERM)
        for node in nodes:
            node.wait()
        etcd.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
