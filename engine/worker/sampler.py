"""Token sampling for a batch with per-request parameters: greedy, temperature, top-k, top-p, min-p, penalties, seeds,
logit bias, structured-output masks, and the log-probabilities a request asks for.

Order per row: logprobs are read from the model's raw distribution first (what vLLM reports by default, and what a
client checks against log_softmax of the logits), then the bias and the grammar mask, then penalties and sampling.

Sampling uses the exponential race (argmax of p / Exp(1) noise), which equals multinomial sampling and lets each
seeded request draw its noise from its own generator, so a seed reproduces its tokens whatever else is batched.
"""

from __future__ import annotations

import collections.abc as abc
from dataclasses import dataclass, field

import torch

from tokenweir.engine.sched.sampling_params import SamplingParams
from tokenweir.engine.sched.sequence import Sequence, TokenLogprob


class DraftRow:
    """A row that checks a draft: its sequence as it would stand had the drafts before this row been accepted, so
    penalties count them. What the sampler reads of a sequence; its seeded generator is the sequence's own. Its
    grammar's mask comes precomputed (Sampler's draft_masks), so the row itself has no matcher to advance."""

    __slots__ = ("seq", "extra")
    matcher = None

    def __init__(self, seq: Sequence, extra: list[int]) -> None:
        self.seq, self.extra = seq, extra

    @property
    def params(self) -> SamplingParams:
        return self.seq.params

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.extra)

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.extra


Row = Sequence | DraftRow


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # per row; None where the request asked for none
    # rows whose grammar could not go on (a parser limit hit, or a token refused): why, for the client. Their token
    # is not theirs to keep: the sequence ends with an error, and the batch goes on without it.
    failed: dict[int, str] = field(default_factory=dict)


class Sampler:
    def __init__(self, seed: int = 0, device: str | torch.device = "cpu", structured=None) -> None:
        self.device = device
        self.structured = structured  # engine.text.structured.StructuredOutputs: fills and applies grammar masks
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.seq_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self.seq_generators.pop(request_id, None)

    def _generator(self, seq: Row) -> torch.Generator:
        if seq.params.seed is None:
            return self.generator
        gen = self.seq_generators.get(seq.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seq.params.seed)
            self.seq_generators[seq.request_id] = gen
        return gen

    @torch.inference_mode()  # the logits are inference tensors, and penalties edit them in place
    def __call__(
        self,
        logits: torch.Tensor,
        seqs: abc.Sequence[Row],
        masks: torch.Tensor | None = None,
        draft_masks: tuple[list[int], torch.Tensor] | None = None,
    ) -> SamplerOutput:
        """logits: float32 [len(seqs), vocab]. masks: the grammar masks of the rows with a matcher, in row order, if
        already computed (StructuredOutputs.fill_masks_async). draft_masks: (rows, their masks) for draft rows of
        sequences with a grammar (StructuredOutputs.fill_draft_masks); the caller advances those matchers."""
        assert logits.shape[0] == len(seqs)
        logprob_rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        raw = torch.log_softmax(logits[logprob_rows], dim=-1) if logprob_rows else None
        self._apply_bias(logits, seqs)
        guided = [i for i, s in enumerate(seqs) if s.matcher is not None]
        matchers = [m for s in seqs if (m := s.matcher) is not None]  # row guided[k]'s is matchers[k]
        if guided:
            self.structured.apply_masks(logits, guided, matchers, masks)
        if draft_masks is not None:
            self.structured.apply_masks(logits, draft_masks[0], None, draft_masks[1])
        token_ids = self._sample(logits, seqs)
        failed: dict[int, str] = {}
        for i, matcher in zip(guided, matchers, strict=True):
            if not matcher.accept(token_ids[i]):
                # A grammar past one of the parser's limits allows only a stop token, which it then refuses while
                # the document is incomplete: that request's grammar cannot be honoured, the others' can.
                failed[i] = grammar_failure(matcher.error)
                self.structured.refuse(matcher.grammar, failed[i])
        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        for j, i in enumerate(logprob_rows):
            k = seqs[i].params.logprobs
            assert raw is not None and k is not None  # a logprob row asked for them, so raw was computed
            logprobs[i] = token_logprob(raw[j], token_ids[i], k)
        return SamplerOutput(token_ids, logprobs, failed)

    def _sample(self, logits: torch.Tensor, seqs: abc.Sequence[Row]) -> list[int]:
        self._apply_penalties(logits, seqs)
        greedy_ids = logits.argmax(dim=-1)
        sample_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if not sample_rows:
            return greedy_ids.tolist()
        rows = torch.tensor(sample_rows, device=logits.device)
        sub = [seqs[i] for i in sample_rows]
        temps = torch.tensor([s.params.temperature for s in sub], device=logits.device)
        scaled = logits[rows] / temps[:, None]
        scaled = _top_k_top_p(scaled, sub)
        probs = torch.softmax(scaled, dim=-1)
        min_ps = torch.tensor([s.params.min_p for s in sub], device=logits.device)
        if bool((min_ps > 0).any()):
            top = probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < min_ps[:, None] * top, 0.0)
        noise = torch.empty_like(probs)
        for j, seq in enumerate(sub):
            noise[j].exponential_(generator=self._generator(seq))
        sampled = (probs / noise).argmax(dim=-1)
        out = greedy_ids.clone()
        out[rows] = sampled
        return out.tolist()

    @staticmethod
    def _apply_bias(logits: torch.Tensor, seqs: abc.Sequence[Row]) -> None:
        for i, seq in enumerate(seqs):
            bias = seq.params.logit_bias
            if bias:
                ids = torch.tensor(list(bias), device=logits.device)
                logits[i, ids] += torch.tensor(list(bias.values()), device=logits.device, dtype=logits.dtype)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, seqs: abc.Sequence[Row]) -> None:
        # OpenAI semantics: logit -= presence * [count > 0] + frequency * count, over generated tokens.
        for i, seq in enumerate(seqs):
            p = seq.params
            if (p.presence_penalty == 0 and p.frequency_penalty == 0) or seq.num_output_tokens == 0:
                continue
            ids = torch.tensor(seq.output_token_ids, device=logits.device)
            counts = torch.bincount(ids, minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _top_k_top_p(logits: torch.Tensor, seqs: abc.Sequence[Row]) -> torch.Tensor:
    top_ks = [s.params.top_k for s in seqs]
    top_ps = [s.params.top_p for s in seqs]
    if all(k == -1 for k in top_ks) and all(p >= 1.0 for p in top_ps):
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([k if k > 0 else vocab for k in top_ks], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    mask = ranks >= ks[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
    cumulative = probs.cumsum(dim=-1) - probs  # mass strictly before each token: always keep the first
    ps = torch.tensor(top_ps, device=logits.device, dtype=probs.dtype)
    mask |= cumulative >= ps[:, None]
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def grammar_failure(error: str | None) -> str:
    """The client's message for a response_format the engine stopped being able to follow mid-generation."""
    why = (error or "the grammar refused every token the model could produce").split("\n", 1)[0]
    return (
        f"the response_format could not be followed: {why}. Simplify the schema (e.g. fewer nested bounded "
        "repetitions like (...{1,40}){1,40} in a string pattern) and retry"
    )


def token_logprob(logprobs: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    """One position's entry from a row of log-probabilities: the chosen token's and the top k."""
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        values, ids = logprobs.topk(k)
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token_id, float(logprobs[token_id]), top)
