"""An asyncio etcd v3 client over etcd's own JSON gateway (``/v3/...``), on aiohttp.

Why the gateway and not a gRPC client library: the gateway is part of every etcd v3
server (3.4 and 3.5 alike), aiohttp is already a dependency, and the few calls a
cluster needs (range, put, delete, txn, lease grant/keepalive/revoke) are one JSON POST
each; the maintained asyncio gRPC clients pin their own generated protobuf code, which
must then agree with the protobuf and grpcio versions the Rivven codec uses.
docs/cluster.md says more.

Keys and values travel base64-encoded and int64 fields as decimal strings, as the
gateway's JSON mapping of etcd's protobuf messages has it. Several endpoints may be
given: a call that cannot reach one tries the next.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp


class EtcdError(Exception):
    """etcd answered with an error."""


class EtcdUnavailable(EtcdError):
    """No endpoint answered."""


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int

    def json(self) -> Any:
        return json.loads(self.value)


@dataclass(frozen=True)
class Compare:
    """A txn guard: ``key``'s ``target`` (CREATE, MOD or VALUE) equals ``value``."""

    key: str
    target: str
    value: int | bytes

    def request(self) -> dict[str, Any]:
        field = {"CREATE": "create_revision", "MOD": "mod_revision", "VALUE": "value"}[self.target]
        wire = _b64(self.value) if isinstance(self.value, bytes) else str(self.value)
        return {"key": _b64(self.key), "target": self.target, "result": "EQUAL", field: wire}


def absent(key: str) -> Compare:
    """The txn guard "``key`` does not exist"."""
    return Compare(key, "CREATE", 0)


def unchanged(kv: KeyValue) -> Compare:
    """The txn guard "``kv`` was not written since it was read"."""
    return Compare(kv.key, "MOD", kv.mod_revision)


def same_key(kv: KeyValue) -> Compare:
    """The txn guard "``kv``'s key was not deleted (and created again) since it was
    read": written since, it still holds."""
    return Compare(kv.key, "CREATE", kv.create_revision)


@dataclass(frozen=True)
class Put:
    key: str
    value: bytes
    lease: int = 0

    def request(self) -> dict[str, Any]:
        put: dict[str, Any] = {"key": _b64(self.key), "value": _b64(self.value)}
        if self.lease:
            put["lease"] = str(self.lease)
        return {"request_put": put}


@dataclass(frozen=True)
class Delete:
    key: str
    prefix: bool = False  # every key starting with ``key``

    def request(self) -> dict[str, Any]:
        delete = {"key": _b64(self.key)}
        if self.prefix:
            delete["range_end"] = _prefix_end(self.key)
        return {"request_delete_range": delete}


def put_json(key: str, value: Any, lease: int = 0) -> Put:
    return Put(key, json.dumps(value, sort_keys=True).encode(), lease)


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _prefix_end(prefix: str) -> str:
    raw = bytearray(prefix.encode())
    raw[-1] += 1  # keys here are ASCII paths: the last byte never is 0xff
    return _b64(bytes(raw))


def _key_values(answer: dict[str, Any]) -> list[KeyValue]:
    return [
        KeyValue(
            key=base64.b64decode(kv["key"]).decode(),
            value=base64.b64decode(kv.get("value", "")),
            create_revision=int(kv.get("create_revision", 0)),
            mod_revision=int(kv.get("mod_revision", 0)),
            lease=int(kv.get("lease", 0)),
        )
        for kv in answer.get("kvs", [])
    ]


class Etcd:
    """One client for a node's or a command's whole life (``close`` at the end)."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float = 2.0) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        self.endpoints = [e if "://" in e else f"http://{e}" for e in endpoints]
        self._current = 0
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        failures = []
        for attempt in range(len(self.endpoints)):
            endpoint = self.endpoints[(self._current + attempt) % len(self.endpoints)]
            try:
                async with self._session.post(f"{endpoint}/v3/{path}", json=body) as response:
                    answer: dict[str, Any] = await response.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                failures.append(f"{endpoint}: {exc or type(exc).__name__}")
                continue
            self._current = (self._current + attempt) % len(self.endpoints)
            if "error" in answer:
                raise EtcdError(f"etcd {path}: {answer.get('message') or answer['error']}")
            return answer
        raise EtcdUnavailable("no etcd endpoint answered: " + "; ".join(failures))

    async def get(self, key: str) -> KeyValue | None:
        found = _key_values(await self._call("kv/range", {"key": _b64(key)}))
        return found[0] if found else None

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        """Every key starting with ``prefix``, in key order."""
        body = {"key": _b64(prefix), "range_end": _prefix_end(prefix)}
        return _key_values(await self._call("kv/range", body))

    async def put(self, key: str, value: bytes, lease: int = 0) -> None:
        await self._call("kv/put", Put(key, value, lease).request()["request_put"])

    async def delete(self, key: str) -> None:
        await self._call("kv/deleterange", {"key": _b64(key)})

    async def txn(self, compare: Sequence[Compare], success: Sequence[Put | Delete]) -> bool:
        """Apply ``success`` if every guard of ``compare`` holds; whether it did."""
        answer = await self._call(
            "kv/txn",
            {
                "compare": [c.request() for c in compare],
                "success": [op.request() for op in success],
            },
        )
        return bool(answer.get("succeeded", False))

    async def grant_lease(self, ttl_s: int) -> int:
        answer = await self._call("lease/grant", {"TTL": str(ttl_s)})
        return int(answer["ID"])

    async def keep_alive(self, lease: int) -> int:
        """Renew ``lease``; its new TTL in seconds, 0 when it has already expired."""
        answer = await self._call("lease/keepalive", {"ID": str(lease)})
        return int(answer.get("result", {}).get("TTL", 0))

    async def revoke_lease(self, lease: int) -> None:
        """Drop ``lease`` and every key under it now (a clean shutdown)."""
        await self._call("lease/revoke", {"ID": str(lease)})
