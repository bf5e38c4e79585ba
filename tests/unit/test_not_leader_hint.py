"""NotLeader's leader hint (docs/cluster.md, "Front ends"): what the SDKs follow."""

from __future__ import annotations

from headwater.errors import NotLeader, error_for_code

MESSAGE = (
    "node 2 leads partition 0 of events: http 10.0.0.2:8080, kafka 10.0.0.2:9092, "
    "kimberlite 10.0.0.2:7401, rivven 10.0.0.2:7404"
)


def test_the_message_names_each_listener_s_address() -> None:
    # Kimberlite's ErrorResponse carries only the message: the client reads it there.
    refused = error_for_code(15, MESSAGE)
    assert isinstance(refused, NotLeader) and refused.leader is None
    assert refused.address_of("kimberlite") == "10.0.0.2:7401"
    assert refused.address_of("rivven") == "10.0.0.2:7404"
    assert refused.address_of("http") == "10.0.0.2:8080"
    assert refused.address_of("convergedb") is None


def test_a_structured_hint_wins_over_the_message() -> None:
    refused = NotLeader(MESSAGE, {"node_id": 3, "rivven": "10.0.0.3:7404"})
    assert refused.address_of("rivven") == "10.0.0.3:7404"
    assert refused.address_of("kimberlite") is None  # not named in the hint
    assert refused.address_of("node_id") is None  # not an address


def test_no_leader_named_gives_nothing() -> None:
    refused = NotLeader("partition 0 of events has no leader right now")
    assert refused.address_of("kimberlite") is None
