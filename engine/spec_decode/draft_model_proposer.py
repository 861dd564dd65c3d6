"""vLLM's "draft_model" method: a smaller model with the target's tokenizer proposes each sequence's next k tokens,
greedily, one forward per draft position batched over the sequences that speculate.

The draft model runs on a ModelRunner and a BlockManager of its own (no prefix cache), and mirrors each target
sequence with a shadow Sequence whose K/V it keeps between steps. A shadow holds the target's tokens plus its last
drafts; at the next proposal it keeps the K/V of the tokens the target really has (the accepted drafts included),
computes the few it lacks (the target's own token after the drafts, or a whole prompt the first time) and drafts on.
Shadows of finished sequences are freed at the next proposal; a shadow that finds no free blocks is dropped, and its
sequence does without drafts until blocks are free again.

Greedy drafts are deterministic, so the target's verification (accept while its sample equals the draft) keeps the
target's distribution exactly at any temperature.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from tokenweir.engine.config import EngineConfig, SpeculativeConfig
from tokenweir.engine.sched.block_manager import BlockManager
from tokenweir.engine.sched.sampling_params import SamplingParams
from tokenweir.engine.sched.scheduler import SchedulerOutput
from tokenweir.engine.sched.sequence import Sequence
from tokenweir.engine.spec_decode.acceptance import AcceptanceGate
from tokenweir.engine.worker.model_runner import ModelRunner

log = logging.getLogger("tokenweir.engine")


class DraftModelProposer:
    def __init__(
        self, config: SpeculativeConfig, engine_config: EngineConfig, vocab_size: int, stop_token_ids: set[int]
    ) -> None:
        assert config.method == "draft_model" and config.model
        self.config = config
        self.gate = AcceptanceGate(config)
        draft_config = replace(
            engine_config,
            model=config.model,
            speculative=None,
            enable_prefix_caching=False,
            num_kv_blocks=config.draft_num_kv_blocks or engine_config.num_kv_blocks,
        )
        self.runner = ModelRunner(draft_config, config.model)
        draft = self.runner.model.config
        if draft.vocab_size != vocab_size:
            raise ValueError(
                f"the draft model {config.model} has a vocabulary of {draft.vocab_size} tokens, the target "
                f"{vocab_size}: a draft model must share the target's tokenizer"
            )
        self.max_len = draft.max_position_embeddings
        self.block_manager = BlockManager(self.runner.num_blocks, engine_config.block_size, enable_prefix_caching=False)
        self.stop_token_ids = stop_token_ids
        self.shadows: dict[Sequence, Sequence] = {}  # target -> its shadow
        self._synced: dict[Sequence, int] = {}  # shadow -> the target's length when they were last in step
        self._params = SamplingParams(temperature=0, max_tokens=1)
        log.info("draft model: %s, %d KV blocks", config.model, self.runner.num_blocks)

    def finished(self, seq: Sequence) -> None:
        """A sequence that ended gives its shadow's blocks back (an aborted one's go at the next proposal)."""
        if seq in self.shadows:
            self._drop(seq)

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        self.gate.record(seq, proposed, accepted)

    def release_finished(self) -> None:
        for target in [t for t in self.shadows if t.is_finished]:
            self._drop(target)

    def propose_batch(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Drafts for each (sequence, most drafts it may take)."""
        self.release_finished()
        drafts: list[list[int]] = [[] for _ in requests]
        wanted: dict[Sequence, tuple[list[int], int]] = {}  # shadow -> (its sequence's drafts, how many)
        first = SchedulerOutput()
        for (seq, max_drafts), proposal in zip(requests, drafts, strict=True):
            k = min(self.config.num_speculative_tokens, max_drafts, self.max_len - seq.num_tokens)
            if k <= 0 or not self.gate.is_open(seq):
                continue
            shadow = self._sync(seq)
            new = shadow.num_tokens - shadow.num_computed_tokens
            # room for the tokens to compute now and the k - 1 drafts computed to draft the next
            if not self.block_manager.allocate_slots(shadow, new, num_lookahead_tokens=k - 1):
                self._drop(seq)
                continue
            wanted[shadow] = (proposal, k)
            if new == 1:
                first.decodes.append(shadow)
            else:
                first.prefills.append((shadow, new))
        batch = first
        while not batch.is_empty:
            sampled, _, _ = self.runner.run(batch)
            following = SchedulerOutput()
            for shadow, num_tokens in batch.scheduled():
                token_id = sampled[shadow.request_id][0]
                shadow.num_computed_tokens += num_tokens
                shadow.append_token(token_id)
                proposal, k = wanted[shadow]
                proposal.append(token_id)
                if len(proposal) < k and token_id not in self.stop_token_ids:
                    following.decodes.append(shadow)
            batch = following
        return drafts

    def _sync(self, seq: Sequence) -> Sequence:
        """The target's shadow, holding the target's tokens, with the K/V of the longest prefix it still has right.
        The target only ever appends, so only the tokens after the last sync (the drafts) can differ."""
        shadow = self.shadows.get(seq)
        if shadow is None:
            shadow = self.shadows[seq] = Sequence(f"draft:{seq.request_id}", seq.token_ids, self._params)
            self._synced[shadow] = seq.num_tokens
            return shadow
        mine, theirs = shadow.token_ids, seq.token_ids
        same = min(shadow.num_computed_tokens, len(theirs))
        for j in range(self._synced[shadow], same):
            if mine[j] != theirs[j]:
                same = j
                break
        shadow.num_computed_tokens = same
        del mine[same:]
        mine.extend(theirs[same:])
        self._synced[shadow] = seq.num_tokens
        self.block_manager.trim(shadow)
        return shadow

    def _drop(self, target: Sequence) -> None:
        shadow = self.shadows.pop(target)
        del self._synced[shadow]
        self.block_manager.free(shadow)
