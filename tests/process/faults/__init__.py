"""Faults injected into running gateway processes: billed == served, no leak, one event per request."""
