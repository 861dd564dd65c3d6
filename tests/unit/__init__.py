"""Unit tests: one module or a few in memory, no server, no other process."""
