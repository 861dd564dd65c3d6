"""Retry-After values and Rejected: whole seconds >= 1, statuses per reason, headers."""

import math

import pytest

from tokenweir.policies.decisions import REASON_STATUS, Rejected
from tokenweir.policies.retry import MAX_RETRY_AFTER_S, queue_retry_after, reset_header, retry_after


@pytest.mark.parametrize(
    ("wait", "expected"),
    [(0.0, 1), (0.001, 1), (1.0, 1), (1.01, 2), (59.5, 60), (None, 1), (math.inf, 1), (-3, 1), (math.nan, 1)],
)
def test_retry_after_is_whole_seconds_at_least_one(wait, expected):
    assert retry_after(wait) == expected


def test_retry_after_fallback_and_ceiling():
    assert retry_after(None, fallback_s=60) == 60
    assert retry_after(10**12) == MAX_RETRY_AFTER_S


def test_queue_retry_after_scales_with_queue_and_hold():
    assert queue_retry_after(0, 4, 0.2) == 1
    assert queue_retry_after(40, 4, 2.0) == 22  # (40 / 4 + 1) * 2
    assert queue_retry_after(5, 0, 3.0) == 3  # no capacity at all: at least one hold time
    assert isinstance(queue_retry_after(3, 2, 0.7), int)


@pytest.mark.parametrize(("wait", "text"), [(0, "0s"), (0.2, "1s"), (59, "59s"), (60, "1m0s"), (3723, "1h2m3s")])
def test_reset_header_format(wait, text):
    assert reset_header(wait) == text


def test_rejected_carries_status_code_and_retry_after_header():
    r = Rejected("rate_limited", "slow down", 7, {"x-ratelimit-limit-requests": "10"})
    assert (r.status, r.code, r.retry_after_s, str(r)) == (429, "rate_limited", 7, "slow down")
    assert r.headers == {"x-ratelimit-limit-requests": "10", "retry-after": "7"}
    assert Rejected("queue_full", "busy", 2).status == 429
    assert Rejected("too_long", "shorter").headers == {}


def test_rejected_refuses_unknown_reasons_and_bad_retry_after():
    with pytest.raises(AssertionError):
        Rejected("nope", "x")
    with pytest.raises(AssertionError):
        Rejected("rate_limited", "x", 0)
    assert set(REASON_STATUS) >= {"rate_limited", "budget_exhausted", "queue_full", "queue_timeout", "too_long"}
