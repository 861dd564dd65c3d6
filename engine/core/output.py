"""What one engine step reports per choice of a request (`RequestOutput`). The text in it is made by
engine/core/output_processor.py."""

from __future__ import annotations

from dataclasses import dataclass

from tokenweir.engine.sched.sequence import TokenLogprob


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """When a finished request arrived, was first scheduled, got its first token and its last (time.monotonic();
    None: it never got that far), for its trace's spans (engine/api/tracing.py). Its first choice's, except the
    last token: the last of any choice."""

    arrival: float
    first_scheduled: float | None
    first_token: float | None
    last_token: float | None


@dataclass
class RequestOutput:
    """New tokens of one choice (`index`); `finished` once every choice of the request has, while `finish_reason`
    says this choice has. The counts are the request's: prompt once, output summed over its choices."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # stop | length | abort | error
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    stop_reason: str | int | None = None  # the stop string or token that ended it (vLLM's field)
    index: int = 0
    logprobs: list[TokenLogprob] | None = None  # of new_token_ids, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on a choice's first output, when asked
    error: Exception | None = None  # why the request failed (finish_reason "error"): raised to its client
    # speculative decoding, summed over its choices: drafts checked, and of those accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # a finished prefill hop's answer: where a decode engine fetches the prompt's KV (engine/kv_transfer/params.py)
    kv_transfer_params: dict | None = None
    timings: RequestTimings | None = None  # on the request's finished output

    @property
    def usage(self) -> dict:
        usage = {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_output_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
        }
        if self.num_draft_tokens:  # OpenAI's names for a prediction's tokens (its Predicted Outputs)
            usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": self.num_accepted_tokens,
                "rejected_prediction_tokens": self.num_draft_tokens - self.num_accepted_tokens,
            }
        return usage

    def take_counts(self, later: RequestOutput) -> None:
        """The request's counts (and a prefill hop's answer) as `later`, a newer output of it, states them."""
        self.num_prompt_tokens, self.num_output_tokens = later.num_prompt_tokens, later.num_output_tokens
        self.num_cached_tokens = later.num_cached_tokens
        self.num_draft_tokens, self.num_accepted_tokens = later.num_draft_tokens, later.num_accepted_tokens
        self.kv_transfer_params = later.kv_transfer_params or self.kv_transfer_params

    def add(self, later: RequestOutput) -> None:
        """Fold a later output of the same request into this one: the tokens and text so far, the latest counts."""
        assert later.request_id == self.request_id and later.index == self.index
        self.new_token_ids += later.new_token_ids
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
        self.new_text += later.new_text
        self.finished, self.finish_reason, self.stop_reason = later.finished, later.finish_reason, later.stop_reason
        self.take_counts(later)

    @classmethod
    def empty(cls, request_id: str, index: int = 0) -> RequestOutput:
        """Nothing yet: the start of an `add` accumulation."""
        return cls(request_id, [], "", False, None, 0, 0, 0, index=index)
