"""LLMEngine: owns the model, the KV pool and the scheduler; its step is schedule -> run the model -> update the
sequences -> per-request outputs (text and stop strings included). Requests are checked once, at the edge, by
`validate`: AsyncEngine.add_request for the server, LLM.generate offline; add_request only asserts.

The offline convenience wrapper is engine/llm.py.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from tokenweir.common.text.model_files import default_model_path
from tokenweir.common.text.tokenizer import Tokenizer
from tokenweir.engine.config import EngineConfig
from tokenweir.engine.core.block_manager import BlockManager
from tokenweir.engine.core.model_runner import ModelRunner, kv_block_bytes
from tokenweir.engine.core.output import RequestOutput, TextState
from tokenweir.engine.core.sampling_params import SamplingParams
from tokenweir.engine.core.scheduler import Scheduler
from tokenweir.engine.core.sequence import Sequence
from tokenweir.engine.core.stats import SchedulerStats, StepStats
from tokenweir.engine.model.attention import AttentionMetadata
from tokenweir.engine.model.linear import GGUF_MODES
from tokenweir.engine.model.llama import LlamaForCausalLM
from tokenweir.engine.model.loader import load_gguf_blocks, load_model_weights
from tokenweir.engine.model.precision import resolve as resolve_precision

log = logging.getLogger("tokenweir.engine")


class RequestError(ValueError):
    """A request the engine can never serve (too long, bad parameters): a 400 for the client, not a crash."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


class RequestFailed(RuntimeError):
    """One request failed inside the engine (an error in its detokenizing, stop strings or start): it ends with an
    error while every other request goes on. A 500 for its client, and a request a router must not retry elsewhere:
    its own input may be what fails."""

    code = "request_failed"


def _resolve_device(config: EngineConfig) -> torch.device:
    if config.device != "auto":
        return torch.device(config.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def kv_budget_bytes(total: int, free: int, utilization: float, own_bytes: int, activation_peak: int) -> int:
    """Bytes for this process's KV pool on a GPU: its share (`utilization` of the device's memory, per instance as
    vLLM reads gpu_memory_utilization, so two engines on one GPU take about half each) less what it holds already
    (`own_bytes`, the weights) and the activations' peak; never more than is free now, less that peak."""
    share = int(utilization * total) - own_bytes - activation_peak
    return max(min(share, free - activation_peak), 0)


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = False) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        path = config.model or default_model_path()
        self.model_path = path
        device = _resolve_device(config)
        if config.quantization in GGUF_MODES and not path.endswith(".gguf"):
            raise ValueError(
                f"{path}: --quantization {config.quantization} takes a .gguf model; a HF directory has no GGUF blocks"
            )
        model_config, state = load_model_weights(path, progress=progress)
        self.model_config = model_config
        self.model_name = config.served_model_name or model_config.name
        self.tokenizer = self._load_tokenizer(path)
        widest = (model_config.hidden_size, 2 * model_config.intermediate_size)  # the fused gate/up projection
        self.precision = resolve_precision(
            config.dtype, config.quantization, device, widest, model_config.layer_formats
        )
        dtype = self.precision.dtype
        log.info("precision: %s", self.precision.reason)
        self.model = LlamaForCausalLM(
            model_config,
            state,
            dtype,
            device,
            config.attention_backend,
            model_config.max_position_embeddings,
            self.precision.quantization,
            load_gguf_blocks(path) if self.precision.quantization in GGUF_MODES else None,
            self.precision.prefill_dtype,
        )
        del state
        # Sized after the weights are on the device, so gpu_memory_utilization counts them (as nano-vllm does).
        block_bytes = kv_block_bytes(model_config, config.block_size, dtype)
        num_blocks = config.num_kv_blocks or self._blocks_from_memory(block_bytes, device)
        assert num_blocks > 0, "the KV-cache budget holds no block: raise --kv-cache-memory"
        self.max_model_len = min(
            config.max_model_len or model_config.max_position_embeddings,
            model_config.max_position_embeddings,
            num_blocks * config.block_size,
        )
        self.stop_token_ids = set(self.tokenizer.stop_token_ids) if self.tokenizer else set()
        if model_config.eos_token_id is not None:
            self.stop_token_ids.add(model_config.eos_token_id)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=self.stop_token_ids,
        )
        self._structured = None  # engine.text.structured.StructuredOutputs, made on the first request that needs it
        self.runner = ModelRunner(self.model, config, num_blocks, dtype, device)
        self.sequences: dict[str, Sequence] = {}  # by sequence id (a request's id, or its id and choice for n > 1)
        self.groups: dict[str, list[Sequence]] = {}  # by request id: its choices' sequences
        self.open_choices: dict[str, int] = {}  # by request id: choices whose final output is still to come
        self.texts: dict[str, TextState] = {}  # detokenizer and stop strings, per sequence
        self.last_stats = StepStats()
        log.info(
            "engine ready: %s, %d KV blocks x %d tokens (%.0f MiB), attention=%s, device=%s, dtype=%s, weights=%s",
            self.model_name,
            num_blocks,
            config.block_size,
            num_blocks * block_bytes / 2**20,
            self.model.attention_backend,
            device,
            dtype,
            self.precision.quantization,
        )

    def _blocks_from_memory(self, block_bytes: int, device: torch.device) -> int:
        if device.type != "cuda":
            return self.config.kv_cache_memory // block_bytes
        # As nano-vllm: the weights are on the device already; a warm-up forward of the largest step measures the
        # activations' peak, and the pool gets what is left of this process's share after both.
        activation_peak = self._warmup_peak_bytes(device)
        free, total = torch.cuda.mem_get_info(device)
        budget = kv_budget_bytes(
            total, free, self.config.gpu_memory_utilization, torch.cuda.memory_reserved(device), activation_peak
        )
        return max(budget // block_bytes, 0)

    def _warmup_peak_bytes(self, device: torch.device) -> int:
        """Peak bytes allocated above the weights by one prefill of max_num_batched_tokens (a throwaway KV pool)."""
        tokens = min(self.config.max_num_batched_tokens, self.model_config.max_position_embeddings)
        kv = self.model.scratch_kv(tokens, self.config.block_size)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        meta = AttentionMetadata.one_prefill(0, tokens, len(kv[0][0]), device)
        ids = torch.zeros(tokens, dtype=torch.long, device=device)
        self.model.forward(ids, meta.slot_mapping, kv, meta, torch.tensor([tokens - 1], device=device))
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del kv, meta
        torch.cuda.empty_cache()
        log.info("warm-up: %d tokens, activation peak %.0f MiB", tokens, peak / 2**20)
        return peak

    @staticmethod
    def _load_tokenizer(path: str) -> Tokenizer | None:
        if path.endswith(".gguf"):
            return Tokenizer.from_gguf(path)
        if os.path.exists(os.path.join(path, "tokenizer.json")):
            return Tokenizer.from_hf_dir(path)
        return None  # a bare test model: token ids in, token ids out

    # --- requests -------------------------------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError for a request that can never run; fills in a missing max_tokens. The one check of a
        request against this engine's limits, made at the edge (AsyncEngine.add_request, LLM.generate). No engine
        state is touched, so it runs on the event loop, and a stream's 400 comes before its first byte."""
        if not prompt_token_ids:
            raise RequestError("the prompt is empty", code="empty_prompt", param="prompt")
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})", code="invalid_token_id", param="prompt")
        bias = params.logit_bias or {}
        if any(not 0 <= t < vocab for t in bias):
            raise RequestError(
                f"logit_bias keys must be token ids in [0, {vocab})", code="invalid_token_id", param="logit_bias"
            )
        if params.structured is not None:
            try:
                self.structured.compile(params.structured)
            except ValueError as exc:
                raise RequestError(str(exc), code="invalid_response_format", param="response_format") from exc
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

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> Sequence:
        """Queue a request that passed `validate`; returns its (first) sequence. n > 1 queues one sequence per choice,
        the later ones held until the first has prefilled the prompt they share (through the prefix cache)."""
        assert request_id not in self.groups, f"request id {request_id!r} is already running"
        assert params.max_tokens is not None and len(prompt_token_ids) + params.max_tokens <= self.max_model_len
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # Registered before its sequences are made, so a failure half-way is cleaned up by fail_request.
        group: list[Sequence] = self.groups.setdefault(request_id, [])
        self.open_choices[request_id] = 0
        for index in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{index}"
            lead = group[0] if group and self.block_manager.enable_prefix_caching else None
            choice = params if params.n == 1 else params.for_choice(index)
            seq = Sequence(
                seq_id,
                prompt_token_ids,
                choice,
                priority,
                arrival_time,
                group_id=request_id,
                index=index,
                wait_for=lead,
            )
            if choice.structured is not None:
                seq.matcher = self.structured.matcher(self.structured.compile(choice.structured))
            self.texts[seq_id] = TextState(
                self.tokenizer, choice.stop, choice.include_stop_str_in_output, choice.skip_special_tokens
            )
            self.sequences[seq_id] = seq
            group.append(seq)
            self.open_choices[request_id] += 1
            self.scheduler.add(seq)
        return group[0]

    @property
    def structured(self):
        """Grammar masks for structured outputs (imported on first use: plain decoding never needs the library)."""
        if self._structured is None:
            if self.tokenizer is None:
                raise RequestError(
                    "this model has no tokenizer, so it cannot follow a response_format",
                    code="invalid_response_format",
                    param="response_format",
                )
            from tokenweir.engine.text.structured import StructuredOutputs

            self._structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size, self.stop_token_ids)
            self.runner.sampler.structured = self._structured
        return self._structured

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Stop a request's unfinished choices now and free their blocks; returns their final outputs (the last one
        `finished`, with the request's exact token counts), or nothing for an unknown request."""
        outputs = []
        for seq in [s for s in self.groups.get(request_id, []) if not s.is_finished]:
            self.scheduler.finish(seq, "abort")
            outputs.append(self._final_output(seq, []))
        return outputs

    def fail_request(self, request_id: str, error: Exception) -> list[RequestOutput]:
        """End a request's open choices with `error` and free their blocks; returns their final outputs (the last one
        `finished`, with the tokens made so far counted), each carrying the error. The engine goes on."""
        outputs = []
        for seq in [s for s in self.groups.get(request_id, []) if s.request_id in self.sequences]:
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")
            seq.finish_reason = "error"
            out = self._close_choice(seq, [], "")
            out.error = error
            outputs.append(out)
        if self.open_choices.get(request_id) == 0:  # it failed before its first choice was made
            del self.groups[request_id], self.open_choices[request_id]
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    # --- the step ---------------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, let the scheduler record what it produced, make the outputs."""
        start = time.monotonic()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            self.last_stats = StepStats()
            return []
        sampled_token_ids, logprobs, failed = self.runner.run(batch)
        stepped = self.scheduler.update(batch, sampled_token_ids, logprobs)
        outputs = []
        for seq in stepped:
            if seq.request_id not in self.sequences:  # a sibling choice failed earlier in this loop
                continue
            try:
                outputs.append(self._output(seq))
            except Exception as exc:  # this request's text handling failed: end it, not the step loop
                log.exception("request %s failed in its output", seq.group_id)
                outputs += self.fail_request(seq.group_id, RequestFailed(f"the engine failed on this request: {exc!r}"))
        for seq_id, why in failed.items():
            failing = self.sequences.get(seq_id)
            if failing is not None:
                log.warning("request %s: %s", failing.group_id, why)
                outputs += self.fail_request(
                    failing.group_id, RequestError(why, code="invalid_response_format", param="response_format")
                )
        self.last_stats = StepStats(
            num_generation_tokens=len(stepped),
            num_tokens=batch.num_tokens,
            first_tokens=[seq for seq in stepped if seq.num_output_tokens == 1],  # per choice: each is a sequence
            finished=[seq for seq in stepped if seq.is_finished],
            step_seconds=time.monotonic() - start,
        )
        return outputs

    def _output(self, seq: Sequence) -> RequestOutput:
        """The step's output for a sequence that got a token. Stop strings are matched here, not in Scheduler.update,
        because they need the detokenized text, which lives in the request's TextState."""
        token_id = seq.token_ids[-1]
        text = self.texts[seq.request_id]
        stop_string = text.add(token_id)
        if stop_string is not None:
            if seq.is_finished:  # EOS or length on the same token: the stop string wins, as in vLLM
                seq.finish_reason = "stop"
            else:
                self.scheduler.finish(seq, "stop")
            seq.stop_reason = stop_string
        if seq.is_finished:
            return self._final_output(seq, [token_id])
        return self._request_output(seq, [token_id], text.take_delta(finished=False))

    def _final_output(self, seq: Sequence, new_token_ids: list[int]) -> RequestOutput:
        return self._close_choice(seq, new_token_ids, self.texts[seq.request_id].take_delta(finished=True))

    def _close_choice(self, seq: Sequence, new_token_ids: list[int], text: str) -> RequestOutput:
        """A finished choice's last output; the request is forgotten once its last choice closes."""
        del self.sequences[seq.request_id]
        self.texts.pop(seq.request_id, None)
        self.runner.sampler.forget(seq.request_id)
        self.open_choices[seq.group_id] -= 1
        out = self._request_output(seq, new_token_ids, text)
        if out.finished:
            del self.groups[seq.group_id], self.open_choices[seq.group_id]
        return out

    def _request_output(self, seq: Sequence, new_token_ids: list[int], new_text: str) -> RequestOutput:
        group = self.groups[seq.group_id]
        wants = seq.params.logprobs is not None
        return RequestOutput(
            seq.group_id,
            new_token_ids,
            new_text,
            self.open_choices[seq.group_id] == 0,
            seq.finish_reason,
            seq.num_prompt_tokens,
            sum(s.num_output_tokens for s in group),
            group[0].num_cached_tokens,
            seq.stop_reason,
            index=seq.index,
            logprobs=seq.logprobs[len(seq.logprobs) - len(new_token_ids) :] if wants else None,
            prompt_logprobs=seq.prompt_logprobs if seq.prompt_logprobs and seq.num_output_tokens == 1 else None,
        )
