"""What a SQL text asks for, decided by DuckDB's own parser and tokenizer.

A query is exactly one statement. Reads (SELECT and everything DuckDB parses as one:
``FROM t``, ``VALUES``, ``WITH``, ``DESCRIBE``, ``SUMMARIZE``, ``PIVOT`` ...) and
``EXPLAIN`` of a read are allowed; ``INSERT INTO <stream>`` appends; every other
statement (UPDATE, DELETE, CREATE, DROP, COPY, ATTACH, SET, PRAGMA, CALL, ...) is refused
with QueryExecutionError before it reaches an engine. The DuckDB connections themselves
are locked down too (no file or network access, configuration locked), so this check is
the first line of defence, not the only one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import duckdb

from headwater.errors import QueryExecutionError, QueryParseError

#: Words that make a query look at the catalog rather than at named tables.
CATALOG_WORDS = frozenset(
    {
        "tables",
        "information_schema",
        "pg_catalog",
        "pg_tables",
        "pg_class",
        "sqlite_master",
        "duckdb_tables",
        "duckdb_views",
        "duckdb_columns",
        "duckdb_dependencies",
    }
)

#: Columns an INSERT may give; the others are assigned by the log.
INSERT_COLUMNS = ("data", "json")
LOG_COLUMNS = ("offset", "position", "ts")


@dataclass(frozen=True)
class Token:
    kind: str  # identifier, keyword, operator, string_const, numeric_const
    text: str
    start: int

    @property
    def word(self) -> str:
        """Lower-cased keyword/identifier text, quotes removed."""
        text = self.text
        if self.kind == "identifier" and len(text) >= 2 and text[0] == text[-1] == '"':
            return text[1:-1].replace('""', '"').lower()
        return text.lower()

    @property
    def name(self) -> str:
        """Identifier as written (quotes removed, case kept)."""
        text = self.text
        if len(text) >= 2 and text[0] == text[-1] == '"':
            return text[1:-1].replace('""', '"')
        return text


@dataclass(frozen=True)
class InsertPlan:
    """``INSERT INTO table [(columns) | BY NAME | BY POSITION] source``."""

    table: str
    columns: tuple[str, ...] | None  # lower-cased, None without a column list
    by_name: bool
    source: str  # a read statement producing the rows


@dataclass(frozen=True)
class ParsedQuery:
    kind: Literal["read", "insert"]
    text: str
    words: frozenset[str]  # lower-cased identifiers, keywords and string constants
    insert: InsertPlan | None = None


def tokens(text: str) -> list[Token]:
    """DuckDB's tokens of ``text`` without comments."""
    try:
        raw = duckdb.tokenize(text)
    except duckdb.Error as exc:
        raise QueryParseError(str(exc)) from None
    # DuckDB's offsets count bytes of the UTF-8 text: with a non-ASCII character before
    # it, a token sliced by them out of the str was cut wrong ('é' before FROM trades
    # made the table 'rades', not found).
    data = text.encode()
    chars: dict[int, int] | None = None  # byte offset -> character offset
    if len(data) != len(text):
        chars, at = {}, 0
        for index, char in enumerate(text):
            chars[at] = index
            at += len(char.encode())
        chars[at] = len(text)
    out: list[Token] = []
    for i, (start, kind) in enumerate(raw):
        end = raw[i + 1][0] if i + 1 < len(raw) else len(data)
        name = kind.name
        if name == "comment":
            continue
        piece = data[start:end].decode().strip()
        if chars is not None:
            start = chars[start]
        if name == "string_const" and len(piece) >= 2 and piece[0] == piece[-1] == "'":
            piece = piece[1:-1].replace("''", "'")
        out.append(Token(name, piece, start))
    return out


def _one_statement(sql: str) -> duckdb.Statement:
    if not sql.strip():
        raise QueryParseError("empty query")
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise QueryParseError(str(exc)) from None
    if len(statements) != 1:
        raise QueryParseError(f"a query is exactly one SQL statement, not {len(statements)}")
    return statements[0]


def _strip(text: str) -> str:
    text = text.strip()
    while text.endswith(";"):
        text = text[:-1].rstrip()
    return text


def parse_query(sql: str, *, allow_insert: bool = True) -> ParsedQuery:
    """Classify ``sql``; raise QueryParseError or QueryExecutionError if it is refused."""
    statement = _one_statement(sql)
    kind = statement.type.name
    text = _strip(statement.query)
    toks = tokens(text)
    words = frozenset(t.word for t in toks if t.kind != "operator" and t.kind != "numeric_const")
    if kind == "SELECT":
        return ParsedQuery("read", text, words)
    if kind == "EXPLAIN":
        rest = toks[1:]
        if rest and rest[0].word == "analyze":
            rest = rest[1:]
        if rest and _one_statement(text[rest[0].start :]).type.name == "SELECT":
            return ParsedQuery("read", text, words)
        raise QueryExecutionError("EXPLAIN is allowed for read statements only")
    if kind == "INSERT":
        if not allow_insert:
            raise QueryExecutionError("INSERT is not allowed in QueryAt: the past is read-only")
        return ParsedQuery("insert", text, words, _parse_insert(text, toks))
    if kind in ("UPDATE", "DELETE"):
        raise QueryExecutionError(
            f"{kind} is not allowed: streams are append-only (use INSERT INTO a stream)"
        )
    raise QueryExecutionError(
        f"{kind} statements are not allowed: queries are read-only except INSERT INTO a stream"
    )


def statement_kind(sql: str) -> Literal["read", "insert"] | None:
    """What :func:`parse_query` makes of ``sql``, without raising: ``"read"``,
    ``"insert"``, or None for a statement it refuses or cannot parse (running it fails,
    nothing stored). A front end that must know before running a statement whether it
    writes (a PostgreSQL Describe, an INSERT's command tag) asks this, so comments and
    case are read as the engine reads them."""
    try:
        return parse_query(sql).kind
    except (QueryParseError, QueryExecutionError):
        return None


def _parse_insert(text: str, toks: list[Token]) -> InsertPlan:
    def fail(why: str) -> QueryExecutionError:
        return QueryExecutionError(f"unsupported INSERT: {why}")

    if len(toks) < 4 or toks[0].word != "insert":
        raise fail("expected INSERT INTO <stream> ...")
    if toks[1].word == "or":
        raise fail("INSERT OR REPLACE/IGNORE: streams are append-only")
    if toks[1].word != "into":
        raise fail("expected INSERT INTO <stream> ...")
    target = toks[2]
    if target.kind not in ("identifier", "keyword"):
        raise fail("expected a stream name after INSERT INTO")
    i = 3
    if i < len(toks) and toks[i].text == ".":
        raise fail("qualified table names: name the stream alone")
    columns: tuple[str, ...] | None = None
    by_name = False
    if i < len(toks) and toks[i].text == "(":
        names: list[str] = []
        i += 1
        while i < len(toks) and toks[i].text != ")":
            if toks[i].text != ",":
                names.append(toks[i].word)
            i += 1
        i += 1  # the closing parenthesis
        columns = tuple(names)
        for name in columns:
            if name in LOG_COLUMNS:
                raise fail(f"column {name!r} is assigned by the log; insert data or json")
            if name not in INSERT_COLUMNS:
                raise fail(f"a stream has no column {name!r}; insert data or json")
    elif i + 1 < len(toks) and toks[i].word == "by" and toks[i + 1].word in ("name", "position"):
        by_name = toks[i + 1].word == "name"
        i += 2
    if i >= len(toks):
        raise fail("no rows to insert")
    if toks[i].word == "default":
        raise fail("DEFAULT VALUES: give data or json")
    for j in range(i, len(toks)):
        word = toks[j].word if toks[j].kind == "keyword" else ""
        if word == "returning":
            raise fail("RETURNING is not supported")
        if word == "on" and j + 1 < len(toks) and toks[j + 1].word == "conflict":
            raise fail("ON CONFLICT: streams are append-only")
    source = text[toks[i].start :]
    if _one_statement(source).type.name != "SELECT":
        raise fail("the rows must come from VALUES or a SELECT")
    return InsertPlan(target.name, columns, by_name, source)
