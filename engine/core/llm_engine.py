"""LLMEngine: the step loop over a ModelRunner (the model, its KV pool), the Scheduler and the OutputProcessor (text,
stop strings, per-request outputs); its step is schedule -> run the model -> update the sequences -> outputs. Beside
the scheduler, a Speculator (engine/spec_decode/speculator.py) drafts tokens before the schedule and records their
acceptance after the run, and a KVTransferCoordinator (engine/kv_transfer/coordinator.py) runs a disaggregated
prefill's pins and fetches, each called at named points of a request and of the step.
Requests are checked once, at the edge, by `validate` (engine/core/request_checks.py): AsyncEngine.add_request for
the server, LLM.generate offline; add_request only asserts.

The offline convenience wrapper is engine/llm.py.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from tokenweir.common.http.fairness_id import MAX_FAIRNESS_ID_CHARS
from tokenweir.common.text.model_files import default_model_path, model_digest
from tokenweir.common.text.tokenizer import Tokenizer
from tokenweir.engine.config import EngineConfig
from tokenweir.engine.core.errors import RequestError, RequestFailed
from tokenweir.engine.core.output import RequestOutput
from tokenweir.engine.core.output_processor import OutputProcessor
from tokenweir.engine.core.request_checks import check_kv_transfer, check_request
from tokenweir.engine.kv_transfer.coordinator import KVTransferCoordinator
from tokenweir.engine.sched.block_manager import BlockManager
from tokenweir.engine.sched.fairness import VirtualTokenCounter
from tokenweir.engine.sched.sampling_params import SamplingParams
from tokenweir.engine.sched.scheduler import Scheduler, SchedulerOutput
from tokenweir.engine.sched.sequence import Sequence
from tokenweir.engine.sched.stats import SchedulerStats, SpecDecodingStats, StepStats
from tokenweir.engine.spec_decode.speculator import Speculator
from tokenweir.engine.worker.model_runner import ModelRunner
from tokenweir.kernels.cpu import ops as cpu_ops

log = logging.getLogger("tokenweir.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = False) -> None:
        self.config = config
        cpu_ops.hold_torch_to_isa()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_path = config.model or default_model_path()
        self.runner = ModelRunner(config, self.model_path, progress)  # loads the model, sizes and allocates the pool
        self.model_revision = model_digest(self.model_path)  # which weights these are, for routers and KV transfers
        self.model, self.precision = self.runner.model, self.runner.precision
        self.model_config = self.model.config
        self.model_name = config.served_model_name or self.model_config.name
        self.tokenizer = _load_tokenizer(self.model_path)
        num_blocks = self.runner.num_blocks
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
            num_blocks * config.block_size,
        )
        if not config.enable_chunked_prefill and self.max_model_len > config.max_num_batched_tokens:
            # a prompt (or a preempted sequence's recompute) must fit one step
            log.info(
                "chunked prefill off: max_model_len %d capped to max_num_batched_tokens %d",
                self.max_model_len,
                config.max_num_batched_tokens,
            )
            self.max_model_len = config.max_num_batched_tokens
        self.stop_token_ids = set(self.tokenizer.stop_token_ids) if self.tokenizer else set()
        if self.model_config.eos_token_id is not None:
            self.stop_token_ids.add(self.model_config.eos_token_id)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=self.stop_token_ids,
            chunked_prefill=config.enable_chunked_prefill,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            shortest_prompt_first=config.scheduling_policy == "shortest-prompt",
        )
        self.scheduler.fairness = VirtualTokenCounter(output_weight=config.fairness_output_weight)
        self.speculator: Speculator | None = None
        if config.speculative is not None:
            vocab_size = self.model_config.vocab_size
            self.speculator = Speculator(config, vocab_size, self.max_model_len, self.stop_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler, self.runner.sampler)
        self.on_transfer_event = lambda: None  # AsyncEngine wakes its idle loop with it: a pin fetched, a fetch done
        self.kv_transfer: KVTransferCoordinator | None = None
        if config.kv_transfer is not None:
            self.kv_transfer = KVTransferCoordinator(
                config.kv_transfer,
                self.scheduler,
                self.runner.kv_cache,
                self.model_revision,
                self.precision.quantization,
                on_event=lambda: self.on_transfer_event(),  # late: AsyncEngine sets it after this
            )
        self._structured = None  # engine.text.structured.StructuredOutputs, made on the first request that needs it
        self.last_stats = StepStats()
        log.info(
            "engine ready: %s, %d KV blocks x %d tokens (%.0f MiB), attention=%s, device=%s, dtype=%s, weights=%s",
            self.model_name,
            num_blocks,
            config.block_size,
            num_blocks * self.runner.block_bytes / 2**20,
            self.model.attention_backend,
            self.runner.device,
            self.precision.dtype,
            self.precision.quantization,
        )
        log.info("levers: %s", self.levers())

    def close(self) -> None:
        """Stop the KV transfer threads (the model and its pool go with the object)."""
        if self.kv_transfer is not None:
            self.kv_transfer.close()

    def levers(self) -> str:
        """Each serving lever's setting, as the start-up log states it."""
        config, spec = self.config, self.config.speculative
        chunk = min(config.long_prefill_token_threshold or config.max_num_batched_tokens, config.max_num_batched_tokens)
        chunked = f"on (chunks of {chunk})" if config.enable_chunked_prefill else "off"
        return (
            f"prefix_caching={'on' if config.enable_prefix_caching else 'off'}, chunked_prefill={chunked}, "
            f"scheduling_policy={config.scheduling_policy}, "
            f"speculative={spec.describe() if spec is not None else 'off'}, structured_outputs=per request, "
            f"kv_transfer={config.kv_transfer.describe() if config.kv_transfer is not None else 'off'}"
        )

    # --- requests -------------------------------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError for a request that can never run; fills in a missing max_tokens (check_request)."""
        vocab_size = self.model_config.vocab_size
        check_request(prompt_token_ids, params, vocab_size, self.max_model_len, lambda: self.structured)
        check_kv_transfer(params.kv_transfer_params, self.config.kv_transfer)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        fairness_id: str | None = None,
    ) -> Sequence:
        """Queue a request that passed `validate`; returns its (first) sequence. n > 1 queues one sequence per choice,
        the later ones held until the first has prefilled the prompt they share (through the prefix cache).
        `fairness_id`: the tenant whose token-fairness counter its tokens count in (engine/sched/fairness.py)."""
        assert params.max_tokens is not None and len(prompt_token_ids) + params.max_tokens <= self.max_model_len
        assert fairness_id is None or len(fairness_id) <= MAX_FAIRNESS_ID_CHARS
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        group = self.output_processor.add_request(request_id).choices  # first: a failure half-way is cleaned up
        for index in range(params.n):
            lead = group[0] if group and self.block_manager.enable_prefix_caching else None
            choice = params if params.n == 1 else params.for_choice(index)
            seq_id = request_id if params.n == 1 else f"{request_id}#{index}"
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
            seq.fairness_id = fairness_id
            if choice.structured is not None:
                seq.matcher = self.structured.matcher(self.structured.compile(choice.structured))
            if index == 0 and self.kv_transfer is not None:  # the first choice carries the prompt's KV for the others
                self.kv_transfer.add_request(seq, params)
            self.output_processor.add_choice(seq)
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
        """Stop a request's unfinished choices and free their blocks; returns their final outputs (OutputProcessor).
        A finished prefill hop's pinned blocks are let go too (no consumer will come for them)."""
        if self.kv_transfer is not None:
            self.kv_transfer.release(request_id)
        return self.output_processor.abort(request_id)

    def fail_request(self, request_id: str, error: Exception) -> list[RequestOutput]:
        """End a request's open choices with `error`, freeing their blocks; the engine goes on (OutputProcessor)."""
        return self.output_processor.fail(request_id, error)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def make_stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        return self.kv_transfer.add_stats(stats) if self.kv_transfer is not None else stats

    # --- the step ---------------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, let the scheduler record what it produced, make the outputs."""
        start = time.monotonic()
        batch = self._schedule()
        if batch.is_empty:
            self.last_stats = StepStats()
            if self.kv_transfer is not None:
                self.kv_transfer.wait_for_fetch()
            return []
        sampled_token_ids, logprobs, failed = self.runner.run(batch)
        self._time_run(batch, time.monotonic() - start)
        spec = self.speculator.record(batch, sampled_token_ids) if self.speculator is not None else None
        stepped = self.scheduler.update(batch, sampled_token_ids, logprobs)
        outputs = self._make_outputs(stepped) + self._fail_stuck(batch, failed)
        if self.speculator is not None:
            self.speculator.finished(stepped)
        self.last_stats = _step_stats(batch, stepped, spec, time.monotonic() - start)
        return outputs

    def _schedule(self) -> SchedulerOutput:
        """The step's batch, with what the KV transfers did since the last step taken in before it, drafts proposed
        for the decoding sequences, and the fetches started for the decode hops it gave blocks to."""
        self.collect_transfers()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if self.kv_transfer is not None:
            self.kv_transfer.start_fetches()
        return batch

    def _time_run(self, batch: SchedulerOutput, ran_s: float) -> None:
        """The run's rows and time, to what prices a step's rows: the scheduler's prefill chunks, the speculator's
        verification rows."""
        if batch.prefills:
            self.scheduler.observe_step(batch.num_tokens, ran_s)
        elif self.speculator is not None:
            self.speculator.observe_step(batch.num_tokens, ran_s)

    def _make_outputs(self, stepped: list[Sequence]) -> list[RequestOutput]:
        """The stepped sequences' outputs; a request whose text handling fails is ended, not the step loop."""
        outputs: list[RequestOutput] = []
        for seq in stepped:
            if not self.output_processor.is_open(seq):  # a sibling choice failed earlier in this loop
                continue
            try:
                outputs.append(self.output_processor.process(seq))
            except Exception as exc:  # this request's text handling failed: end it, not the step loop
                log.exception("request %s failed in its output", seq.group_id)
                outputs += self.fail_request(seq.group_id, RequestFailed(f"the engine failed on this request: {exc!r}"))
        return outputs

    def _fail_stuck(self, batch: SchedulerOutput, failed: dict[str, str]) -> list[RequestOutput]:
        """End the requests whose grammar could not go on this step (`failed`: why, by sequence id)."""
        outputs: list[RequestOutput] = []
        for failing in [seq for seq, _ in batch.scheduled() if seq.request_id in failed]:
            if self.output_processor.is_open(failing):
                why = failed[failing.request_id]
                log.warning("request %s: %s", failing.group_id, why)
                outputs += self.fail_request(
                    failing.group_id, RequestError(why, code="invalid_response_format", param="response_format")
                )
        return outputs

    # --- disaggregated prefill ----------------------------------------------------------------------------------------

    def collect_transfers(self) -> bool:
        """Take in what the KV transfers did (KVTransferCoordinator.collect); True if a pin was freed (the pool
        changed while no request ran)."""
        return self.kv_transfer.collect() if self.kv_transfer is not None else False

    def idle_wait_s(self) -> float:
        """How long an engine with no request may sleep: until its next pin expires, a second at most."""
        return self.kv_transfer.idle_wait_s() if self.kv_transfer is not None else 1.0


def _step_stats(
    batch: SchedulerOutput, stepped: list[Sequence], spec: SpecDecodingStats | None, seconds: float
) -> StepStats:
    return StepStats(
        num_generation_tokens=sum(seq.num_new_tokens for seq in stepped),
        spec=spec,
        num_tokens=batch.num_tokens,
        first_tokens=[seq for seq in stepped if seq.num_output_tokens == seq.num_new_tokens],  # per choice
        decoded=[seq.num_new_tokens for seq in stepped if seq.num_output_tokens > seq.num_new_tokens],
        finished=[seq for seq in stepped if seq.is_finished],
        step_seconds=seconds,
    )


def _load_tokenizer(path: str) -> Tokenizer | None:
    if path.endswith(".gguf"):
        return Tokenizer.from_gguf(path)
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return Tokenizer.from_hf_dir(path)
    return None  # a bare test model: token ids in, token ids out
