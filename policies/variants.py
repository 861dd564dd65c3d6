"""Weighted variants of a public model name (A/B, canary): which variant a request gets. Sticky: the same subject (a
key, a `user`, a header's value) always lands on the same variant while the weights stand, and moving weight from one
variant to another only moves the subjects that must move (each subject's point on [0, 1) is fixed; the variants'
slices of [0, 1) grow and shrink in place)."""

from __future__ import annotations

import hashlib


def subject_point(alias: str, subject: str) -> float:
    """A subject's fixed point on [0, 1) for `alias` (another alias puts it elsewhere: splits are independent)."""
    digest = hashlib.sha256(f"{alias}\x00{subject}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def pick_variant(weights: list[float], point: float) -> int:
    """The index of the variant whose slice of [0, 1) holds `point`, slices in order and sized by weight. Weights
    are >= 0 with a positive sum; a zero weight gets no slice."""
    assert weights and all(w >= 0 for w in weights) and sum(weights) > 0
    total, edge = sum(weights), 0.0
    for index, weight in enumerate(weights):
        edge += weight / total
        if point < edge and weight > 0:
            return index
    return max(i for i, w in enumerate(weights) if w > 0)  # rounding at the top edge
