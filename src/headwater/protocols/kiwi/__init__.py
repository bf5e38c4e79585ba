"""Kiwi: the JSON-over-WebSocket subscription protocol (spec/PROTOCOLS.md §3,
docs/protocols/kiwi.md). Pure: messages, results and the per-connection state machine."""
