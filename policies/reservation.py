"""A reservation: what one admitted request holds against its team's counters until it settles."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

_ids = itertools.count(1)


@dataclass(eq=False)
class Reservation:
    team_id: str
    tokens: int  # prompt_tokens + max_tokens, held on tpm and the day / month budgets
    taken_at: float  # wall-clock seconds; identifies the rate-window slot and the budget periods
    day_key: str
    month_key: str
    id: int = field(default_factory=lambda: next(_ids))
    headers: dict[str, str] = field(default_factory=dict)  # x-ratelimit-* as of admission, for the response
    settled: bool = False
    actual_tokens: int | None = None  # prompt + completion once settled
    overshoot: int = 0  # actual beyond `tokens`, charged in full
    backend_id: str | None = None  # the hold's name in a shared backend (unique across replicas)
    key_id: str | None = None  # the API key whose own counters this hold also took from (None: the team's only)
    cost: int = 0  # micro-USD held on the spend budgets, rounded up (policies.pricing)
    actual_cost: int | None = None  # femto-USD, exact, once settled

    def mark_settled(self, actual_tokens: int, actual_cost: int, overshoot: int) -> Reservation:
        """Record what the request really used (its team's overshoot beyond the hold included): every backend's
        settle ends here, and a settled reservation is never settled again."""
        self.settled = True
        self.actual_tokens, self.actual_cost, self.overshoot = actual_tokens, actual_cost, overshoot
        return self
