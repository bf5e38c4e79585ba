"""PostgreSQL's catalog, as the postgres listener's clients read it, over DuckDB.

Tools that browse a database (pgjdbc's DatabaseMetaData under DBeaver, Grafana's table
and column pickers, psql's ``\\dt``) query ``pg_catalog`` and ``information_schema`` and
use PostgreSQL functions and casts DuckDB lacks (``regclass``, ``quote_ident``,
``array_upper``, ``current_setting('search_path')``, a scalar function in FROM).
DuckDB's own ``pg_catalog`` views cannot be replaced (its system schema takes no new
objects), and they do not match what this listener reports: the tenant's tables live
in DuckDB's ``temp`` catalog, missing from its ``pg_namespace``, and their columns carry
DuckDB's type OIDs, not the ones the wire sends.

So a statement that names the catalog is rewritten before it runs:

* ``pg_catalog.<relation>`` and ``information_schema.<relation>`` of :data:`RELATIONS`
  become common table expressions prepended to the statement, built from DuckDB's
  ``duckdb_views()`` / ``duckdb_columns()`` of the statement's own snapshot (the
  tenant's streams and kinds: each a table, ``relkind 'r'``, in schema ``main``), with
  the type OIDs and names of :mod:`headwater.protocols.postgres.types`;
* casts to ``regclass`` / ``regtype`` / ``regnamespace`` of a literal or a parameter
  (``'t'::regclass``, ``CAST($1 AS REGCLASS)``) look the name up in those relations;
  other ``reg*`` casts are dropped (the value is the oid);
* the PostgreSQL functions in :data:`FUNCTIONS` become DuckDB expressions, a scalar
  function in a FROM list becomes a one-row ``unnest``, and ``current_setting('x')``
  of a session setting is the session's value;
* ``current_user`` and ``current_database()`` are the user and database names the
  client connected with.

Nothing is answered from a list of known queries: any statement over these relations
runs in DuckDB. Statements that name none of it are passed through untouched.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import duckdb

from headwater.protocols.postgres import types as t

SCHEMA = "main"  # where DuckDB keeps the tables (``SELECT * FROM main.trades`` works)
NAMESPACES = ((11, "pg_catalog"), (2200, SCHEMA), (13000, "information_schema"))
SCHEMA_OID = 2200
OWNER = "headwater"

# (oid, typname, information_schema data_type, typlen, typcategory) of every type the
# wire sends or reads.
PG_TYPES = (
    (t.BOOL, "bool", "boolean", 1, "B"),
    (t.BYTEA, "bytea", "bytea", -1, "U"),
    (t.NAME, "name", "name", 64, "S"),
    (t.INT8, "int8", "bigint", 8, "N"),
    (t.INT2, "int2", "smallint", 2, "N"),
    (t.INT4, "int4", "integer", 4, "N"),
    (t.TEXT, "text", "text", -1, "S"),
    (t.OID, "oid", "oid", 4, "N"),
    (t.JSON, "json", "json", -1, "U"),
    (t.FLOAT4, "float4", "real", 4, "N"),
    (t.FLOAT8, "float8", "double precision", 8, "N"),
    (t.BPCHAR, "bpchar", "character", -1, "S"),
    (t.VARCHAR, "varchar", "character varying", -1, "S"),
    (t.DATE, "date", "date", 4, "D"),
    (t.TIMESTAMP, "timestamp", "timestamp without time zone", 8, "D"),
    (t.TIMESTAMPTZ, "timestamptz", "timestamp with time zone", 8, "D"),
    (t.NUMERIC, "numeric", "numeric", -1, "N"),
    (t.UUID, "uuid", "uuid", 16, "U"),
    (t.JSONB, "jsonb", "jsonb", -1, "U"),
)


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _values(rows: list[tuple[object, ...]], names: str, alias: str = "v") -> str:
    def literal(value: object) -> str:
        return _quote(value) if isinstance(value, str) else str(value)

    body = ", ".join("(" + ", ".join(literal(v) for v in row) + ")" for row in rows)
    return f"(VALUES {body}) AS {alias}({names})"


# The database's name in the relations' bodies (the one the client named, when known).
_DATABASE = "current_database()"
_TYPE_OID = "coalesce(v.oid, CASE WHEN c.data_type LIKE 'DECIMAL%' THEN 1700 ELSE 25 END)"


def _oid(name: str) -> str:
    """A table's oid, from its name: the same in every statement (DuckDB's own oid is
    new each time, as each statement registers its snapshots anew), as tools that look
    a table up by oid in a later statement (psql's ``\\d``) need."""
    return f"(16384 + hash({name}) % 2000000000)::BIGINT"


# The tenant's tables: the snapshots the SQL layer registered for this statement.
_TABLES = "duckdb_views() WHERE database_name = 'temp' AND NOT internal"
# Each column's DuckDB type as the wire sends it: OID and length (DECIMAL(p,s) is
# numeric, with PostgreSQL's typmod; a type without a counterpart is text).
_COLUMNS = (
    "duckdb_columns() AS c LEFT JOIN "
    + _values(
        [(name, oid, t.SIZES.get(oid, -1)) for name, oid in t.DUCKDB_TYPES.items()],
        "duck, oid, len",
    )
    + " ON upper(c.data_type) = v.duck"
    + " LEFT JOIN "
    + _values(
        [(oid, name, sql) for oid, name, sql, _, _ in PG_TYPES], "toid, typname, sqlname", "v2"
    )
    + f" ON v2.toid = {_TYPE_OID} WHERE c.database_name = 'temp'"
)
_TYPMOD = (
    "CASE WHEN c.data_type LIKE 'DECIMAL%' "
    "THEN ((c.numeric_precision << 16) | c.numeric_scale) + 4 ELSE -1 END"
)

# Nothing in headwater has a comment, a default, an index, a key, a sequence, a policy, a
# statistics object, a publication, a parent table, an access method, an operator class,
# a tablespace, an extension, a view, a role membership or a function: these relations
# are empty, with the columns PostgreSQL's tools read.
EMPTY = {
    "pg_description": "objoid BIGINT, classoid BIGINT, objsubid INTEGER, description VARCHAR",
    "pg_attrdef": "oid BIGINT, adrelid BIGINT, adnum SMALLINT, adbin VARCHAR",
    "pg_index": "indexrelid BIGINT, indrelid BIGINT, indnatts SMALLINT, indnkeyatts SMALLINT,"
    " indkey SMALLINT[], indclass BIGINT[], indoption SMALLINT[], indcollation BIGINT[],"
    " indisprimary BOOLEAN, indisunique BOOLEAN, indnullsnotdistinct BOOLEAN,"
    " indisvalid BOOLEAN, indisclustered BOOLEAN, indisexclusion BOOLEAN,"
    " indimmediate BOOLEAN, indisreplident BOOLEAN, indpred VARCHAR, indexprs VARCHAR",
    "pg_constraint": "oid BIGINT, conname VARCHAR, connamespace BIGINT, contype VARCHAR,"
    " condeferrable BOOLEAN, condeferred BOOLEAN, convalidated BOOLEAN, conrelid BIGINT,"
    " contypid BIGINT, conindid BIGINT, conparentid BIGINT, confrelid BIGINT,"
    " confupdtype VARCHAR, confdeltype VARCHAR, confmatchtype VARCHAR, conislocal BOOLEAN,"
    " coninhcount INTEGER, connoinherit BOOLEAN, conkey SMALLINT[], confkey SMALLINT[]",
    "pg_sequence": "seqrelid BIGINT, seqtypid BIGINT, seqstart BIGINT, seqincrement BIGINT,"
    " seqmax BIGINT, seqmin BIGINT, seqcache BIGINT, seqcycle BOOLEAN",
    "pg_opclass": "oid BIGINT, opcmethod BIGINT, opcname VARCHAR, opcnamespace BIGINT,"
    " opcowner BIGINT, opcfamily BIGINT, opcintype BIGINT, opcdefault BOOLEAN,"
    " opckeytype BIGINT",
    "pg_tablespace": "oid BIGINT, spcname VARCHAR, spcowner BIGINT, spcoptions VARCHAR[]",
    "pg_collation": "oid BIGINT, collname VARCHAR, collnamespace BIGINT",
    "pg_policy": "polname VARCHAR, polrelid BIGINT, polpermissive BOOLEAN, polroles BIGINT[],"
    " polcmd VARCHAR, polqual VARCHAR, polwithcheck VARCHAR",
    "pg_auth_members": "oid BIGINT, roleid BIGINT, member BIGINT, grantor BIGINT,"
    " admin_option BOOLEAN",
    "pg_statistic_ext": "oid BIGINT, stxrelid BIGINT, stxnamespace BIGINT, stxname VARCHAR,"
    " stxkind VARCHAR[], stxstattarget INTEGER",
    "pg_publication": "oid BIGINT, pubname VARCHAR, puballtables BOOLEAN, pubviaroot BOOLEAN",
    "pg_publication_rel": "oid BIGINT, prpubid BIGINT, prrelid BIGINT, prqual VARCHAR,"
    " prattrs SMALLINT[]",
    "pg_publication_namespace": "oid BIGINT, pnpubid BIGINT, pnnspid BIGINT",
    "pg_inherits": "inhrelid BIGINT, inhparent BIGINT, inhseqno INTEGER, inhdetachpending BOOLEAN",
    "pg_am": "oid BIGINT, amname VARCHAR, amtype VARCHAR",
    "pg_extension": "oid BIGINT, extname VARCHAR, extversion VARCHAR, extnamespace BIGINT",
    # DuckDB's own functions (its pg_proc) are not PostgreSQL's: \df lists none.
    "pg_proc": "oid BIGINT, proname VARCHAR, pronamespace BIGINT, proowner BIGINT,"
    " prolang BIGINT, procost FLOAT, prorows FLOAT, provariadic BIGINT, prosupport BIGINT,"
    " prokind VARCHAR, prosecdef BOOLEAN, proleakproof BOOLEAN, proisstrict BOOLEAN,"
    " proretset BOOLEAN, provolatile VARCHAR, proparallel VARCHAR, pronargs SMALLINT,"
    " pronargdefaults SMALLINT, prorettype BIGINT, proargtypes BIGINT[],"
    " proallargtypes BIGINT[], proargmodes VARCHAR[], proargnames VARCHAR[],"
    " prosrc VARCHAR, probin VARCHAR, proconfig VARCHAR[], proacl VARCHAR[]",
    "pg_language": "oid BIGINT, lanname VARCHAR, lanowner BIGINT, lanispl BOOLEAN,"
    " lanpltrusted BOOLEAN",
    "pg_views": "schemaname VARCHAR, viewname VARCHAR, viewowner VARCHAR, definition VARCHAR",
}


def _empty(columns: str) -> str:
    typed = (column.split() for column in columns.split(","))
    return "SELECT " + ", ".join(f"NULL::{kind} AS {name}" for name, kind in typed) + " WHERE false"


#: Relation name as written (schema-qualified) -> the name of its CTE and its body.
RELATIONS: dict[str, tuple[str, str]] = {
    **{f"pg_catalog.{name}": (name, _empty(columns)) for name, columns in EMPTY.items()},
    "pg_catalog.pg_namespace": (
        "pg_namespace",
        "SELECT oid::BIGINT AS oid, nspname, 10::BIGINT AS nspowner, NULL::VARCHAR AS nspacl"
        f" FROM {_values(list(NAMESPACES), 'oid, nspname')}",
    ),
    "pg_catalog.pg_class": (
        "pg_class",
        f"SELECT {_oid('view_name')} AS oid, view_name AS relname,"
        f" {SCHEMA_OID}::BIGINT AS relnamespace, 'r' AS relkind, 10::BIGINT AS relowner,"
        " 0::BIGINT AS relam, 0::BIGINT AS reltype, 0::BIGINT AS reloftype,"
        " column_count::SMALLINT AS relnatts, 'p' AS relpersistence, false AS relhasindex,"
        " false AS relisshared, false AS relhasrules, false AS relhastriggers,"
        " false AS relhassubclass, false AS relrowsecurity, false AS relforcerowsecurity,"
        " true AS relispopulated, false AS relispartition, 0::BIGINT AS reltablespace,"
        " 0 AS relpages, -1::FLOAT AS reltuples, 0::BIGINT AS reltoastrelid,"
        " 0::SMALLINT AS relchecks, 'd' AS relreplident, NULL::VARCHAR AS relacl,"
        " NULL::VARCHAR[] AS reloptions, NULL::VARCHAR AS relpartbound"
        f" FROM {_TABLES}",
    ),
    "pg_catalog.pg_attribute": (
        "pg_attribute",
        f"SELECT {_oid('c.table_name')} AS attrelid, c.column_name AS attname,"
        f" {_TYPE_OID}::BIGINT AS atttypid, c.column_index::SMALLINT AS attnum,"
        f" NOT c.is_nullable AS attnotnull, {_TYPMOD}::INTEGER AS atttypmod,"
        " coalesce(v.len, -1)::SMALLINT AS attlen, false AS attisdropped,"
        " '' AS attidentity, '' AS attgenerated, false AS atthasdef, 0 AS attndims,"
        " 0::BIGINT AS attcollation, true AS attislocal, 0 AS attinhcount,"
        " coalesce(v.len, -1) > 0 AS attbyval, -1 AS attcacheoff, false AS atthasmissing,"
        f" CASE WHEN coalesce(v.len, -1) > 0 THEN 'p' WHEN {_TYPE_OID} = {t.NUMERIC}"
        " THEN 'm' ELSE 'x' END AS attstorage, 'i' AS attalign, '' AS attcompression,"
        " -1::SMALLINT AS attstattarget, NULL::VARCHAR[] AS attoptions,"
        f" NULL::VARCHAR[] AS attfdwoptions, NULL::VARCHAR AS attacl FROM {_COLUMNS}",
    ),
    # Every table is owned by one role (pg_get_userbyid's): the only one there is.
    # Connections are not roles: any user name is taken, the token is what counts.
    "pg_catalog.pg_roles": (
        "pg_roles",
        f"SELECT 10::BIGINT AS oid, {_quote(OWNER)} AS rolname, false AS rolsuper,"
        " true AS rolinherit, false AS rolcreaterole, false AS rolcreatedb,"
        " false AS rolcanlogin, false AS rolreplication, -1 AS rolconnlimit,"
        " NULL::VARCHAR AS rolpassword, NULL::TIMESTAMPTZ AS rolvaliduntil,"
        " false AS rolbypassrls, NULL::VARCHAR[] AS rolconfig",
    ),
    "pg_catalog.pg_tables": (
        "pg_tables",
        f"SELECT {_quote(SCHEMA)} AS schemaname, view_name AS tablename,"
        f" {_quote(OWNER)} AS tableowner, NULL::VARCHAR AS tablespace,"
        " false AS hasindexes, false AS hasrules, false AS hastriggers,"
        f" false AS rowsecurity FROM {_TABLES}",
    ),
    "pg_catalog.pg_type": (
        "pg_type",
        "SELECT oid::BIGINT AS oid, typname, 11::BIGINT AS typnamespace, 10::BIGINT AS typowner,"
        " typlen::SMALLINT AS typlen, typlen > 0 AS typbyval, 'b' AS typtype, typcategory,"
        " false AS typispreferred, true AS typisdefined, ',' AS typdelim,"
        " 0::BIGINT AS typrelid, 0::BIGINT AS typelem, 0::BIGINT AS typarray,"
        " NULL::VARCHAR AS typinput, NULL::VARCHAR AS typoutput, false AS typnotnull,"
        " 0::BIGINT AS typbasetype, -1 AS typtypmod, 0 AS typndims,"
        " 0::BIGINT AS typcollation, NULL::VARCHAR AS typdefault, NULL::VARCHAR[] AS typacl"
        " FROM "
        + _values(
            [(oid, name, size, cat) for oid, name, _, size, cat in PG_TYPES],
            "oid, typname, typlen, typcategory",
        ),
    ),
    "information_schema.schemata": (
        "information_schema_schemata",
        f"SELECT {_DATABASE} AS catalog_name, nspname AS schema_name,"
        f" {_quote(OWNER)} AS schema_owner FROM {_values(list(NAMESPACES), 'oid, nspname')}",
    ),
    "information_schema.tables": (
        "information_schema_tables",
        f"SELECT {_DATABASE} AS table_catalog, {_quote(SCHEMA)} AS table_schema,"
        " view_name AS table_name, 'BASE TABLE' AS table_type,"
        " 'YES' AS is_insertable_into, 'NO' AS is_typed, NULL::VARCHAR AS commit_action"
        f" FROM {_TABLES}",
    ),
    "information_schema.columns": (
        "information_schema_columns",
        f"SELECT {_DATABASE} AS table_catalog, {_quote(SCHEMA)} AS table_schema,"
        " c.table_name, c.column_name, c.column_index AS ordinal_position,"
        " NULL::VARCHAR AS column_default,"
        " CASE WHEN c.is_nullable THEN 'YES' ELSE 'NO' END AS is_nullable,"
        " v2.sqlname AS data_type, v2.typname AS udt_name,"
        " NULL::INTEGER AS character_maximum_length,"
        " CASE WHEN v2.typname = 'numeric' THEN c.numeric_precision END AS numeric_precision,"
        " CASE WHEN v2.typname = 'numeric' THEN c.numeric_scale END AS numeric_scale,"
        f" 'NO' AS is_identity, 'NEVER' AS is_generated FROM {_COLUMNS}",
    ),
}


def _in_from(clause: str | None, previous: str) -> bool:
    return clause in ("from", "join") and previous in ("from", "join", ",")


def _format_type(oid: str, typmod: str) -> str:
    """PostgreSQL's format_type(oid, typmod) over the wire's types."""
    names = " ".join(f"WHEN {t_oid} THEN {_quote(sql)}" for t_oid, _, sql, _, _ in PG_TYPES)
    numeric = (
        f"WHEN {t.NUMERIC} THEN 'numeric' || CASE WHEN {typmod} >= 4 THEN '(' || "
        f"(({typmod} - 4) >> 16) || ',' || (({typmod} - 4) & 65535) || ')' ELSE '' END"
    )
    return f"(CASE {oid} {numeric} {names} ELSE '???' END)"


def _list_length(args: list[str]) -> str:
    return f"CASE WHEN len({args[0]}) > 0 THEN len({args[0]}) END"


#: PostgreSQL functions DuckDB lacks, as DuckDB expressions of their rewritten
#: arguments (keyed by the name as written, qualified or not).
FUNCTIONS: dict[str, Callable[[list[str]], str]] = {
    # As PostgreSQL's: quoted unless a lower-case name that is no keyword but an
    # unreserved one (DuckDB's keywords: "offset" must be quoted to be read back).
    "quote_ident": lambda a: (
        f"(CASE WHEN regexp_full_match({a[0]}, '[a-z_][a-z0-9_$]*') AND {a[0]} NOT IN"
        " (SELECT keyword_name FROM duckdb_keywords() WHERE keyword_category <> 'unreserved')"
        f" THEN {a[0]} ELSE '\"' || replace({a[0]}, '\"', '\"\"') || '\"' END)"
    ),
    "array_lower": lambda a: f"CASE WHEN len({a[0]}) > 0 THEN 1 END",
    "array_upper": _list_length,
    "array_length": _list_length,
    "parse_ident": lambda a: f"list_transform(string_split({a[0]}, '.'), lambda p: trim(p, '\"'))",
    "pg_get_userbyid": lambda a: _quote(OWNER),
    # No table has a default, an index or a check: no expression to show.
    **dict.fromkeys(
        (
            "pg_get_expr",
            "pg_get_statisticsobjdef_columns",
            "pg_get_indexdef",
            "pg_get_constraintdef",
            "pg_get_triggerdef",
            "pg_get_ruledef",
            "pg_get_partkeydef",
            "pg_get_partition_constraintdef",
        ),
        lambda a: "NULL::VARCHAR",
    ),
    # No column takes its values from a sequence (serial, identity).
    "pg_get_serial_sequence": lambda a: "NULL::VARCHAR",
    # No function to describe (pg_proc is empty).
    **dict.fromkeys(
        (
            "pg_get_function_result",
            "pg_get_function_arguments",
            "pg_get_function_identity_arguments",
            "pg_get_functiondef",
            "pg_get_function_sqlbody",
        ),
        lambda a: "NULL::VARCHAR",
    ),
    "json_build_object": lambda a: f"json_object({', '.join(a)})",
    "format_type": lambda a: _format_type(a[0], a[1]),
    "pg_relation_is_publishable": lambda a: "false",
    "pg_encoding_to_char": lambda a: "'UTF8'",
    # Tables are projections in memory: no size on disk to report.
    **dict.fromkeys(
        ("pg_table_size", "pg_relation_size", "pg_total_relation_size", "pg_database_size"),
        lambda a: "NULL::BIGINT",
    ),
    "information_schema._pg_expandarray": lambda a: (
        f"{{'x': unnest({a[0]}), 'n': unnest(generate_series(1, len({a[0]})))}}"
    ),
}
# The session's names: the user and the database the client connected with.
USER_NAMES = ("current_user", "session_user", "current_role", "getpgusername")
DATABASE_NAMES = ("current_database", "current_catalog")
SELECT_ITEM_START = frozenset({"select", ",", "distinct", "all"})
# Scalar functions PostgreSQL takes as a FROM item (one row, the alias names the column).
SCALARS_IN_FROM = frozenset({"string_to_array", "current_schemas", "regexp_split_to_array"})
# reg* casts of a literal: the relation and column to look the name up in.
REG_LOOKUPS = {
    "regclass": ("pg_catalog.pg_class", "relname"),
    "regtype": ("pg_catalog.pg_type", "typname"),
    "regnamespace": ("pg_catalog.pg_namespace", "nspname"),
}
REG_TYPES = frozenset({*REG_LOOKUPS, "regproc", "regprocedure", "regoper", "regrole"})
CLAUSES = frozenset(
    {"select", "from", "join", "where", "group", "order", "having", "limit", "on", "using"}
)
# Words without which a statement is passed through untouched (the common case).
TRIGGERS = (
    "pg_",
    "information_schema",
    "::reg",
    "current_setting",
    "quote_ident",
    "array_",
    "parse_ident",
    "string_to_array",
    "current_schemas",
    *USER_NAMES,
    *DATABASE_NAMES,
)


@dataclass(frozen=True, slots=True)
class _Token:
    kind: str
    word: str  # lower-cased text, quotes of an identifier kept
    start: int
    end: int  # where the next token starts (trailing blanks and comments included)


def _tokens(sql: str, data: bytes) -> list[_Token]:
    """DuckDB's tokens of ``sql``; their offsets count bytes of its UTF-8 (``data``)."""
    raw = duckdb.tokenize(sql)
    out: list[_Token] = []
    for i, (start, kind) in enumerate(raw):
        if kind.name == "comment":
            continue
        end = raw[i + 1][0] if i + 1 < len(raw) else len(data)
        out.append(_Token(kind.name, data[start:end].decode().strip().lower(), start, end))
    # A comment between tokens belongs to the span of the token before it.
    return [
        _Token(tok.kind, tok.word, tok.start, out[i + 1].start if i + 1 < len(out) else len(data))
        for i, tok in enumerate(out)
    ]


class _Rewriter:
    def __init__(
        self, sql: str, settings: Mapping[str, str], user: str | None, database: str | None
    ) -> None:
        self.data = sql.encode()  # token offsets count bytes
        self.settings = {k.lower(): v for k, v in settings.items()}
        self.toks = _tokens(sql, self.data)
        self.used: dict[str, str] = {}  # CTE name -> body, in first-use order
        self.database = database
        # The session's names, as PostgreSQL answers them (DuckDB's are its own).
        self.names: dict[str, str] = {}
        if user is not None:
            self.names.update(dict.fromkeys(USER_NAMES, user))
        if database is not None:
            self.names.update(dict.fromkeys(DATABASE_NAMES, database))

    def relation(self, qualified: str) -> str:
        name, body = RELATIONS[qualified]
        if self.database is not None:
            body = body.replace(_DATABASE, _quote(self.database))
        self.used.setdefault(name, body)
        return name

    def text(self, i: int, j: int) -> str:
        """Tokens ``i`` up to ``j`` (exclusive) as written, without the trailing blanks."""
        if i >= j:
            return ""
        return self.data[self.toks[i].start : self.toks[j - 1].end].decode().rstrip()

    def closing(self, i: int) -> int:
        """Index of the parenthesis closing the one at ``i`` (len(toks) when none)."""
        depth = 0
        for k in range(i, len(self.toks)):
            word = self.toks[k].word
            if word == "(":
                depth += 1
            elif word == ")":
                depth -= 1
                if depth == 0:
                    return k
        return len(self.toks)

    def arguments(self, i: int, j: int) -> list[str]:
        """The rewritten, top-level comma-separated arguments between ``i`` and ``j``."""
        args: list[str] = []
        depth, first = 0, i
        for k in range(i, j):
            word = self.toks[k].word
            depth += (word in ("(", "[")) - (word in (")", "]"))
            if word == "," and depth == 0:
                args.append(self.rewrite(first, k))
                first = k + 1
        if first < j:
            args.append(self.rewrite(first, j))
        return args

    def qualified_name(self, i: int) -> tuple[str, int]:
        """The name at ``i`` (``a`` or ``a.b``) and the index after it."""
        toks = self.toks
        if i + 2 < len(toks) and toks[i + 1].word == "." and toks[i + 2].kind != "operator":
            return f"{toks[i].word}.{toks[i + 2].word}", i + 3
        return toks[i].word, i + 1

    def rewrite(self, i: int, j: int) -> str:
        toks = self.toks
        out: list[str] = []
        clause: dict[int, str] = {}  # innermost clause keyword per parenthesis depth
        depth = 0
        previous = ""
        k = i
        while k < j:
            tok = toks[k]
            name, after = self.qualified_name(k)
            if tok.kind in ("identifier", "keyword") and previous != ".":
                bare = name.removeprefix("pg_catalog.")
                calls = after < j and toks[after].word == "("
                function = FUNCTIONS.get(name) or FUNCTIONS.get(bare)
                end = self._session_name(bare, calls, after, j)
                if end is not None and previous != "as":
                    out.append(_quote(self.names[bare]))
                    alone = end >= j or toks[end].word in (",", "from", ")", ";")
                    if clause.get(depth) == "select" and previous in SELECT_ITEM_START and alone:
                        out.append(f' AS "{bare}"')  # the column's name, as PostgreSQL's
                    out.append(self._gap(end - 1))
                    previous, k = ")", end
                    continue
                if calls and function is not None:
                    close = min(self.closing(after), j)
                    value = function(self.arguments(after + 1, close))
                    out.append(self._keep_parameters(value, after + 1, close) + self._gap(close))
                    previous, k = ")", close + 1
                    continue
                if calls and bare == "current_setting":
                    close = min(self.closing(after), j)
                    setting = self._current_setting(after + 1, close)
                    if setting is not None:
                        out.append(setting + self._gap(close))
                        previous, k = ")", close + 1
                        continue
                if calls and bare in SCALARS_IN_FROM and _in_from(clause.get(depth), previous):
                    close = min(self.closing(after), j)
                    call = f"{self.text(k, after)}({', '.join(self.arguments(after + 1, close))})"
                    out.append(f"unnest([{call}])" + self._gap(close))
                    previous, k = ")", close + 1
                    continue
                if calls and name.startswith("pg_catalog."):
                    # DuckDB finds its PostgreSQL-named macros (array_to_string ...)
                    # unqualified only.
                    out.append(self.text(after - 1, after) + self._gap(after - 1))
                    previous, k = "function", after
                    continue
                if not calls:
                    qualified = name if "." in name else f"pg_catalog.{name}"
                    if qualified in RELATIONS and ("." in name or RELATIONS[qualified][0] == name):
                        out.append(self.relation(qualified) + self._gap(after - 1))
                        previous, k = "relation", after
                        continue
            if tok.word == "collate" and k + 1 < j:
                # PostgreSQL's collations (pg_catalog.default, "C") are not DuckDB's.
                collation, after = self.qualified_name(k + 1)
                if collation.startswith("pg_catalog.") or collation in ('"c"', '"default"'):
                    out.append(self._gap(after - 1))
                    previous, k = "collation", after
                    continue
            if tok.word == "operator" and k + 1 < j and toks[k + 1].word == "(":
                # OPERATOR(pg_catalog.~) is the operator itself.
                close = min(self.closing(k + 1), j)
                if close - 1 > k + 1:
                    out.append(self.text(close - 1, close) + self._gap(close))
                    previous, k = "operator", close + 1
                    continue
            if tok.word == "::" and k + 1 < j:
                cast, after = self.qualified_name(k + 1)
                cast = cast.removeprefix("pg_catalog.")
                if cast in REG_TYPES:
                    first = self._operand_start(i, k)
                    lookup = self._reg_cast(cast, first, k)
                    if lookup is not None:
                        del out[len(out) - (k - first) :]  # the operand, now inside it
                        out.append(lookup)
                    out.append(self._gap(after - 1))
                    previous, k = "cast", after
                    continue
                target = self._cast_type(k + 1, after)
                if target is not None:
                    out.append(f"::{target}" + self._gap(after - 1))
                    previous, k = "cast", after
                    continue
            if tok.word == "cast" and k + 1 < j and toks[k + 1].word == "(":
                # CAST(x AS regclass) as x::regclass (SQLAlchemy's spelling).
                close = min(self.closing(k + 1), j)
                as_at = self._top_level(k + 2, close, "as")
                if as_at is not None:
                    cast, after = self.qualified_name(as_at + 1)
                    cast = cast.removeprefix("pg_catalog.")
                    target = self._cast_type(as_at + 1, after)
                    if after == close and (cast in REG_TYPES or target is not None):
                        operand = self.rewrite(k + 2, as_at)
                        if cast in REG_TYPES:
                            reg = self._reg_cast(cast, k + 2, as_at)
                            out.append(f"({operand})" if reg is None else reg)
                        else:
                            out.append(f"CAST({operand} AS {target})")
                        out.append(self._gap(close))
                        previous, k = ")", close + 1
                        continue
            if tok.word == "(":
                depth += 1
            elif tok.word == ")":
                clause.pop(depth, None)
                depth -= 1
            elif tok.kind == "keyword" and tok.word in CLAUSES:
                clause[depth] = tok.word
            out.append(self.data[tok.start : tok.end].decode())
            previous = tok.word
            k += 1
        return "".join(out).rstrip()

    def _gap(self, k: int) -> str:
        piece = self.data[self.toks[k].start : self.toks[k].end].decode()
        return piece[len(piece.rstrip()) :]

    def _session_name(self, bare: str, calls: bool, after: int, j: int) -> int | None:
        """Where ``current_database()`` or ``current_user`` (unqualified, or
        ``pg_catalog.current_database()``) ends when the name at ``after`` is one."""
        if bare not in self.names:
            return None
        if bare in ("current_database", "getpgusername"):
            closed = calls and after + 1 < j and self.toks[after + 1].word == ")"
            return after + 2 if closed else None
        return None if calls else after

    def _current_setting(self, i: int, j: int) -> str | None:
        """current_setting() of the arguments ``i``..``j``: a session setting named by a
        literal is its value; a name known when the statement runs (a parameter) is
        looked up among the session's settings (NULL for any other); None (DuckDB's
        current_setting) for a literal naming no session setting."""
        arg = self.toks[i] if i + 1 == j else None
        if arg is not None and arg.kind == "string_const":
            value = self.settings.get(arg.word.strip("'"))
            return None if value is None else _quote(value)
        if i == j or not self.settings:
            return None
        names = self.arguments(i, j)
        table = _values(
            sorted(self.settings.items()), "setting_name, setting_value", "headwater_settings"
        )
        lookup = f"(SELECT setting_value FROM {table} WHERE setting_name = lower({names[0]}))"
        return self._keep_parameters(lookup, i, j)

    def _keep_parameters(self, value: str, i: int, j: int) -> str:
        """``value``, the translation of a call whose arguments are the tokens ``i``..``j``,
        still naming each parameter (``$1``) they name: DuckDB refuses parameters a
        statement does not use (pg_get_constraintdef(oid, $1) is NULL)."""
        toks = self.toks
        dropped = [
            f"${toks[k + 1].word}"
            for k in range(i, j - 1)
            if toks[k].word == "$"
            and toks[k + 1].kind == "numeric_const"
            and not re.search(rf"\${toks[k + 1].word}(?!\d)", value)
        ]
        if not dropped:
            return value
        return f"(CASE WHEN row({', '.join(dropped)}) IS NULL AND false THEN NULL ELSE {value} END)"

    def _top_level(self, i: int, j: int, word: str) -> int | None:
        """Index of the last ``word`` between ``i`` and ``j`` outside any parentheses."""
        depth, found = 0, None
        for k in range(i, j):
            here = self.toks[k].word
            depth += (here in ("(", "[")) - (here in (")", "]"))
            if depth == 0 and here == word:
                found = k
        return found

    def _cast_type(self, i: int, j: int) -> str | None:
        """The DuckDB type for PostgreSQL's type name at ``i``..``j`` when it differs."""
        cast = self.text(i, j).lower()
        if cast.removeprefix("pg_catalog.") in ("name", '"char"'):
            return "VARCHAR"
        if cast.startswith("pg_catalog."):
            # DuckDB knows PostgreSQL's type names (text, int4 ...), unqualified.
            return self.text(j - 1, j)
        return None

    def _operand_start(self, i: int, k: int) -> int:
        """Where the operand of the ``::`` at ``k`` starts when it is a literal or a
        parameter (``$1``): the cast looks those up; ``k`` for anything else."""
        toks = self.toks
        if k - 1 >= i and toks[k - 1].kind == "string_const":
            return k - 1
        if k - 2 >= i and toks[k - 2].word == "$" and toks[k - 1].kind == "numeric_const":
            return k - 2
        return k

    def _reg_cast(self, cast: str, first: int, last: int) -> str | None:
        """A ``reg*`` cast of the tokens ``first``..``last``: the lookup of a name literal
        or of a parameter (a name, or an oid kept as it is); None for anything else,
        which keeps its value (the oid)."""
        if cast not in REG_LOOKUPS:
            return None
        relation, column = REG_LOOKUPS[cast]
        operand = self.toks[first:last]
        if len(operand) == 1 and operand[0].kind == "string_const":
            name = operand[0].word.strip("'").rsplit(".", 1)[-1].strip('"')
            return f"(SELECT oid FROM {self.relation(relation)} WHERE {column} = {_quote(name)})"
        if [tok.word for tok in operand[:1]] == ["$"] and len(operand) == 2:
            value = f"{self.text(first, last)}::VARCHAR"
            name = f"trim(string_split({value}, '.')[-1], '\"')"
            return (
                f"coalesce(TRY_CAST({value} AS BIGINT), "
                f"(SELECT oid FROM {self.relation(relation)} WHERE {column} = {name}))"
            )
        return None


def rewrite(
    sql: str,
    settings: Mapping[str, str],
    *,
    user: str | None = None,
    database: str | None = None,
) -> str:
    """``sql`` as DuckDB runs it: the catalog relations it names prepended as CTEs, the
    PostgreSQL functions and casts it uses translated (see the module's docstring).
    ``current_user`` (``session_user`` ...) is ``user`` and ``current_database()`` is
    ``database``, the names the client connected with, when given.
    Returned unchanged when it names none of them."""
    lowered = sql.lower()
    if not any(trigger in lowered for trigger in TRIGGERS):
        return sql
    try:
        rewriter = _Rewriter(sql, settings, user, database)
    except duckdb.Error:
        return sql  # DuckDB will say what is wrong with it
    if not rewriter.toks:
        return sql
    body = rewriter.rewrite(0, len(rewriter.toks))
    if not rewriter.used:
        return body
    ctes = ", ".join(f"{name} AS ({cte})" for name, cte in rewriter.used.items())
    first = rewriter.toks[0]
    if first.word == "with":
        recursive = len(rewriter.toks) > 1 and rewriter.toks[1].word == "recursive"
        skip = rewriter.toks[1 if recursive else 0].end - first.start
        head = body[:skip]
        return f"{head}{ctes}, {body[skip:]}"
    return f"WITH {ctes} {body}"
