"""What a PostgreSQL client's SQL text asks of the session, before any reaches DuckDB.

A simple Query may hold several statements separated by semicolons (``psql -c "SET
...; SELECT ..."``): :func:`split_statements` cuts them as PostgreSQL's lexer does
(quotes, quoted identifiers, dollar quotes and comments respected). :func:`classify`
then tells the statements the session answers itself (transaction control, SET, RESET,
SHOW, ``SELECT version()``, DISCARD) from the SQL that goes to the engine's DuckDB.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_DOLLAR_TAG = re.compile(r"\$([A-Za-z_][A-Za-z_0-9]*)?\$")
_PARAMETER = re.compile(r"\$([0-9]+)")
# PostgreSQL's most parameters: Bind and ParameterDescription count them in 16 bits.
MAX_PARAMETERS = 65_535


def _scan(sql: str) -> list[tuple[int, int]]:
    """Spans of ``sql`` that are code (outside quotes and comments)."""
    spans: list[tuple[int, int]] = []
    i = start = 0
    n = len(sql)
    while i < n:
        c = sql[i]
        end = -1
        if c == "'" or c == '"':
            # E'...' (an escape string): a backslash takes the next character, as
            # PostgreSQL's lexer reads it, so E'it\'s' is one string.
            escapes = c == "'" and i > 0 and sql[i - 1] in "Ee" and not _word_char(sql, i - 2)
            j = i + 1
            while j < n:
                if escapes and sql[j] == "\\":
                    j += 2
                    continue
                if sql[j] == c:
                    if j + 1 < n and sql[j + 1] == c:
                        j += 2
                        continue
                    break
                j += 1
            end = j + 1
        elif c == "-" and sql.startswith("--", i):
            nl = sql.find("\n", i)
            end = n if nl < 0 else nl + 1
        elif c == "/" and sql.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if sql.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif sql.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            end = j
        elif c == "$" and not _word_char(sql, i - 1):
            match = _DOLLAR_TAG.match(sql, i)
            if match:
                close = sql.find(match.group(0), match.end())
                end = n if close < 0 else close + len(match.group(0))
        if end >= 0:
            spans.append((start, i))
            i = start = min(end, n)
        else:
            i += 1
    spans.append((start, n))
    return spans


def _word_char(sql: str, i: int) -> bool:
    """``sql[i]`` continues an identifier (False before the start)."""
    return i >= 0 and (sql[i].isalnum() or sql[i] == "_")


def split_statements(sql: str) -> list[str]:
    """The statements of ``sql``, each stripped, empty ones dropped."""
    cuts = [
        start + pos
        for start, end in _scan(sql)
        for pos, ch in enumerate(sql[start:end])
        if ch == ";"
    ]
    out: list[str] = []
    begin = 0
    for cut in [*cuts, len(sql)]:
        text = sql[begin:cut].strip()
        if text and _code(text).strip():
            out.append(text)
        begin = cut + 1
    return out


def _code(sql: str) -> str:
    """``sql`` with quotes and comments blanked (for matching keywords)."""
    return " ".join(sql[a:b] for a, b in _scan(sql))


def parameter_count(sql: str) -> int:
    """The highest ``$n`` placeholder in ``sql`` outside quotes and comments (a number
    of more than 18 digits counts as 10**18: past :data:`MAX_PARAMETERS` either way)."""
    highest = 0
    for match in _PARAMETER.finditer(_code(sql)):
        digits = match.group(1).lstrip("0")
        highest = max(highest, int(digits) if len(digits) <= 18 else 10**18)
    return highest


# ---- what a statement is -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Engine:
    """SQL for the engine (DuckDB)."""

    sql: str


@dataclass(frozen=True, slots=True)
class Transaction:
    action: str  # BEGIN, COMMIT, ROLLBACK, SAVEPOINT, RELEASE or ROLLBACK TO


@dataclass(frozen=True, slots=True)
class SetVariable:
    name: str  # lower-cased
    value: str | None  # None: RESET (back to the default)
    local: bool = False  # SET LOCAL: until the end of the transaction block


@dataclass(frozen=True, slots=True)
class Show:
    name: str  # lower-cased; "version" for SELECT version()


@dataclass(frozen=True, slots=True)
class Empty:
    """Only comments or whitespace."""


@dataclass(frozen=True, slots=True)
class Discard:
    """DISCARD ALL (connection poolers send it): every setting back to its session
    default, as RESET ALL, and every prepared statement and portal closed."""


@dataclass(frozen=True, slots=True)
class ResetAll:
    """RESET ALL (what some poolers send): every setting back to its session default."""


@dataclass(frozen=True, slots=True)
class NoTypes:
    """A lookup of a type by name in ``pg_type`` (psycopg's ``TypeInfo.fetch``, which
    SQLAlchemy runs at connect to find hstore): headwater defines no PostgreSQL types,
    so it finds none (DuckDB has no ``to_regtype`` to run the query itself)."""


Statement = Engine | Transaction | SetVariable | Show | Empty | Discard | ResetAll | NoTypes

_TRANSACTION = {
    "begin": "BEGIN",
    "start": "BEGIN",
    "commit": "COMMIT",
    "end": "COMMIT",
    "rollback": "ROLLBACK",
    "abort": "ROLLBACK",
    "savepoint": "SAVEPOINT",
    "release": "RELEASE",
}
_NAME = r"([A-Za-z_][A-Za-z_0-9]*(?:\.[A-Za-z_][A-Za-z_0-9]*)?)"
_SET = re.compile(rf"set\s+(session\s+|local\s+)?{_NAME}\s*(?:=|\s+to\s+|\s+)\s*(.+)", re.I | re.S)
_SET_TIME_ZONE = re.compile(r"set\s+(session\s+|local\s+)?time\s+zone\s+(.+)", re.I | re.S)
_RESET = re.compile(rf"reset\s+{_NAME}", re.I)
_SHOW = re.compile(rf"show\s+{_NAME}", re.I)
_VERSION = re.compile(r"select\s+(?:pg_catalog\s*\.\s*)?version\s*\(\s*\)", re.I)
_SHOW_SPECIAL = {"transaction isolation level": "transaction_isolation"}


def _local(match: re.Match[str]) -> bool:
    """Whether a SET said LOCAL (its first group: SESSION, LOCAL or nothing)."""
    return (match.group(1) or "").strip().lower() == "local"


def _setting_value(text: str) -> str | None:
    text = text.strip()
    if text.lower() == "default":
        return None
    if len(text) >= 2 and text[0] == text[-1] == "'":
        return text[1:-1].replace("''", "'")
    return text


def classify(statement: str) -> Statement:
    """What one statement (from :func:`split_statements`) asks for."""
    code = " ".join(_code(statement).split())
    if not code:
        return Empty()
    first = code.split(" ", 1)[0].lower()
    if first in _TRANSACTION and (first != "start" or code.lower().startswith("start transaction")):
        words = code.lower().split()
        if first in ("rollback", "abort") and len(words) > 1 and words[1] == "to":
            return Transaction("ROLLBACK TO")
        return Transaction(_TRANSACTION[first])
    text = statement.strip().rstrip(";").strip()
    if first == "set":
        if match := _SET_TIME_ZONE.fullmatch(text):
            return SetVariable("timezone", _setting_value(match.group(2)), _local(match))
        if match := _SET.fullmatch(text):
            name, value = match.group(2).lower(), _setting_value(match.group(3))
            return SetVariable(name, value, _local(match))
    if first == "reset" and code.lower() == "reset all":
        return ResetAll()
    if first == "reset" and (match := _RESET.fullmatch(text)):
        return SetVariable(match.group(1).lower(), None)
    if first == "discard" and code.lower() in ("discard all", "discard all;"):
        return Discard()
    if first == "show":
        special = _SHOW_SPECIAL.get(" ".join(code.lower().split()[1:]))
        if special is not None:
            return Show(special)
        if match := _SHOW.fullmatch(text):
            return Show(match.group(1).lower())
    if _VERSION.fullmatch(text):
        return Show("version")
    lowered = code.lower()
    if "from pg_type" in lowered and "to_regtype" in lowered:
        return NoTypes()
    return Engine(text)
