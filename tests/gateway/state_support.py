"""Shared by the state-backend tests: the real Redis's URL and a settable clock at a fixed date (the fresh key
prefix fixture, `redis_prefix`, is in conftest.py)."""

from datetime import UTC, datetime

URL = "redis://127.0.0.1:6379/0"
NOW = datetime(2026, 5, 10, 12, 0, tzinfo=UTC).timestamp()


class Clock:
    def __init__(self, t: float = NOW) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
