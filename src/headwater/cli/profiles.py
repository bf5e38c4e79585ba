"""``headwater profile add|list|remove``: saved connection settings, used with
``--profile NAME`` (the file and the order options are taken in:
:mod:`headwater.cli.connection`), as ``rpk profile`` and ``nats context`` keep them.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.table import Table

from headwater.cli.client_cmds import fail, out, say
from headwater.cli.connection import (
    PROFILE_KEYS,
    load_profiles,
    non_negative,
    profiles_path,
    save_profiles,
)

# ---- headwater profile -------------------------------------------------------------------
# A profile file that cannot be read raises ProfileError, which main() reports (status 2).


def cmd_profile_add(args: argparse.Namespace) -> int:
    profiles = load_profiles()
    if args.name in profiles and not args.replace:
        return fail(f"profile {args.name!r} exists (--replace to overwrite it)", 1)
    profile = {key: getattr(args, key) for key in PROFILE_KEYS}
    if not any(value is not None for value in profile.values()):
        return fail("a profile needs at least one of --server, --http, --token, ...", 2)
    profiles[args.name] = {k: v for k, v in profile.items() if v is not None}
    path = save_profiles(profiles)
    say(f"saved profile {args.name} in {path}")
    return 0


def _shown(key: str, value: object) -> str:
    return "****" if key == "token" and value else str(value)


def cmd_profile_list(args: argparse.Namespace) -> int:
    profiles = load_profiles()
    if args.json:
        shown = {n: {k: _shown(k, v) for k, v in p.items()} for n, p in profiles.items()}
        sys.stdout.write(json.dumps(shown) + "\n")
        return 0
    table = Table(title=f"profiles in {profiles_path()}")
    table.add_column("name", no_wrap=True)
    for key in PROFILE_KEYS:
        table.add_column(key)
    for name in sorted(profiles):
        profile = profiles[name]
        table.add_row(name, *(_shown(k, profile[k]) if k in profile else "" for k in PROFILE_KEYS))
    out.print(table)
    out.print(f"{len(profiles)} profile{'s' if len(profiles) != 1 else ''}")
    return 0


def cmd_profile_remove(args: argparse.Namespace) -> int:
    profiles = load_profiles()
    if args.name not in profiles:
        return fail(f"no profile {args.name!r} in {profiles_path()}", 1)
    del profiles[args.name]
    save_profiles(profiles)
    say(f"removed profile {args.name}")
    return 0


def add_profile_commands(sub: Any) -> None:
    profile = sub.add_parser(
        "profile",
        help="save connection settings under a name (use them with --profile NAME)",
        description=f"Profiles are kept in {profiles_path()} (mode 0600). A connection "
        "option comes from its flag, else its environment variable, else the profile "
        "(--profile, $HEADWATER_PROFILE, or the profile named 'default'), else its default.",
    )
    profile_sub = profile.add_subparsers(dest="profile_command", required=True)
    p = profile_sub.add_parser("add", help="save a profile")
    p.add_argument("name")
    p.add_argument("--server", help="Kimberlite address host:port")
    p.add_argument("--convergedb", help="ConvergeDB address host:port (kind/entity commands)")
    p.add_argument("--http", help="HTTP API address host:port (kind/entity commands)")
    p.add_argument("--token", help="auth token (stored in the file: it is mode 0600)")
    p.add_argument("--tenant", type=non_negative, help="tenant id")
    p.add_argument("--tls", action="store_true", default=None, help="connect over TLS")
    p.add_argument("--ca-file", help="CA file (PEM) to verify the server")
    p.add_argument("--cert", help="client certificate (PEM) for mutual TLS")
    p.add_argument("--tls-key", "--key", dest="tls_key", help="the certificate's private key")
    p.add_argument("--replace", action="store_true", help="overwrite a profile of that name")
    p.set_defaults(func=cmd_profile_add)
    p = profile_sub.add_parser("list", help="list the saved profiles (tokens hidden)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_profile_list)
    p = profile_sub.add_parser("remove", help="delete a saved profile")
    p.add_argument("name")
    p.set_defaults(func=cmd_profile_remove)
