"""LLMEngine: the step loop over a ModelRunner (the model, its KV pool), the Scheduler and the OutputProcessor (text,
stop strings, per-request outputs); its step is schedule -> run the model -> update the sequences -> outputs.
Requests are checked once, at the edge, by `validate` (engine/core/request_checks.py): AsyncEngine.add_request for
the server, LLM.generate offline; add_request only asserts.

The offline convenience wrapper is engine/llm.py.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace

import torch

from tokenweir.common.text.model_files import default_model_path, model_digest
from tokenweir.common.text.tokenizer import Tokenizer
from tokenweir.engine.config import EngineConfig
from tokenweir.engine.core.errors import RequestError, RequestFailed
from tokenweir.engine.core.output import RequestOutput
from tokenweir.engine.core.output_processor import OutputProcessor
from tokenweir.engine.core.request_checks import check_request
from tokenweir.engine.kv_transfer.fetcher import KVFetch, KVFetcher
from tokenweir.engine.kv_transfer.layout import KVLayout, prompt_digest
from tokenweir.engine.kv_transfer.params import (
    RemotePrefill,
    consumer_answer,
    wants_remote_decode,
    wants_remote_prefill,
)
from tokenweir.engine.kv_transfer.pins import KVPins
from tokenweir.engine.kv_transfer.server import KVServer
from tokenweir.engine.sched.block_manager import BlockManager
from tokenweir.engine.sched.sampling_params import SamplingParams
from tokenweir.engine.sched.scheduler import Scheduler, SchedulerOutput
from tokenweir.engine.sched.sequence import Sequence
from tokenweir.engine.sched.stats import SchedulerStats, SpecDecodingStats, StepStats
from tokenweir.engine.spec.draft_budget import DraftBudget
from tokenweir.engine.spec.draft_model_proposer import DraftModelProposer
from tokenweir.engine.spec.ngram_proposer import NgramProposer
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
        self.proposer: NgramProposer | DraftModelProposer | None = None
        if config.speculative is not None and config.speculative.method == "draft_model":
            vocab_size = self.model_config.vocab_size
            self.proposer = DraftModelProposer(config.speculative, config, vocab_size, self.stop_token_ids)
        elif config.speculative is not None:
            self.proposer = NgramProposer(config.speculative)
        self.draft_budget = DraftBudget() if config.speculative is not None and config.speculative.cost_aware else None
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler, self.runner.sampler)
        self._set_up_kv_transfer()
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

    def _set_up_kv_transfer(self) -> None:
        """The producer's pins and KV server, the consumer's fetcher (engine/kv_transfer/)."""
        self.on_transfer_event = lambda: None  # AsyncEngine wakes its idle loop with it
        self.kv_pins: KVPins | None = None
        self.kv_server: KVServer | None = None
        self.kv_fetcher: KVFetcher | None = None
        self._remote: dict[str, tuple[Sequence, RemotePrefill]] = {}  # decode hops by sequence id, until fetching
        self._fetches: dict[str, KVFetch] = {}  # by sequence id, while in flight
        self.kv_fetches = self.kv_fetch_failures = self.kv_fetched_bytes = 0
        self.kv_fetch_seconds = 0.0
        config = self.config.kv_transfer
        if config is None:
            return
        kv_cache = self.runner.kv_cache
        self.kv_layout = KVLayout.of_cache(kv_cache, self.model_revision, self.precision.quantization)
        self.engine_id = f"{config.kv_ip}:{os.getpid()}:{id(self):x}"
        if config.is_producer:
            self.kv_pins = KVPins(config.pin_timeout_s, lambda: self.on_transfer_event(), config.transfer_key)
            self.kv_server = KVServer(self.kv_pins, kv_cache, self.kv_layout, config.kv_ip, config.kv_port)
            self.kv_pins.address = (self.kv_server.host, self.kv_server.port, self.engine_id)
            self.scheduler.pin = self.kv_pins.pin
        if config.is_consumer:
            self.kv_fetcher = KVFetcher(kv_cache, self.kv_layout, config, on_done=lambda: self.on_transfer_event())
        log.info("kv transfer: %s, serving on port %s", config.describe(), self.kv_server and self.kv_server.port)

    def close(self) -> None:
        """Stop the KV transfer threads (the model and its pool go with the object)."""
        if self.kv_server is not None:
            self.kv_server.close()
        if self.kv_fetcher is not None:
            self.kv_fetcher.close()

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
        self._check_kv_transfer(params.kv_transfer_params)

    def _check_kv_transfer(self, params: dict | None) -> None:
        if not params:
            return
        config = self.config.kv_transfer
        hop = "prefill" if wants_remote_decode(params) else "decode" if wants_remote_prefill(params) else None
        if hop is None:
            raise RequestError(
                'kv_transfer_params: {"do_remote_decode": true} for a prefill hop, or a prefill hop\'s answer',
                code="invalid_kv_transfer_params",
                param="kv_transfer_params",
            )
        role_ok = config is not None and (config.is_producer if hop == "prefill" else config.is_consumer)
        if not role_ok:
            raise RequestError(
                f"this engine takes no {hop} hops: its --kv-transfer-config is "
                f"{config.kv_role if config is not None else 'unset'}",
                code="kv_transfer_unsupported",
                param="kv_transfer_params",
            )
        if hop == "decode":
            try:
                RemotePrefill.parse(params)
            except ValueError as exc:
                raise RequestError(str(exc), code="invalid_kv_transfer_params", param="kv_transfer_params") from None

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
        assert params.max_tokens is not None and len(prompt_token_ids) + params.max_tokens <= self.max_model_len
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
            if choice.structured is not None:
                seq.matcher = self.structured.matcher(self.structured.compile(choice.structured))
            if index == 0 and params.kv_transfer_params:  # the first choice carries the prompt's KV for the others
                seq.remote_decode = wants_remote_decode(params.kv_transfer_params)
                if wants_remote_prefill(params.kv_transfer_params):
                    remote = RemotePrefill.parse(params.kv_transfer_params)
                    # prompt logprobs need every prompt position computed here: the producer's pin is let go
                    seq.num_remote_tokens = remote.num_tokens if params.prompt_logprobs is None else None
                    seq.kv_transfer_params = consumer_answer(remote.engine_id, 0, 0, 0.0, None)
                    self._remote[seq_id] = (seq, remote)
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
        if self.kv_pins is not None:
            self.kv_pins.release(request_id)
        return self.output_processor.abort(request_id)

    def fail_request(self, request_id: str, error: Exception) -> list[RequestOutput]:
        """End a request's open choices with `error`, freeing their blocks; the engine goes on (OutputProcessor)."""
        return self.output_processor.fail(request_id, error)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def make_stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        if self.config.kv_transfer is None:
            return stats
        pins, server = self.kv_pins, self.kv_server
        return replace(
            stats,
            kv_pinned_blocks=pins.num_blocks if pins is not None else 0,
            kv_pins_served=server.transfers_served if server is not None else 0,
            kv_pins_expired=pins.num_expired if pins is not None else 0,
            kv_bytes_sent=server.bytes_sent if server is not None else 0,
            kv_fetches=self.kv_fetches,
            kv_fetch_failures=self.kv_fetch_failures,
            kv_bytes_fetched=self.kv_fetched_bytes,
            kv_fetch_seconds=self.kv_fetch_seconds,
        )

    # --- the step ---------------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, let the scheduler record what it produced, make the outputs."""
        start = time.monotonic()
        self.collect_transfers()
        if self.proposer is not None:
            self._propose()
        batch = self.scheduler.schedule()
        self._start_fetches()
        if batch.is_empty:
            self.last_stats = StepStats()
            if self.kv_fetcher is not None and self.kv_fetcher.in_flight:
                self.kv_fetcher.wait(0.01)  # only fetches are under way: wait for one rather than spin
            return []
        sampled_token_ids, logprobs, failed = self.runner.run(batch)
        ran_s = time.monotonic() - start
        if batch.prefills:
            self.scheduler.observe_step(batch.num_tokens, ran_s)
        elif self.draft_budget is not None:
            self.draft_budget.observe_step(batch.num_tokens, ran_s)
        spec = self._record_drafts(batch, sampled_token_ids)
        stepped = self.scheduler.update(batch, sampled_token_ids, logprobs)
        outputs = []
        for seq in stepped:
            if not self.output_processor.is_open(seq):  # a sibling choice failed earlier in this loop
                continue
            try:
                outputs.append(self.output_processor.process(seq))
            except Exception as exc:  # this request's text handling failed: end it, not the step loop
                log.exception("request %s failed in its output", seq.group_id)
                outputs += self.fail_request(seq.group_id, RequestFailed(f"the engine failed on this request: {exc!r}"))
        for failing in [seq for seq, _ in batch.scheduled() if seq.request_id in failed]:
            if self.output_processor.is_open(failing):
                why = failed[failing.request_id]
                log.warning("request %s: %s", failing.group_id, why)
                outputs += self.fail_request(
                    failing.group_id, RequestError(why, code="invalid_response_format", param="response_format")
                )
        if self.proposer is not None:
            for seq in stepped:
                if seq.is_finished:
                    self.proposer.finished(seq)
        self.last_stats = StepStats(
            num_generation_tokens=sum(seq.num_new_tokens for seq in stepped),
            spec=spec,
            num_tokens=batch.num_tokens,
            first_tokens=[seq for seq in stepped if seq.num_output_tokens == seq.num_new_tokens],  # per choice
            decoded=[seq.num_new_tokens for seq in stepped if seq.num_output_tokens > seq.num_new_tokens],
            finished=[seq for seq in stepped if seq.is_finished],
            step_seconds=time.monotonic() - start,
        )
        return outputs

    # --- disaggregated prefill ----------------------------------------------------------------------------------------

    def collect_transfers(self) -> bool:
        """Free the pins consumers have fetched or that expired; take in the finished fetches (their sequences run,
        or compute their prompts here if the fetch failed); stop fetching for requests that ended. True if a pin was
        freed (the pool changed while no request ran)."""
        freed = self.kv_pins is not None and self.kv_pins.collect(self.block_manager.free) > 0
        if self.kv_fetcher is None:
            return freed
        for fetch in self.kv_fetcher.poll():
            if not fetch.block_ids:  # a release: the producer's pin is not needed
                if not fetch.ok:
                    log.warning(
                        "request %s: the producer was not told to free its pinned KV (%s); it frees it at its timeout",
                        fetch.seq.group_id,
                        fetch.detail,
                    )
                continue
            del self._fetches[fetch.seq.request_id]
            self.kv_fetches += 1
            self.kv_fetched_bytes += fetch.num_bytes
            self.kv_fetch_seconds += fetch.seconds
            seq = fetch.seq
            fetched = seq.num_prompt_tokens - 1 - seq.num_cached_tokens if fetch.ok else 0
            seq.kv_transfer_params = consumer_answer(
                fetch.remote.engine_id, fetched, fetch.num_bytes, fetch.seconds, None if fetch.ok else fetch.error
            )
            if not fetch.ok and not seq.is_finished:
                self.kv_fetch_failures += 1
                log.warning("request %s: KV fetch failed (%s); computing its prompt here", seq.group_id, fetch.detail)
            self.scheduler.fetched(seq, fetch.ok)
        for fetch in self._fetches.values():
            if fetch.seq.is_finished:
                fetch.cancelled.set()
        for seq_id in [i for i, (seq, _) in self._remote.items() if seq.is_finished or seq.num_remote_tokens is None]:
            # ended before its fetch began, or its prefix cache holds the prompt: the producer may free its pin
            seq, remote = self._remote.pop(seq_id)
            self.kv_fetcher.submit(_fetch_of(seq, remote, 0, []))
        return freed

    def idle_wait_s(self) -> float:
        """How long an engine with no request may sleep: until its next pin expires, a second at most."""
        expiry = self.kv_pins.next_expiry() if self.kv_pins is not None else None
        return 1.0 if expiry is None else min(1.0, max(0.0, expiry - time.monotonic()) + 0.001)

    def _start_fetches(self) -> None:
        for seq in self.scheduler.new_fetches:
            assert self.kv_fetcher is not None  # validate checked the role
            _, remote = self._remote.pop(seq.request_id)
            first = seq.num_computed_tokens // self.config.block_size
            fetch = _fetch_of(seq, remote, first, seq.block_table[first:])
            self._fetches[seq.request_id] = fetch
            self.kv_fetcher.submit(fetch)
        self.scheduler.new_fetches.clear()

    def _propose(self) -> None:
        """Drafts for the decoding sequences that may speculate (none above the batch-size switch)."""
        assert self.proposer is not None
        running = self.scheduler.running
        limit = self.proposer.config.disable_by_batch_size
        requests: list[tuple[Sequence, int]] = []
        decoding = 0
        # above the switch no sequence asks, but the budget still hears of the empty step (it scores only this one's)
        for seq in running if limit is None or len(running) <= limit else []:
            # one token to compute, not of the prompt (a prompt's last token is a prefill row, never a verify row)
            if seq.num_tokens - seq.num_computed_tokens != 1 or seq.is_prefilling:
                continue
            decoding += 1
            if not _may_speculate(seq):
                continue
            params = seq.params
            assert params.max_tokens is not None
            # never a draft past max_tokens or the context: the tokens a step emits are its drafts and one more
            room = min(params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            requests.append((seq, room))
        proposed = self.proposer.propose_batch(requests)
        proposals = [(seq, drafts) for (seq, _), drafts in zip(requests, proposed, strict=True)]
        kept = [drafts for _, drafts in proposals]
        if self.draft_budget is not None:
            kept = self.draft_budget.trim(proposals, decoding)
        for (seq, _), drafts in zip(proposals, kept, strict=True):
            seq.draft_token_ids = drafts

    def _record_drafts(self, batch: SchedulerOutput, sampled: dict[str, list[int]]) -> SpecDecodingStats | None:
        """This step's drafts and how many of each sequence's were accepted (before update clears them)."""
        if self.proposer is None:
            return None
        stats = SpecDecodingStats(self.proposer.config.num_speculative_tokens)
        for seq, _ in batch.scheduled():
            emitted = sampled.get(seq.request_id)
            if emitted is None:
                continue
            if self.draft_budget is not None:  # also scores a draft it held back
                self.draft_budget.record(seq, emitted)
            drafts = seq.draft_token_ids
            if drafts:
                accepted = len(emitted) - 1
                stats.observe(len(drafts), accepted)
                seq.num_draft_tokens += len(drafts)
                seq.num_accepted_tokens += accepted
                self.proposer.record(seq, len(drafts), accepted)
        return stats


def _fetch_of(seq: Sequence, remote: RemotePrefill, first_block: int, block_ids: list[int]) -> KVFetch:
    """A fetch of `seq`'s prompt KV from `remote` into `block_ids` (none: only let the producer's pin go)."""
    return KVFetch(seq, remote, prompt_digest(seq.token_ids[: seq.num_prompt_tokens]), first_block, block_ids)


def _may_speculate(seq: Sequence) -> bool:
    """Drafts are checked against the sequence's own sampling (a grammar's masks walk them); prompt logprobs are
    scored by prefill rows, not verification rows; a request may opt out."""
    params = seq.params
    return params.prompt_logprobs is None and params.speculative


def _load_tokenizer(path: str) -> Tokenizer | None:
    if path.endswith(".gguf"):
        return Tokenizer.from_gguf(path)
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return Tokenizer.from_hf_dir(path)
    return None  # a bare test model: token ids in, token ids out
