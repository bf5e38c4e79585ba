"""The REST API against its own OpenAPI file, with schemathesis generating the requests.

Every documented operation gets requests built from its schema (valid and invalid); each
answer must be documented (status code, content type, body schema) and never a 5xx. A
separate server keeps the generated streams and deletions away from the other HTTP tests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from servers import serving
from test_http_api import LISTEN, OPENAPI, TENANTS_CONFIG, HttpApi

# /ws is the Kiwi WebSocket upgrade, not a REST resource: tests/integration/test_kiwi_gateway.py
# drives it with a real WebSocket client.
schema = schemathesis.openapi.from_path(str(OPENAPI)).exclude(path="/ws")
# SQL text is a string to the schema; whether DuckDB parses it is beyond any schema, so
# a well-formed body with bad SQL may be refused (400 QueryParseError). An Arrow append's
# body is bytes to the schema; whether they are an Arrow IPC stream is beyond it too.
FREE_TEXT_OPERATIONS = {("POST", "/api/sql"), ("POST", "/api/streams/{name}/arrow")}


@schemathesis.serializer("application/x-ndjson")
def ndjson_body(ctx: object, value: object) -> bytes:
    # The schema says "a string"; generated negative cases are other JSON values.
    return value.encode() if isinstance(value, str) else json.dumps(value).encode()


@schemathesis.serializer("application/vnd.apache.arrow.stream")
def arrow_body(ctx: object, value: object) -> bytes:
    # Generated "binary" bodies: bytes, or text for the negative cases.
    return value if isinstance(value, bytes) else str(value).encode()


@pytest.fixture(scope="module")
def fuzzed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpApi]:
    root = tmp_path_factory.mktemp("http_schemathesis")
    for server in serving(root, config=TENANTS_CONFIG, listen=LISTEN):
        yield HttpApi(server)


@pytest.mark.slow
@schema.parametrize()
@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,  # the same cases every run: CI is reproducible, findings replayable
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_rest_api_conforms_to_openapi(case: object, fuzzed_server: HttpApi) -> None:
    operation = (case.method.upper(), case.path)  # type: ignore[attr-defined]
    excluded = (
        [schemathesis.checks.positive_data_acceptance] if operation in FREE_TEXT_OPERATIONS else []
    )
    case.call_and_validate(  # type: ignore[attr-defined]
        base_url=fuzzed_server.base, excluded_checks=excluded
    )
