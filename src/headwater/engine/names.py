"""Names of streams, kinds and sources: one namespace per tenant (spec/PROTOCOLS.md)."""

from __future__ import annotations

import re

from headwater.errors import InvalidRequest

_NAME = re.compile(r"[A-Za-z0-9_]{1,256}")
RESERVED_PREFIXES = ("convergedb_", "hw_")


def check_name(name: str, *, internal: bool = False) -> str:
    """Return ``name`` if it is a valid user name; raise InvalidRequest otherwise.

    ``internal`` admits the reserved prefixes, which only headwater itself may use.
    """
    if not _NAME.fullmatch(name):
        raise InvalidRequest(f"invalid name {name!r}: use 1..256 characters of [A-Za-z0-9_]")
    if not internal and name.startswith(RESERVED_PREFIXES):
        raise InvalidRequest(
            f"invalid name {name!r}: the prefixes convergedb_ and hw_ are reserved"
        )
    return name


# SQL's table of a kind's changelog; the reserved prefix keeps it clear of user names.
CHANGES_PREFIX = "hw_changes_"


def changes_table_name(kind: str) -> str:
    return CHANGES_PREFIX + kind
