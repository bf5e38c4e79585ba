"""The PostgreSQL wire front end (docs/protocols/postgres.md)."""
