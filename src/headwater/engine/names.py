"""Names of streams, kinds and sources: one namespace per tenant (spec/PROTOCOLS.md).

Stream names follow Kafka's topic rules, so Kafka clients and tools (Kafka Connect,
Debezium's "dbserver1.inventory.customers") find their topics: ``[A-Za-z0-9._-]``,
headwater's 256 characters at most (Kafka's 249 where a Kafka client creates one), never
"." or ".." (Kafka's refusal: they are path steps). Kinds, their fields and sources keep
``[A-Za-z0-9_]``: they are SQL columns and tables and the entity protocols' identifiers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from headwater.errors import InvalidRequest

_NAME = re.compile(r"[A-Za-z0-9_]{1,256}")
_STREAM_NAME = re.compile(r"[A-Za-z0-9._-]{1,256}")
RESERVED_PREFIXES = ("convergedb_", "hw_")
KAFKA_MAX_TOPIC_NAME = 249  # Kafka's limit on a topic name's length


class InvalidName(InvalidRequest):
    """A name that breaks the rules: an InvalidRequest to every front end (Kafka's
    INVALID_TOPIC_EXCEPTION for a topic)."""


def check_name(name: str, *, internal: bool = False) -> str:
    """Return ``name`` if it is a valid user name of a kind, field or source; raise
    InvalidName otherwise.

    ``internal`` admits the reserved prefixes, which only headwater itself may use.
    """
    if not _NAME.fullmatch(name):
        raise InvalidName(f"invalid name {name!r}: use 1..256 characters of [A-Za-z0-9_]")
    _check_reserved(name, internal)
    return name


def check_stream_name(name: str, *, internal: bool = False) -> str:
    """Return ``name`` if it is a valid stream name (Kafka's topic rules); raise
    InvalidName otherwise."""
    if not _STREAM_NAME.fullmatch(name) or name in (".", ".."):
        raise InvalidName(
            f"invalid stream name {name!r}: use 1..256 characters of [A-Za-z0-9._-],"
            " not '.' or '..'"
        )
    _check_reserved(name, internal)
    return name


def check_topic_name(name: str, existing: Iterable[str] = ()) -> str:
    """A stream name a Kafka client may create: Kafka's length limit too, and, as Kafka
    refuses it, no name that differs from one of ``existing`` only in '.' against '_'
    (Kafka's metric names make them one)."""
    if len(name) > KAFKA_MAX_TOPIC_NAME:
        raise InvalidName(
            f"invalid topic name: {len(name)} characters, Kafka's limit is {KAFKA_MAX_TOPIC_NAME}"
        )
    check_stream_name(name)
    if "." in name or "_" in name:
        folded = name.replace(".", "_")
        for other in existing:
            if other != name and other.replace(".", "_") == folded:
                raise InvalidName(
                    f"topic {name!r} collides with the existing {other!r}: Kafka takes '.'"
                    " and '_' for one"
                )
    return name


def _check_reserved(name: str, internal: bool) -> None:
    if not internal and name.startswith(RESERVED_PREFIXES):
        raise InvalidName(f"invalid name {name!r}: the prefixes convergedb_ and hw_ are reserved")


# SQL's table of a kind's changelog; the reserved prefix keeps it clear of user names.
CHANGES_PREFIX = "hw_changes_"


def changes_table_name(kind: str) -> str:
    return CHANGES_PREFIX + kind
