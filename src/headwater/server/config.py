"""Server configuration from TOML (``headwater serve --config F``).

Keys documented in spec/PROTOCOLS.md are never renamed; headwater's own additions live in
the same tables (docs/operations.md lists them all).
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headwater.api.auth import AuthConfig
from headwater.api.quotas import TenantQuota
from headwater.cluster.config import ClusterConfig
from headwater.engine.engine import EngineConfig, StreamSettings
from headwater.engine.kinds.model import KindsConfig
from headwater.engine.names import check_name
from headwater.errors import InvalidRequest
from headwater.storage.compression import check_compression
from headwater.storage.log import SyncPolicy

DEFAULT_LISTEN = {
    "http": "127.0.0.1:7400",
    "kimberlite": "127.0.0.1:7401",
    "convergedb": "127.0.0.1:7402",
    "ripple": "127.0.0.1:7403",
    "rivven": "127.0.0.1:7404",
    "postgres": "127.0.0.1:7405",
    "kafka": "127.0.0.1:9092",
}


# Positive-integer options of [convergedb] and [kiwi.subscriber], defaulting to the
# config classes' own defaults.
KIND_OPTIONS = (
    "coalesce_ms",
    "live_buffer",
    "default_liveness_ms",
    "liveness_check_ms",
    "hot_entities",
)
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
class LimitsConfig:
    """``[limits]``: what one server gives its clients (docs/operations.md, "Limits").

    Every limit is enforced on every listener it applies to, answered with the
    protocol's own error (HTTP 503/413/429 where there is none) and counted in /metrics
    (``headwater_limit_refusals_total{limit=...}``)."""

    max_connections: int = 10_000  # open client connections, all listeners together
    handshake_timeout_s: float = 10.0  # no completed auth or first whole frame: closed
    idle_timeout_s: float = 300.0  # no traffic and no subscription: closed
    max_pending_bytes: int = 1 << 20  # buffered for a connection before it authenticates
    max_subscriptions_per_connection: int = 1024
    max_streams_per_tenant: int = 100_000
    open_files: int = 512  # segment files open at once (least recently used closed)
    sql_timeout_ms: int = 30_000  # a query running longer is cancelled
    # DuckDB's memory per query (larger spills or fails); x sql_concurrency is DuckDB's
    # share of memory_mib (docs/operations.md, "Memory")
    sql_memory_mib: int = 256
    sql_concurrency: int = 2  # queries running at once; the rest wait, fairly per tenant
    sql_spill_mib: int = 4096  # disk the running queries may spill to beyond their memory
    sql_result_mib: int = 32  # a result costing the server more (Arrow + values) is refused
    memory_mib: int = 1024  # the server's anonymous resident memory budget (issue 16)
    # Read answers (Kafka Fetch, Kimberlite ReadEvents) held until their peers read them,
    # all connections together (server/answers.py)
    read_answers_mib: int = 48


# Keys of [limits] that take seconds and may be fractional; the others are integers.
LIMIT_SECONDS = ("handshake_timeout_s", "idle_timeout_s")


@dataclass(frozen=True)
class TlsConfig:
    """``[tls]``: one certificate for every listener; ``client_ca`` turns on mutual TLS
    (clients must present a certificate that CA signed)."""

    cert: Path
    key: Path
    client_ca: Path | None = None


QUOTA_KEYS = ("produce_bytes_per_s", "consume_bytes_per_s", "requests_per_s")


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
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    tls: TlsConfig | None = None
    quotas: dict[int, TenantQuota] = field(default_factory=dict)  # by tenant id
    cluster: ClusterConfig | None = None  # [cluster]: a node of a replicated cluster

    def address(self, name: str) -> tuple[str, int] | None:
        """(host, port) of a listener, or None when it is switched off."""
        text = self.listen.get(name, "")
        if not text:
            return None
        return parse_address(text, name)


MAX_LIVENESS_MS = 2**32 - 1  # a source's deadline is a u32 on the wire (presence kind)


def parse_address(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    # ASCII digits only: str.isdigit() takes any script's ("١٢" was port 12).
    if not sep or not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise ConfigError(f"listen.{what}: expected host:port, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


# Past these a value is no setting anyone means, and breaks later, not at start-up:
# DuckDB refuses a memory limit of 2**63 MiB, a socket buffer must fit a C int.
MAX_SETTING = (1 << 63) - 1
MAX_MIB = 1 << 30  # a PiB
MAX_SOCKET_BUFFER = (1 << 31) - 1


def _positive_int(
    section: dict[str, Any], key: str, where: str, at_most: int | None = None
) -> int | None:
    value = section.get(key)
    if value is None:
        return None
    if at_most is None:
        at_most = MAX_MIB if key.endswith("_mib") else MAX_SETTING
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= at_most:
        raise ConfigError(f"{where}.{key} must be an integer from 1 to {at_most}, got {value!r}")
    return value


def _seconds(value: object, name: str) -> float:
    """A positive, finite number of seconds (TOML's nan and inf are not: a NaN timeout
    left every connection of every listener hanging)."""
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def load_config(path: Path | None) -> ServerConfig:
    if path is None:
        return ServerConfig()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8
        raise ConfigError(f"config {path} is not UTF-8: {exc.reason} at byte {exc.start}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path} is not valid TOML: {exc}") from None
    return config_from_dict(data)


# Every table and key the server reads. Anything else stops start-up with an error naming
# it: a typo in a limit must not silently drop the limit. ([listen] checks its own keys.)
KNOWN_KEYS: dict[str, frozenset[str]] = {
    "": frozenset(
        {"listen", "storage", "auth", "tenants", "convergedb", "ripple", "kiwi", "logging"}
        | {"limits", "tls", "cluster"}
    ),
    "storage": frozenset(
        {"sync", "segment_bytes", "segment_ms", "retention_ms", "retention_bytes"}
        | {"delete_retention_ms", "producer_expiry_ms", "maintenance_interval_ms"}
        | {"compression"}
    ),
    "auth": frozenset({"required", "tokens"}),
    "auth.tokens": frozenset({"token", "tenants", "admin", "cert_cn"}),
    "tenants": frozenset({"id", "name", *QUOTA_KEYS}),
    "convergedb": frozenset(KIND_OPTIONS),
    "ripple": frozenset({"liveness_ms"}),
    "kiwi": frozenset({"subscriber", "sources"}),
    "kiwi.subscriber": frozenset({*KIWI_OPTIONS, "socket_send_buffer"}),
    "kiwi.sources": frozenset({"id", "type", "interval_ms", "min", "max", "lazy"}),
    "logging": frozenset({"level", "format"}),
    "limits": frozenset(LimitsConfig.__dataclass_fields__),
    "tls": frozenset({"cert", "key", "client_ca"}),
    "cluster": frozenset(ClusterConfig.__dataclass_fields__),
}


def check_known_keys(data: dict[str, Any], path: str = "") -> None:
    """ConfigError naming every unknown table or key of ``data`` (and its sub-tables)."""
    known = KNOWN_KEYS[path]
    unknown = sorted(key for key in data if key not in known)
    if unknown:
        where = f"[{path}]" if path else "the top level"
        raise ConfigError(
            f"unknown key{'s' if len(unknown) > 1 else ''} in {where}: {', '.join(unknown)}"
            f" (known: {', '.join(sorted(known))})"
        )
    for key, value in data.items():
        sub = f"{path}.{key}" if path else key
        if sub not in KNOWN_KEYS:
            continue
        entries = value if isinstance(value, list) else [value]
        for entry in entries:
            if not isinstance(entry, dict):
                raise ConfigError(f"[{sub}] must be a table")
            check_known_keys(entry, sub)


def _compression(value: object) -> str:
    try:
        return check_compression(value)
    except ValueError as exc:
        raise ConfigError(f"storage.compression: {exc}") from None


def config_from_dict(data: dict[str, Any]) -> ServerConfig:
    """The server's config from a parsed TOML document; ConfigError naming what is
    wrong (a setting's own check, a segment size say, too: one line, not a traceback)."""
    try:
        return _config_from_dict(data)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _config_from_dict(data: dict[str, Any]) -> ServerConfig:
    check_known_keys(data)
    listen = dict(DEFAULT_LISTEN)
    for name, value in _table(data.get("listen", {}), "[listen]").items():
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
    quotas: dict[int, TenantQuota] = {}
    declared: set[int] = set()
    entries = data.get("tenants", [])
    if not isinstance(entries, list):
        raise ConfigError("[[tenants]] is an array of tables: write [[tenants]], not [tenants]")
    for entry in entries:
        tenant_id = _table(entry, "[[tenants]]").get("id")
        if not isinstance(tenant_id, int) or isinstance(tenant_id, bool) or tenant_id < 0:
            raise ConfigError(f"tenants: id must be a non-negative integer, got {tenant_id!r}")
        if tenant_id in declared:  # the later entry silently replaced the earlier
            raise ConfigError(f"tenants: id {tenant_id} is declared twice")
        declared.add(tenant_id)
        name = entry.get("name", f"tenant{tenant_id}")
        # A name chooses its tenant (PostgreSQL's dbname): text, and not another's id.
        if not isinstance(name, str) or not name or name.isdigit():
            raise ConfigError(f"tenants[{tenant_id}].name must be a name, not {name!r}")
        if any(other == name and t != tenant_id for t, other in tenants.items()):
            raise ConfigError(f"tenants[{tenant_id}].name {name!r} is another tenant's")
        tenants[tenant_id] = name
        rates = {key: _positive_int(entry, key, f"tenants[{tenant_id}]") for key in QUOTA_KEYS}
        if any(rate is not None for rate in rates.values()):
            quotas[tenant_id] = TenantQuota(**rates)

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
        compression=_compression(storage.get("compression", defaults.compression)),
        tenants=tenants,
    )

    # Every stream's log is made of these defaults: what the log refuses (a segment
    # size out of range) stops start-up here, not the first stream's open.
    StreamSettings().log_config(engine)
    auth = _auth_config(data.get("auth", {}))

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
        auth=auth,
        kinds=kinds,
        kiwi=kiwi,
        ripple_liveness_ms=ripple_liveness,
        log_level=level,
        log_format=fmt,
        limits=_limits_config(data.get("limits", {})),
        tls=_tls_config(data.get("tls")),
        quotas=quotas,
        cluster=_cluster_config(data.get("cluster")),
    )


def _auth_config(data: Any) -> AuthConfig:
    data = _table(data, "[auth]")
    tokens: dict[str, frozenset[int]] = {}
    admins: set[str] = set()
    cert_cns: dict[str, frozenset[int]] = {}
    entries = data.get("tokens", [])
    if not isinstance(entries, list):
        raise ConfigError(
            "[[auth.tokens]] is an array of tables: write [[auth.tokens]], not [auth.tokens]"
        )
    for entry in entries:
        token = _table(entry, "[[auth.tokens]]").get("token")
        cert_cn = entry.get("cert_cn")
        granted = entry.get("tenants", [0])
        if not isinstance(granted, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in granted
        ):
            raise ConfigError("auth.tokens: tenants must be a list of integers")
        admin = entry.get("admin", False)
        if not isinstance(admin, bool):
            raise ConfigError("auth.tokens: admin must be true or false")
        if (token is None) == (cert_cn is None):
            raise ConfigError(
                "auth.tokens: every entry needs a non-empty token string or a cert_cn, not both"
            )
        if cert_cn is not None:
            if not isinstance(cert_cn, str) or not cert_cn:
                raise ConfigError("auth.tokens: cert_cn must be a non-empty string")
            if cert_cn in cert_cns:
                raise ConfigError(f"auth.tokens: cert_cn {cert_cn!r} is given twice")
            cert_cns[cert_cn] = frozenset(granted)
            continue
        if not isinstance(token, str) or not token:
            raise ConfigError("auth.tokens: every entry needs a non-empty token string")
        if token in tokens:  # the later entry's grant silently replaced the earlier's
            raise ConfigError("auth.tokens: a token is given twice (one entry each)")
        tokens[token] = frozenset(granted)
        if admin:
            admins.add(token)
    required = data.get("required", False)
    if not isinstance(required, bool):
        raise ConfigError("auth.required must be true or false")
    return AuthConfig(
        required=required, tokens=tokens, admin_tokens=frozenset(admins), cert_cns=cert_cns
    )


def _limits_config(data: Any) -> LimitsConfig:
    data = _table(data, "[limits]")
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key in LIMIT_SECONDS:
            values[key] = _seconds(value, f"limits.{key}")
        else:
            values[key] = _positive_int(data, key, "limits")
    return LimitsConfig(**values)


def _cluster_config(data: Any) -> ClusterConfig | None:
    """``[cluster]`` (docs/cluster.md); None without the table: a single node."""
    if data is None:
        return None
    data = _table(data, "[cluster]")
    node_id = data.get("node_id")
    if not isinstance(node_id, int) or isinstance(node_id, bool) or not 0 <= node_id < 1 << 20:
        raise ConfigError(f"cluster.node_id must be an integer 0..1048575, got {node_id!r}")
    etcd = data.get("etcd")
    if isinstance(etcd, str):
        etcd = [etcd]
    if not isinstance(etcd, list) or not etcd or not all(isinstance(e, str) and e for e in etcd):
        raise ConfigError("cluster.etcd must be a list of etcd endpoints like '127.0.0.1:2379'")
    options: dict[str, Any] = {}
    for key in ("advertise_host", "rack", "prefix"):
        value = data.get(key)
        if value is not None:
            if not isinstance(value, str) or not value:
                raise ConfigError(f"cluster.{key} must be a non-empty string")
            options[key] = value
    for key in ("replication_factor", "min_insync_replicas", "lease_s"):
        size = _positive_int(data, key, "cluster")
        if size is not None:
            options[key] = size
    lag = data.get("replica_lag_s")
    if lag is not None:
        options["replica_lag_s"] = _seconds(lag, "cluster.replica_lag_s")
    port = data.get("replication_port")
    if port is not None:
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ConfigError("cluster.replication_port must be a port number (0: any free one)")
        options["replication_port"] = port
    options.update(_cluster_secret(data))
    advertised = data.get("advertise_ports")
    if advertised is not None:
        if not isinstance(advertised, dict) or not all(
            isinstance(p, int) and not isinstance(p, bool) and 0 < p <= 65535
            for p in advertised.values()
        ):
            raise ConfigError(
                "cluster.advertise_ports must be a table of listener = port, e.g. {kafka = 9092}"
            )
        options["advertise_ports"] = tuple(sorted(advertised.items()))
    try:
        return ClusterConfig(node_id=node_id, etcd=tuple(etcd), **options)
    except ValueError as exc:
        raise ConfigError(f"cluster: {exc}") from None


def _cluster_secret(data: dict[str, Any]) -> dict[str, Any]:
    """``secret`` or ``secret_file`` of ``[cluster]``: the bytes nodes prove to each other."""
    secret, secret_file = data.get("secret"), data.get("secret_file")
    if secret is not None and secret_file is not None:
        raise ConfigError("cluster: give secret or secret_file, not both")
    if secret is not None:
        if not isinstance(secret, str) or len(secret) < 16:
            raise ConfigError("cluster.secret must be a string of 16 characters or more")
        return {"secret": secret.encode()}
    if secret_file is None:
        return {}
    if not isinstance(secret_file, str) or not secret_file:
        raise ConfigError("cluster.secret_file must be a file path")
    try:
        raw = Path(secret_file).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(
            f"cluster.secret_file: cannot read {secret_file}: {exc.strerror}"
        ) from None
    if len(raw) < 16:
        raise ConfigError(f"cluster.secret_file: {secret_file} holds under 16 bytes")
    return {"secret": raw, "secret_file": secret_file}


def _tls_config(data: Any) -> TlsConfig | None:
    if data is None:
        return None
    data = _table(data, "[tls]")
    paths: dict[str, Path] = {}
    for key in ("cert", "key", "client_ca"):
        value = data.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise ConfigError(f"tls.{key} must be a file path")
        path = Path(value)
        if not path.is_file():
            raise ConfigError(f"tls.{key}: no such file: {path}")
        paths[key] = path
    if "cert" not in paths or "key" not in paths:
        raise ConfigError("[tls] needs both cert and key")
    return TlsConfig(paths["cert"], paths["key"], paths.get("client_ca"))


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
        socket_send_buffer=_positive_int(
            subscriber, "socket_send_buffer", "kiwi.subscriber", MAX_SOCKET_BUFFER
        ),
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
