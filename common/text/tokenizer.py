"""Byte-level BPE tokenizer as a tiktoken.Encoding, chat template rendering and an incremental detokenizer.

The model's own vocab and merges (from a GGUF file or a HF tokenizer.json) become tiktoken mergeable ranks, so
tiktoken's Rust core does the hot-path work (the gateway counts prompt tokens with it). tiktoken merges the
adjacent pair whose concatenation has the lowest rank; with rank = merge index this reproduces the merge-list
BPE of HF `tokenizers` / llama.cpp (tests/contract/engine/test_tokenizer.py checks it token for token).
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterable
from functools import cache
from typing import Any, cast

import jinja2
import tiktoken

from tokenweir.common.text.chat_template import compile_chat_template, template_reads
from tokenweir.common.text.gguf_file import read_gguf

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes (tiktoken / fancy-regex syntax), keyed by GGUF `tokenizer.ggml.pre`.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# llama.cpp's smollm/starcoder: split every digit out first, then GPT-2's regex on the pieces between digits.
# As one regex: digits alone, no " ?\p{N}+", and a whitespace run before a digit stays whole (in the two-stage
# split it ends its piece, so `\s+(?!\S)` takes all of it).
DIGITS_GPT2_PATTERN = r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?=\p{N})|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
PRE_PATTERNS = {
    "default": GPT2_PATTERN,
    "gpt2": GPT2_PATTERN,
    "gpt-2": GPT2_PATTERN,
    "smollm": DIGITS_GPT2_PATTERN,
    "starcoder": DIGITS_GPT2_PATTERN,
    "refact": DIGITS_GPT2_PATTERN,
    "llama-bpe": LLAMA3_PATTERN,
    "llama3": LLAMA3_PATTERN,
    "qwen2": QWEN2_PATTERN,
}

# Token strings that end a turn in common chat formats; generation stops on them as on eos.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


@cache
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable stand-in character -> the raw byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _unicode_to_bytes(token: str) -> bytes:
    dec = _byte_decoder()
    return bytes(dec[ch] for ch in token)


class Tokenizer:
    """Encode/decode with the model's byte-level BPE; render and encode chats with the model's template."""

    def __init__(
        self,
        name: str,
        tokens: list[str],
        token_types: list[int],
        merges: list[tuple[str, str]],
        pre: str | None,
        bos_token_id: int | None,
        eos_token_id: int | None,
        pad_token_id: int | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
        pattern: str | None = None,
    ):
        assert len(tokens) == len(token_types), "one token type per token"
        self.name = name
        self.vocab_size = len(tokens)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.pre = pre or "default"
        special_types = (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN)
        # Text of control tokens is dropped by decode(skip_special_tokens=True); user-defined tokens are
        # ordinary text that the model wants as one id.
        self.special_ids = frozenset(i for i, t in enumerate(token_types) if t in (TOKEN_CONTROL, TOKEN_UNKNOWN))
        special = {tok: i for i, (tok, t) in enumerate(zip(tokens, token_types, strict=True)) if t in special_types}
        self._user_defined = frozenset(tokens[i] for i, t in enumerate(token_types) if t == TOKEN_USER_DEFINED)
        self._token_to_id = {tok: i for i, tok in enumerate(tokens)}

        # Bytes of every id, for decode (covers ids tiktoken cannot rank, e.g. unreachable tokens). Special and
        # unused tokens are plain UTF-8, the rest are in GPT-2's byte-to-unicode spelling.
        plain = {i for i, t in enumerate(token_types) if t in (*special_types, TOKEN_UNUSED)}
        self._id_bytes: list[bytes] = [
            tok.encode("utf-8") if i in plain else _unicode_to_bytes(tok) for i, tok in enumerate(tokens)
        ]
        ranks, self._rank_to_id = self._build_ranks(tokens, merges, plain)
        if pattern is None:
            assert self.pre in PRE_PATTERNS, f"unsupported pre-tokenizer {self.pre!r}; known: {sorted(PRE_PATTERNS)}"
            pattern = PRE_PATTERNS[self.pre]
        if self._rank_to_id is None:
            special_ranks = special
        else:  # special tokens get ranks after the mergeable ones, mapped back to their ids
            base = len(self._rank_to_id)
            special_ranks = {tok: base + k for k, tok in enumerate(special)}
            self._rank_to_id.extend(special.values())
        self.encoding = tiktoken.Encoding(
            name=f"tokenweir-{name}", pat_str=pattern, mergeable_ranks=ranks, special_tokens=special_ranks
        )
        self._all_special = frozenset(special)
        stops = {eos_token_id} if eos_token_id is not None else set()
        stops.update(self._token_to_id[t] for t in END_OF_TURN_TOKENS if t in special)
        self.stop_token_ids: frozenset[int] = frozenset(stops)
        self._template: jinja2.Template | None = None
        self._takes_tools: bool | None = None

    def _build_ranks(
        self,
        tokens: list[str],
        merges: list[tuple[str, str]],
        plain: set[int],
    ) -> tuple[dict[bytes, int], list[int] | None]:
        """Mergeable ranks for tiktoken; the rank -> id list is None when ranks are the ids themselves.

        Ids serve as ranks when every merge result is a distinct token, ids grow with merge order, and every
        multi-byte normal token is some merge's result (else tiktoken could reach a token HF never makes).
        Otherwise rank = byte value for single bytes and 256 + merge index for merge results.
        Bytes missing from the vocab still need a rank (tiktoken starts from single bytes): they get ids past
        the vocab and encode() drops them, as llama.cpp does.
        """
        tok_id = self._token_to_id
        found = [tok_id.get(a + b) for a, b in merges]
        assert None not in found, "a merge produces a string that is not in the vocab"
        results = cast("list[int]", found)  # no None: asserted just above
        multi = [i for i in range(len(tokens)) if i not in plain and len(self._id_bytes[i]) > 1]
        in_order = all(x < y for x, y in zip(results, results[1:], strict=False))
        if in_order and len(set(results)) == len(results) == len(multi):
            ranks = {self._id_bytes[i]: i for i in range(len(tokens)) if i not in plain}
            extra = len(tokens)
            for byte in range(256):
                if bytes([byte]) not in ranks:
                    ranks[bytes([byte])] = extra
                    extra += 1
            return ranks, None
        ranks = {bytes([b]): b for b in range(256)}
        rank_to_id = [tok_id.get(chr(c), -1) for c in _byte_decoder_inverse()]
        for k, (a, b) in enumerate(merges):
            piece = _unicode_to_bytes(a + b)
            if piece not in ranks:  # a duplicate merge result keeps its first (lowest) rank
                ranks[piece] = 256 + k
            rank_to_id.append(tok_id[a + b])
        return ranks, rank_to_id

    # -- construction

    @classmethod
    def from_gguf(cls, path: str) -> Tokenizer:
        """The tokenizer a .gguf file carries (its metadata only: no weights are read)."""
        fields = read_gguf(path).fields
        model = fields.get("tokenizer.ggml.model")
        assert model == "gpt2", f"only byte-level BPE (tokenizer.ggml.model 'gpt2') is supported, got {model!r}"
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", [])]
        return cls(
            name=fields.get("general.name", os.path.basename(path)),
            tokens=tokens,
            token_types=fields.get("tokenizer.ggml.token_type", [TOKEN_NORMAL] * len(tokens)),
            merges=merges,
            pre=fields.get("tokenizer.ggml.pre"),
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
            pad_token_id=fields.get("tokenizer.ggml.padding_token_id"),
            add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=fields.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: str) -> Tokenizer:
        with open(os.path.join(path, "tokenizer.json"), encoding="utf-8") as f:
            tj = json.load(f)
        config: dict[str, Any] = {}
        config_path = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        model = tj["model"]
        assert model.get("type", "BPE") == "BPE", f"only BPE tokenizer.json is supported, got {model.get('type')}"
        vocab: dict[str, int] = dict(model["vocab"])
        types: dict[int, int] = {}
        for added in tj.get("added_tokens", []):
            vocab[added["content"]] = added["id"]
            types[added["id"]] = TOKEN_CONTROL if added.get("special") else TOKEN_USER_DEFINED
        n = max(vocab.values()) + 1
        tokens = [""] * n
        for tok, i in vocab.items():
            tokens[i] = tok
        token_types = [types.get(i, TOKEN_NORMAL) for i in range(n)]
        holes = [i for i, t in enumerate(tokens) if t == ""]
        for i in holes:  # ids nobody uses still need a unique, unreachable string
            tokens[i], token_types[i] = f"<unused_{i}>", TOKEN_UNUSED
        # each merge is two pieces, written "a b" or ["a", "b"]
        merges = cast(
            "list[tuple[str, str]]",
            [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])],
        )
        pre, pattern = _hf_pre_tokenizer(tj.get("pre_tokenizer"))

        def token_id(key: str) -> int | None:
            tok = config.get(key)
            if isinstance(tok, dict):
                tok = tok.get("content")
            return vocab.get(tok) if tok is not None else None

        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and os.path.exists(os.path.join(path, "chat_template.jinja")):
            with open(os.path.join(path, "chat_template.jinja"), encoding="utf-8") as f:
                template = f.read()
        return cls(
            name=os.path.basename(os.path.normpath(path)),
            tokens=tokens,
            token_types=token_types,
            merges=merges,
            pre=pre,
            bos_token_id=token_id("bos_token"),
            eos_token_id=token_id("eos_token"),
            pad_token_id=token_id("pad_token"),
            add_bos_token=bool(config.get("add_bos_token", False)),
            chat_template=template,
            pattern=pattern,
        )

    # -- encode / decode

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Token ids of `text`. Special-token strings in user text stay plain text unless allow_special."""
        if allow_special:
            ids = self.encoding.encode(text, allowed_special=self._all_special, disallowed_special=())
        elif self._user_defined:
            ids = self.encoding.encode(text, allowed_special=self._user_defined, disallowed_special=())
        else:
            ids = self.encoding.encode_ordinary(text)
        if self._rank_to_id is not None:
            m = self._rank_to_id
            return [m[r] for r in ids if m[r] >= 0]
        if ids and max(ids) >= self.vocab_size:  # bytes the vocab lacks: drop them, as llama.cpp does
            return [i for i in ids if i < self.vocab_size]
        return ids

    def with_bos(self, ids: list[int]) -> list[int]:
        """A text prompt's `ids` as the model takes them: after BOS where the model adds one."""
        if self.add_bos_token and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def count(self, text: str) -> int:
        """Number of tokens in user text (the gateway's hot path)."""
        return len(self.encode(text))

    def token_bytes(self, token_id: int) -> bytes:
        return self._id_bytes[token_id]

    def all_token_bytes(self) -> list[bytes]:
        """Bytes of every id, in id order (a copy): grammar engines build their token tries from it."""
        return list(self._id_bytes)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        table = self._id_bytes
        if skip_special_tokens:
            special = self.special_ids
            data = b"".join(table[i] for i in ids if i not in special)
        else:
            data = b"".join(table[i] for i in ids)
        return data.decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> int | None:
        return self._token_to_id.get(token)

    # -- chat

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render a conversation with the model's chat template, as transformers' apply_chat_template does."""
        if self.chat_template is None:
            raise ValueError(f"model {self.name!r} has no chat template; send a plain completion prompt instead")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        return self._template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_id),
            pad_token=self._token_text(self.pad_token_id),
        )

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Prompt ids for a chat. Special tokens are allowed: the template inserts them, and message contents
        containing special-token strings are the template author's concern, as in HF."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools), allow_special=True)

    @property
    def template_takes_tools(self) -> bool:
        """The chat template renders a `tools` list itself (common/text/tool_prompt.py renders them otherwise)."""
        if self._takes_tools is None:
            self._takes_tools = self.chat_template is not None and template_reads(self.chat_template, "tools")
        return self._takes_tools

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self._id_bytes[token_id].decode("utf-8", errors="replace")


class IncrementalDetokenizer:
    """Turns a stream of token ids into text, never emitting half a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # errors="replace" matches Tokenizer.decode for invalid bytes; incomplete tails are held back.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        if self.skip_special_tokens and token_id in self.tokenizer.special_ids:
            return ""
        return self._decoder.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


# -- helpers


@cache
def _byte_decoder_inverse() -> list[int]:
    """Code point of the stand-in character for each byte value 0..255."""
    out = [0] * 256
    for ch, b in _byte_decoder().items():
        out[b] = ord(ch)
    return out


def _hf_pre_tokenizer(pre_tokenizer: dict[str, Any] | None) -> tuple[str | None, str | None]:
    """(pre name, regex) from a tokenizer.json pre_tokenizer; regex None means the named one."""
    if pre_tokenizer is None:
        return "default", None
    parts = pre_tokenizer.get("pretokenizers", [pre_tokenizer])
    kinds = [p.get("type") for p in parts]
    if any(p.get("type") == "Digits" and p.get("individual_digits") for p in parts):
        return "smollm", None
    splits = [p for p in parts if p.get("type") == "Split" and "Regex" in p.get("pattern", {})]
    if splits:
        return "custom", splits[0]["pattern"]["Regex"]
    assert "ByteLevel" in kinds, f"unsupported pre_tokenizer {kinds}"
    return "gpt2", None
