"""How the CLI reaches a server: the connection options (flag, environment, saved
profile, default), the Kimberlite client they make, and the HTTP API for what
Kimberlite cannot carry.

Profiles live in one TOML file, ``$XDG_CONFIG_HOME/headwater/profiles.toml``
(``~/.config/headwater/profiles.toml``), or ``$HEADWATER_PROFILES`` when set, written
with permissions 0600 since it holds tokens::

    [profiles.prod]
    server = "hw1.example.com:7401"
    token = "..."
    tls = true
    ca_file = "/etc/headwater/ca.pem"

Each connection option is taken from the first of: its flag, its environment variable,
the chosen profile (``--profile NAME``, else ``$HEADWATER_PROFILE``, else a profile named
``default`` when there is one), the built-in default.
"""

from __future__ import annotations

import argparse
import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from headwater.client import Client

DEFAULT_PROFILE = "default"

# Profile keys: the connection options' destinations, and what each holds.
PROFILE_KEYS: dict[str, str] = {
    "server": "Kimberlite address host:port",
    "convergedb": "ConvergeDB address host:port (kind and entity commands)",
    "http": "HTTP API address host:port",
    "token": "auth token",
    "tenant": "tenant id",
    "tls": "connect over TLS",
    "ca_file": "CA file (PEM) to verify the server",
    "cert": "client certificate (PEM) for mutual TLS",
    "tls_key": "the client certificate's private key (PEM)",
}


class ProfileError(Exception):
    """A profile file that cannot be read, or a profile that is not in it."""


def profiles_path() -> Path:
    explicit = os.environ.get("HEADWATER_PROFILES")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "headwater" / "profiles.toml"


def load_profiles(path: Path | None = None) -> dict[str, dict[str, Any]]:
    """Every saved profile by name (none when the file does not exist)."""
    path = path or profiles_path()
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ProfileError(f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path} is not valid TOML: {exc}") from None
    profiles = data.get("profiles", {})
    if not isinstance(profiles, dict) or not all(isinstance(p, dict) for p in profiles.values()):
        raise ProfileError(f"{path}: [profiles.NAME] tables expected")
    for name, profile in profiles.items():
        unknown = set(profile) - set(PROFILE_KEYS)
        if unknown:
            raise ProfileError(
                f"{path}: profile {name!r} has unknown key(s) {', '.join(sorted(unknown))} "
                f"(known: {', '.join(PROFILE_KEYS)})"
            )
    return profiles


def _toml_value(value: object) -> str:
    # Profiles hold only strings, integers and booleans; a JSON string is a valid TOML
    # basic string (the same escapes), so no TOML writer is needed for these.
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return json.dumps(str(value))


def save_profiles(profiles: dict[str, dict[str, Any]], path: Path | None = None) -> Path:
    """Write every profile, replacing the file atomically, readable by its owner only."""
    path = path or profiles_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    lines = ["# headwater connection profiles (headwater profile add|remove)"]
    for name in sorted(profiles):
        lines.append("")
        lines.append(f"[profiles.{json.dumps(name)}]")
        for key in PROFILE_KEYS:  # a stable order
            if profiles[name].get(key) is not None:
                lines.append(f"{key} = {_toml_value(profiles[name][key])}")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write("\n".join(lines) + "\n")
    os.chmod(tmp, 0o600)  # whatever the umask; an existing file keeps no wider mode
    os.replace(tmp, path)
    return path


@dataclass(frozen=True)
class ConnectionSpec:
    """How a command's ``--server`` is found: its protocol, environment variable,
    built-in default and profile key."""

    protocol: str
    env: str
    default: str
    profile_key: str


# (argparse destination, environment variable, profile key, built-in default); --server
# and its variable come from the command's ConnectionSpec.
_OPTIONS: tuple[tuple[str, str, str, object], ...] = (
    ("http", "HEADWATER_HTTP", "http", "127.0.0.1:7400"),
    ("token", "HEADWATER_TOKEN", "token", None),
    ("tenant", "HEADWATER_TENANT", "tenant", 0),
    ("tls", "HEADWATER_TLS", "tls", False),
    ("ca_file", "HEADWATER_CA_FILE", "ca_file", None),
    ("cert", "HEADWATER_CERT", "cert", None),
    ("tls_key", "HEADWATER_KEY", "tls_key", None),
)


def _from_env(dest: str, text: str) -> object:
    if dest == "tls":
        return text.lower() not in ("", "0", "false", "no")
    if dest == "tenant":
        if not text.isdigit():
            raise ProfileError(f"$HEADWATER_TENANT must be a tenant id >= 0, not {text!r}")
        return int(text)
    return text


def resolve_connection(args: argparse.Namespace) -> None:
    """Fill the connection options left unset on the command line: environment, then
    the profile, then the built-in default (ProfileError for an unknown profile)."""
    spec: ConnectionSpec = args.connection
    chosen = args.profile or os.environ.get("HEADWATER_PROFILE") or None
    profiles = load_profiles()
    if chosen is not None and chosen not in profiles:
        known = ", ".join(sorted(profiles)) or "none saved"
        raise ProfileError(f"no profile {chosen!r} in {profiles_path()} (profiles: {known})")
    profile = profiles.get(chosen or DEFAULT_PROFILE, {})
    options = (("server", spec.env, spec.profile_key, spec.default), *_OPTIONS)
    for dest, env, key, default in options:
        if not hasattr(args, dest) or getattr(args, dest) is not None:
            continue  # the command has no such option, or its flag was given
        if os.environ.get(env):
            value = _from_env(dest, os.environ[env])
        elif profile.get(key) is not None:
            value = profile[key]
        else:
            value = default
        setattr(args, dest, value)


def connection_options(
    protocol: str = "Kimberlite",
    env: str = "HEADWATER_SERVER",
    default: str = "127.0.0.1:7401",
    *,
    http: bool = False,
    tenant_help: str = "tenant id (default 0; $HEADWATER_TENANT)",
    profile_key: str = "server",
    key_flag: bool = True,
) -> argparse.ArgumentParser:
    """The connection options every client command takes: ``--server`` (the
    ``protocol``'s address), ``--token``, ``--tenant``, TLS, ``--profile``, and with
    ``http`` the HTTP API address (the kind catalog). Each is left None here and filled
    after parsing (:func:`headwater.cli.profiles.resolve_connection`): its flag, else its
    environment variable, else the profile, else its default. ``key_flag``: ``--key`` is
    also the TLS key (not on ``append``, where it is the event key)."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group(
        "connection (each: the flag, else its $VARIABLE, else the profile, else the default)"
    )
    group.add_argument(
        "--profile",
        default=None,
        help="a saved connection profile (headwater profile add; $HEADWATER_PROFILE; "
        "else the profile named 'default' if saved)",
    )
    group.add_argument(
        "--server",
        default=None,
        help=f"{protocol} address host:port (${env}; default {default})",
    )
    if http:
        group.add_argument(
            "--http",
            default=None,
            help="HTTP API address for the kind catalog ($HEADWATER_HTTP; default 127.0.0.1:7400)",
        )
    group.add_argument("--token", default=None, help="auth token ($HEADWATER_TOKEN)")
    group.add_argument("--tenant", type=non_negative, default=None, help=tenant_help)
    group.add_argument(
        "--tls",
        action="store_true",
        default=None,
        help="connect over TLS, verifying the server against the system's CAs "
        "($HEADWATER_TLS=1); --ca-file or --cert imply it",
    )
    group.add_argument(
        "--ca-file",
        default=None,
        help="verify the server against this CA file (PEM) ($HEADWATER_CA_FILE)",
    )
    group.add_argument(
        "--cert",
        default=None,
        help="client certificate (PEM) for mutual TLS ($HEADWATER_CERT)",
    )
    group.add_argument(
        *(("--tls-key", "--key") if key_flag else ("--tls-key",)),
        dest="tls_key",
        default=None,
        help="the client certificate's private key, when not in the --cert file ($HEADWATER_KEY)",
    )
    parent.set_defaults(connection=ConnectionSpec(protocol, env, default, profile_key))
    return parent


def tls_options(args: argparse.Namespace) -> dict[str, Any]:
    """The SDK's TLS keyword arguments from the connection options."""
    return {"tls": args.tls, "ca": args.ca_file, "cert": args.cert, "key": args.tls_key}


def connect(args: argparse.Namespace) -> Client:
    """The Kimberlite client of the command's connection options."""
    import headwater

    return headwater.connect(args.server, token=args.token, tenant=args.tenant, **tls_options(args))


HTTP_TIMEOUT_S = 30.0


MAX_INT64 = (1 << 63) - 1


def non_negative(text: str) -> int:
    """An offset, position, tenant, count: 0 to 2**63-1 (what the wire's fields hold;
    past it the request could not be encoded)."""
    value = int(text)
    if not 0 <= value <= MAX_INT64:
        raise argparse.ArgumentTypeError("must be from 0 to 2**63-1")
    return value


class HttpApi:
    """JSON requests to a server's HTTP API at ``host:port``, with the command's token,
    tenant and TLS options."""

    def __init__(self, args: argparse.Namespace, host: str, port: int) -> None:
        from headwater.client._core.tls import client_context

        self.host = host
        self.port = port
        self.tls = client_context(**tls_options(args))
        self.token: str | None = args.token
        self.tenant: int = args.tenant

    @classmethod
    def advertised(cls, args: argparse.Namespace, hw: Client) -> HttpApi:
        """The HTTP API the Kimberlite server ``hw`` is connected to advertises."""
        from headwater.client._core.session import parse_server
        from headwater.client.errors import ServerUnavailable
        from headwater.protocols.kimberlite.messages import http_port

        port = http_port(hw.capabilities)
        if port is None:
            raise ServerUnavailable(
                f"the server at {hw.address} does not advertise an HTTP API (http:<port>): "
                "this command needs its [listen] http on"
            )
        return cls(args, parse_server(args.server)[0], port)

    @classmethod
    def at(cls, args: argparse.Namespace, address: str) -> HttpApi:
        """The HTTP API at ``address`` (host:port, port 7400 when left out)."""
        from headwater.client._core.session import parse_server

        return cls(args, *parse_server(address, 7400))

    def request(self, method: str, path: str, body: object = None) -> Any:
        """The answer's JSON; a headwater error (its class) for an error answer,
        ServerUnavailable when the API cannot be reached. A cluster's 421 is followed
        to the leader it names (headwater.client.arrow.HttpApi, which sends it)."""
        from headwater.client.arrow import HttpApi as Connection

        with Connection(
            self.host,
            self.port,
            token=self.token,
            tenant=self.tenant,
            timeout=HTTP_TIMEOUT_S,
            tls=self.tls,
        ) as api:
            return api.request(
                method,
                path,
                None if body is None else json.dumps(body).encode(),
                None if body is None else "application/json",
                repeatable=method == "GET",
                accept="application/json",
            )


def http_api(args: argparse.Namespace) -> tuple[Client, HttpApi]:
    hw = connect(args)
    try:
        return hw, HttpApi.advertised(args, hw)
    except BaseException:
        hw.close()
        raise
