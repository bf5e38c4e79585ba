"""The Kafka wire protocol, sans-I/O: framing, requests and responses of the implemented
APIs (kio's classes from Kafka's message definitions, read by a bounded decoder), the
ApiVersions table, the server connection, and record batch v2 (:mod:`.records`).
See docs/kafka.md."""
