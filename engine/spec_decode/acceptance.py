"""Each sequence's recent acceptance, shared by the proposers: a sequence whose drafts keep being refused stops
drafting for a while (they would cost compute and win nothing), then tries again."""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, field

from tokenweir.engine.config import SpeculativeConfig
from tokenweir.engine.sched.sequence import Sequence


@dataclass
class _Record:
    outcomes: deque[tuple[int, int]] = field(default_factory=deque)  # (proposed, accepted) of its recent steps
    proposed: int = 0  # sums over `outcomes`
    accepted: int = 0
    paused_until: int = 0  # no drafts before the sequence has this many tokens


class AcceptanceGate:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._records: weakref.WeakKeyDictionary[Sequence, _Record] = weakref.WeakKeyDictionary()

    def is_open(self, seq: Sequence) -> bool:
        record = self._records.get(seq)
        return record is None or seq.num_tokens >= record.paused_until

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """One verification's outcome; a sequence whose acceptance over its last `acceptance_window` proposed tokens
        fell below `min_acceptance` pauses for `retry_after` tokens."""
        if proposed == 0:
            return
        record = self._records.get(seq)
        if record is None:
            record = self._records[seq] = _Record()
        record.outcomes.append((proposed, accepted))
        record.proposed += proposed
        record.accepted += accepted
        window = self.config.acceptance_window
        while record.proposed - record.outcomes[0][0] >= window:
            old_proposed, old_accepted = record.outcomes.popleft()
            record.proposed -= old_proposed
            record.accepted -= old_accepted
        if record.proposed >= window and record.accepted < self.config.min_acceptance * record.proposed:
            record.paused_until = seq.num_tokens + self.config.retry_after
            record.outcomes.clear()
            record.proposed = record.accepted = 0
