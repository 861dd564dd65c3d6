"""The durable store: teams, keys, limits and usage rows in SQLite or PostgreSQL."""
