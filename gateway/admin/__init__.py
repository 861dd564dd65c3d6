"""The admin REST API: teams, keys, usage."""
