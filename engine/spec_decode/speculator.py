"""Speculator: speculative decoding as the engine's step sees it. Before a step it has the proposer (prompt lookup or
a draft model) draft tokens for the decoding sequences, and the draft budget (draft_budget.py) keep those that pay;
after the model has run, it records how many of each sequence's drafts the target accepted, for the proposer's gate
(acceptance.py), the budget and the step's SpecDecodingStats, and lets the proposer forget finished sequences."""

from __future__ import annotations

from tokenweir.engine.config import EngineConfig
from tokenweir.engine.sched.scheduler import SchedulerOutput
from tokenweir.engine.sched.sequence import Sequence
from tokenweir.engine.sched.stats import SpecDecodingStats
from tokenweir.engine.spec_decode.draft_budget import DraftBudget
from tokenweir.engine.spec_decode.draft_model_proposer import DraftModelProposer
from tokenweir.engine.spec_decode.ngram_proposer import NgramProposer


class Speculator:
    def __init__(self, config: EngineConfig, vocab_size: int, max_model_len: int, stop_token_ids: set[int]) -> None:
        speculative = config.speculative
        assert speculative is not None
        self.max_model_len = max_model_len
        self.proposer: NgramProposer | DraftModelProposer
        if speculative.method == "draft_model":
            self.proposer = DraftModelProposer(speculative, config, vocab_size, stop_token_ids)
        else:
            self.proposer = NgramProposer(speculative)
        self.draft_budget = DraftBudget() if speculative.cost_aware else None

    def propose(self, running: list[Sequence]) -> None:
        """Drafts for the decoding sequences that may speculate (none above the batch-size switch)."""
        limit = self.proposer.config.disable_by_batch_size
        requests: list[tuple[Sequence, int]] = []
        decoding = 0
        # above the switch no sequence asks, but the budget still hears of the empty step (it scores only this one's)
        for seq in running if limit is None or len(running) <= limit else []:
            # one token to compute, not of the prompt (a prompt's last token is a prefill row, never a verify row)
            if seq.num_tokens - seq.num_computed_tokens != 1 or seq.is_prefilling:
                continue
            decoding += 1
            if not _may_speculate(seq):
                continue
            params = seq.params
            assert params.max_tokens is not None
            # never a draft past max_tokens or the context: the tokens a step emits are its drafts and one more
            room = min(params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            requests.append((seq, room))
        proposed = self.proposer.propose_batch(requests)
        proposals = [(seq, drafts) for (seq, _), drafts in zip(requests, proposed, strict=True)]
        kept = [drafts for _, drafts in proposals]
        if self.draft_budget is not None:
            kept = self.draft_budget.trim(proposals, decoding)
        for (seq, _), drafts in zip(proposals, kept, strict=True):
            seq.draft_token_ids = drafts

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A decode step's rows and time, which price a verification row for the draft budget."""
        if self.draft_budget is not None:
            self.draft_budget.observe_step(num_tokens, seconds)

    def record(self, batch: SchedulerOutput, sampled: dict[str, list[int]]) -> SpecDecodingStats:
        """This step's drafts and how many of each sequence's were accepted (before update clears them)."""
        stats = SpecDecodingStats(self.proposer.config.num_speculative_tokens)
        for seq, _ in batch.scheduled():
            emitted = sampled.get(seq.request_id)
            if emitted is None:
                continue
            if self.draft_budget is not None:  # also scores a draft it held back
                self.draft_budget.record(seq, emitted)
            drafts = seq.draft_token_ids
            if drafts:
                accepted = len(emitted) - 1
                stats.observe(len(drafts), accepted)
                seq.num_draft_tokens += len(drafts)
                seq.num_accepted_tokens += accepted
                self.proposer.record(seq, len(drafts), accepted)
        return stats

    def finished(self, stepped: list[Sequence]) -> None:
        """Hand the proposer the sequences this step finished (the n-gram cache learns their outputs, a draft model
        frees their shadows)."""
        for seq in stepped:
            if seq.is_finished:
                self.proposer.finished(seq)


def _may_speculate(seq: Sequence) -> bool:
    """Drafts are checked against the sequence's own sampling (a grammar's masks walk them); prompt logprobs are
    scored by prefill rows, not verification rows; a request may opt out."""
    params = seq.params
    return params.prompt_logprobs is None and params.speculative
