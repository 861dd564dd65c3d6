"""The draft budget (engine/spec/draft_budget.py) against its definition, on step timings given to it: the step cost
it fits, the drafts it keeps where rows are free, cheap or dear, and a held-back sequence trying again."""

import pytest

from tokenweir.engine.sched.sampling_params import SamplingParams
from tokenweir.engine.sched.sequence import Sequence
from tokenweir.engine.spec.draft_budget import DraftBudget


def seq(name: str) -> Sequence:
    return Sequence(name, [1, 2, 3], SamplingParams(max_tokens=64))


def timed(fixed: float, per_row: float, rows=(1, 2, 3, 5, 1, 4, 2, 1)) -> DraftBudget:
    budget = DraftBudget()
    for n in rows * 4:
        budget.observe_step(n, fixed + per_row * n)
    return budget


def best_count(alpha: float, k: int, fixed: float, per_row: float) -> int:
    """The number of drafts that maximizes one sequence's tokens per second, by trying each."""
    rate = [sum(alpha**j for j in range(d + 1)) / (fixed + per_row * (1 + d)) for d in range(k + 1)]
    return max(range(k + 1), key=lambda d: (rate[d], -d))


def test_it_fits_the_step_cost_line_from_the_steps_it_saw():
    fixed, per_row = timed(0.004, 0.0055).step_cost()
    assert fixed == pytest.approx(0.004) and per_row == pytest.approx(0.0055)


def test_before_any_step_or_where_rows_are_free_every_draft_is_checked():
    a, b = seq("a"), seq("b")
    drafts = [(a, [5, 6, 7, 8]), (b, [9])]
    assert DraftBudget().trim(drafts, decoding=2) == [[5, 6, 7, 8], [9]]
    assert timed(0.01, 0.0).trim(drafts, decoding=2) == [[5, 6, 7, 8], [9]]


@pytest.mark.parametrize("accepted_runs", [[0, 0, 0, 1, 0], [1, 2, 1, 0, 2], [4, 4, 3, 4, 4], [4, 4, 4, 4, 4, 4, 4]])
@pytest.mark.parametrize("share", [0.1, 0.55])
def test_one_sequence_keeps_the_count_that_maximizes_its_tokens_per_second(accepted_runs, share):
    fixed, per_row = 0.01 * (1 - share), 0.01 * share
    budget, s = timed(fixed, per_row), seq("s")
    for accepted in accepted_runs:
        budget.record(s, 4, accepted)
    kept = budget.trim([(s, [5, 6, 7, 8])], decoding=1)[0]
    assert len(kept) == best_count(budget.alpha(s), 4, fixed, per_row)
    assert kept == [5, 6, 7, 8][: len(kept)]


def test_dear_rows_keep_a_copying_sequence_drafting_and_stop_an_open_one():
    budget = timed(0.0045, 0.0055)  # this CPU: an extra row is ~0.55 of a one-row step
    copying, chatting = seq("copying"), seq("chatting")
    for _ in range(6):
        budget.record(copying, 4, 4)
        budget.record(chatting, 4, 0)
    kept = budget.trim([(copying, [1, 2, 3, 4]), (chatting, [5, 6, 7, 8])], decoding=2)
    assert len(kept[0]) >= 2 and kept[1] == []


def test_a_held_back_sequence_tries_again_once_its_record_fades():
    budget = timed(0.0045, 0.0055)
    s = seq("s")
    for _ in range(6):
        budget.record(s, 4, 0)
    held = 0
    while not budget.trim([(s, [1, 2])], decoding=1)[0]:
        held += 1
        assert held < 200, "never tried again"
    assert held >= 5  # not at once: a refused sequence waits
