"""The Kafka front end: an asyncio shell over :mod:`headwater.protocols.kafka` whose
requests are answered by the engine API (docs/kafka.md)."""
