"""Server configuration from TOML (``headwater serve --config F``).

Keys documented in spec/PROTOCOLS.md are never renamed; headwater's own additions live in
the same tables (docs/operations.md lists them all).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headwater.api.auth import AuthConfig
from headwater.engine.engine import EngineConfig
from headwater.engine.kinds.model import KindsConfig
from headwater.engine.names import check_name
from headwater.errors import InvalidRequest
from headwater.storage.log import SyncPolicy

DEFAULT_LISTEN = {
    "http": "127.0.0.1:7400",
    "kimberlite": "127.0.0.1:7401",
    "convergedb": "127.0.0.1:7402",
    "ripple": "127.0.0.1:7403",
}


# Positive-integer options of [convergedb] and [kiwi.subscriber], defaulting to the
# config classes' own defaults.
KIND_OPTIONS = ("coalesce_ms", "live_buffer", "default_liveness_ms", "liveness_check_ms")
KIWI_OPTIONS = ("buffer_capacity", "lag_notice_threshold", "send_queue", "max_message_bytes")


class ConfigError(ValueError):
    """The configuration file is unreadable or holds a bad value."""


@dataclass(frozen=True)
class CounterSource:
    """A Kiwi counter source (``[[kiwi.sources]]`` with ``type = "counter"``)."""

    source_id: str
    interval_ms: int
    min: int = 0
    max: int | None = None  # the last count; the source then ends
    lazy: bool = False  # start at the first subscription rather than at server start


@dataclass(frozen=True)
class KiwiConfig:
    """The Kiwi WebSocket gateway (``[kiwi.subscriber]``, ``[[kiwi.sources]]``)."""

    buffer_capacity: int = 1024
    lag_notice_threshold: int = 1
    send_queue: int = 1024  # messages waiting for one connection's socket
    socket_send_buffer: int | None = None  # SO_SNDBUF of each WebSocket; None: the OS's
    max_message_bytes: int = 64 << 10  # largest command a client may send
    counters: tuple[CounterSource, ...] = ()


@dataclass(frozen=True)
class ServerConfig:
    listen: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_LISTEN))
    engine: EngineConfig = field(default_factory=EngineConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    kinds: KindsConfig = field(default_factory=KindsConfig)
    kiwi: KiwiConfig = field(default_factory=KiwiConfig)
    ripple_liveness_ms: int = 0  # 0: the kinds' default_liveness_ms
    log_level: str = "INFO"
    log_format: str = "text"
    raw: dict[str, Any] = field(default_factory=dict)  # sections later issues read

    def address(self, name: str) -> tuple[str, int] | None:
        """(host, port) of a listener, or None when it is switched off."""
        text = self.listen.get(name, "")
        if not text:
            return None
        return parse_address(text, name)


MAX_LIVENESS_MS = 2**32 - 1  # a source's deadline is a u32 on the wire (presence kind)


def parse_address(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"listen.{what}: expected host:port, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _positive_int(section: dict[str, Any], key: str, where: str) -> int | None:
    value = section.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{where}.{key} must be a positive integer, got {value!r}")
    return value


def load_config(path: Path | None) -> ServerConfig:
    if path is None:
        return ServerConfig()
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path} is not valid TOML: {exc}") from None
    return config_from_dict(data)


def config_from_dict(data: dict[str, Any]) -> ServerConfig:
    listen = dict(DEFAULT_LISTEN)
    for name, value in data.get("listen", {}).items():
        if name not in DEFAULT_LISTEN:
            raise ConfigError(f"listen.{name}: unknown listener (one of {', '.join(listen)})")
        if not isinstance(value, str):
            raise ConfigError(f"listen.{name} must be a string like '127.0.0.1:7400'")
        if value:
            parse_address(value, name)
        listen[name] = value

    storage = data.get("storage", {})
    try:
        sync = SyncPolicy.parse(storage.get("sync", "fsync"))
    except (ValueError, AttributeError) as exc:
        raise ConfigError(f"storage.sync: {exc}") from None
    defaults = EngineConfig()
    tenants = {0: "default"}
    for entry in data.get("tenants", []):
        tenant_id = entry.get("id")
        if not isinstance(tenant_id, int) or tenant_id < 0:
            raise ConfigError(f"tenants: id must be a non-negative integer, got {tenant_id!r}")
        tenants[tenant_id] = str(entry.get("name", f"tenant{tenant_id}"))

    def opt(key: str, default: int | None) -> int | None:
        value = _positive_int(storage, key, "storage")
        return default if value is None else value

    engine = EngineConfig(
        sync=sync,
        segment_bytes=opt("segment_bytes", defaults.segment_bytes) or defaults.segment_bytes,
        segment_ms=opt("segment_ms", defaults.segment_ms),
        retention_ms=opt("retention_ms", defaults.retention_ms),
        retention_bytes=opt("retention_bytes", defaults.retention_bytes),
        delete_retention_ms=opt("delete_retention_ms", defaults.delete_retention_ms)
        or defaults.delete_retention_ms,
        producer_expiry_ms=opt("producer_expiry_ms", defaults.producer_expiry_ms)
        or defaults.producer_expiry_ms,
        maintenance_interval_ms=opt("maintenance_interval_ms", defaults.maintenance_interval_ms)
        or defaults.maintenance_interval_ms,
        tenants=tenants,
    )

    auth_data = data.get("auth", {})
    tokens: dict[str, frozenset[int]] = {}
    for entry in auth_data.get("tokens", []):
        token = entry.get("token")
        granted = entry.get("tenants", [0])
        if not isinstance(token, str) or not token:
            raise ConfigError("auth.tokens: every entry needs a non-empty token string")
        if not isinstance(granted, list) or not all(isinstance(t, int) for t in granted):
            raise ConfigError(f"auth.tokens: tenants of token {token[:2]}… must be integers")
        tokens[token] = frozenset(granted)
    required = auth_data.get("required", False)
    if not isinstance(required, bool):
        raise ConfigError("auth.required must be true or false")

    convergedb = _table(data.get("convergedb", {}), "[convergedb]")
    kinds = KindsConfig(**_positive_ints(convergedb, "convergedb", KindsConfig(), KIND_OPTIONS))

    kiwi = _kiwi_config(data.get("kiwi", {}))

    ripple = _table(data.get("ripple", {}), "[ripple]")
    ripple_liveness = _positive_int(ripple, "liveness_ms", "ripple") or 0
    if ripple_liveness > MAX_LIVENESS_MS:
        raise ConfigError(f"ripple.liveness_ms must be at most {MAX_LIVENESS_MS} (a u32)")

    logging_data = data.get("logging", {})
    level = str(logging_data.get("level", "INFO")).upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ConfigError(f"logging.level must be DEBUG, INFO, WARNING or ERROR, not {level}")
    fmt = str(logging_data.get("format", "text"))
    if fmt not in ("text", "json"):
        raise ConfigError("logging.format must be 'text' or 'json'")
    return ServerConfig(
        listen=listen,
        engine=engine,
        auth=AuthConfig(required=required, tokens=tokens),
        kinds=kinds,
        kiwi=kiwi,
        ripple_liveness_ms=ripple_liveness,
        log_level=level,
        log_format=fmt,
        raw=data,
    )


def _table(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a table")
    return value


def _positive_ints(
    table: dict[str, Any], where: str, defaults: object, keys: tuple[str, ...]
) -> dict[str, Any]:
    """``keys`` of ``table`` as positive integers, each defaulting to ``defaults``'."""
    out: dict[str, Any] = {}
    for key in keys:
        value = _positive_int(table, key, where)
        out[key] = int(getattr(defaults, key)) if value is None else value
    return out


def _kiwi_config(data: Any) -> KiwiConfig:
    data = _table(data, "[kiwi]")
    subscriber = _table(data.get("subscriber", {}), "[kiwi.subscriber]")
    sized = _positive_ints(subscriber, "kiwi.subscriber", KiwiConfig(), KIWI_OPTIONS)

    sources = data.get("sources", [])
    if not isinstance(sources, list):
        raise ConfigError("kiwi.sources must be an array of tables ([[kiwi.sources]])")
    counters: list[CounterSource] = []
    seen: set[str] = set()
    for entry in sources:
        counters.append(_counter_source(entry, seen))
    return KiwiConfig(
        **sized,
        socket_send_buffer=_positive_int(subscriber, "socket_send_buffer", "kiwi.subscriber"),
        counters=tuple(counters),
    )


def _counter_source(entry: Any, seen: set[str]) -> CounterSource:
    if not isinstance(entry, dict):
        raise ConfigError("every [[kiwi.sources]] entry must be a table")
    source_id = entry.get("id")
    if not isinstance(source_id, str):
        raise ConfigError(f"kiwi.sources: id must be a string, got {source_id!r}")
    try:
        check_name(source_id)
    except InvalidRequest as exc:
        raise ConfigError(f"kiwi.sources: {exc.message}") from None
    where = f"kiwi.sources[{source_id}]"
    if source_id in seen:
        raise ConfigError(f"{where}: the id is used twice")
    seen.add(source_id)
    kind = entry.get("type", "counter")
    if kind != "counter":
        raise ConfigError(f"{where}: type must be 'counter' (streams and kinds need no entry)")
    interval = _positive_int(entry, "interval_ms", where)
    if interval is None:
        raise ConfigError(f"{where}: interval_ms is required")
    low = entry.get("min", 0)
    high = entry.get("max")
    for key, value in (("min", low), ("max", high)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConfigError(f"{where}.{key} must be an integer, got {value!r}")
    if high is not None and high < low:
        raise ConfigError(f"{where}: max ({high}) is below min ({low})")
    lazy = entry.get("lazy", False)
    if not isinstance(lazy, bool):
        raise ConfigError(f"{where}.lazy must be true or false")
    return CounterSource(source_id, interval, low, high, lazy)
