"""The postgres listener through pgjdbc, the PostgreSQL JDBC driver that DBeaver and
other JVM tools use (Debian's libpostgresql-jdbc-java, run by the JDK Spark needs):
SCRAM with a token and a wrong one, INSERT, GROUP BY with its column types, a prepared
statement past pgjdbc's switch to a named binary statement, AS OF, and the
DatabaseMetaData calls a schema browser draws its tree from (getSchemas, getTables,
getColumns, getPrimaryKeys, getTypeInfo: PostgreSQL catalog queries, answered through
server/postgres/catalog.py; docs/protocols/postgres.md).
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kimberlite_raw import RawClient, create_stream
from servers import AUTH_CONFIG, LOCAL, Server, serving

DRIVER = Path("/usr/share/java/postgresql.jar")
PROBE = Path(__file__).with_name("PgjdbcProbe.java")
TOKEN = "s3cret"  # the token servers.AUTH_CONFIG grants tenant 0
CONFIG = AUTH_CONFIG


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("postgres_jdbc"),
        config=CONFIG,
        listen={"postgres": LOCAL},
        clean_log=True,
    )


def test_pgjdbc(server: Server) -> None:
    java = shutil.which("java")
    assert java, "java is missing: the JDK Spark uses (Debian's openjdk-17-jdk-headless)"
    assert DRIVER.exists(), (
        "pgjdbc is missing: `make system-deps` installs Debian's libpostgresql-jdbc-java"
    )
    stream = f"jdbc_{uuid.uuid4().hex[:8]}"
    with RawClient(server.port, 0, token=TOKEN) as client:
        create_stream(client, stream)
    done = subprocess.run(
        [java, "-cp", str(DRIVER), str(PROBE), str(server.ports["postgres"]), TOKEN, stream],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        "wrong password: 28P01",
        "product: PostgreSQL",
        "inserted: 3",
        "types: text,int8,float8",
        "group: A,2,4.5",
        "group: B,1,2.0",
        "group: C,1,4.0",
        *(f"prepared {run}: {2 if run % 2 == 0 else 1},true" for run in range(1, 7)),
        "as of: 3",
        "latest: 4",
        # DatabaseMetaData: DBeaver's navigator tree (the stream a table of schema main,
        # its columns with the types the wire sends, no key, the wire's types).
        "schemas: information_schema,main,pg_catalog",
        "table: main,TABLE",
        "column: 1,offset,int8,-5,YES",
        "column: 2,position,int8,-5,YES",
        "column: 3,ts,timestamp,93,YES",
        "column: 4,data,bytea,-2,YES",
        "column: 5,json,json,1111,YES",
        "primary key columns: 0",
        "types: int8=-5,bytea=-2,float8=8,timestamp=93,json=1111",
        "after: 2",
    ]
    assert "password authentication failed" in server.log_text()
