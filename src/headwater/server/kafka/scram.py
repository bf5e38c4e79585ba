"""SCRAM-SHA-256 (RFC 5802 / RFC 7677) for the Kafka listener, the password being a
headwater token.

The user name carries no meaning here (a token is not tied to a name), so the server
cannot look a password up by it: it sends a fresh salt, and checks the client's proof
against each configured token salted with it. The proof is a keyed hash of the whole
exchange, so a match proves the client knows that token; the server's signature then
proves the server knows it too. Only PBKDF2 runs per token (4096 iterations, RFC 7677's
minimum), in a worker thread."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from headwater.errors import AuthenticationFailed

ITERATIONS = 4096
MECHANISM = "SCRAM-SHA-256"


def _h(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _hmac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def _fields(message: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for part in message.split(","):
        name, sep, value = part.partition("=")
        if not sep or len(name) != 1:
            raise AuthenticationFailed(f"malformed SCRAM attribute {part[:20]!r}")
        fields.setdefault(name, value)
    return fields


@dataclass
class ScramServer:
    """One exchange: :meth:`first` answers the client-first message, :meth:`final`
    checks the client-final one against the candidate tokens and returns the token
    that matched and the server-final message."""

    salt: bytes = b""
    nonce: str = ""
    client_first_bare: str = ""
    server_first: str = ""

    def first(self, message: bytes) -> bytes:
        text = message.decode("utf-8", "replace")
        header, sep, bare = text.partition(",")
        _authzid, sep2, bare = bare.partition(",")
        if not sep or not sep2 or header not in ("n", "y"):
            raise AuthenticationFailed("SCRAM client-first message without a gs2 header 'n,,'")
        fields = _fields(bare)
        client_nonce = fields.get("r", "")
        if "n" not in fields or not client_nonce:
            raise AuthenticationFailed("SCRAM client-first message without n= and r=")
        self.salt = secrets.token_bytes(16)
        self.nonce = client_nonce + secrets.token_urlsafe(18)
        self.client_first_bare = bare
        salt = base64.b64encode(self.salt).decode()
        self.server_first = f"r={self.nonce},s={salt},i={ITERATIONS}"
        return self.server_first.encode()

    def final(self, message: bytes, tokens: Iterable[str]) -> tuple[str, bytes]:
        text = message.decode("utf-8", "replace")
        without_proof, sep, proof_part = text.rpartition(",p=")
        if not sep:
            raise AuthenticationFailed("SCRAM client-final message without a proof")
        fields = _fields(without_proof)
        # Kafka checks that the nonce ends with the server's (endsWith): librdkafka
        # before 2.2 (Debian's kcat) sends the client nonce twice in front of it.
        if not fields.get("r", "").endswith(self.nonce):
            raise AuthenticationFailed("SCRAM nonce does not match this exchange")
        try:
            proof = base64.b64decode(proof_part, validate=True)
        except ValueError:
            raise AuthenticationFailed("SCRAM proof is not base64") from None
        auth_message = f"{self.client_first_bare},{self.server_first},{without_proof}".encode()
        for token in tokens:
            salted = hashlib.pbkdf2_hmac("sha256", token.encode(), self.salt, ITERATIONS)
            client_key = _hmac(salted, b"Client Key")
            stored_key = _h(client_key)
            signature = _hmac(stored_key, auth_message)
            if len(proof) != len(signature):
                continue
            candidate = bytes(a ^ b for a, b in zip(proof, signature, strict=True))
            if hmac.compare_digest(_h(candidate), stored_key):
                server_key = _hmac(salted, b"Server Key")
                server_signature = _hmac(server_key, auth_message)
                return token, b"v=" + base64.b64encode(server_signature)
        raise AuthenticationFailed("unknown token")
