"""TOML configuration: documented keys parse, bad values fail with a clear message."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from headwater.server.config import ConfigError, config_from_dict, load_config

FULL = """
[listen]
http = "127.0.0.1:0"
kimberlite = "127.0.0.1:0"
convergedb = ""
ripple = "127.0.0.1:7403"

[storage]
sync = "interval:20"
retention_ms = 3600000
segment_bytes = 1048576

[auth]
required = true
[[auth.tokens]]
token = "s3cret"
tenants = [0, 42]

[[tenants]]
id = 42
name = "acme"

[logging]
level = "debug"
format = "json"
"""


def test_full_config(tmp_path: Path) -> None:
    path = tmp_path / "headwater.toml"
    path.write_text(FULL)
    config = load_config(path)
    assert config.address("http") == ("127.0.0.1", 0)
    assert config.address("convergedb") is None
    assert config.address("ripple") == ("127.0.0.1", 7403)
    assert str(config.engine.sync) == "interval:20"
    assert config.engine.retention_ms == 3_600_000
    assert config.engine.segment_bytes == 1 << 20
    assert config.engine.tenants == {0: "default", 42: "acme"}
    assert config.auth.required is True
    assert config.auth.tokens == {"s3cret": frozenset({0, 42})}
    assert (config.log_level, config.log_format) == ("DEBUG", "json")


def test_defaults_without_a_file() -> None:
    config = load_config(None)
    assert config.address("kimberlite") == ("127.0.0.1", 7401)
    assert str(config.engine.sync) == "fsync"
    assert config.auth.required is False


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"storage": {"sync": "sometimes"}}, "storage.sync"),
        ({"storage": {"sync": "interval:0"}}, "storage.sync"),
        ({"storage": {"retention_ms": -1}}, "storage.retention_ms"),
        ({"listen": {"http": "nowhere"}}, "listen.http"),
        ({"listen": {"gopher": "127.0.0.1:70"}}, "unknown listener"),
        ({"auth": {"required": "yes"}}, "auth.required"),
        ({"auth": {"tokens": [{"tenants": [0]}]}}, "non-empty token"),
        ({"tenants": [{"id": -3}]}, "tenants"),
        ({"logging": {"level": "chatty"}}, "logging.level"),
        ({"ripple": {"liveness_ms": 0}}, "ripple.liveness_ms"),
        ({"ripple": {"liveness_ms": 2**32}}, "ripple.liveness_ms"),
        ({"ripple": "often"}, r"\[ripple\]"),
        ({"limits": {"max_conections": 5}}, r"unknown key in \[limits\]: max_conections"),
        ({"limits": {"max_connections": 0}}, "limits.max_connections"),
        ({"limits": {"idle_timeout_s": True}}, "limits.idle_timeout_s"),
        ({"storage": {"sync": "fsync", "segmentbytes": 1}}, r"\[storage\]: segmentbytes"),
        ({"kiwi": {"subscriber": {"send_queu": 1}}}, r"\[kiwi.subscriber\]: send_queu"),
        ({"tenants": [{"id": 1, "produce_byte_per_s": 1}]}, r"\[tenants\]"),
        ({"tenants": [{"id": 1, "requests_per_s": -1}]}, r"tenants\[1\].requests_per_s"),
        ({"auth": {"tokens": [{"token": "t", "cert_cn": "c"}]}}, "not both"),
        ({"auth": {"tokens": [{"token": "t", "admin": "yes"}]}}, "admin"),
        ({"limit": {}}, "unknown key in the top level: limit"),
        ({"tls": {"cert": "/nonexistent.pem", "key": "/nonexistent.key"}}, "tls.cert"),
        # Each of these started a server that broke later, or stopped with a traceback,
        # or a later entry silently replaced an earlier one.
        ({"listen": {"http": "127.0.0.1:\u0661\u0662"}}, "listen.http"),
        ({"auth": {"tokens": {"token": "t"}}}, r"write \[\[auth.tokens\]\]"),
        ({"auth": {"tokens": [{"token": "t"}, {"token": "t", "tenants": [1]}]}}, "twice"),
        ({"auth": {"tokens": [{"cert_cn": "w"}, {"cert_cn": "w"}]}}, "cert_cn 'w'"),
        ({"tenants": [{"id": 1}, {"id": 1, "name": "again"}]}, "id 1 is declared twice"),
        ({"tenants": [{"id": True}]}, "tenants: id must be a non-negative integer"),
        ({"tenants": [{"id": 1, "name": ["x"]}]}, r"tenants\[1\].name must be a name"),
        ({"tenants": [{"id": 1, "name": "2"}]}, r"tenants\[1\].name must be a name"),
        ({"tenants": [{"id": 1, "name": "default"}]}, "another tenant's"),
        ({"listen": "x"}, r"\[listen\] must be a table"),
        ({"tenants": {"id": 1}}, r"write \[\[tenants\]\], not \[tenants\]"),
        ({"tenants": ["acme"]}, r"\[tenants\] must be a table"),
        ({"storage": {"segment_bytes": 1}}, "segment_bytes must be between"),
        ({"limits": {"sql_memory_mib": 2**62}}, "limits.sql_memory_mib must be an integer from"),
        ({"limits": {"handshake_timeout_s": math.nan}}, "limits.handshake_timeout_s"),
        ({"limits": {"idle_timeout_s": math.inf}}, "limits.idle_timeout_s"),
        ({"kiwi": {"subscriber": {"socket_send_buffer": 2**32}}}, "socket_send_buffer"),
        (
            {"cluster": {"node_id": 1, "etcd": ["127.0.0.1:2379"], "replica_lag_s": math.nan}},
            "cluster.replica_lag_s",
        ),
    ],
)
def test_bad_values_are_named(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_dict(data)


def test_ripple_liveness() -> None:
    assert config_from_dict({}).ripple_liveness_ms == 0  # the kinds' default
    assert config_from_dict({"ripple": {"liveness_ms": 86_400_000}}).ripple_liveness_ms == (
        86_400_000
    )


def test_unreadable_and_invalid_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    latin = tmp_path / "latin.toml"
    latin.write_bytes('[[tenants]]\nid = 1\nname = "caf\u00e9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8"):  # it was a traceback
        load_config(latin)
    bad = tmp_path / "bad.toml"
    bad.write_text("[listen\nhttp=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_limits_quotas_and_admin_tokens() -> None:
    config = config_from_dict(
        {
            "limits": {"max_connections": 7, "handshake_timeout_s": 0.5, "sql_concurrency": 1},
            "tenants": [{"id": 42, "name": "acme", "produce_bytes_per_s": 1000}],
            "auth": {
                "tokens": [
                    {"token": "ops", "tenants": [], "admin": True},
                    {"cert_cn": "worker-1", "tenants": [42]},
                ]
            },
        }
    )
    assert config.limits.max_connections == 7
    assert config.limits.handshake_timeout_s == 0.5
    assert config.limits.sql_concurrency == 1
    assert config.limits.idle_timeout_s == 300.0  # untouched keys keep their defaults
    assert config.quotas[42].produce_bytes_per_s == 1000
    assert config.quotas[42].requests_per_s is None
    assert config.auth.admin_tokens == frozenset({"ops"})
    assert config.auth.cert_cns == {"worker-1": frozenset({42})}
    assert config.tls is None


def test_tls_paths(tmp_path: Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("x")
    key.write_text("y")
    tls = config_from_dict({"tls": {"cert": str(cert), "key": str(key)}}).tls
    assert tls is not None and tls.cert == cert and tls.client_ca is None
    with pytest.raises(ConfigError, match="needs both cert and key"):
        config_from_dict({"tls": {"cert": str(cert)}})


def test_storage_compression_default_and_per_stream_override() -> None:
    from headwater.engine.engine import StreamSettings
    from headwater.errors import InvalidRequest

    assert config_from_dict({}).engine.compression == "none"
    engine = config_from_dict({"storage": {"compression": "zstd"}}).engine
    assert engine.compression == "zstd"
    assert StreamSettings().log_config(engine).compression == "zstd"
    assert StreamSettings(compression="lz4").log_config(engine).compression == "lz4"
    with pytest.raises(ConfigError, match=r"storage\.compression: compression must be one of"):
        config_from_dict({"storage": {"compression": "gzip"}})
    with pytest.raises(InvalidRequest, match="compression must be one of none, zstd, lz4"):
        StreamSettings.from_dict({"compression": "brotli"})
