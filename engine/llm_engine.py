"""LLMEngine: owns the model, the KV pool, the scheduler, and turns steps into per-request outputs.

`LLM` is the offline convenience wrapper (`generate` a list of prompts to completion).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig, default_model_path
from engine.loader import load_model_weights
from engine.model import LlamaForCausalLM
from engine.model_runner import ModelRunner, kv_block_bytes
from engine.output import RequestOutput, TextState
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer

log = logging.getLogger("tokenweir.engine")


class RequestError(ValueError):
    """A request the engine can never serve (too long, bad parameters): a 400 for the client, not a crash."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


@dataclass
class StepStats:
    """What one step did, for metrics."""

    num_prompt_tokens: int = 0  # prefill tokens computed this step
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    finished: list[Sequence] = field(default_factory=list)
    first_tokens: list[Sequence] = field(default_factory=list)
    step_seconds: float = 0.0


def _resolve_device(config: EngineConfig) -> torch.device:
    if config.device != "auto":
        return torch.device(config.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[config.dtype]


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = False) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        path = config.model or default_model_path()
        self.model_path = path
        device = _resolve_device(config)
        dtype = _resolve_dtype(config, device)
        model_config, state = load_model_weights(path, progress=progress)
        self.model_config = model_config
        self.model_name = config.served_model_name or model_config.name
        self.tokenizer = self._load_tokenizer(path)
        block_bytes = kv_block_bytes(model_config, config.block_size, dtype)
        num_blocks = config.num_kv_blocks or self._blocks_from_memory(block_bytes, device)
        assert num_blocks > 0, "the KV-cache budget holds no block: raise --kv-cache-memory"
        self.max_model_len = min(
            config.max_model_len or model_config.max_position_embeddings,
            model_config.max_position_embeddings,
            num_blocks * config.block_size,
        )
        self.model = LlamaForCausalLM(
            model_config, state, dtype, device, config.attention_backend, model_config.max_position_embeddings
        )
        del state
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, config, num_blocks, dtype, device)
        self.sequences: dict[str, Sequence] = {}
        self.texts: dict[str, TextState] = {}
        self.stop_token_ids = set(self.tokenizer.stop_token_ids) if self.tokenizer else set()
        if model_config.eos_token_id is not None:
            self.stop_token_ids.add(model_config.eos_token_id)
        self.last_stats = StepStats()
        log.info(
            "engine ready: %s, %d KV blocks x %d tokens (%.0f MiB), attention=%s, device=%s, dtype=%s",
            self.model_name,
            num_blocks,
            config.block_size,
            num_blocks * block_bytes / 2**20,
            self.model.attention_backend,
            device,
            dtype,
        )

    def _blocks_from_memory(self, block_bytes: int, device: torch.device) -> int:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = free - (1 - self.config.gpu_memory_utilization) * total
            return max(int(budget // block_bytes), 0)
        return self.config.kv_cache_memory // block_bytes

    @staticmethod
    def _load_tokenizer(path: str) -> Tokenizer | None:
        if path.endswith(".gguf"):
            return Tokenizer.from_gguf(path)
        if os.path.exists(os.path.join(path, "tokenizer.json")):
            return Tokenizer.from_hf_dir(path)
        return None  # a bare test model: token ids in, token ids out

    # --- requests -------------------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> Sequence:
        if request_id in self.sequences:
            raise RequestError(f"request id {request_id!r} is already running", code="duplicate_request_id")
        self.validate(prompt_token_ids, params)
        seq = Sequence(request_id, prompt_token_ids, params, priority, arrival_time)
        self.sequences[request_id] = seq
        self.texts[request_id] = TextState(
            self.tokenizer, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
        )
        self.scheduler.add(seq)
        return seq

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError for a request that can never run; fills in a missing max_tokens. No engine state is
        touched, so the server may call it from the event loop."""
        if not prompt_token_ids:
            raise RequestError("the prompt is empty", code="empty_prompt", param="prompt")
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})", code="invalid_token_id", param="prompt")
        num_prompt = len(prompt_token_ids)
        limit = self.max_model_len
        if params.max_tokens is None:
            params.max_tokens = max(limit - num_prompt, 1)
        if num_prompt + params.max_tokens > limit:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + params.max_tokens} tokens ({num_prompt} in the messages, {params.max_tokens} in the "
                f"completion). Please reduce the length of the messages or completion.",
                code="context_length_exceeded",
                param="messages",
            )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (exact token counts), or None."""
        seq = self.sequences.get(request_id)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        return self._finish_output(seq, [], None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the step ---------------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        start = time.monotonic()
        stats = StepStats()
        batch = self.scheduler.schedule()
        stats.num_preemptions = len(batch.preempted)
        self.last_stats = stats
        if batch.is_empty:
            return []
        for seq in [*batch.decodes, *(s for s, _ in batch.prefills)]:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = start
        sampled, token_ids = self.runner.run(batch)
        for seq in batch.decodes:
            seq.num_computed_tokens += 1
        for seq, n in batch.prefills:
            seq.num_computed_tokens += n
            stats.num_prompt_tokens += n if seq.num_preemptions == 0 else 0
        now = time.monotonic()
        outputs = []
        for seq, token_id in zip(sampled, token_ids, strict=True):
            outputs.append(self._append_token(seq, token_id, now, stats))
        stats.num_generation_tokens = len(sampled)
        stats.step_seconds = time.monotonic() - start
        return outputs

    def _append_token(self, seq: Sequence, token_id: int, now: float, stats: StepStats) -> RequestOutput:
        seq.append_token(token_id)
        if seq.first_token_time is None:
            seq.first_token_time = now
            stats.first_tokens.append(seq)
        seq.last_token_time = now
        params = seq.params
        stop_reason: str | int | None = None
        reason = None
        stop_string = self.texts[seq.request_id].add(token_id)
        if stop_string is not None:
            reason, stop_reason = "stop", stop_string
        elif not params.ignore_eos and token_id in self.stop_token_ids or token_id in params.stop_token_ids:
            reason, stop_reason = "stop", token_id
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is None:
            text = self.texts[seq.request_id].take_delta(finished=False)
            return RequestOutput(
                seq.request_id,
                [token_id],
                text,
                False,
                None,
                seq.num_prompt_tokens,
                seq.num_output_tokens,
                seq.num_cached_tokens,
            )
        self.scheduler.finish(seq, reason)
        stats.finished.append(seq)
        return self._finish_output(seq, [token_id], stop_reason)

    def _finish_output(self, seq: Sequence, new_token_ids: list[int], stop_reason) -> RequestOutput:
        text = self.texts.pop(seq.request_id).take_delta(finished=True)
        self.sequences.pop(seq.request_id, None)
        self.runner.sampler.forget(seq.request_id)
        return RequestOutput(
            seq.request_id,
            new_token_ids,
            text,
            True,
            seq.finish_reason,
            seq.num_prompt_tokens,
            seq.num_output_tokens,
            seq.num_cached_tokens,
            stop_reason,
        )

    # --- introspection ----------------------------------------------------------------------------------------------

    def load(self) -> dict:
        bm = self.block_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": round(bm.usage, 4),
            "num_free_blocks": bm.num_free_blocks,
            "num_total_blocks": bm.num_blocks,
            "num_cached_free_blocks": bm.num_cached_free_blocks,
            "max_num_seqs": self.config.max_num_seqs,
        }


class LLM:
    """Offline generation: `LLM(model=...).generate(prompts, params)` runs every prompt to completion."""

    def __init__(self, model: str = "", **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._next_id = 0

    def generate(
        self,
        prompts: list[list[int]] | list[str],
        params: SamplingParams | list[SamplingParams],
        priorities=None,
    ) -> list[RequestOutput]:
        """Returns, per prompt, a RequestOutput whose new_token_ids / new_text hold the whole completion."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
            tokens = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            rid = f"offline-{self._next_id}"
            self._next_id += 1
            self.engine.add_request(rid, tokens, SamplingParams(**vars(p)), (priorities or [0] * len(prompts))[i])
            ids.append(rid)
        results = {rid: RequestOutput(rid, [], "", False, None, 0, 0, 0) for rid in ids}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                acc = results[out.request_id]
                acc.new_token_ids += out.new_token_ids
                acc.new_text += out.new_text
                acc.finished, acc.finish_reason, acc.stop_reason = (
                    out.finished,
                    out.finish_reason,
                    out.stop_reason,
                )
                acc.num_prompt_tokens, acc.num_output_tokens = out.num_prompt_tokens, out.num_output_tokens
                acc.num_cached_tokens = out.num_cached_tokens
        return [results[rid] for rid in ids]
