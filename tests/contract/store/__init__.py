"""One behaviour on both stores: SQLite and the real PostgreSQL."""
