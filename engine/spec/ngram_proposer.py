"""Prompt lookup (vLLM's "ngram" method): a sequence's drafts are the tokens that followed the latest earlier
occurrence of its last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max] that occurs. Free to
compute, and right often where the output copies from the prompt or from itself (code edits, quoting, extraction).

Each sequence's tokens are kept as packed 32-bit integers, extended as it grows, so a lookup is one `bytes.rfind` in
C rather than a Python loop over the context. The proposer also keeps each sequence's recent acceptance: one whose
drafts keep being refused stops drafting for a while (they would cost compute and win nothing).
"""

from __future__ import annotations

import array
import weakref
from collections import deque
from dataclasses import dataclass, field

from tokenweir.engine.config import SpeculativeConfig
from tokenweir.engine.sched.sequence import Sequence
from tokenweir.engine.spec.ngram_cache import NgramCache

_WIDTH = 4  # bytes per packed token


@dataclass
class _Lookup:
    packed: array.array = field(default_factory=lambda: array.array("i"))
    outcomes: deque[tuple[int, int]] = field(default_factory=deque)  # (proposed, accepted) of its recent steps
    proposed: int = 0  # sums over `outcomes`
    accepted: int = 0
    paused_until: int = 0  # no drafts before the sequence has this many tokens


class NgramProposer:
    """Prompt lookup; with method "ngram_cache", where the sequence itself has no match, the n-gram cache learned
    from finished requests' outputs (engine/spec/ngram_cache.py)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.method in ("ngram", "ngram_cache")
        self.config = config
        self._state: weakref.WeakKeyDictionary[Sequence, _Lookup] = weakref.WeakKeyDictionary()
        self.cache = None
        if config.method == "ngram_cache":
            self.cache = NgramCache(config.prompt_lookup_min, config.prompt_lookup_max, config.cache_capacity)

    def learn(self, seq: Sequence) -> None:
        """A finished sequence's output (with the prompt tokens just before it) goes into the cache."""
        if self.cache is not None and seq.num_output_tokens:
            start = max(0, seq.num_prompt_tokens - self.config.prompt_lookup_max)
            self.cache.learn(seq.token_ids[start:])

    def propose(self, seq: Sequence, max_drafts: int) -> list[int]:
        """Up to min(k, max_drafts) draft tokens to follow `seq`'s tokens; [] when nothing matches or it is paused."""
        k = min(self.config.num_speculative_tokens, max_drafts)
        if k <= 0:
            return []
        state = self._state.get(seq)
        if state is None:
            state = self._state[seq] = _Lookup()
        if seq.num_tokens < state.paused_until:
            return []
        packed = state.packed
        if len(packed) > seq.num_tokens:  # never shrinks in this engine; rebuilt if it ever does
            del packed[:]
        packed.extend(seq.token_ids[len(packed) :])
        drafts = self._lookup(packed.tobytes(), len(packed), k)
        if not drafts and self.cache is not None:
            drafts = self.cache.draft(seq.token_ids, k)
        return drafts

    def _lookup(self, data: bytes, num_tokens: int, k: int) -> list[int]:
        lo, hi = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        for n in range(min(hi, num_tokens - 1), lo - 1, -1):
            pattern = data[-n * _WIDTH :]
            # an earlier occurrence with at least one token after it: it ends before the last token
            end = (num_tokens - 1) * _WIDTH
            at = data.rfind(pattern, 0, end)
            while at >= 0 and at % _WIDTH:  # a match across token boundaries: look further back
                at = data.rfind(pattern, 0, at + len(pattern) - 1)
            if at >= 0:
                start = at // _WIDTH + n
                follow = array.array("i")
                follow.frombytes(data[start * _WIDTH : min(start + k, num_tokens) * _WIDTH])
                return follow.tolist()
        return []

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """One verification's outcome; a sequence whose acceptance over its last `acceptance_window` proposed tokens
        fell below `min_acceptance` pauses for `retry_after` tokens."""
        state = self._state.get(seq)
        if state is None or proposed == 0:
            return
        state.outcomes.append((proposed, accepted))
        state.proposed += proposed
        state.accepted += accepted
        window = self.config.acceptance_window
        while state.proposed - state.outcomes[0][0] >= window:
            old_proposed, old_accepted = state.outcomes.popleft()
            state.proposed -= old_proposed
            state.accepted -= old_accepted
        if state.proposed >= window and state.accepted < self.config.min_acceptance * state.proposed:
            state.paused_until = seq.num_tokens + self.config.retry_after
            state.outcomes.clear()
            state.proposed = state.accepted = 0
