"""How many of its drafts each sequence checks this step: only those whose expected tokens pay for their rows.

A verification row is not free on every device: on a 2-core CPU each extra row of a decode step cost about half of a
one-row step (the integer GEMMs and the attention are compute-bound per row there), while on a GPU a few extra rows
cost next to nothing. So the budget measures it: decode steps' seconds are fitted as a line in their rows,
t(rows) = fixed + per_row * rows, through each row count's recent mean (per count, so the few multi-row steps of a
mostly plain workload are not outvoted by its many one-row steps). A draft at position j of a sequence whose drafts
are accepted with probability `alpha` each (given the previous one was) yields alpha ** j expected tokens; drafts are
kept, best first, while a draft's expected tokens per second of its row beat the step's tokens per second so far.
A workload whose drafts are rarely right (open chat) so decodes as without the lever, one whose drafts are right
(copying) checks as many as pay.

`alpha` is estimated per sequence from its recent trials (accepted drafts / (accepted + first refusals)), starting
from the engine's pooled estimate over recent sequences. A draft held back is scored too, for free: where the step
reaches its position (every checked draft accepted), the token the step emits there is what the draft had to be, and
the chance that they are equal is the chance that a check would have accepted it (p(draft), greedy or sampled). So a
sequence that stopped drafting in a stretch of new text takes its drafts back once its output copies again (measured
on a 2-core Intel Xeon: a fading record instead kept a code-editing answer from drafting for its whole copied
function). Only the target's rows are counted: a draft model's own forwards are spent before the budget is asked.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from tokenweir.engine.sched.sequence import Sequence


@dataclass
class _Acceptance:
    accepted: float = 0.0  # decayed counts of this sequence's recent trials
    trials: float = 0.0


class DraftBudget:
    PRIOR_ROW_SHARE = 0.25  # before two row counts are measured, an extra row costs this share of a one-row step
    BUCKET_MEMORY = 20  # a row count's mean step time follows its last ~20 steps (a rare count keeps its own)
    SEQ_DECAY = 0.8  # weight of a sequence's trial per later one
    PRIOR_TRIALS = 2.0  # the pooled estimate's weight in a sequence's
    POOLED_START = 0.6
    POOLED_RATE = 0.05  # the pooled estimate's step towards each step's outcome

    def __init__(self) -> None:
        self._buckets: dict[int, list[float]] = {}  # rows -> [steps counted (capped), their mean seconds]
        self.pooled = self.POOLED_START
        self._sequences: weakref.WeakKeyDictionary[Sequence, _Acceptance] = weakref.WeakKeyDictionary()
        # this step's proposals: sequence -> (drafts kept, the first draft held back or None)
        self._proposed: dict[Sequence, tuple[list[int], int | None]] = {}

    # --- what it learns ---------------------------------------------------------------------------------------------

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode step (decode and verification rows only: prefill rows cost otherwise) took `seconds`."""
        bucket = self._buckets.setdefault(rows, [0.0, 0.0])
        bucket[0] = min(bucket[0] + 1, self.BUCKET_MEMORY)
        bucket[1] += (seconds - bucket[1]) / bucket[0]

    def record(self, seq: Sequence, emitted: list[int]) -> None:
        """The step `seq` was proposed for emitted `emitted` for it: its checked drafts the model agreed with, then
        the model's own token. Scores the checked drafts, and the first held-back one where the step reached it."""
        proposed = self._proposed.pop(seq, None)
        if proposed is None or not emitted:
            return
        kept, held = proposed
        accepted = len(emitted) - 1
        assert emitted[:accepted] == kept[:accepted]
        trials = accepted + (1 if accepted < len(kept) else 0)
        if accepted == len(kept) and held is not None:
            trials += 1
            accepted += emitted[-1] == held
        if trials == 0:
            return
        record = self._sequences.setdefault(seq, _Acceptance())
        record.accepted = record.accepted * self.SEQ_DECAY + accepted
        record.trials = record.trials * self.SEQ_DECAY + trials
        self.pooled += self.POOLED_RATE * (accepted / trials - self.pooled)

    def alpha(self, seq: Sequence) -> float:
        record = self._sequences.get(seq) or _Acceptance()
        return (record.accepted + self.PRIOR_TRIALS * self.pooled) / (record.trials + self.PRIOR_TRIALS)

    def step_cost(self) -> tuple[float, float] | None:
        """(fixed, per_row) seconds of a decode step, or None before any step was measured: a line fitted by least
        squares through each row count's recent mean, weighted by how many steps it holds."""
        if not self._buckets:
            return None
        w = sum(weight for weight, _ in self._buckets.values())
        mean_n = sum(weight * rows for rows, (weight, _) in self._buckets.items()) / w
        mean_t = sum(weight * mean for weight, mean in self._buckets.values()) / w
        if len(self._buckets) > 1:
            items = self._buckets.items()
            covariance = sum(weight * (rows - mean_n) * (mean - mean_t) for rows, (weight, mean) in items)
            variance = sum(weight * (rows - mean_n) ** 2 for rows, (weight, _) in items)
            per_row = max(covariance / variance, 0.0)
            return mean_t - per_row * mean_n, per_row
        # every measured step had the same rows: the prior share of a one-row step per extra row
        one_row = mean_t / (1 + self.PRIOR_ROW_SHARE * (mean_n - 1))
        return one_row * (1 - self.PRIOR_ROW_SHARE), one_row * self.PRIOR_ROW_SHARE

    # --- the decision -----------------------------------------------------------------------------------------------

    def trim(self, proposals: list[tuple[Sequence, list[int]]], decoding: int) -> list[list[int]]:
        """Each proposal's drafts cut to those that pay, in a step of `decoding` one-token rows before drafts."""
        cost = self.step_cost()
        if cost is None or cost[1] == 0:  # nothing measured yet, or rows are free here: check them all
            everything = [drafts for _, drafts in proposals]
            self._remember(proposals, everything)
            return everything
        fixed, per_row = cost
        candidates = []
        for i, (seq, drafts) in enumerate(proposals):
            alpha = self.alpha(seq)
            candidates += [(alpha**j, j, i) for j in range(1, len(drafts) + 1)]
        candidates.sort(key=lambda c: (-c[0], c[1]))
        kept = [0] * len(proposals)
        tokens, seconds = float(decoding), fixed + per_row * decoding
        for gain, position, i in candidates:
            if gain * seconds <= tokens * per_row:  # this row's tokens per second would lower the step's
                break
            assert position == kept[i] + 1  # alpha < 1: a sequence's gains fall with position, so they come in order
            kept[i] = position
            tokens, seconds = tokens + gain, seconds + per_row
        trimmed = [drafts[:count] for (_, drafts), count in zip(proposals, kept, strict=True)]
        self._remember(proposals, trimmed)
        return trimmed

    def _remember(self, proposals: list[tuple[Sequence, list[int]]], kept: list[list[int]]) -> None:
        self._proposed = {
            seq: (checked, drafts[len(checked)] if len(checked) < len(drafts) else None)
            for (seq, drafts), checked in zip(proposals, kept, strict=True)
            if drafts
        }
