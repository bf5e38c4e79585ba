"""Entity ids as people write them: one rule for every surface (SDKs, CLI, HTTP, SQL).

An entity id is 32 raw bytes. Writers address entities by a key: a text or bytes key of
at most 32 bytes is its bytes zero-padded to 32, a longer one its SHA-256 (the same rule
as Ripple's keys, so both address the same entities). Shown to people, an id is its key
again when that key was short printable text (``lab-1``), else ``0x`` and 64 hex digits.
Typed by people, ``0x`` + 64 hex digits is the raw id and anything else a key.

This module imports nothing of ours but ``errors``, so the engine's SQL tables, the
server's routes and the client SDKs all share it.
"""

from __future__ import annotations

import hashlib
import re
from typing import TypeAlias

from headwater.errors import UsageError

ENTITY_ID_SIZE = 32
"""An entity id is 32 raw bytes (the ConvergeDB wire's entity_id)."""

KeyLike: TypeAlias = str | bytes | bytearray | memoryview
"""An entity key: text (UTF-8) or bytes."""

_HEX_ID = re.compile(r"[0-9a-fA-F]{64}")


def entity_id(key: KeyLike) -> bytes:
    """The 32-byte entity id of a key: its bytes zero-padded to 32, or their SHA-256 when
    longer (the same rule as Ripple's keys, so both address the same entities)."""
    if isinstance(key, str):
        data = key.encode()
    elif isinstance(key, bytes | bytearray | memoryview):
        data = bytes(key)
    else:
        raise UsageError(f"an entity key is str or bytes, not {type(key).__name__}")
    if len(data) <= ENTITY_ID_SIZE:
        return data.ljust(ENTITY_ID_SIZE, b"\0")
    return hashlib.sha256(data).digest()


def key_text(eid: bytes) -> str:
    """An entity id for people: the key's text when it was a short UTF-8 key (zero
    padding removed), otherwise ``0x`` and 64 hex digits."""
    stripped = eid.rstrip(b"\0")
    try:
        text = stripped.decode()
    except UnicodeDecodeError:
        return "0x" + eid.hex()
    if not text or "\0" in text or not text.isprintable() or text.startswith("0x"):
        return "0x" + eid.hex()
    return text


def parse_key(text: str) -> bytes:
    """The entity id a person typed: ``0x`` + 64 hex digits is the raw id, anything else
    a key (see :func:`entity_id`)."""
    if text.startswith("0x") and len(text) == 2 + 2 * ENTITY_ID_SIZE:
        try:
            return bytes.fromhex(text[2:])
        except ValueError:
            pass
    return entity_id(text)


def parse_entity_ref(text: str) -> bytes:
    """An entity id as an HTTP path or query names it: 64 hex digits (what the HTTP API
    and SQL's ``entity_id`` column have always shown) are the raw id, anything else as
    :func:`parse_key` reads it (``lab-1``, or ``0x`` + 64 hex digits). A key that is
    itself 64 hex digits is therefore reached by its id (``key_text`` shows it so)."""
    if _HEX_ID.fullmatch(text):
        return bytes.fromhex(text)
    return parse_key(text)
