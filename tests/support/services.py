"""Real services (Redis, PostgreSQL) in tests: under CI=true a missing one fails, never skips."""

import os

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_service(name: str, reason: str) -> None:
    """Skip locally when a real service is down, but fail in CI where every service must be up."""
    if IN_CI:
        pytest.fail(f"{name} is required in CI: {reason}")
    pytest.skip(f"{name} unavailable: {reason}")
