"""The one check of a request against an engine's limits (`check_request`; `check_kv_transfer` for its hop of a
disaggregated prefill), made at the edge (LLMEngine.validate: AsyncEngine.add_request, LLM.generate) so a request that
can never run is a 400 before a stream's first byte, and add_request only asserts."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokenweir.engine.config import KVTransferConfig
from tokenweir.engine.core.errors import RequestError
from tokenweir.engine.kv_transfer.params import RemotePrefill, wants_remote_decode, wants_remote_prefill
from tokenweir.engine.sched.sampling_params import SamplingParams

if TYPE_CHECKING:  # structured.py pulls in llguidance: only a request with a response_format needs it
    from tokenweir.engine.text.structured import StructuredOutputs


def check_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    structured: Callable[[], StructuredOutputs],
) -> None:
    """Raise RequestError for a request that can never run; fills in a missing max_tokens. `structured` gives the
    engine's grammar compiler, asked for only when the request has a response_format. Touches no engine state, so it
    runs on the event loop."""
    if not prompt_token_ids:
        raise RequestError("the prompt is empty", code="empty_prompt", param="prompt")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        raise RequestError(f"prompt token ids must be in [0, {vocab_size})", code="invalid_token_id", param="prompt")
    if any(not 0 <= t < vocab_size for t in params.logit_bias or {}):
        raise RequestError(
            f"logit_bias keys must be token ids in [0, {vocab_size})", code="invalid_token_id", param="logit_bias"
        )
    if params.structured is not None:
        try:
            structured().compile(params.structured)
        except ValueError as exc:
            raise RequestError(str(exc), code="invalid_response_format", param="response_format") from exc
    num_prompt, limit = len(prompt_token_ids), max_model_len
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


def check_kv_transfer(params: dict[str, Any] | None, config: KVTransferConfig | None) -> None:
    """Raise RequestError unless a request's `kv_transfer_params` name a hop that this engine's `config` takes."""
    if not params:
        return
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
