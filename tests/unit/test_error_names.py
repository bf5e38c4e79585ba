"""One set of error names (headwater.errors.ErrorName) for the SDKs, the CLI and HTTP, and
docs/errors.md lists every error class and every name."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from types import ModuleType

import pytest

from headwater import errors
from headwater.client import errors as client_errors
from headwater.entities import errors as entity_errors
from headwater.errors import ErrorName, HeadwaterError
from headwater.protocols.convergedb.codes import ErrorCode, Opcode

DOC = (Path(__file__).parents[2] / "docs" / "errors.md").read_text()
MODULES = (errors, client_errors, entity_errors)


def error_classes(module: ModuleType) -> list[type[BaseException]]:
    return [
        cls
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, BaseException) and cls.__module__ == module.__name__
    ]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_every_error_class_is_in_the_doc(module: ModuleType) -> None:
    classes = error_classes(module)
    assert classes
    missing = [cls.__name__ for cls in classes if f"`{cls.__name__}`" not in DOC]
    # ProtocolError and UsageError are not errors a user is shown (docs/errors.md says
    # what the SDK raises); every other class is listed by name.
    assert [m for m in missing if m not in ("ProtocolError", "UsageError")] == []


def test_every_name_is_in_the_doc_and_every_class_has_one() -> None:
    rows = {line.split("|")[1].strip() for line in DOC.splitlines() if line.startswith("| ")}
    assert {name.value for name in ErrorName} <= rows
    for module in MODULES:
        for cls in error_classes(module):
            if issubclass(cls, HeadwaterError):
                assert isinstance(cls.name, ErrorName), cls
    # Names are CamelCase: none of the upper-case wire spellings is one.
    assert all(re.fullmatch(r"(?:[A-Z][a-z]+)+", name.value) for name in ErrorName)


def test_convergedb_errors_have_our_names_and_keep_their_wire_names() -> None:
    for code in ErrorCode:
        exc = entity_errors.error_for(code, Opcode.ASSERT, "m")
        assert exc.cdb_code == code and exc.wire_name == code.name
        assert ErrorName.parse(code.name) is exc.name
    missing = entity_errors.error_for(ErrorCode.KIND_NOT_FOUND, Opcode.ASSERT, "no kind 7")
    assert missing.name == "KindNotFound" and str(missing) == "no kind 7"
    # One concept, one class to catch, from either SDK.
    assert isinstance(missing, errors.KindNotFound) and isinstance(missing, errors.TableNotFound)
    assert isinstance(entity_errors.AuthFailed(), errors.AuthenticationFailed)
    assert isinstance(entity_errors.Internal(), errors.InternalError)
    assert entity_errors.Internal().retryable
    unknown = entity_errors.error_for(99, Opcode.ASSERT, "what")
    assert unknown.name == "Unknown" and unknown.wire_name == "code 99"
    assert ErrorName.parse("StreamNotFound") is ErrorName.STREAM_NOT_FOUND
    assert ErrorName.parse("NO_SUCH_THING") is None


def test_client_errors_are_named() -> None:
    for cls in error_classes(client_errors):
        assert cls.name == cls.__name__  # type: ignore[attr-defined]


def test_http_error_bodies_map_to_the_finest_class() -> None:
    def body(code: int, name: str) -> bytes:
        return f'{{"error": {{"code": {code}, "name": "{name}", "message": "m"}}}}'.encode()

    assert type(client_errors.http_api_error(404, body(6, "KindNotFound"), "u")) is (
        errors.KindNotFound
    )
    assert type(client_errors.http_api_error(404, body(6, "EntityNotFound"), "u")) is (
        errors.EntityNotFound
    )
    assert type(client_errors.http_api_error(404, body(6, "TableNotFound"), "u")) is (
        errors.TableNotFound
    )
    # A name that does not belong to the code: the code decides.
    assert type(client_errors.http_api_error(404, body(5, "KindNotFound"), "u")) is (
        errors.StreamNotFound
    )
    assert type(client_errors.http_api_error(500, b"<html>", "u")) is (
        client_errors.ServerUnavailable
    )
