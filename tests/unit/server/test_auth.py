"""The one auth module every listener uses: what a token grants."""

from __future__ import annotations

import pytest

from headwater.api.auth import Auth, AuthConfig
from headwater.errors import AuthenticationFailed, TenantForbidden

TOKENS = {"s3cret": frozenset({0, 42}), "other": frozenset({7})}


def test_known_token_grants_exactly_its_tenants() -> None:
    for required in (True, False):
        principal = Auth(AuthConfig(required=required, tokens=TOKENS)).authenticate("s3cret")
        assert principal.token_known
        assert principal.default_tenant == 0
        principal.check_tenant(42)
        with pytest.raises(TenantForbidden, match="does not grant tenant 7"):
            principal.check_tenant(7)


def test_required_auth_refuses_missing_and_unknown_tokens() -> None:
    auth = Auth(AuthConfig(required=True, tokens=TOKENS))
    with pytest.raises(AuthenticationFailed, match="a valid token is required"):
        auth.authenticate(None)
    with pytest.raises(AuthenticationFailed, match="a valid token is required"):
        auth.authenticate("")
    with pytest.raises(AuthenticationFailed, match="unknown token") as refused:
        auth.authenticate("s3cre")  # a prefix of a known token is not it
    assert "s3cre" not in str(refused.value)  # tokens never appear in errors


def test_optional_auth_lets_anonymous_clients_act_for_every_tenant() -> None:
    auth = Auth(AuthConfig(required=False, tokens=TOKENS))
    for token in (None, "unknown"):
        principal = auth.authenticate(token)
        assert not principal.token_known
        assert principal.tenants is None and principal.default_tenant == 0
        principal.check_tenant(123456)


def test_forbidden_is_an_authentication_failure_on_the_wire() -> None:
    # Kimberlite and ConvergeDB answer code 3 for both; only HTTP tells them apart (403).
    assert TenantForbidden.code == AuthenticationFailed.code == 3
