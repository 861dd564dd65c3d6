"""Iteration-level scheduler: each step picks which sequences run and how many of their tokens.

Per step, under `max_num_batched_tokens` and `max_num_seqs`: running sequences first, in priority order (decodes
and unfinished prefill chunks), then waiting ones by (priority, arrival), their prompts cut into chunks that fit the
remaining token budget, so a long prompt never stalls the streams already running. When blocks run out, the
lowest-priority, latest-arriving running sequence is preempted (its blocks freed; it is recomputed later, mostly from
the prefix cache).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    decodes: list[Sequence] = field(default_factory=list)  # one new token each
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, chunk length)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence for good and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        queue = sorted(self.running, key=Sequence.sort_key)
        kept: list[Sequence] = []
        while queue:
            seq = queue.pop(0)
            if budget == 0:
                kept.append(seq)
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = queue.pop() if queue else seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                scheduled.append((seq, num_new))
                kept.append(seq)
                budget -= num_new
        self.running = kept
        out_of_memory = bool(out.preempted)

        # New work only when running sequences fit: admitting while evicting them would thrash.
        while self.waiting and budget > 0 and not out_of_memory and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.block_manager.find_cached_prefix(seq)
            num_cached = len(cached) * self.block_manager.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if not self.block_manager.allocate_slots(seq, num_new, cached):
                victim = max(self.running, key=Sequence.sort_key, default=None)
                if victim is None or victim.sort_key() <= seq.sort_key():
                    break
                # A more urgent request is waiting for memory held by a less urgent one.
                budget += next((n for s, n in scheduled if s is victim), 0)
                scheduled = [(s, n) for s, n in scheduled if s is not victim]
                self.running.remove(victim)
                self._preempt(victim, out)
                continue
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = num_cached
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
            self.running.append(seq)
            scheduled.append((seq, num_new))
            budget -= num_new

        for seq, n in scheduled:
            if n == 1:
                out.decodes.append(seq)
            else:
                out.prefills.append((seq, n))
        return out

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        self.add(seq)
