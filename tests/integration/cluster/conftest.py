"""Fixtures of the cluster tests: a real etcd per test and a :class:`Cluster` on it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_nodes import Cluster

from headwater.cluster.local import EtcdProcess


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    process = EtcdProcess(tmp_path / "etcd").start()
    try:
        yield process
    finally:
        process.kill()


@pytest.fixture
def cluster(tmp_path: Path, etcd: EtcdProcess) -> Iterator[Cluster]:
    """Nodes are added by the test (``cluster.add(node_id)``); every one still running
    at the end must stop cleanly (SIGTERM, status 0)."""
    nodes = Cluster(tmp_path, etcd)
    try:
        yield nodes
        for node in nodes.nodes.values():
            if node.running:
                assert node.stop() == 0, node.log_tail()
    finally:
        for node in nodes.nodes.values():
            node.kill()
