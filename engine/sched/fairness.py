"""Token fairness between tenants: the Virtual Token Counter (VTC) of Sheng et al., "Fairness in Serving Large
Language Models" (OSDI'24), in the scheduler's terms.

Every request may carry a fairness id (the gateway's tenant, sent as the `x-gateway-inference-fairness-id` header).
Each id has a counter of the service it received, in weighted tokens: prompt tokens computed + `output_weight` x
output tokens sampled (the paper's w_p = 1 and w_q, 2 in its experiments). The scheduler asks it three things:

- which waiting sequence starts next within a priority: one of the id with the least counter (`next_waiting`; within
  an id, and between ids of equal counters, the scheduler's own order: arrival, or shortest-prompt's key);
- which running sequence to preempt when blocks run out: at the lowest priority, the latest one of the id with the
  greatest counter (`victim`);
- what a step computed, to charge (`charge_computed` for prompt chunks as they ran, `charge_sampled` for output
  tokens as they were sampled). Each prompt token and each output token is charged once: a prefix-cache hit is not
  computed, and a preempted sequence's recompute is the scheduler's choice, not its tenant's (a per-sequence
  high-water mark, `Sequence.num_charged_prompt_tokens`). Within one `schedule`, a sequence admitted is reserved
  for at once (`reserve`: the paper charges a prompt at admission) so that two tenants' queued requests alternate
  within a step instead of the least-served one taking the whole step; `charge_computed` replaces the reservation
  with what ran.

An id is backlogged while it has a sequence waiting, fetching or running (`join` when the scheduler first queues a
sequence, `leave` when it finishes). An id that becomes backlogged has its counter lifted to the least counter of the
ids backlogged then, or, with none, to the counter of the id that left last (VTC's lift): time spent idle is not
banked as credit, so a tenant back after an hour does not take the engine from the others until its counter catches
up. With that, the paper's bound: for two ids f and g backlogged over [t1, t2),

    |W_f(t1, t2) - W_g(t1, t2)| <= 2 U,   U = max(w_p * L_input + w_q * M)

W the service (weighted tokens) each received in the interval, L_input a request's prompt tokens, M the output tokens
requests can hold in the batch at once (at most the KV pool's tokens: while one id's running requests decode, the
other's may wait for blocks). This sum form is at least the paper's max(w_p * L_input, w_q * M), so it is the looser
statement; tests/unit/engine/test_fairness.py checks it through the real scheduler (chunked prefill, preemption) on
random arrivals and lengths, with L_input the longest prompt and M the pool's tokens, and that FCFS breaks it.

Requests without an id form one group of their own (`None`), with its own counter. With no ids at all there is one
group, and while fewer than two ids are backlogged `next_waiting` and `victim` give the scheduler's order without
looking at a counter: id-less traffic is scheduled exactly as without fairness. Mixed with tenants, id-less traffic
(a client reaching the engine directly, the offline LLM) is one more tenant: it neither jumps ahead of the gateway's
tenants (they would starve behind a flood of it) nor starves behind them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tokenweir.engine.sched.sequence import Sequence

DEFAULT_OUTPUT_WEIGHT = 2.0
# /metrics names at most this many ids; later ones are summed as OTHER_LABEL. A time series per tenant is kept by
# Prometheus for as long as it is retained, and every id is a new series: a bound keeps a gateway with thousands of
# tenants (or a buggy one sending a fresh id per request) from blowing up the scrape and the TSDB. The first ids seen
# keep their names for the engine's life, so each series stays one tenant's and its counter only grows.
MAX_LABELLED_IDS = 32
NO_ID_LABEL = "(none)"
OTHER_LABEL = "(other)"
# Counters of idle ids kept past those that the lift makes moot (an idle id's counter at or under the floor is lifted
# to the floor when it comes back, so forgetting it changes nothing); past this, the lowest ones are forgotten too,
# which can only give those tenants a head start of what they were ahead by.
MAX_IDLE_COUNTERS = 4096

FairnessId = str | None


@dataclass(frozen=True)
class FairShare:
    """One /metrics label's service: weighted tokens served in all (a counter) and the VTC counter now (a gauge:
    for OTHER_LABEL the greatest among its backlogged ids)."""

    label: str
    served: float
    counter: float


class VirtualTokenCounter:
    """The counters and the backlog, by fairness id. Pure bookkeeping: the scheduler calls it, it calls nothing."""

    def __init__(
        self,
        output_weight: float = DEFAULT_OUTPUT_WEIGHT,
        prompt_weight: float = 1.0,
        max_labels: int = MAX_LABELLED_IDS,
    ) -> None:
        assert output_weight >= 0 and prompt_weight >= 0
        self.output_weight = output_weight
        self.prompt_weight = prompt_weight
        self.counters: dict[FairnessId, float] = {}
        self.backlog: dict[FairnessId, int] = {}  # backlogged ids -> their sequences waiting or running
        self._members: dict[str, FairnessId] = {}  # backlogged sequences (by request id) -> their id
        self._last_left: FairnessId = None  # the id that left the backlog last: the floor when none is backlogged
        self._pending: dict[FairnessId, float] = {}  # reserved in this schedule, not yet charged
        self._max_labels = max_labels
        self._labels: dict[FairnessId, str] = {None: NO_ID_LABEL}
        self.served: dict[str, float] = {}  # by label: weighted tokens charged in all

    # --- by id ------------------------------------------------------------------------------------------------------

    @property
    def contended(self) -> bool:
        """Two ids or more backlogged: only then does the counter change the scheduler's order."""
        return len(self.backlog) > 1

    def floor(self) -> float:
        """What an id becoming backlogged is lifted to: the least counter backlogged, else the last one to leave."""
        if self.backlog:
            return min(self.counters[fid] for fid in self.backlog)
        return self.counters.get(self._last_left, 0.0)

    def join(self, member: str, fid: FairnessId) -> None:
        """Sequence `member` of `fid` is queued; idempotent (a preempted sequence is queued again, still a member)."""
        if member in self._members:
            return
        self._members[member] = fid
        if fid not in self.backlog:
            self.counters[fid] = max(self.counters.get(fid, 0.0), self.floor())
            self.backlog[fid] = 0
            self._label(fid)
        self.backlog[fid] += 1

    def leave(self, member: str) -> None:
        """Sequence `member` finished; idempotent."""
        if member not in self._members:
            return
        fid = self._members.pop(member)
        self.backlog[fid] -= 1
        if not self.backlog[fid]:
            del self.backlog[fid]
            self._last_left = fid
            if len(self.counters) > MAX_IDLE_COUNTERS + len(self.backlog):
                self._forget_idle()

    def charge(self, fid: FairnessId, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        cost = self.prompt_weight * prompt_tokens + self.output_weight * output_tokens
        self.counters[fid] = self.counters.get(fid, 0.0) + cost
        label = self._label(fid)
        self.served[label] = self.served.get(label, 0.0) + cost

    def reserve(self, fid: FairnessId, prompt_tokens: int) -> None:
        """Count `prompt_tokens` scheduled for `fid` in this schedule, until `charge_computed` charges what ran."""
        self._pending[fid] = self._pending.get(fid, 0.0) + self.prompt_weight * prompt_tokens

    def counter(self, fid: FairnessId) -> float:
        """`fid`'s counter with this schedule's reservations: what the scheduler orders by."""
        return self.counters.get(fid, 0.0) + self._pending.get(fid, 0.0)

    def shares(self) -> tuple[FairShare, ...]:
        """Every label's service, for /metrics (at most MAX_LABELLED_IDS + 2 of them)."""
        others = [self.counters[fid] for fid in self.backlog if self._labels.get(fid) is None]
        rows = [
            FairShare(label, self.served.get(label, 0.0), self.counters.get(fid, 0.0))
            for fid, label in self._labels.items()
            if label in self.served or fid in self.backlog
        ]
        if OTHER_LABEL in self.served:
            rows.append(FairShare(OTHER_LABEL, self.served[OTHER_LABEL], max(others, default=0.0)))
        return tuple(rows)

    def _label(self, fid: FairnessId) -> str:
        label = self._labels.get(fid)
        if label is None:
            # NO_ID_LABEL's entry is not one of the max_labels; an id spelt as one of ours would be mistaken for it
            if len(self._labels) > self._max_labels or fid in (NO_ID_LABEL, OTHER_LABEL):
                return OTHER_LABEL
            assert fid is not None  # NO_ID_LABEL's is always there
            label = self._labels[fid] = fid
        return label

    def _forget_idle(self) -> None:
        """Drop idle ids' counters that the lift makes moot, then, while still over MAX_IDLE_COUNTERS, the lowest;
        the labelled ids (their gauge) and the last to leave (the floor) stay."""
        floor = self.floor()
        keep = self.backlog.keys() | self._labels.keys() | {self._last_left}
        idle = sorted(((fid, c) for fid, c in self.counters.items() if fid not in keep), key=lambda item: item[1])
        excess = len(self.counters) - MAX_IDLE_COUNTERS - len(self.backlog)
        for i, (fid, value) in enumerate(idle):
            if value > floor and i >= excess:
                break
            del self.counters[fid]

    # --- by sequence: the scheduler's hooks -------------------------------------------------------------------------

    def join_seq(self, seq: Sequence) -> None:
        self.join(seq.request_id, seq.fairness_id)

    def leave_seq(self, seq: Sequence) -> None:
        self.leave(seq.request_id)

    def next_waiting(
        self, ready: Iterable[Sequence], order: Callable[[Sequence], tuple[int, float]] | None = None
    ) -> Sequence | None:
        """The sequence to start next of those `ready` (given in (priority, arrival) order): by priority, then, with
        two ids or more backlogged, the least counter, then the scheduler's `order` (priority first, then its rank:
        shortest-prompt's key) or, None, arrival. With fewer ids, exactly the order without fairness."""
        if not self.contended:
            return next(iter(ready), None) if order is None else min(ready, key=order, default=None)
        rank_of = order or Sequence.sort_key

        def key(seq: Sequence) -> tuple[int, float, float]:
            priority, rank = rank_of(seq)
            return priority, self.counter(seq.fairness_id), rank

        return min(ready, key=key, default=None)

    def victim(self, candidates: Iterable[Sequence]) -> Sequence | None:
        """The sequence to preempt: the lowest priority, the most-served id, the latest arrival (of equals, the first
        in `candidates`). With fewer than two ids backlogged, the lowest-priority latest arrival, as always."""
        if not self.contended:
            return max(candidates, key=Sequence.sort_key, default=None)
        return max(candidates, key=lambda s: (s.priority, self.counter(s.fairness_id), s.arrival_time), default=None)

    def pop_victim(self, queue: list[Sequence], seq: Sequence) -> Sequence:
        """Whom to preempt so that running `seq` gets its blocks: `seq` or one of those after it in `queue` (the
        running ones not yet given blocks this step, in (priority, arrival) order), as `victim` chooses; without
        fairness ids, queue's last. Taken out of `queue`."""
        victim = self.victim([*reversed(queue), seq])
        assert victim is not None
        if victim is not seq:
            queue.remove(victim)
        return victim

    def outranked(self, running: list[Sequence], seq: Sequence) -> Sequence | None:
        """A running sequence that waiting `seq` may take blocks from: one after it in (priority, arrival) order (a
        static order, so two sequences never take each other's blocks in turn, as counters would), as `victim`
        chooses."""
        return self.victim(s for s in running if s.sort_key() > seq.sort_key())

    def reserve_seq(self, seq: Sequence, num_new: int) -> None:
        """`seq` starts with a chunk of `num_new` tokens from its num_computed_tokens: reserve its uncharged part."""
        start = max(seq.num_computed_tokens, seq.num_charged_prompt_tokens)
        end = min(seq.num_computed_tokens + num_new, seq.num_prompt_tokens)
        if end > start:
            self.reserve(seq.fairness_id, end - start)

    def charge_computed(self, scheduled: Iterable[tuple[Sequence, int]]) -> None:
        """Before a step's bookkeeping: charge each sequence's prompt tokens that the step computed and that were
        never charged (not its drafts: those are output tokens, charged if accepted). Clears the reservations."""
        self._pending.clear()
        for seq, num_tokens in scheduled:
            start = max(seq.num_computed_tokens, seq.num_charged_prompt_tokens)
            end = min(seq.num_computed_tokens + num_tokens - len(seq.draft_token_ids), seq.num_prompt_tokens)
            if end > start:
                self.charge(seq.fairness_id, prompt_tokens=end - start)
                seq.num_charged_prompt_tokens = end

    def charge_sampled(self, stepped: Iterable[Sequence]) -> None:
        """After a step's bookkeeping: charge the output tokens each sequence got."""
        for seq in stepped:
            if seq.num_new_tokens:
                self.charge(seq.fairness_id, output_tokens=seq.num_new_tokens)
