"""``[cluster] secret`` / ``secret_file``: what the replication handshake proves
(cluster/peers.py), refused at load when it cannot be used."""

from __future__ import annotations

from pathlib import Path

import pytest

from headwater.cluster.peers import proof
from headwater.server.config import ConfigError, config_from_dict

CLUSTER = {"node_id": 1, "etcd": ["127.0.0.1:2379"]}


def cluster_with(**keys: object) -> dict[str, object]:
    return {"cluster": {**CLUSTER, **keys}}


def test_an_inline_secret_is_kept_and_never_shown() -> None:
    config = config_from_dict(cluster_with(secret="s" * 16))
    assert config.cluster is not None and config.cluster.secret == b"s" * 16
    assert "ssss" not in repr(config.cluster)


def test_a_secret_file_is_read_without_its_surrounding_whitespace(tmp_path: Path) -> None:
    path = tmp_path / "cluster.secret"
    path.write_text("  0123456789abcdef0123\n")
    config = config_from_dict(cluster_with(secret_file=str(path)))
    assert config.cluster is not None and config.cluster.secret == b"0123456789abcdef0123"


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"secret": "short"}, "16 characters or more"),
        ({"secret": 12345678901234567}, "16 characters or more"),
        ({"secret": "s" * 16, "secret_file": "/x"}, "not both"),
        ({"secret_file": "/nonexistent/cluster.secret"}, "cannot read"),
    ],
)
def test_unusable_secrets_are_refused(keys: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_dict(cluster_with(**keys))


def test_the_proof_depends_on_the_secret_and_the_nonce() -> None:
    assert proof(None, "n") == ""
    assert proof(b"a" * 16, "n") != proof(b"b" * 16, "n") != proof(b"b" * 16, "m")
