"""SQL over the tenant log: DuckDB over Arrow projections of streams (and later kinds)."""

from headwater.sql.service import SqlService
from headwater.sql.tables import SqlTable, StreamTables, TableSource
from headwater.sql.values import QueryParam, QueryResult, QueryValue, Timestamp

__all__ = [
    "QueryParam",
    "QueryResult",
    "QueryValue",
    "SqlService",
    "SqlTable",
    "StreamTables",
    "TableSource",
    "Timestamp",
]
