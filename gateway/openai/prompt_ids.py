"""A request's prompt token ids as our engine will compute them, for prefix routing: the pool's tokenizer (the one
gateway/openai/token_count.py loads for exact counts, loaded once and shared) and the engine's own steps
(engine/api/routes.py encode_chat / encode_text; the message join of common/text/chat_text.py). None where they
cannot be had (the pool names no tokenizer, the tokenizer is not installed, the template refuses the messages): the
router then goes by load.
"""

from __future__ import annotations

import logging

from tokenweir.common.text.chat_text import template_message
from tokenweir.gateway.openai.token_count import _load

log = logging.getLogger("tokenweir.routing")


def _tokenizer(path: str):
    if path == "default":
        from tokenweir.common.text.model_files import default_model_path  # torch-free

        path = default_model_path()
    return _load(path)


def head_tokens(tokenizer_path: str | None, body: dict, ids: list[int]) -> int:
    """How many of a chat prompt's ids `ids` come before its first user turn (the system part, rendered alone: a
    team's own instructions after a preamble many teams share), 0 when there is none or it cannot be had."""
    messages = body.get("messages") or []
    first_user = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"), 0)
    if tokenizer_path is None or first_user == 0:
        return 0
    try:
        head = _tokenizer(tokenizer_path).encode_chat([template_message(m) for m in messages[:first_user]], False)
    except Exception as e:  # routing must never fail a request
        log.debug("no prompt head for routing: %r", e)
        return 0
    n = 0
    for a, b in zip(head, ids, strict=False):  # the rendered system part is the prompt's own first tokens
        if a != b:
            break
        n += 1
    return n


def prompt_token_ids(tokenizer_path: str | None, kind: str, body: dict) -> list[int] | None:
    """The prompt's ids: a completion's token-id prompt as it is (no tokenizer needed), else through the pool's."""
    prompt = body.get("prompt") if kind != "chat" else None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    if tokenizer_path is None:
        return None
    try:
        tok = _tokenizer(tokenizer_path)
        if kind == "chat":
            messages = [template_message(m) for m in body.get("messages") or []]
            return tok.encode_chat(messages, body.get("add_generation_prompt", True) is not False)
        if isinstance(prompt, str):
            return tok.with_bos(tok.encode(prompt))
    except Exception as e:  # routing must never fail a request: go by load instead
        log.debug("no prompt token ids for routing: %r", e)
    return None
