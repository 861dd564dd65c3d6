"""Prompt lookup (vLLM's "ngram" method): a sequence's drafts are the tokens that followed the latest earlier
occurrence of its last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max] that occurs. Free to
compute, and right often where the output copies from the prompt or from itself (code edits, quoting, extraction).

Each sequence's tokens are kept as packed 32-bit integers, extended as it grows, so a lookup is one `bytes.rfind` in
C rather than a Python loop over the context. A sequence whose drafts keep failing pauses
(engine/spec_decode/acceptance.py).
"""

from __future__ import annotations

import array
import weakref

from tokenweir.engine.config import SpeculativeConfig
from tokenweir.engine.sched.sequence import Sequence
from tokenweir.engine.spec_decode.acceptance import AcceptanceGate
from tokenweir.engine.spec_decode.ngram_cache import NgramCache

_WIDTH = 4  # bytes per packed token


class NgramProposer:
    """Prompt lookup; with method "ngram_cache", where the sequence itself has no match, the n-gram cache learned
    from finished requests' outputs of the same cache_salt (engine/spec_decode/ngram_cache.py)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.method in ("ngram", "ngram_cache")
        self.config = config
        self.gate = AcceptanceGate(config)
        self._packed: weakref.WeakKeyDictionary[Sequence, array.array] = weakref.WeakKeyDictionary()
        self.cache = None
        if config.method == "ngram_cache":
            self.cache = NgramCache(config.prompt_lookup_min, config.prompt_lookup_max, config.cache_capacity)

    def finished(self, seq: Sequence) -> None:
        """A sequence that ended: its output (with the prompt tokens just before it) goes into the cache, unless it
        was cut short."""
        if self.cache is not None and seq.num_output_tokens and seq.finish_reason in ("stop", "length"):
            start = max(0, seq.num_prompt_tokens - self.config.prompt_lookup_max)
            self.cache.learn(seq.token_ids[start:], seq.params.cache_salt)

    def propose_batch(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Drafts for each (sequence, most drafts it may take)."""
        return [self.propose(seq, max_drafts) for seq, max_drafts in requests]

    def propose(self, seq: Sequence, max_drafts: int) -> list[int]:
        """Up to min(k, max_drafts) draft tokens to follow `seq`'s tokens; [] when nothing matches or it is paused."""
        k = min(self.config.num_speculative_tokens, max_drafts)
        if k <= 0 or not self.gate.is_open(seq):
            return []
        packed = self._packed.get(seq)
        if packed is None:
            packed = self._packed[seq] = array.array("i")
        if len(packed) > seq.num_tokens:  # never shrinks in this engine; rebuilt if it ever does
            del packed[:]
        packed.extend(seq.token_ids[len(packed) :])
        drafts = self._lookup(packed.tobytes(), len(packed), k)
        if not drafts and self.cache is not None:
            drafts = self.cache.draft(seq.token_ids, k, seq.params.cache_salt)
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
        self.gate.record(seq, proposed, accepted)
