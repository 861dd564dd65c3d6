"""The draft budget (engine/spec_decode/draft_budget.py) against its definition, on step timings given to it: the step
cost it fits, the drafts it keeps where rows are free, cheap or dear, and how a held-back draft is scored against the
token the step emits, so a sequence takes its drafts back once its output copies again."""

import pytest

from tokenweir.engine.sched.sampling_params import SamplingParams
from tokenweir.engine.sched.sequence import Sequence
from tokenweir.engine.spec_decode.draft_budget import DraftBudget


def seq(name: str) -> Sequence:
    return Sequence(name, [1, 2, 3], SamplingParams(max_tokens=64))


def timed(fixed: float, per_row: float, rows=(1, 2, 3, 5, 1, 4, 2, 1)) -> DraftBudget:
    budget = DraftBudget()
    for n in rows * 4:
        budget.observe_step(n, fixed + per_row * n)
    return budget


def step(budget: DraftBudget, s: Sequence, drafts: list[int], truth: list[int], decoding: int = 1) -> list[int]:
    """One step of `s`: the budget trims its drafts, and the model emits the kept drafts that match `truth` (what it
    would emit one token at a time) and then its own next token. Returns the drafts kept."""
    kept = budget.trim([(s, drafts)], decoding)[0]
    agreed = next((j for j, (d, t) in enumerate(zip(kept, truth, strict=False)) if d != t), len(kept))
    budget.record(s, truth[: agreed + 1])
    return kept


def outcome(accepted: int, drafts=(5, 6, 7, 8)) -> list[int]:
    """What the model emits where the first `accepted` drafts are right and the next one is not."""
    return [*drafts[:accepted], 99, 98, 97, 96, 95][: len(drafts) + 1]


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
    budget, s = DraftBudget(), seq("s")
    for accepted in accepted_runs:  # before any timing every draft is checked
        assert step(budget, s, [5, 6, 7, 8], outcome(accepted)) == [5, 6, 7, 8]
    for n in (1, 2, 3, 5, 1, 4, 2, 1) * 4:
        budget.observe_step(n, fixed + per_row * n)
    kept = budget.trim([(s, [5, 6, 7, 8])], decoding=1)[0]
    assert len(kept) == best_count(budget.alpha(s), 4, fixed, per_row)
    assert kept == [5, 6, 7, 8][: len(kept)]


def test_dear_rows_keep_a_copying_sequence_drafting_and_stop_an_open_one():
    budget = DraftBudget()
    copying, chatting = seq("copying"), seq("chatting")
    for _ in range(6):
        step(budget, copying, [1, 2, 3, 4], [1, 2, 3, 4, 5])
        step(budget, chatting, [5, 6, 7, 8], [9, 9, 9, 9, 9])
    for n in (1, 2, 3, 5, 1, 4, 2, 1) * 4:
        budget.observe_step(n, 0.0045 + 0.0055 * n)  # this CPU: an extra row is ~0.55 of a one-row step
    kept = budget.trim([(copying, [1, 2, 3, 4]), (chatting, [5, 6, 7, 8])], decoding=2)
    assert len(kept[0]) >= 2 and kept[1] == []


def test_a_held_back_draft_is_scored_against_the_token_the_step_emits():
    budget, s = timed(0.0045, 0.0055), seq("s")
    for _ in range(6):
        step(budget, s, [1, 2], [7, 7, 7])
    assert budget.trim([(s, [1, 2])], decoding=1)[0] == []
    before = budget.alpha(s)
    budget.record(s, [1])  # the step emitted what the held-back draft said
    assert budget.alpha(s) > before
    budget.trim([(s, [1, 2])], decoding=1)
    before = budget.alpha(s)
    budget.record(s, [3])  # ... and here what it did not
    assert budget.alpha(s) < before
    budget.record(s, [1])  # no proposal of this step left: nothing to score
    assert budget.alpha(s) < before


def test_a_held_back_sequence_takes_its_drafts_back_once_its_output_copies_again():
    budget, s = timed(0.0045, 0.0055), seq("s")
    for _ in range(6):  # new text: its drafts are refused, then held back
        step(budget, s, [1, 2, 3, 4], [9, 9, 9, 9, 9])
    for _ in range(50):  # still new text: held back all along, scored wrong each step
        assert step(budget, s, [1, 2, 3, 4], [9, 9, 9, 9, 9]) == []
    copying = 0
    while not step(budget, s, [1, 2, 3, 4], [1, 2, 3, 4, 5]):  # the output copies: the held draft is right
        copying += 1
        assert copying < 10, "never took its drafts back"
    assert copying >= 1  # not at once: one right guess does not outweigh a refused record
