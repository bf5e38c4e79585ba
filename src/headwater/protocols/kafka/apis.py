"""The Kafka APIs and versions headwater's codec implements, and the ApiVersions answer.

Each range runs from the lowest version kio models (Kafka 4.0 dropped the older ones) or
the lowest a supported client still sends, up to the highest that librdkafka 2.x
(confluent-kafka), aiokafka 0.14 or Kafka's Java client 3.x asks for while naming
topics by name: versions that identify topics only by topic id (Fetch 13+, Produce 12+,
OffsetCommit/OffsetFetch 10+, DeleteTopics 6) and the KIP-890 "transactions v2" versions
are left out. A client picks the highest version both sides list, so an absent version is
never answered wrongly: it is simply never asked for. docs/kafka.md has the table.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum
from functools import cache

from kio.index import load_request_schema, load_response_schema
from kio.schema.api_versions.v0.response import ApiVersion as ApiVersionV0
from kio.schema.api_versions.v0.response import ApiVersionsResponse as ApiVersionsResponseV0
from kio.schema.api_versions.v3.response import ApiVersion, ApiVersionsResponse
from kio.schema.errors import ErrorCode
from kio.static.primitive import i16
from kio.static.protocol import RequestPayload, ResponsePayload


class ApiKey(IntEnum):
    """Kafka's API keys (``apiKey`` in the message definitions) of the implemented APIs."""

    PRODUCE = 0
    FETCH = 1
    LIST_OFFSETS = 2
    METADATA = 3
    OFFSET_COMMIT = 8
    OFFSET_FETCH = 9
    FIND_COORDINATOR = 10
    JOIN_GROUP = 11
    HEARTBEAT = 12
    LEAVE_GROUP = 13
    SYNC_GROUP = 14
    DESCRIBE_GROUPS = 15
    LIST_GROUPS = 16
    SASL_HANDSHAKE = 17
    API_VERSIONS = 18
    CREATE_TOPICS = 19
    DELETE_TOPICS = 20
    INIT_PRODUCER_ID = 22
    ADD_PARTITIONS_TO_TXN = 24
    ADD_OFFSETS_TO_TXN = 25
    END_TXN = 26
    TXN_OFFSET_COMMIT = 28
    DESCRIBE_CONFIGS = 32
    SASL_AUTHENTICATE = 36
    CREATE_PARTITIONS = 37
    DELETE_GROUPS = 42


@dataclass(frozen=True, slots=True)
class VersionRange:
    min_version: int
    max_version: int

    def __contains__(self, version: object) -> bool:
        return isinstance(version, int) and self.min_version <= version <= self.max_version


SUPPORTED: dict[ApiKey, VersionRange] = {
    ApiKey.PRODUCE: VersionRange(3, 10),  # 3: record batch v2 (magic 2) only
    ApiKey.FETCH: VersionRange(4, 12),  # 4: isolation level, aborted transactions
    ApiKey.LIST_OFFSETS: VersionRange(1, 7),
    ApiKey.METADATA: VersionRange(0, 13),
    ApiKey.OFFSET_COMMIT: VersionRange(2, 9),
    ApiKey.OFFSET_FETCH: VersionRange(1, 9),
    ApiKey.FIND_COORDINATOR: VersionRange(0, 4),
    ApiKey.JOIN_GROUP: VersionRange(0, 9),
    ApiKey.HEARTBEAT: VersionRange(0, 4),
    ApiKey.LEAVE_GROUP: VersionRange(0, 5),
    ApiKey.SYNC_GROUP: VersionRange(0, 5),
    ApiKey.DESCRIBE_GROUPS: VersionRange(0, 5),
    ApiKey.LIST_GROUPS: VersionRange(0, 4),
    # v0 sends the SASL tokens unframed after the handshake; every supported client
    # uses v1, whose tokens travel in SaslAuthenticate requests.
    ApiKey.SASL_HANDSHAKE: VersionRange(0, 1),
    # 4 is 3 again (KAFKA-17011 only lets a feature's min version be 0); Kafka's Java
    # client 3.9+ asks for it first.
    ApiKey.API_VERSIONS: VersionRange(0, 4),
    ApiKey.CREATE_TOPICS: VersionRange(2, 7),
    ApiKey.DELETE_TOPICS: VersionRange(1, 5),
    ApiKey.INIT_PRODUCER_ID: VersionRange(0, 4),
    ApiKey.ADD_PARTITIONS_TO_TXN: VersionRange(0, 3),
    ApiKey.ADD_OFFSETS_TO_TXN: VersionRange(0, 3),
    ApiKey.END_TXN: VersionRange(0, 3),
    ApiKey.TXN_OFFSET_COMMIT: VersionRange(0, 3),
    ApiKey.DESCRIBE_CONFIGS: VersionRange(1, 4),
    ApiKey.SASL_AUTHENTICATE: VersionRange(0, 2),
    ApiKey.CREATE_PARTITIONS: VersionRange(0, 3),
    ApiKey.DELETE_GROUPS: VersionRange(0, 2),
}
"""Every implemented API and its versions: exactly what ApiVersions announces."""


_BY_KEY: dict[int, VersionRange] = {int(key): versions for key, versions in SUPPORTED.items()}


def is_supported(api_key: int, version: int) -> bool:
    versions = _BY_KEY.get(api_key)
    return versions is not None and version in versions


@cache
def request_type(api_key: int, version: int) -> type[RequestPayload]:
    """kio's request class of a supported API version."""
    return load_request_schema(api_key, version)


@cache
def response_type(api_key: int, version: int) -> type[ResponsePayload]:
    """kio's response class of a supported API version."""
    return load_response_schema(api_key, version)


_API_KEYS = tuple(
    ApiVersion(api_key=i16(key), min_version=i16(r.min_version), max_version=i16(r.max_version))
    for key, r in sorted(SUPPORTED.items())
)


def api_versions_response(version: int) -> ResponsePayload:
    """The ApiVersions answer for a request of ``version``.

    A version above the supported ones gets the v0 answer with UNSUPPORTED_VERSION and
    the table (Kafka's rule: the client then retries with a version from it). Nothing
    is ever put in the v3/v4 answer's tagged fields (features, finalized features, their
    epoch): librdkafka before 2.2.0 (kcat 1.7.1 in Debian bundles 2.0.2) skips one byte
    too few of every tagged field it does not know, which misreads the next field or
    runs off the end ("Read underflow"). An answer with only empty tag sections reads
    the same in every librdkafka. See docs/kafka.md.
    """
    if version not in SUPPORTED[ApiKey.API_VERSIONS]:
        return ApiVersionsResponseV0(
            error_code=ErrorCode.unsupported_version,
            api_keys=tuple(
                ApiVersionV0(
                    api_key=entry.api_key,
                    min_version=entry.min_version,
                    max_version=entry.max_version,
                )
                for entry in _API_KEYS
            ),
        )
    response_class = response_type(ApiKey.API_VERSIONS, version)
    fields: dict[str, object] = {
        "error_code": ErrorCode.none,
        "api_keys": tuple(_as_version(entry, version) for entry in _API_KEYS),
    }
    if version >= 1:
        fields["throttle_time"] = timedelta(0)
    return response_class(**fields)


def _as_version(entry: ApiVersion, version: int) -> object:
    # Each version's module has its own ApiVersion struct class (same fields).
    module = importlib.import_module(f"kio.schema.api_versions.v{version}.response")
    entry_class = module.ApiVersion
    return entry_class(
        api_key=entry.api_key, min_version=entry.min_version, max_version=entry.max_version
    )


__all__ = [
    "SUPPORTED",
    "ApiKey",
    "ApiVersionsResponse",
    "VersionRange",
    "api_versions_response",
    "is_supported",
    "request_type",
    "response_type",
]
