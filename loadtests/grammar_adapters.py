"""One adapter per grammar library loadtests/bench_grammar.py compares (xgrammar, llguidance, outlines-core, and
engine/text/structured.py over llguidance), each set up on SmolLM2's tokenizer with the same four calls:
compile(schema), matcher(grammar), fill(matcher, bitmask) into a packed int32 bitmask, accept(matcher, token).
ADAPTERS maps the command line's library names to them.
"""

from __future__ import annotations

import json


def load_tokenizer():
    from tokenweir.common.text.model_files import default_model_path
    from tokenweir.common.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf(default_model_path())


class XGrammar:
    def __init__(self, tok, vocab_size: int):
        import xgrammar as xgr

        self.xgr = xgr
        # Special tokens as empty strings: xgrammar then never allows them as text (e.g. "<|im_start|>" in a string).
        vocab = [b"" if i in tok.special_ids else b for i, b in enumerate(tok.all_token_bytes())]
        info = xgr.TokenizerInfo(
            vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=sorted(tok.stop_token_ids)
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema):
        if schema is None:
            return self.compiler.compile_json_schema(
                {"type": "object"}, any_whitespace=False, separators=(",", ":"), strict_mode=False
            )
        return self.compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def fill(self, m, bitmask):
        m.fill_next_token_bitmask(bitmask)

    def accept(self, m, t: int) -> bool:
        return m.accept_token(t)


class LLGuidance:
    def __init__(self, tok, vocab_size: int):
        import llguidance

        self.llg = llguidance

        class Wrapper:  # llguidance's TokenizerWrapper protocol
            eos_token_id = tok.eos_token_id
            bos_token_id = tok.bos_token_id
            tokens = tok.all_token_bytes()
            special_token_ids = sorted(tok.special_ids)

            def __call__(self, s):
                return tok.encode(s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s)

        self.lltok = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(Wrapper()), n_vocab=vocab_size, eos_token=sorted(tok.stop_token_ids)
        )

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            {"type": "object"} if schema is None else schema,
            defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"},
        )
        # llguidance compiles inside the matcher constructor; a pristine matcher is the cached "grammar" and each
        # request deep-copies it.
        m = self.llg.LLMatcher(self.lltok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, grammar):
        return grammar.deep_copy()

    def fill(self, m, bitmask):
        m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)

    def accept(self, m, t: int) -> bool:
        return m.consume_token(t)


class OutlinesCore:
    def __init__(self, tok, vocab_size: int):
        import outlines_core as oc

        self.oc = oc
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(tok.all_token_bytes()):
            if i not in tok.special_ids:
                by_bytes.setdefault(b, []).append(i)
        self.vocab = oc.Vocabulary(tok.eos_token_id, by_bytes)

    def compile(self, schema):
        from outlines_core.json_schema import build_regex_from_schema

        # Regular languages only: json_object becomes "an object nested at most max_recursion_depth deep".
        regex = build_regex_from_schema(json.dumps({"type": "object"} if schema is None else schema), "")
        return self.oc.Index(regex, self.vocab)

    def matcher(self, grammar):
        return self.oc.Guide(grammar)

    def fill(self, m, bitmask):
        m.write_mask_into(bitmask.data_ptr(), bitmask.numel(), 4)

    def accept(self, m, t: int) -> bool:
        m.advance(t, return_tokens=False)
        return True


class Engine:
    """engine/text/structured.py itself (llguidance underneath): the wrapper's overhead on top of the library."""

    def __init__(self, tok, vocab_size: int):
        from tokenweir.engine.text.structured import StructuredOutputs

        self.so = StructuredOutputs(tok, vocab_size, set(tok.stop_token_ids), num_threads=1)

    def compile(self, schema):
        spec = {"type": "json_object"} if schema is None else {"type": "json_schema", "json_schema": {"schema": schema}}
        return self.so.compile(spec)

    def matcher(self, grammar):
        return self.so.matcher(grammar)

    def fill(self, m, bitmask):
        self.so.fill_masks([m], out=bitmask)

    def accept(self, m, t: int) -> bool:
        return m.accept(t)


ADAPTERS = {"xgrammar": XGrammar, "llguidance": LLGuidance, "outlines-core": OutlinesCore, "engine": Engine}
