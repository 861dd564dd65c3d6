"""Iteration-level scheduler: before a step, which sequences run and how many of their tokens (`schedule`); after
it, what they produced (`update`).

`schedule`, under `max_num_batched_tokens` and `max_num_seqs`: running sequences first, in priority order (decodes
and unfinished prefill chunks), then waiting ones by (priority, arrival) or, with `shortest_prompt_first`, by
(priority, when their prompt would be done had it started on arrival), their prompts cut into chunks that fit the
remaining token budget, so a long prompt never stalls the streams already running. When blocks run out, the
lowest-priority, latest-arriving running sequence is preempted (its blocks freed; it is recomputed later, mostly from
the prefix cache).

Token fairness (engine/sched/fairness.py, VTC): while sequences of two fairness ids or more are queued, within a
priority the waiting sequence of the least-served id starts first, and the preemption victim at the lowest priority
is the latest sequence of the most-served id; `update` charges each id for the tokens computed and sampled. Without
fairness ids (or with one), the order above is unchanged.

`update` is the post-step bookkeeping (nano-vllm's `postprocess`, vLLM's `update_from_output`): advance each
sequence's computed tokens, append its sampled token, and finish and free it on EOS, a stop token id, max_tokens or
the context limit. Stop strings are not checked here: they need detokenized text (see OutputProcessor.process).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tokenweir.engine.sched.block_manager import BlockManager
from tokenweir.engine.sched.fairness import VirtualTokenCounter
from tokenweir.engine.sched.sequence import Sequence, SequenceStatus, TokenLogprob
from tokenweir.engine.sched.stats import SchedulerStats


@dataclass
class SchedulerOutput:
    decodes: list[Sequence] = field(default_factory=list)  # one new token each
    verifies: list[Sequence] = field(default_factory=list)  # decodes checking drafts: 1 + len(drafts) tokens each
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, chunk length)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.verifies and not self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled())

    def scheduled(self) -> Iterator[tuple[Sequence, int]]:
        """(sequence, tokens computed this step), in the order the model runner lays out the batch."""
        for seq in self.decodes:
            yield seq, 1
        for seq in self.verifies:
            yield seq, 1 + len(seq.draft_token_ids)
        yield from self.prefills


class Scheduler:
    INITIAL_TOKENS_PER_S = 1000.0  # a CPU's prefill pace, until steps have been timed
    PACE_WEIGHT = 0.2  # of the newest step in the learned pace

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: set[int],
        chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        shortest_prompt_first: bool = False,
    ) -> None:
        self.block_manager = block_manager
        # which waiting sequence starts next within a priority: the earliest arrival, or (shortest_prompt_first)
        # the least `admission_key`, which needs the engine's pace: tokens a step computes per second, learned
        self.shortest_prompt_first = shortest_prompt_first
        self.tokens_per_s = self.INITIAL_TOKENS_PER_S
        self.chunked_prefill = chunked_prefill
        # a prompt's chunk is at most this many tokens a step (0: the whole budget), so a long prompt leaves room for
        # the short ones behind it instead of holding every step's budget until it is done (vLLM's knob)
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids  # end the sequence unless its params say ignore_eos
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.fairness = VirtualTokenCounter()  # service per fairness id (LLMEngine sets its output weight)
        # disaggregated prefill: a producer pins its finished prefill hops' blocks (`pin` keeps them, set by the
        # engine); a consumer's decode hops wait in `fetching` while their prompt's KV arrives (`new_fetches`: those
        # this schedule set blocks aside for)
        self.pin: Callable[[Sequence], object] | None = None
        self.fetching: list[Sequence] = []
        self.new_fetches: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.fairness.join_seq(seq)
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)

    def admission_key(self, seq: Sequence) -> tuple[int, float]:
        """Shortest-prompt order: priority, then when the sequence's prompt (what is left of it) would be computed
        had it started on arrival. A burst's prompts go shortest first; a long prompt is passed over only by
        prompts that arrived within the time its own computation takes, so it waits a bounded time, never starves."""
        left = seq.num_tokens - seq.num_computed_tokens
        return seq.priority, seq.arrival_time + left / self.tokens_per_s

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step with prefill chunks computed `num_tokens` in `seconds`: the pace admission_key counts in."""
        if seconds > 0 and num_tokens > 0:
            self.tokens_per_s += self.PACE_WEIGHT * (num_tokens / seconds - self.tokens_per_s)

    def _next_waiting(self) -> Sequence | None:
        """By priority; then the least-served fairness id's first; then by arrival or `admission_key`."""
        ready = (s for s in self.waiting if not s.is_held)  # in (priority, arrival) order, as the waiting list
        return self.fairness.next_waiting(ready, self.admission_key if self.shortest_prompt_first else None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.fetching)

    def make_stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.fetching),
            kv_cache_usage=bm.usage,
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            num_cached_free_blocks=bm.num_cached_free_blocks,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            fair_shares=self.fairness.shares(),
        )

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence for good and free its blocks at once, except where they are still needed: a prefill hop
        that computed its prompt keeps them pinned for a decode engine, and a sequence whose KV is being fetched
        frees them once the fetch has stopped writing into them (`fetched`)."""
        fetching = seq.status == SequenceStatus.WAITING_FOR_REMOTE_KVS
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if fetching:
            pass  # `fetched` frees them, once the fetch has stopped writing into them
        elif self.pin is not None and seq.remote_decode and reason in ("stop", "length"):
            self.pin(seq)
        else:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.fairness.leave_seq(seq)

    def fetched(self, seq: Sequence, ok: bool) -> None:
        """A fetch of `seq`'s prompt KV ended. With its blocks filled, it runs from the prompt's last token (computed
        here, for the first token's logits); a failed fetch gives the blocks back and the prompt is computed here
        from the start, keeping its place in the queue. A sequence that finished meanwhile (aborted) frees them."""
        self.fetching.remove(seq)
        seq.num_remote_tokens = None
        if seq.is_finished:
            self.block_manager.free(seq)
        elif ok:
            seq.num_computed_tokens = seq.num_prompt_tokens - 1
            seq.status = SequenceStatus.RUNNING
            self.block_manager.record_prefix_query(seq.num_tokens, seq.num_cached_tokens)
            self.running.append(seq)
        else:
            self.block_manager.free(seq)
            seq.num_computed_tokens = seq.num_cached_tokens = 0
            self.add(seq)  # its first scheduling is still to come: that one counts its prefix-cache query

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # Both loops below use these names; the second takes them from lookups that can come back empty.
        seq: Sequence | None
        victim: Sequence | None
        scheduled: list[tuple[Sequence, int]] = []
        queue = sorted(self.running, key=Sequence.sort_key)
        kept: list[Sequence] = []
        while queue:
            seq = queue.pop(0)
            if budget == 0:
                seq.draft_token_ids = []
                kept.append(seq)
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, self._chunk_limit(seq, budget))
            # a decode's drafts, as many as the budget leaves room for, and only while blocks are to be had
            drafts = seq.draft_token_ids[: budget - 1] if seq.num_tokens - seq.num_computed_tokens == 1 else []
            while not self.block_manager.allocate_slots(seq, num_new, num_lookahead_tokens=len(drafts)):
                if drafts:
                    drafts = []
                    continue
                victim = self.fairness.pop_victim(queue, seq)
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                seq.draft_token_ids = drafts
                scheduled.append((seq, num_new + len(drafts)))
                kept.append(seq)
                budget -= num_new + len(drafts)
        self.running = kept
        out_of_memory = bool(out.preempted)

        # New work only when running sequences fit: admitting while evicting them would thrash.
        while (
            self.waiting
            and budget > 0
            and not out_of_memory
            and len(self.running) + len(self.fetching) < self.max_num_seqs
        ):
            seq = self._next_waiting()
            if seq is None:
                break
            if seq.num_remote_tokens is not None:
                if not self._start_fetch(seq):
                    break
                continue
            # Prompt logprobs need logits at every prompt position: such a request computes its whole prompt.
            cached = [] if seq.params.prompt_logprobs is not None else self.block_manager.find_cached_prefix(seq)
            num_cached = len(cached) * self.block_manager.block_size
            num_new = min(seq.num_tokens - num_cached, self._chunk_limit(seq, budget))
            if not self.chunked_prefill and num_new < seq.num_tokens - num_cached:
                break  # its whole prompt waits for a step with room for all of it
            if not self.block_manager.allocate_slots(seq, num_new, cached):
                victim = self.fairness.outranked(self.running, seq)
                if victim is None:
                    break
                # A more urgent request is waiting for memory held by a less urgent one.
                budget += next((n for s, n in scheduled if s is victim), 0)
                scheduled = [(s, n) for s, n in scheduled if s is not victim]
                self.running.remove(victim)
                self._preempt(victim, out)
                continue
            self._admit(seq, num_cached, num_new)
            scheduled.append((seq, num_new))
            budget -= num_new

        for seq, n in scheduled:
            # A prompt's last token alone is still a prefill chunk: every prompt position goes through the prefill
            # kernel and every output position through the decode kernel, however the chunks fell, so a sequence's
            # numbers do not depend on what it was batched with.
            if n == 1 and not seq.is_prefilling:
                out.decodes.append(seq)
            elif seq.draft_token_ids:
                out.verifies.append(seq)
            else:
                out.prefills.append((seq, n))
        return out

    def update(
        self,
        batch: SchedulerOutput,
        sampled_token_ids: dict[str, list[int]],
        logprobs: dict[str, list[TokenLogprob]] | None = None,
    ) -> list[Sequence]:
        """After a step: advance every scheduled sequence by the tokens it computed, append the tokens sampled for it
        (none for a prefill chunk short of the prompt's end; one for a decode; for a decode that checked drafts, the
        drafts the model agreed with and one token of its own) with their logprobs if asked, and finish the ones
        that hit a stop condition (the tokens after it are dropped). Refused drafts' K/V slots are given back.
        Returns the sequences that got a token, in batch order."""
        logprobs = logprobs or {}
        now = time.monotonic()
        self.fairness.charge_computed(batch.scheduled())  # before the sequences advance past what the step computed
        stepped: list[Sequence] = []
        for seq, num_tokens in batch.scheduled():
            num_drafts = len(seq.draft_token_ids)
            seq.draft_token_ids = []
            token_ids = sampled_token_ids.get(seq.request_id)
            if token_ids is None:
                seq.num_computed_tokens += num_tokens - num_drafts
                continue
            assert 1 <= len(token_ids) <= num_drafts + 1
            # the accepted drafts' K/V is in the cache; the last token's is computed next step
            seq.num_computed_tokens += num_tokens - num_drafts + len(token_ids) - 1
            seq_logprobs = logprobs.get(seq.request_id)
            seq.num_new_tokens = 0
            for i, token_id in enumerate(token_ids):
                seq.append_token(token_id, seq_logprobs[i] if seq_logprobs else None)
                seq.num_new_tokens += 1
                if self._stopped(seq, token_id):
                    break
            if num_drafts and not seq.is_finished:
                self.block_manager.trim(seq)
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
            stepped.append(seq)
        self.fairness.charge_sampled(stepped)
        return stepped

    def _stopped(self, seq: Sequence, token_id: int) -> bool:
        """Finish `seq` if its newest token ends it."""
        params = seq.params
        assert params.max_tokens is not None  # LLMEngine.validate fills it in before a request is added
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            self.finish(seq, "stop")
            seq.stop_reason = token_id
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            self.finish(seq, "length")
        return seq.is_finished

    def _admit(self, seq: Sequence, num_cached: int, num_new: int) -> None:
        """A waiting sequence got blocks for `num_new` tokens past its `num_cached`: it runs."""
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = num_cached
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
        if seq.num_preemptions == 0:
            # Its first scheduling: the one prefix-cache query this request counts for. Lookups that found no room
            # for it, and a preempted sequence's lookup on its way back, are not new queries (as in vLLM).
            seq.num_cached_tokens = num_cached
            self.block_manager.record_prefix_query(seq.num_tokens, num_cached)
        self.fairness.reserve_seq(seq, num_new)  # the next waiting one is chosen with this chunk counted
        self.running.append(seq)

    def _chunk_limit(self, seq: Sequence, budget: int) -> int:
        """The most tokens `seq` may compute this step."""
        if seq.is_prefilling and self.chunked_prefill and self.long_prefill_token_threshold:
            return min(budget, self.long_prefill_token_threshold)
        return budget

    def _start_fetch(self, seq: Sequence) -> bool:
        """Set blocks aside for a decode hop's prompt KV (all but the last token's: that one is computed here) past
        what this engine's prefix cache already holds, and move it to `fetching`. With nothing left to fetch it turns
        into an ordinary prompt. False if out of blocks."""
        assert seq.num_remote_tokens is not None
        bm = self.block_manager
        cached = bm.find_cached_prefix(seq)
        num_remote = min(seq.num_prompt_tokens, seq.num_remote_tokens) - 1
        if bm.blocks_needed(num_remote) <= len(cached) or num_remote < seq.num_prompt_tokens - 1:
            seq.num_remote_tokens = None  # the prefix cache covers it, or the producer holds a different prompt
            return True
        if not bm.allocate_for_transfer(seq, cached, num_remote):
            return False
        self.waiting.remove(seq)
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
        seq.num_computed_tokens = seq.num_cached_tokens = len(cached) * bm.block_size
        seq.first_scheduled_time = time.monotonic()
        self.fetching.append(seq)
        self.new_fetches.append(seq)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        seq.draft_token_ids = []
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        self.add(seq)
