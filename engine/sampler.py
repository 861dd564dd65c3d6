"""Token sampling for a batch with per-request parameters: greedy, temperature, top-k, top-p, min-p, penalties, seeds.

Sampling uses the exponential race (argmax of p / Exp(1) noise), which equals multinomial sampling and lets each
seeded request draw its noise from its own generator, so a seed reproduces its tokens whatever else is batched.
"""

from __future__ import annotations

import torch

from engine.sequence import Sequence


class Sampler:
    def __init__(self, seed: int = 0, device: str | torch.device = "cpu") -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.seq_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self.seq_generators.pop(request_id, None)

    def _generator(self, seq: Sequence) -> torch.Generator:
        if seq.params.seed is None:
            return self.generator
        gen = self.seq_generators.get(seq.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seq.params.seed)
            self.seq_generators[seq.request_id] = gen
        return gen

    @torch.inference_mode()  # the logits are inference tensors, and penalties edit them in place
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits: float32 [len(seqs), vocab]."""
        assert logits.shape[0] == len(seqs)
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
    def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
        # OpenAI semantics: logit -= presence * [count > 0] + frequency * count, over generated tokens.
        for i, seq in enumerate(seqs):
            p = seq.params
            if (p.presence_penalty == 0 and p.frequency_penalty == 0) or seq.num_output_tokens == 0:
                continue
            ids = torch.tensor(seq.output_token_ids, device=logits.device)
            counts = torch.bincount(ids, minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _top_k_top_p(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
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
