"""Weighted variants: a 90/10 split over many subjects lands near 10%, each subject on one variant, and moving weight
moves only the subjects that must move."""

from __future__ import annotations

from tokenweir.policies.variants import pick_variant, subject_point


def split(weights: list[float], subjects: list[str]) -> list[int]:
    return [pick_variant(weights, subject_point("chat", s)) for s in subjects]


def test_a_90_10_split_gives_10_percent_within_2_points_over_2000_subjects():
    subjects = [f"key_{i:05d}" for i in range(2000)]
    picked = split([90, 10], subjects)
    assert 0.08 <= picked.count(1) / len(picked) <= 0.12
    assert picked == split([90, 10], subjects)  # sticky: the same subjects, the same variants


def test_moving_weight_moves_only_the_subjects_that_must_move():
    subjects = [f"user-{i}" for i in range(2000)]
    before, after = split([90, 10], subjects), split([80, 20], subjects)
    assert all(b == a or (b, a) == (0, 1) for b, a in zip(before, after, strict=True))  # nobody leaves the canary
    assert 0.18 <= after.count(1) / len(after) <= 0.22


def test_a_variant_at_weight_0_gets_nobody_and_aliases_split_independently():
    subjects = [f"s{i}" for i in range(500)]
    assert set(split([0, 1, 0], subjects)) == {1}
    assert set(split([1, 0], subjects)) == {0}
    other = [pick_variant([50, 50], subject_point("other", s)) for s in subjects]
    assert other != split([50, 50], subjects)
