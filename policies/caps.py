"""Length caps: how many tokens a request may generate, or why it is too long (errors as data)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TooLong:
    """A length violation; `reason` is always 'too_long'. `param` names the request field to fix."""

    # "prompt" (vs max_prompt_tokens), "context" (prompt vs the model), "max_tokens" (vs max_output_tokens)
    what: str
    value: int
    limit: int
    param: str
    message: str
    reason: str = "too_long"


@dataclass(frozen=True)
class CapResult:
    max_tokens: int | None  # effective generation cap; None only when nothing bounds it (no caps, no context)
    error: TooLong | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def apply_caps(
    prompt_tokens: int,
    requested_max_tokens: int | None,
    *,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
    context_window: int | None = None,
    longest_prompt_tokens: int | None = None,
) -> CapResult:
    """effective max_tokens = min(requested or team cap, team cap, context window - prompt).

    Asking for more than the team's max_output_tokens is an error (the client asked for something it may not
    have); asking for more than the context leaves room for is clamped, as the model stops there anyway.
    `longest_prompt_tokens`: a batch's longest prompt (each prompt has the context window to itself), which the
    context is checked against; `prompt_tokens`, all prompts together, is what the team's prompt cap bounds.
    """
    assert prompt_tokens >= 0
    in_context = prompt_tokens if longest_prompt_tokens is None else longest_prompt_tokens
    assert requested_max_tokens is None or requested_max_tokens >= 1, "validate max_tokens >= 1 before caps"
    if max_prompt_tokens is not None and prompt_tokens > max_prompt_tokens:
        msg = (
            f"This request has {prompt_tokens} prompt tokens, but your team allows at most "
            f"{max_prompt_tokens} prompt tokens per request. Shorten the messages."
        )
        return CapResult(None, TooLong("prompt", prompt_tokens, max_prompt_tokens, "messages", msg))
    if context_window is not None and in_context >= context_window:
        msg = (
            f"This model's maximum context length is {context_window} tokens, but the prompt has "
            f"{in_context} tokens, leaving no room to generate. Shorten the messages."
        )
        return CapResult(None, TooLong("context", in_context, context_window, "messages", msg))
    if max_output_tokens is not None and requested_max_tokens is not None and requested_max_tokens > max_output_tokens:
        msg = (
            f"max_tokens is {requested_max_tokens}, but your team allows at most {max_output_tokens} "
            f"output tokens per request. Lower max_tokens."
        )
        return CapResult(None, TooLong("max_tokens", requested_max_tokens, max_output_tokens, "max_tokens", msg))
    bounds = [b for b in (requested_max_tokens, max_output_tokens) if b is not None]
    if context_window is not None:
        bounds.append(context_window - in_context)
    return CapResult(min(bounds) if bounds else None)
