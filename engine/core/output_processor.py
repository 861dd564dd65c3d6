"""OutputProcessor: turns the tokens a step produced into each request's outputs. It owns the per-request output
state (a request's choices and, per open choice, its incremental text), detokenizes, matches stop strings, and closes
a choice once it has finished, forgetting the request with its last choice. As in vLLM v1, where an OutputProcessor
keeps detokenizing out of the engine core.

Stop strings are matched here, not in Scheduler.update, because they need the detokenized text; a stop string ends its
sequence in the scheduler at once (its blocks freed), as a stop token does there."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenweir.common.text.tokenizer import IncrementalDetokenizer, Tokenizer
from tokenweir.engine.core.output import RequestOutput, RequestTimings
from tokenweir.engine.sched.scheduler import Scheduler
from tokenweir.engine.sched.sequence import Sequence
from tokenweir.engine.worker.sampler import Sampler


class TextState:
    """Incremental text of one request. Stop strings are matched on the text, and while a stop string could still be
    completing, the matching tail is held back so a stream never shows text the final output will not contain."""

    def __init__(self, tokenizer: Tokenizer | None, stop: list[str], include_stop: bool, skip_special: bool) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special) if tokenizer is not None else None
        self.stop = stop
        self.include_stop = include_stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0

    def add(self, token_id: int) -> str | None:
        """Append a token's text; returns the stop string if one now appears."""
        if self.detokenizer is None:
            return None
        start = max(0, len(self.text) - self.holdback)
        self.text += self.detokenizer.add(token_id)
        for stop in self.stop:
            idx = self.text.find(stop, start)
            if idx != -1:
                self.text = self.text[: idx + len(stop)] if self.include_stop else self.text[:idx]
                return stop
        return None

    def take_delta(self, finished: bool) -> str:
        if finished and self.detokenizer is not None and not self.stop:
            self.text += self.detokenizer.flush()
        end = len(self.text) if finished else max(self.sent, len(self.text) - self.holdback)
        delta = self.text[self.sent : end]
        self.sent = end
        return delta


@dataclass(slots=True)
class RequestState:
    """One request's output state: its choices' sequences in index order, and the text of each choice still open (a
    choice closes with its final output; the request is done when none is open)."""

    choices: list[Sequence] = field(default_factory=list)
    texts: dict[int, TextState] = field(default_factory=dict)  # by choice index, while that choice is open


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, scheduler: Scheduler, sampler: Sampler) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler  # a stop string finishes its sequence there
        self.sampler = sampler  # a closed choice's seeded generator is dropped there
        self.requests: dict[str, RequestState] = {}  # by request id, from add_request to its last choice's close

    # --- registering ------------------------------------------------------------------------------------------------

    def add_request(self, request_id: str) -> RequestState:
        """Register a request before its choices are made, so a failure half-way is cleaned up by its failure."""
        assert request_id not in self.requests, f"request id {request_id!r} is already running"
        state = self.requests[request_id] = RequestState()
        return state

    def add_choice(self, seq: Sequence) -> None:
        state = self.requests[seq.group_id]
        params = seq.params
        state.texts[seq.index] = TextState(
            self.tokenizer, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
        )
        state.choices.append(seq)

    def choices(self, request_id: str) -> list[Sequence]:
        """A running request's choices (finished ones included); none for an unknown request."""
        state = self.requests.get(request_id)
        return state.choices if state is not None else []

    def is_open(self, seq: Sequence) -> bool:
        """Whether a choice's final output is still to come."""
        state = self.requests.get(seq.group_id)
        return state is not None and seq.index in state.texts

    # --- outputs ----------------------------------------------------------------------------------------------------

    def process(self, seq: Sequence) -> RequestOutput:
        """The step's output for a sequence that got tokens (one, or with accepted drafts several): its text so far
        (held back while a stop string could be completing), or its final output if a token, or a stop string in
        its text, ended it. Tokens after the one that completed a stop string are dropped from the sequence, as if
        never generated."""
        new_token_ids = seq.token_ids[len(seq.token_ids) - seq.num_new_tokens :]
        assert new_token_ids, "process is for a sequence its step gave tokens"
        text = self.requests[seq.group_id].texts[seq.index]
        for i, token_id in enumerate(new_token_ids):
            stop_string = text.add(token_id)
            if stop_string is None:
                continue
            if extra := len(new_token_ids) - i - 1:
                del seq.token_ids[-extra:]
                if seq.params.logprobs is not None:
                    del seq.logprobs[-extra:]
                new_token_ids = new_token_ids[: i + 1]
                seq.num_new_tokens = len(new_token_ids)
            if seq.is_finished:  # EOS or length on the same token: the stop string wins, as in vLLM
                seq.finish_reason = "stop"
            else:
                self.scheduler.finish(seq, "stop")
            seq.stop_reason = stop_string
            break
        if seq.is_finished:
            return self._finish(seq, new_token_ids)
        return self._output(seq, new_token_ids, text.take_delta(finished=False))

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Stop a request's unfinished choices now and free their blocks; returns their final outputs (the last one
        `finished`, with the request's exact token counts), or nothing for an unknown request."""
        outputs = []
        for seq in [s for s in self.choices(request_id) if not s.is_finished]:
            self.scheduler.finish(seq, "abort")
            outputs.append(self._finish(seq, []))
        return outputs

    def fail(self, request_id: str, error: Exception) -> list[RequestOutput]:
        """End a request's open choices with `error` and free their blocks; returns their final outputs (the last one
        `finished`, with the tokens made so far counted), each carrying the error and no more text."""
        state = self.requests.get(request_id)
        if state is None:
            return []
        outputs = []
        for seq in [s for s in state.choices if s.index in state.texts]:
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")
            seq.finish_reason = "error"
            out = self._close(seq, [], "")
            out.error = error
            outputs.append(out)
        if not state.texts and request_id in self.requests:  # it failed before its first choice was made
            del self.requests[request_id]
        return outputs

    def _finish(self, seq: Sequence, new_token_ids: list[int]) -> RequestOutput:
        """The last output of a choice that has finished (the rest of its text), closing it."""
        text = self.requests[seq.group_id].texts[seq.index].take_delta(finished=True)
        return self._close(seq, new_token_ids, text)

    def _close(self, seq: Sequence, new_token_ids: list[int], text: str) -> RequestOutput:
        state = self.requests[seq.group_id]
        del state.texts[seq.index]
        self.sampler.forget(seq.request_id)
        out = self._output(seq, new_token_ids, text)
        if out.finished:
            del self.requests[seq.group_id]
        return out

    def _output(self, seq: Sequence, new_token_ids: list[int], new_text: str) -> RequestOutput:
        state = self.requests[seq.group_id]
        wants = seq.params.logprobs is not None
        finished = not state.texts
        return RequestOutput(
            seq.group_id,
            new_token_ids,
            new_text,
            finished,
            seq.finish_reason,
            seq.num_prompt_tokens,
            sum(s.num_output_tokens for s in state.choices),
            state.choices[0].num_cached_tokens,
            seq.stop_reason,
            index=seq.index,
            logprobs=seq.logprobs[len(seq.logprobs) - len(new_token_ids) :] if wants else None,
            prompt_logprobs=seq.prompt_logprobs if seq.prompt_logprobs and seq.num_output_tokens == 1 else None,
            num_draft_tokens=sum(s.num_draft_tokens for s in state.choices),
            num_accepted_tokens=sum(s.num_accepted_tokens for s in state.choices),
            kv_transfer_params=state.choices[0].kv_transfer_params if finished else None,
            timings=_timings(state.choices) if finished else None,
        )


def _timings(choices: list[Sequence]) -> RequestTimings:
    """A finished request's timings: its first choice's (the one that computed the prompt), with the last token of
    any choice."""
    first = choices[0]
    last_tokens = [s.last_token_time for s in choices if s.last_token_time is not None]
    return RequestTimings(
        first.arrival_time, first.first_scheduled_time, first.first_token_time, max(last_tokens, default=None)
    )
