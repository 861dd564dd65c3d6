"""Structured outputs (OpenAI `response_format` json_object / json_schema) as per-step token masks.

A request's `response_format` compiles once into a `Grammar` (cached, LRU); each sequence drives its own `Matcher`
with the tokens it samples, and before each sampling step the sampler asks for a packed bitmask per constrained row
(`fill_masks`) and sets every disallowed logit to -inf (`apply_token_bitmask`; `apply_masks` does both). Stop tokens
are allowed only where the JSON is complete, and the grammar is compact (no whitespace between tokens, "," and ":"
separators): with free whitespace a small model happily emits newlines forever. The spec is checked, and a schema's
objects closed to the keys they list, by engine/text/response_format.py before it compiles.

Library: llguidance. loadtests/bench_grammar.py (SmolLM2's 49152-token vocab, shared 2-core x86 CPU, one thread,
compact JSON walked token by token; loadtests/results/bench_grammar.md) measured per-token mask mean / p99 in
microseconds, compile time (cache off) in parentheses:

    schema             xgrammar 0.2.8        llguidance 1.9.1      outlines-core 0.2.14
    flat               3.2 / 10  (5.1 ms)    6.3 / 73  (0.8 ms)    35.1 / 144 (44 ms)
    nested             2.3 / 6   (5.5 ms)    5.1 / 25  (0.9 ms)    27.0 / 147 (140 ms)
    enums              1.1 / 2   (0.7 ms)    8.5 / 43  (0.4 ms)     1.3 / 2   (54 ms)
    array_of_objects   2.9 / 10  (4.7 ms)    4.8 / 17  (0.6 ms)    31.1 / 142 (103 ms)
    optional_fields    3.5 / 11  (5.0 ms)    5.7 / 52  (0.6 ms)    34.1 / 113 (109 ms)
    json_object        n/a (a)               4.5 / 32  (0.4 ms)    49.3 / 167 (6.0 s)

This module over llguidance adds ~2 us a mask (7-10 us mean); apply_token_bitmask costs ~15-35 us a 49152-wide row.
xgrammar's masks are ~2x faster on average, but every library is at a few microseconds a token against a decode step
of tens of milliseconds (and `fill_masks_async` can hide it behind the forward), so mask speed does not decide it:
- correctness: xgrammar silently ignores keywords it does not implement (a schema with `not` compiled, so output
  could violate the schema the client asked for); llguidance refuses them ("Unimplemented keys: [\"not\"]"), which
  becomes a 400 instead of invalid JSON. (a) xgrammar's any-JSON sub-grammar hard-codes ", " between nested items
  even with compact separators, so its json_object mode rejected a compact document.
- compile: 0.4-1 ms vs ~5 ms (a cache miss is paid at the request's edge); outlines-core's regex-to-DFA approach
  takes seconds for json_object (recursion cut at depth 3) and cannot express recursive schemas.
- weight: llguidance has no dependencies and imports in 75 ms; xgrammar pulls transformers and apache-tvm-ffi
  (2.8 s import).
- API: LLMatcher / LLExecutor compute masks with the GIL released, straight into a caller's int32 buffer (in
  parallel across a batch with LLExecutor), and try_consume_tokens rejects a token without poisoning the state.

Threading: `compile` may be called from any thread (the cache is locked; llguidance builds the grammar with the GIL
released). A `Matcher` belongs to one sequence and must not be used from two threads at once; `fill_masks` and
`fill_masks_async` only read matcher state (they compute the next mask), so run them between `accept` calls.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import llguidance
import torch

from tokenweir.common.text.tokenizer import Tokenizer
from tokenweir.engine.text.response_format import close_objects, parse_response_format
from tokenweir.engine.text.token_bitmask import apply_token_bitmask

if TYPE_CHECKING:  # declared only in llguidance's stub
    from llguidance._lib import JsonCompileOptions

T = TypeVar("T")
# Compact JSON: no whitespace outside strings, no spaces after separators.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
_MAX_ERROR_CHARS = 400


@dataclass(frozen=True)
class Grammar:
    """A compiled response_format. `template` is a pristine matcher that is never advanced, only copied."""

    key: str
    template: llguidance.LLMatcher


class Matcher:
    """Grammar state of one sequence: feed it every sampled token with accept()."""

    def __init__(self, grammar: Grammar, stop_token_ids: frozenset[int]):
        self.grammar = grammar
        self._m = grammar.template.deep_copy()
        self._stop_token_ids = stop_token_ids
        self._terminated = False

    def accept(self, token_id: int) -> bool:
        """Advance by one token. False, with the state unchanged, if the grammar forbids it here."""
        if self._terminated:
            return False
        if token_id in self._stop_token_ids:
            # llguidance counts a stop token as no consumed token (try/validate give 0), so check it ourselves.
            if not self._m.is_accepting():
                return False
            self._terminated = self._m.consume_token(token_id)
            return self._terminated
        # try_consume_tokens leaves the state as it was on a forbidden token (consume_token would poison it).
        return self._m.try_consume_tokens([token_id]) == 1

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted: the document is complete and the sequence is over."""
        return self._terminated

    @property
    def is_accepting(self) -> bool:
        """The text so far is a complete document: a stop token is allowed now."""
        return self._m.is_accepting()

    @property
    def is_complete(self) -> bool:
        """Nothing but a stop token can follow (the document is closed, or the matcher hit an error)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the matcher cannot go on (a parser limit was hit), or None. Its masks then allow only stops."""
        return self._m.get_error() or None

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding, preemption with recompute)."""
        assert num_tokens >= 0
        if num_tokens and self._terminated:  # llguidance does not count the stop token: undo it here
            self._terminated = False
            num_tokens -= 1
        if num_tokens:
            assert self._m.rollback(num_tokens), self._m.get_error()


class StructuredOutputs:
    """Compiles response_format specs against one tokenizer and computes token masks for the sampler."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: set[int] | frozenset[int],
        *,
        cache_size: int = 256,
        num_threads: int | None = None,
    ):
        assert sys.byteorder == "little", "bitmask words are unpacked as little-endian bytes"
        assert vocab_size > 0 and cache_size > 0
        self.vocab_size = vocab_size
        self.mask_words = (vocab_size + 31) // 32
        self.stop_token_ids = frozenset(t for t in stop_token_ids if 0 <= t < vocab_size)
        assert self.stop_token_ids, "structured outputs need a stop token to end the document"
        # Ids past the tokenizer's tokens (the model's padded vocab) and special tokens are never allowed as text:
        # llguidance marks special tokens so JSON strings cannot contain e.g. "<|im_start|>" as one token.
        tokens = tokenizer.all_token_bytes()[:vocab_size]
        padded = range(len(tokens), vocab_size)
        tokens += [b""] * len(padded)
        special = sorted({*(i for i in tokenizer.special_ids if i < vocab_size), *padded})

        class _Wrapper:  # llguidance.TokenizerWrapper's protocol; encode is used only for forced text, not masks
            eos_token_id = min(self.stop_token_ids)
            bos_token_id = tokenizer.bos_token_id
            special_token_ids = special
            tokens: list[bytes]  # set on the instance below: a class body cannot read the enclosing `tokens`

            def __call__(self, text: str | bytes) -> list[int]:
                if isinstance(text, bytes):
                    text = text.decode("utf-8", errors="replace")
                return tokenizer.encode(text)

        wrapper = _Wrapper()
        wrapper.tokens = tokens
        self._lltok = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(wrapper), n_vocab=vocab_size, eos_token=sorted(self.stop_token_ids)
        )
        self._cache: OrderedDict[str, Grammar | str] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        # Parallel mask fill pays off with cores to spare; on a small box a plain loop is faster (bench: 2 cores).
        if num_threads is None:
            num_threads = min(8, (os.cpu_count() or 1) // 2)
        self._executor = llguidance.LLExecutor(num_threads=num_threads) if num_threads > 1 else None
        self._worker: ThreadPoolExecutor | None = None

    # -- grammars

    def compile(self, spec: dict) -> Grammar | None:
        """Grammar for an OpenAI `response_format`; None for {"type": "text"} (unconstrained).

        Accepts {"type": "json_object"} and {"type": "json_schema", "json_schema": {"name": ..., "schema": {...},
        "strict": ...}} ("name" and "strict" optional, so tool arguments can use it). Raises ValueError with a
        message for the client when the spec or its schema is invalid or unsupported. Cached both ways: a hit,
        valid or not, costs one canonical json.dumps.
        """
        kind, schema = parse_response_format(spec)
        if kind == "text":
            return None
        key = json.dumps([kind, schema], sort_keys=True, separators=(",", ":"))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            hit = self._build(key, kind, schema)
            with self._lock:
                self._cache[key] = hit
                self._cache.move_to_end(key)
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, str):
            raise ValueError(hit)
        return hit

    def _build(self, key: str, kind: str, schema: dict | None) -> Grammar | str:
        """The Grammar, or the client-facing error message (cached like a grammar)."""
        # json_object is any object: OpenAI's JSON mode promises an object, not any JSON value.
        if kind == "json_object":
            schema = {"type": "object"}
        else:
            assert schema is not None  # parse_response_format gives a json_schema its schema, a grammar its text
            schema = schema if kind == "grammar" else close_objects(schema)
        try:
            if kind == "grammar":  # tool calls (engine/tool_parsers): the Lark text holds the functions' schemas
                grammar = llguidance.LLMatcher.grammar_from_lark(schema["lark"])
            else:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except ValueError as e:
            return f"invalid or unsupported JSON schema: {_short(e)}"
        template = llguidance.LLMatcher(self._lltok, grammar, log_level=0)
        if template.is_error():
            return f"invalid or unsupported JSON schema: {_short(template.get_error())}"
        return Grammar(key=key, template=template)

    def refuse(self, grammar: Grammar, message: str) -> None:
        """A grammar that hit a parser limit while generating: later requests with the same response_format are
        refused by compile() (a 400 before their first byte) instead of failing part-way. llguidance grows one lexer
        per compiled grammar, shared by its matchers, so such a grammar fails sooner each time it is used."""
        with self._lock:
            self._cache[grammar.key] = message
            self._cache.move_to_end(grammar.key)

    def matcher(self, grammar: Grammar | None) -> Matcher | None:
        """Fresh state for one sequence (a copy of the compiled grammar: tens of microseconds); None for None, so
        `matcher(compile(spec))` also covers {"type": "text"}."""
        return None if grammar is None else Matcher(grammar, self.stop_token_ids)

    # -- masks

    def allocate_masks(self, n: int) -> torch.Tensor:
        """An int32 [n, ceil(vocab_size / 32)] CPU buffer for fill_masks(out=...)."""
        return torch.empty((n, self.mask_words), dtype=torch.int32)

    def fill_masks(self, matchers: Sequence[Matcher], out: torch.Tensor | None = None) -> torch.Tensor:
        """Packed next-token bitmasks, row i for matchers[i]: bit j of word w allows token 32 * w + j.

        Releases the GIL while computing. Reads the matchers' state: do not accept() while it runs.
        """
        n = len(matchers)
        if out is None:
            out = self.allocate_masks(n)
        assert out.dtype == torch.int32 and out.device.type == "cpu" and out.is_contiguous()
        assert out.shape[0] >= n and out.shape[1] == self.mask_words
        if self._executor is not None and n > 1:
            self._executor.unsafe_compute_mask_ptr(
                [(m._m, i) for i, m in enumerate(matchers)], out.data_ptr(), self.mask_words * 4, out.shape[0]
            )
        else:  # raw pointers: indexing a tensor row per matcher costs more than a JSON mask itself
            ptr, row_bytes = out.data_ptr(), self.mask_words * 4
            for i, m in enumerate(matchers):
                m._m.unsafe_compute_mask_ptr(ptr + i * row_bytes, row_bytes)
        return out if out.shape[0] == n else out[:n]

    def fill_masks_async(self, matchers: Sequence[Matcher], out: torch.Tensor | None = None) -> Future[torch.Tensor]:
        """fill_masks on a worker thread, to overlap with the model's forward (both run without the GIL).

        Call after the last accept() of the step; call .result() before the next accept() on these matchers.
        """
        matchers = list(matchers)  # the caller may reuse its list while the worker reads this one
        return self._submit(self.fill_masks, matchers, out)

    def fill_draft_masks(self, matcher: Matcher, drafts: Sequence[int]) -> torch.Tensor:
        """Masks for checking a sequence's drafts (speculative decoding): row j is the grammar's mask after the
        drafts before j, as plain decoding would have it had they been sampled. The matcher walks the drafts and is
        rolled back to where it stood. A draft the grammar refuses, or a stop token, ends the walk: the rows after it
        repeat its row (their samples are never kept, since that draft cannot be accepted or ends the sequence)."""
        out = self.allocate_masks(len(drafts) + 1)
        ptr, row_bytes = out.data_ptr(), self.mask_words * 4
        m = matcher._m
        m.unsafe_compute_mask_ptr(ptr, row_bytes)
        walked = 0
        for draft in drafts:
            if draft in self.stop_token_ids or m.try_consume_tokens([draft]) != 1:
                break
            walked += 1
            m.unsafe_compute_mask_ptr(ptr + walked * row_bytes, row_bytes)
        out[walked + 1 :] = out[walked]
        if walked:
            assert m.rollback(walked), m.get_error()
        return out

    def draft_masks_async(self, pending: Sequence[tuple[Matcher, list[int]]]) -> Future[list[torch.Tensor]]:
        """fill_draft_masks for each (matcher, drafts) on the worker thread, overlapping the forward; call .result()
        before the next accept() on these matchers."""
        pending = [(m, list(d)) for m, d in pending]
        return self._submit(lambda: [self.fill_draft_masks(m, d) for m, d in pending])

    def _submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="structured-masks")
        return self._worker.submit(fn, *args)

    def apply_masks(
        self,
        logits: torch.Tensor,
        rows: Sequence[int],
        matchers: Sequence[Matcher] | None,
        masks: torch.Tensor | None = None,
    ) -> None:
        """Mask logits[rows[i]] by matchers[i]'s grammar, in place: fill_masks (unless `masks` already holds them,
        e.g. from fill_masks_async or fill_draft_masks, when `matchers` may be None) then apply_token_bitmask."""
        if masks is None:
            assert matchers is not None and len(rows) == len(matchers)
            masks = self.fill_masks(matchers)
        apply_token_bitmask(logits, masks[: len(rows)], rows)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


def _short(err: object) -> str:
    msg = " ".join(str(err).split())
    return msg if len(msg) <= _MAX_ERROR_CHARS else msg[: _MAX_ERROR_CHARS - 3] + "..."
