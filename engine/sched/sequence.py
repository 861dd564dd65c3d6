"""A sequence's running state: its tokens, how many are computed, its block table, and what it reports per token.

A request with n > 1 runs as n sequences (one per choice, `index`), all named by the request's `group_id`; the
choices after the first wait (`wait_for`) until the first has computed the prompt, then take its blocks from the
prefix cache, so the prompt is prefilled once and its blocks are shared by ref count."""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

from tokenweir.common.text.prefix_hash import root
from tokenweir.engine.sched.sampling_params import SamplingParams

if TYPE_CHECKING:  # structured.py pulls in llguidance and torch; a sequence only holds its matcher
    from tokenweir.engine.text.structured import Matcher


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probabilities (of the model's raw distribution, before penalties, bias or masks)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the top-k (token id, logprob), most likely first


class SequenceStatus(Enum):
    WAITING = auto()
    WAITING_FOR_REMOTE_KVS = auto()  # its prompt's KV is being fetched from a producer engine
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        *,
        group_id: str | None = None,
        index: int = 0,
        wait_for: Sequence | None = None,
    ) -> None:
        assert prompt_token_ids, "a prompt needs at least one token"
        self.request_id = request_id  # unique per sequence
        self.group_id = request_id if group_id is None else group_id  # the client's request
        self.index = index  # the choice this sequence produces
        self.wait_for = wait_for  # the sibling whose prefill this one shares
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.priority = priority
        # token fairness (engine/sched/fairness.py): the tenant whose service counter this sequence's tokens count
        # in (set by LLMEngine.add_request; None: the id-less group), and how far into its prompt it has been charged
        self.fairness_id: str | None = None
        self.num_charged_prompt_tokens = 0
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V sit in the cache
        self.num_cached_tokens = 0  # of the prompt, found in the prefix cache at first scheduling
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hash chain of the full blocks registered so far
        self.hash_root = root(params.cache_salt)  # the chain's first parent: a salt's own prefix cache
        self.finish_reason: str | None = None  # stop | length | abort | error
        self.stop_reason: str | int | None = None  # the stop string or stop token that ended it
        self.num_preemptions = 0
        self.logprobs: list[TokenLogprob] = []  # per output token, when params.logprobs is set
        # per prompt token, if asked: the first has none; the model runner appends the rest as it computes them
        self.prompt_logprobs: list[TokenLogprob | None] = [None] if params.prompt_logprobs is not None else []
        self.matcher: Matcher | None = None  # structured output: the grammar state masking its next token
        # disaggregated prefill: a prefill hop's sequence keeps its blocks for a decode engine when it finishes
        # (`kv_transfer_params` says where to fetch them); a decode hop's fetches its prompt's KV before it computes
        self.remote_decode = False
        self.kv_transfer_params: dict[str, Any] | None = None  # a finished prefill hop's answer
        self.num_remote_tokens: int | None = None  # a decode hop's: prompt tokens a producer holds, to fetch
        # speculative decoding: tokens proposed to follow token_ids, checked by the model in this step (never part of
        # token_ids, the block hashes or the prefix cache until accepted)
        self.draft_token_ids: list[int] = []
        self.num_new_tokens = 0  # tokens its last step appended (more than one where drafts were accepted)
        self.num_draft_tokens = 0  # drafts it checked, over its life
        self.num_accepted_tokens = 0  # of those, the ones the model agreed with
        # timestamps for metrics (monotonic seconds)
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_held(self) -> bool:
        """Waits for a sibling's prefill, whose blocks it will share."""
        lead = self.wait_for
        return lead is not None and not lead.is_finished and lead.is_prefilling

    def sort_key(self) -> tuple[int, float]:
        """Scheduling order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_time)

    def append_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        self.token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)
