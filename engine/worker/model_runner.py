"""The model on its device and one step of it. Built from the config, the runner loads the weights at the resolved
precision, sizes the KV pool (engine/worker/kv_sizing.py: on a GPU after a warm-up forward) and allocates it; each
step it turns a scheduled batch into flat tensors (tokens, positions, slot mapping, block tables), runs the model over
the paged KV cache, and samples the sequences that reached the end of their known tokens.

A sequence that asks for prompt logprobs (completions' `echo` with `logprobs`) also gets logits at every prompt
position it computes, after the sampled rows; the scheduler never serves it from the prefix cache, so every prompt
position is computed once."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from tokenweir.engine.config import EngineConfig
from tokenweir.engine.model.attention import AttentionMetadata
from tokenweir.engine.model.linear import GGUF_MODES
from tokenweir.engine.model.llama import LlamaForCausalLM
from tokenweir.engine.model.loader import load_gguf_blocks, load_model_weights
from tokenweir.engine.model.precision import resolve as resolve_precision
from tokenweir.engine.sched.scheduler import SchedulerOutput
from tokenweir.engine.sched.sequence import Sequence, TokenLogprob
from tokenweir.engine.worker.kv_sizing import kv_block_bytes, num_kv_blocks
from tokenweir.engine.worker.sampler import DraftRow, Sampler, grammar_failure, token_logprob

log = logging.getLogger("tokenweir.engine")


@dataclass(slots=True)
class PreparedBatch:
    """A scheduled batch as the model's inputs: logits are computed at `logits_indices`, first one row per sequence in
    `sampled`, then one per position of each sequence in `verified` (its last token and its drafts), then one per
    (sequence, position) in `prompt_rows` whose next prompt token is scored."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionMetadata
    logits_indices: torch.Tensor
    sampled: list[Sequence]
    prompt_rows: list[tuple[Sequence, int]]
    verified: list[Sequence]  # sequences checking drafts: 1 + len(drafts) rows each, after `sampled`'s


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device != "auto":
        return torch.device(config.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ModelRunner:
    def __init__(self, config: EngineConfig, path: str, progress: bool = False) -> None:
        """Load the model at `path` onto the configured device and allocate the KV pool (`num_blocks` blocks)."""
        device = resolve_device(config)
        if config.quantization in GGUF_MODES and not path.endswith(".gguf"):
            raise ValueError(
                f"{path}: --quantization {config.quantization} takes a .gguf model; a HF directory has no GGUF blocks"
            )
        mc, state = load_model_weights(path, progress=progress)
        widest = (mc.hidden_size, 2 * mc.intermediate_size)  # the fused gate/up projection
        self.precision = resolve_precision(
            config.dtype,
            config.quantization,
            device,
            widest,
            mc.layer_formats,
            config.batch_invariant,
            shares_kv=config.kv_transfer is not None,
        )
        dtype = self.precision.dtype
        log.info("precision: %s", self.precision.reason)
        self.model = LlamaForCausalLM(
            mc,
            state,
            dtype,
            device,
            config.attention_backend,
            mc.max_position_embeddings,
            self.precision.quantization,
            load_gguf_blocks(path) if self.precision.quantization in GGUF_MODES else None,
            self.precision.prefill_dtype,
            config.batch_invariant,
        )
        del state
        if config.batch_invariant:  # what the model made of it: Triton's kernels, or the CPU's C++ kernels
            backend = self.model.attention_backend
            if self.model.batch_invariant:
                log.info("batch invariant: the %s backend's kernels", backend)
            else:
                log.warning(
                    "batch invariant: unavailable with the %s backend at %s (the CPU kernels need float32 and "
                    "head_dim 64): a row's output may move with its batch",
                    backend,
                    dtype,
                )
        # Sized after the weights are on the device, so gpu_memory_utilization counts them (as nano-vllm does).
        self.block_bytes = kv_block_bytes(mc, config.block_size, dtype)
        self.num_blocks = num_kv_blocks(self.model, config, self.block_bytes, device)
        assert self.num_blocks > 0, "the KV-cache budget holds no block: raise --kv-cache-memory"
        self.block_size = config.block_size
        self.device = device
        # One allocation for the whole pool: [2 (k, v), layers, blocks, block_size, kv_heads, head_dim].
        self.kv_cache = torch.zeros(
            2,
            mc.num_layers,
            self.num_blocks,
            config.block_size,
            mc.num_kv_heads,
            mc.head_dim,
            dtype=dtype,
            device=device,
        )
        self.kv_caches = [(self.kv_cache[0, i], self.kv_cache[1, i]) for i in range(mc.num_layers)]
        self.sampler = Sampler(config.seed, device)

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max((len(s.block_table) for s in seqs), default=0)
        rows = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32).reshape(len(seqs), width)

    def prepare(self, batch: SchedulerOutput) -> PreparedBatch:
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        sampled: list[Sequence] = []
        prompt_rows: list[tuple[Sequence, int]] = []  # (sequence, position) whose next prompt token is scored
        prompt_indices: list[int] = []

        def score_prompt(seq: Sequence, first_index: int, span: range) -> None:
            # Entry p + 1 scores prompt token p + 1 from position p; positions recomputed after a preemption that
            # already have theirs are skipped.
            for j, p in enumerate(span):
                if len(seq.prompt_logprobs) <= p + 1 < seq.num_prompt_tokens:
                    prompt_indices.append(first_index + j)
                    prompt_rows.append((seq, p))

        for seq in batch.decodes:
            pos = seq.num_computed_tokens
            if seq.params.prompt_logprobs is not None:
                score_prompt(seq, len(tokens), range(pos, pos + 1))
            tokens.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(seq.block_table[pos // bs] * bs + pos % bs)
            if pos + 1 == seq.num_tokens:  # else a one-token prefill chunk: nothing to sample yet
                logits_indices.append(len(tokens) - 1)
                sampled.append(seq)
        # A sequence checking drafts: its last token and its drafts as that many decode rows, row j attending to
        # the cache up to its own position (all of them are stored before attention runs). The decode kernel then
        # computes each row as plain decoding would have, so the verdicts are those of plain decoding.
        verify_indices: list[int] = []
        verify_rows: list[Sequence] = []
        verify_lens: list[int] = []
        for seq in batch.verifies:
            start = seq.num_computed_tokens
            assert start + 1 == seq.num_tokens and seq.draft_token_ids
            for j, token in enumerate([seq.token_ids[start], *seq.draft_token_ids]):
                pos = start + j
                tokens.append(token)
                positions.append(pos)
                slots.append(seq.block_table[pos // bs] * bs + pos % bs)
                verify_indices.append(len(tokens) - 1)
                verify_rows.append(seq)
                verify_lens.append(pos + 1)
        cu_seqlens = [0]
        for seq, n in batch.prefills:
            start = seq.num_computed_tokens
            tokens.extend(seq.token_ids[start : start + n])
            span = range(start, start + n)
            if seq.params.prompt_logprobs is not None:
                score_prompt(seq, len(tokens) - n, span)
            positions.extend(span)
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in span)
            cu_seqlens.append(cu_seqlens[-1] + n)
            if start + n == seq.num_tokens:
                logits_indices.append(len(tokens) - 1)
                sampled.append(seq)
        prefill_seqs = [s for s, _ in batch.prefills]
        decode_lens = [s.num_computed_tokens + 1 for s in batch.decodes] + verify_lens
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            num_decode_tokens=len(batch.decodes) + len(verify_rows),
            decode_block_tables=self._block_tables(batch.decodes + verify_rows),
            decode_context_lens=torch.tensor(decode_lens, dtype=torch.int32),
            prefill_block_tables=self._block_tables(prefill_seqs),
            prefill_cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32),
            prefill_context_lens=torch.tensor(
                [s.num_computed_tokens + n for s, n in batch.prefills], dtype=torch.int32
            ),
            prefill_max_q=max((n for _, n in batch.prefills), default=0),
        )
        if self.device.type != "cpu":
            fields: dict[str, Any] = {
                k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                for k, v in vars(meta).items()
            }
            meta = AttentionMetadata(**fields)
        return PreparedBatch(
            input_ids=torch.tensor(tokens, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            attention=meta,
            logits_indices=torch.tensor(
                logits_indices + verify_indices + prompt_indices, dtype=torch.int64, device=self.device
            ),
            sampled=sampled,
            prompt_rows=prompt_rows,
            verified=batch.verifies,
        )

    def run(self, batch: SchedulerOutput) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprob]], dict[str, str]]:
        """Run one step; returns {request id: its new tokens} for the sequences that reached the end of their tokens
        (one token; for a sequence checking drafts, the drafts the model agrees with and one token of its own),
        {request id: their logprobs} for those of them that asked, and {request id: why} for those whose grammar
        could not go on (they get no token)."""
        prepared = self.prepare(batch)
        sampled, verified = prepared.sampled, prepared.verified
        # Grammar masks are computed on a worker thread while the forward runs (both release the GIL).
        guided = [seq.matcher for seq in sampled if seq.matcher is not None]
        masks = self.sampler.structured.fill_masks_async(guided) if guided else None
        guided_drafts = [(seq.matcher, seq.draft_token_ids) for seq in verified if seq.matcher is not None]
        draft_masks = self.sampler.structured.draft_masks_async(guided_drafts) if guided_drafts else None
        logits = self.model.forward(
            prepared.input_ids, prepared.positions, self.kv_caches, prepared.attention, prepared.logits_indices
        )
        num_verify_rows = sum(1 + len(seq.draft_token_ids) for seq in verified)
        if prepared.prompt_rows:
            self._score_prompts(logits[len(sampled) + num_verify_rows :], prepared.prompt_rows)
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprob]] = {}
        failed: dict[str, str] = {}
        if sampled:
            out = self.sampler(logits[: len(sampled)], sampled, masks.result() if masks is not None else None)
            for i, seq in enumerate(sampled):
                rid = seq.request_id
                if i in out.failed:
                    failed[rid] = out.failed[i]
                    continue
                tokens[rid] = [out.token_ids[i]]
                if (lp := out.logprobs[i]) is not None:
                    logprobs[rid] = [lp]
        if verified:
            verify_logits = logits[len(sampled) : len(sampled) + num_verify_rows]
            self._verify(verify_logits, verified, draft_masks.result() if draft_masks else [], tokens, logprobs, failed)
        return tokens, logprobs, failed

    def _verify(
        self,
        logits: torch.Tensor,
        verified: list[Sequence],
        grammar_masks: list[torch.Tensor],
        tokens: dict[str, list[int]],
        logprobs: dict[str, list[TokenLogprob]],
        failed: dict[str, str],
    ) -> None:
        """Sample every position as if the drafts before it were accepted, and keep the drafts up to the first one
        the sample differs from, plus the sample there (or after the last draft). For a draft d this accepts it with
        probability p(d) and otherwise emits a token drawn from p without d: the rejection sampling of speculative
        decoding for a deterministic proposer, so the output follows the target model's distribution exactly
        (greedy: the tokens plain decoding would give). A sequence with a grammar samples each row under the mask
        of its drafts so far (`grammar_masks`, one tensor per such sequence in order); its matcher then takes the
        emitted tokens."""
        rows = [DraftRow(seq, seq.draft_token_ids[:j]) for seq in verified for j in range(len(seq.draft_token_ids) + 1)]
        draft_masks = None
        if grammar_masks:
            first_rows = itertools.accumulate((1 + len(seq.draft_token_ids) for seq in verified), initial=0)
            guided_rows = [
                first + j
                for seq, first in zip(verified, first_rows, strict=False)
                if seq.matcher is not None
                for j in range(1 + len(seq.draft_token_ids))
            ]
            draft_masks = (guided_rows, torch.cat(grammar_masks))
        out = self.sampler(logits, rows, draft_masks=draft_masks)
        first = 0
        for seq in verified:
            drafts = seq.draft_token_ids
            emitted: list[int] = []
            for j in range(len(drafts) + 1):
                emitted.append(out.token_ids[first + j])
                if j == len(drafts) or emitted[-1] != drafts[j]:
                    break
            if seq.matcher is not None and (why := _advance_grammar(seq, emitted, self.sampler)) is not None:
                failed[seq.request_id] = why
            else:
                tokens[seq.request_id] = emitted
                if seq.params.logprobs is not None:
                    emitted_logprobs = out.logprobs[first : first + len(emitted)]
                    logprobs[seq.request_id] = [lp for lp in emitted_logprobs if lp is not None]
            first += len(drafts) + 1

    @staticmethod
    def _score_prompts(logits: torch.Tensor, prompt_rows: list[tuple[Sequence, int]]) -> None:
        rows = torch.log_softmax(logits.float(), dim=-1)
        for row, (seq, p) in zip(rows, prompt_rows, strict=True):
            k = seq.params.prompt_logprobs
            assert k is not None  # only a sequence that asked for prompt logprobs has rows here
            seq.prompt_logprobs.append(token_logprob(row, seq.token_ids[p + 1], k))


def _advance_grammar(seq: Sequence, emitted: list[int], sampler: Sampler) -> str | None:
    """Feed a guided sequence's emitted tokens to its matcher, up to a stop token (the tokens after one are dropped
    by the scheduler); why it failed, or None. Each was sampled under its mask, so only a grammar past the parser's
    limits refuses one, as in plain decoding."""
    matcher = seq.matcher
    assert matcher is not None and sampler.structured is not None
    for token_id in emitted:
        if not matcher.accept(token_id):
            why = grammar_failure(matcher.error)
            sampler.structured.refuse(matcher.grammar, why)
            return why
        if matcher.is_terminated:
            break
    return None
