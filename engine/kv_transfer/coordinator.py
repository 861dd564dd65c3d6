"""KVTransferCoordinator: disaggregated prefill on the scheduler's side, as vLLM's KV connector has one. LLMEngine
holds one when it has a `--kv-transfer-config` and calls it at named points: a request's hop is set up when it is
added (`add_request`) and a prefill hop's pin let go when it is aborted (`release`); a step first takes in what the
transfers did meanwhile (`collect`), and once the scheduler has given the decode hops their blocks starts their
fetches (`start_fetches`); the engine's stats carry its counters (`add_stats`).

On a producer it owns the pins that hold finished prefill hops' KV blocks (pins.py; the scheduler hands it each one
through `Scheduler.pin`) and the TCP server that serves them (server.py). On a consumer it owns the fetcher
(fetcher.py), the decode hops waiting for their blocks (`remote`) and the fetches in flight (`fetches`)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from tokenweir.engine.config import KVTransferConfig
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
from tokenweir.engine.sched.sampling_params import SamplingParams
from tokenweir.engine.sched.scheduler import Scheduler
from tokenweir.engine.sched.sequence import Sequence
from tokenweir.engine.sched.stats import SchedulerStats

log = logging.getLogger("tokenweir.engine")


class KVTransferCoordinator:
    def __init__(
        self,
        config: KVTransferConfig,
        scheduler: Scheduler,
        kv_cache: torch.Tensor,
        model_digest: str,
        weights: str,
        on_event: Callable[[], None],
    ) -> None:
        """The KV pool's layout is checked against a producer's by the model file's digest and the weights'
        quantization. `on_event` is called from the transfer threads when a pin was fetched or a fetch ended (the
        engine loop may be asleep, waiting for one)."""
        self.scheduler = scheduler
        self.layout = layout = KVLayout.of_cache(kv_cache, model_digest, weights)
        self.pins: KVPins | None = None
        self.server: KVServer | None = None
        self.fetcher: KVFetcher | None = None
        self.remote: dict[str, tuple[Sequence, RemotePrefill]] = {}  # decode hops by sequence id, until fetching
        self.fetches: dict[str, KVFetch] = {}  # by sequence id, while in flight
        self.num_fetches = self.num_fetch_failures = self.fetched_bytes = 0
        self.fetch_seconds = 0.0
        self.engine_id = f"{config.kv_ip}:{os.getpid()}:{id(self):x}"
        if config.is_producer:
            self.pins = KVPins(config.pin_timeout_s, on_event, config.transfer_key)
            self.server = KVServer(self.pins, kv_cache, layout, config.kv_ip, config.kv_port)
            self.pins.address = (self.server.host, self.server.port, self.engine_id)
            scheduler.pin = self.pins.pin
        if config.is_consumer:
            self.fetcher = KVFetcher(kv_cache, layout, config, on_done=on_event)
        log.info("kv transfer: %s, serving on port %s", config.describe(), self.server and self.server.port)

    def close(self) -> None:
        """Stop the server's and the fetcher's threads."""
        if self.server is not None:
            self.server.close()
        if self.fetcher is not None:
            self.fetcher.close()

    def add_request(self, seq: Sequence, params: SamplingParams) -> None:
        """Make `seq`, a request's first choice (it carries the prompt's KV for the others), the hop its
        kv_transfer_params ask for: a prefill hop is pinned when it finishes, a decode hop waits for its fetch."""
        if not params.kv_transfer_params:
            return
        seq.remote_decode = wants_remote_decode(params.kv_transfer_params)
        if wants_remote_prefill(params.kv_transfer_params):
            remote = RemotePrefill.parse(params.kv_transfer_params)
            # prompt logprobs need every prompt position computed here: the producer's pin is let go
            seq.num_remote_tokens = remote.num_tokens if params.prompt_logprobs is None else None
            seq.kv_transfer_params = consumer_answer(remote.engine_id, 0, 0, 0.0, None)
            self.remote[seq.request_id] = (seq, remote)

    def release(self, request_id: str) -> None:
        """A request was aborted: a finished prefill hop's pinned blocks go (no consumer will come for them)."""
        if self.pins is not None:
            self.pins.release(request_id)

    def add_stats(self, stats: SchedulerStats) -> SchedulerStats:
        """`stats` with what this engine pinned and served, and what it fetched."""
        pins, server = self.pins, self.server
        return replace(
            stats,
            kv_pinned_blocks=pins.num_blocks if pins is not None else 0,
            kv_pins_served=server.transfers_served if server is not None else 0,
            kv_pins_expired=pins.num_expired if pins is not None else 0,
            kv_bytes_sent=server.bytes_sent if server is not None else 0,
            kv_fetches=self.num_fetches,
            kv_fetch_failures=self.num_fetch_failures,
            kv_bytes_fetched=self.fetched_bytes,
            kv_fetch_seconds=self.fetch_seconds,
        )

    def collect(self) -> bool:
        """Free the pins consumers have fetched or that expired; take in the finished fetches (their sequences run,
        or compute their prompts here if the fetch failed); stop fetching for requests that ended. True if a pin was
        freed (the pool changed while no request ran)."""
        freed = self.pins is not None and self.pins.collect(self.scheduler.block_manager.free) > 0
        if self.fetcher is None:
            return freed
        for fetch in self.fetcher.poll():
            self._take_in(fetch)
        for fetch in self.fetches.values():
            if fetch.seq.is_finished:
                fetch.cancelled.set()
        for seq_id in [i for i, (seq, _) in self.remote.items() if seq.is_finished or seq.num_remote_tokens is None]:
            # ended before its fetch began, or its prefix cache holds the prompt: the producer may free its pin
            seq, remote = self.remote.pop(seq_id)
            self.fetcher.submit(_fetch_of(seq, remote, 0, []))
        return freed

    def _take_in(self, fetch: KVFetch) -> None:
        if not fetch.block_ids:  # a release: the producer's pin is not needed
            if not fetch.ok:
                log.warning(
                    "request %s: the producer was not told to free its pinned KV (%s); it frees it at its timeout",
                    fetch.seq.group_id,
                    fetch.detail,
                )
            return
        del self.fetches[fetch.seq.request_id]
        self.num_fetches += 1
        self.fetched_bytes += fetch.num_bytes
        self.fetch_seconds += fetch.seconds
        seq = fetch.seq
        fetched = seq.num_prompt_tokens - 1 - seq.num_cached_tokens if fetch.ok else 0
        seq.kv_transfer_params = consumer_answer(
            fetch.remote.engine_id, fetched, fetch.num_bytes, fetch.seconds, None if fetch.ok else fetch.error
        )
        if not fetch.ok and not seq.is_finished:
            self.num_fetch_failures += 1
            log.warning("request %s: KV fetch failed (%s); computing its prompt here", seq.group_id, fetch.detail)
        self.scheduler.fetched(seq, fetch.ok)

    def idle_wait_s(self) -> float:
        """How long an engine with no request may sleep: until its next pin expires, a second at most."""
        expiry = self.pins.next_expiry() if self.pins is not None else None
        return 1.0 if expiry is None else min(1.0, max(0.0, expiry - time.monotonic()) + 0.001)

    def start_fetches(self) -> None:
        """Fetch the prompts' KV of the decode hops the scheduler has just given blocks to."""
        for seq in self.scheduler.new_fetches:
            assert self.fetcher is not None  # validate checked the role
            _, remote = self.remote.pop(seq.request_id)
            first = seq.num_computed_tokens // self.scheduler.block_manager.block_size
            fetch = _fetch_of(seq, remote, first, seq.block_table[first:])
            self.fetches[seq.request_id] = fetch
            self.fetcher.submit(fetch)
        self.scheduler.new_fetches.clear()

    def wait_for_fetch(self) -> None:
        """A step with nothing to compute: if only fetches are under way, wait for one rather than spin."""
        if self.fetcher is not None and self.fetcher.in_flight:
            self.fetcher.wait(0.01)


def _fetch_of(seq: Sequence, remote: RemotePrefill, first_block: int, block_ids: list[int]) -> KVFetch:
    """A fetch of `seq`'s prompt KV from `remote` into `block_ids` (none: only let the producer's pin go)."""
    return KVFetch(seq, remote, prompt_digest(seq.token_ids[: seq.num_prompt_tokens]), first_block, block_ids)
