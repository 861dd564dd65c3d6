"""`Rejected`: how an admission decision says no, shared by the state backends and the dispatch queue."""

from __future__ import annotations

from tokenweir.policies.retry import retry_after

# Why a request was shed -> the HTTP status the gateway answers with. Over-quota is the client's to fix (429); a
# full queue also asks the client to back off and retry (429, as OpenAI answers when it is overloaded), and so does
# a waiter displaced from a full queue by a higher-priority request; a queue deadline is the gateway being too slow
# (503); a request over its length caps is bad input (400).
REASON_STATUS = {
    "rate_limited": 429,
    "budget_exhausted": 429,
    "concurrency": 429,
    "queue_full": 429,
    "displaced": 429,
    "queue_timeout": 503,
    "too_long": 400,
}


class Rejected(Exception):
    """A request refused by policy. `reason` is the JSONL event's reason and the OpenAI error code."""

    def __init__(
        self,
        reason: str,
        message: str,
        retry_after_s: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        assert reason in REASON_STATUS, f"unknown rejection reason {reason!r}"
        assert retry_after_s is None or (isinstance(retry_after_s, int) and retry_after_s >= 1)
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after_s = retry_after_s
        self.headers = dict(headers or {})
        if retry_after_s is not None:
            self.headers.setdefault("retry-after", str(retry_after_s))

    @property
    def status(self) -> int:
        return REASON_STATUS[self.reason]

    @property
    def code(self) -> str:
        return self.reason

    def __repr__(self) -> str:
        return f"Rejected({self.reason!r}, {self.message!r}, retry_after_s={self.retry_after_s})"


def rate_rejection(
    unit: str, limit: int, remaining: int, needed: int, wait_s: float | None, headers: dict[str, str]
) -> Rejected:
    """rpm (unit 'requests') or tpm (unit 'tokens') said no; wait_s None: these tokens can never fit."""
    wait = retry_after(wait_s, 60.0)
    if unit == "requests":
        msg = f"Rate limit reached: {limit} requests per minute. Retry after {wait}s."
    elif wait_s is None:
        msg = (
            f"Request too large: it needs {needed} {unit} (prompt + max_tokens) but the team's limit is "
            f"{limit} {unit} per minute. Lower max_tokens or shorten the prompt."
        )
    else:
        msg = (
            f"Rate limit reached: {limit} tokens/min ({remaining} left); "
            f"this request needs {needed} (prompt + max_tokens). Retry after {wait}s."
        )
    return Rejected("rate_limited", msg, wait, headers)


def budget_rejection(
    period: str, limit: int, remaining: int, needed: int, reset_in_s: float, headers: dict[str, str]
) -> Rejected:
    """A daily ('day') or monthly ('month') token budget said no."""
    wait = retry_after(reset_in_s)
    adj = {"day": "daily", "month": "monthly"}[period]
    if needed > limit:
        msg = (
            f"Request too large for the team's {adj} token budget: it needs {needed} tokens "
            f"(prompt + max_tokens), the whole budget is {limit}. Lower max_tokens."
        )
    else:
        msg = (
            f"Token budget exhausted: the team's {adj} budget is {limit} tokens, {remaining} left, "
            f"this request needs {needed} (prompt + max_tokens). "
            f"It resets at the start of the next UTC {period}, in {wait}s."
        )
    return Rejected("budget_exhausted", msg, wait, headers)
