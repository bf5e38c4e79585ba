"""The Rivven front end (protobuf format): docs/protocols/rivven.md."""
