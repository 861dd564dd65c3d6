"""Structured-output grammar libraries on this CPU with SmolLM2's real 49152-token vocabulary:

    .venv/bin/python loadtests/bench_grammar.py                 # table + loadtests/results/bench_grammar.{md,png}
    .venv/bin/python loadtests/bench_grammar.py --libs llguidance --walks 2

For each library (xgrammar, llguidance, outlines-core) and each schema: compile time (grammar -> token-level
automaton, cache off), matcher creation time (per request), and the per-token mask time (mean and p99) while walking
a valid compact JSON document token by token: compute the mask into a packed int32 bitmask, check the document's
next token is allowed, accept it; at the end check a stop token is allowed. The JSON is compact (no whitespace
between tokens) as engine/structured.py configures it. Each library runs in its own subprocess with a time limit so
one that hangs or crashes gets an "n/a (reason)" row instead of taking the run down.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LIBS = ("xgrammar", "llguidance", "outlines-core", "engine")  # engine: engine/structured.py over llguidance
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# (schema or None for json_object, a valid instance). Instances are what a model would plausibly write.
_ADDRESS = {
    "type": "object",
    "properties": {
        "street": {"type": "string"},
        "city": {"type": "string"},
        "geo": {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
            "required": ["lat", "lon"],
            "additionalProperties": False,
        },
    },
    "required": ["street", "city", "geo"],
    "additionalProperties": False,
}
SCHEMAS: dict[str, tuple[dict | None, object]] = {
    "flat": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "email": {"type": "string"},
                "active": {"type": "boolean"},
                "score": {"type": "number"},
            },
            "required": ["name", "age", "email", "active", "score"],
            "additionalProperties": False,
        },
        {"name": "Alice Johnson", "age": 34, "email": "alice@example.com", "active": True, "score": 87.5},
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "person": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "address": _ADDRESS},
                    "required": ["name", "address"],
                    "additionalProperties": False,
                },
                "company": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "address": _ADDRESS},
                    "required": ["name", "address"],
                    "additionalProperties": False,
                },
            },
            "required": ["person", "company"],
            "additionalProperties": False,
        },
        {
            "person": {
                "name": "Bob Smith",
                "address": {"street": "12 Main St", "city": "Springfield", "geo": {"lat": 39.78, "lon": -89.65}},
            },
            "company": {
                "name": "Acme Corp",
                "address": {"street": "1 Market Sq", "city": "Chicago", "geo": {"lat": 41.88, "lon": -87.63}},
            },
        },
    ),
    "enums": (
        {
            "type": "object",
            "properties": {
                "status": {"type": "string", "enum": ["pending", "shipped", "delivered", "cancelled"]},
                "color": {"enum": ["red", "green", "blue", "light goldenrod yellow"]},
                "priority": {"type": "integer", "enum": [1, 2, 3, 5, 8]},
                "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
            },
            "required": ["status", "color", "priority", "size"],
            "additionalProperties": False,
        },
        {"status": "shipped", "color": "light goldenrod yellow", "priority": 5, "size": "XL"},
    ),
    "array_of_objects": (
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "id": {"type": "integer"},
                            "name": {"type": "string"},
                            "price": {"type": "number"},
                            "tags": {"type": "array", "items": {"type": "string"}},
                        },
                        "required": ["id", "name", "price", "tags"],
                        "additionalProperties": False,
                    },
                }
            },
            "required": ["items"],
            "additionalProperties": False,
        },
        {
            "items": [
                {"id": 1, "name": "Widget", "price": 9.99, "tags": ["tools", "metal"]},
                {"id": 2, "name": "Gadget", "price": 24.5, "tags": ["electronics"]},
                {"id": 3, "name": "Doohickey", "price": 3.25, "tags": []},
                {"id": 4, "name": "Thingamajig", "price": 105.0, "tags": ["misc", "large", "heavy"]},
            ]
        },
    ),
    "optional_fields": (
        {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "year": {"type": "integer"},
                "director": {"type": "string"},
                "rating": {"type": "number"},
                "genres": {"type": "array", "items": {"type": "string"}},
                "sequel": {"type": "boolean"},
                "notes": {"type": "string"},
            },
            "required": ["title", "year"],
            "additionalProperties": False,
        },
        {"title": "The Matrix", "year": 1999, "rating": 8.7, "genres": ["action", "sci-fi"], "notes": "classic"},
    ),
    "json_object": (
        None,
        {
            "user": {"id": 42, "name": "Carol", "roles": ["admin", "dev"], "verified": True},
            "scores": [1.5, 2, -3e2],
            "meta": {"created": "2024-01-01", "parent": None},
        },
    ),
}


NOTES = """Notes:
- compile: grammar -> token-level automaton with the library's cache off; matcher: per-request state from it
  (llguidance and engine: a deep copy of a compiled matcher). mask: computing one packed int32 bitmask.
- engine = engine/structured.py (llguidance underneath, the wrapper's Python overhead included).
- xgrammar json_object n/a: its any-JSON sub-grammar hard-codes ", " between nested items even with separators
  (",", ":"), so a compact document is rejected (its output is still JSON, with spaces).
- outlines-core compiles a regex to a DFA: json_object becomes objects nested at most 3 deep, and takes seconds.
- The machine is shared: repeated runs move means by ~2x; the ranking holds.
"""


# -- one library per subprocess


def _load_tokenizer():
    from engine.config import default_model_path
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_gguf(default_model_path())


class _XGrammar:
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


class _LLGuidance:
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


class _OutlinesCore:
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


class _Engine:
    """engine/structured.py itself (llguidance underneath): the wrapper's overhead on top of the library."""

    def __init__(self, tok, vocab_size: int):
        from engine.structured import StructuredOutputs

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


def _allowed(bitmask, t: int) -> bool:
    return bool((int(bitmask[0, t // 32]) >> (t % 32)) & 1)


def worker(lib: str, walks: int, schemas: list[str]) -> None:
    """Print one JSON line per schema (the parent reads them as they come, so a hang loses only the rest)."""
    import torch

    torch.set_num_threads(1)
    tok = _load_tokenizer()
    vocab_size = 49152
    t0 = time.perf_counter()
    try:
        impls = {"xgrammar": _XGrammar, "llguidance": _LLGuidance, "outlines-core": _OutlinesCore, "engine": _Engine}
        impl = impls[lib](tok, vocab_size)
    except Exception as e:  # an import or tokenizer failure makes every row n/a
        print(json.dumps({"fatal": f"{type(e).__name__}: {e}"}), flush=True)
        return
    print(json.dumps({"setup_ms": (time.perf_counter() - t0) * 1e3}), flush=True)
    stops = sorted(tok.stop_token_ids)
    for name in schemas:
        schema, doc = SCHEMAS[name]
        ids = tok.encode(json.dumps(doc, separators=(",", ":")))
        row: dict = {"schema": name, "tokens": len(ids)}
        try:
            t = time.perf_counter()
            grammar = impl.compile(schema)
            row["compile_ms"] = (time.perf_counter() - t) * 1e3
            mask_ns: list[int] = []
            matcher_ns: list[int] = []
            for _ in range(walks):
                t = time.perf_counter_ns()
                m = impl.matcher(grammar)
                matcher_ns.append(time.perf_counter_ns() - t)
                bitmask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
                for i, tid in enumerate([*ids, None]):
                    t = time.perf_counter_ns()
                    impl.fill(m, bitmask)
                    mask_ns.append(time.perf_counter_ns() - t)
                    if tid is None:  # document complete: a stop token must be allowed now
                        if not any(_allowed(bitmask, s) for s in stops):
                            raise RuntimeError("no stop token allowed after the complete document")
                        break
                    if not _allowed(bitmask, tid):
                        raise RuntimeError(f"mask forbids token {i} {tok.token_bytes(tid)!r} of a valid document")
                    if not impl.accept(m, tid):
                        raise RuntimeError(f"rejects token {i} {tok.token_bytes(tid)!r} of a valid document")
            mask_ns.sort()
            row["matcher_us"] = statistics.median(matcher_ns) / 1e3
            row["mask_mean_us"] = statistics.fmean(mask_ns) / 1e3
            row["mask_p99_us"] = mask_ns[min(len(mask_ns) - 1, int(0.99 * len(mask_ns)))] / 1e3
        except Exception as e:
            row = {"schema": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
        print(json.dumps(row), flush=True)


# -- parent: run, tabulate, plot


def run_lib(lib: str, walks: int, timeout: float) -> tuple[dict[str, dict], str | None]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", lib, "--walks", str(walks)]
    rows: dict[str, dict] = {}
    fatal = None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        out, rc, err = proc.stdout, proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc, err = None, f"timed out after {timeout:.0f}s"
    for line in out.splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "fatal" in rec:
            fatal = rec["fatal"]
        elif "schema" in rec:
            rows[rec["schema"]] = rec
    if rc is None or rc != 0:
        reason = err if rc is None else f"worker exited {rc}: {err.strip().splitlines()[-1] if err.strip() else ''}"
        for name in SCHEMAS:
            rows.setdefault(name, {"schema": name, "error": reason})
    return rows, fatal


def cell(rec: dict) -> tuple[str, str, str]:
    if "error" in rec:
        return (f"n/a ({rec['error']})", "", "")
    return (
        f"{rec['compile_ms']:.1f}",
        f"{rec['matcher_us']:.0f}",
        f"{rec['mask_mean_us']:.1f} / {rec['mask_p99_us']:.1f}",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--libs", nargs="*", default=list(LIBS))
    ap.add_argument("--walks", type=int, default=5, help="walks of each document (fresh matcher each)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per library")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.walks, list(SCHEMAS))
        return

    import platform

    results: dict[str, dict[str, dict]] = {}
    for lib in args.libs:
        rows, fatal = run_lib(lib, args.walks, args.timeout)
        if fatal:
            rows = {name: {"schema": name, "error": fatal} for name in SCHEMAS}
        results[lib] = rows
    header = "| library | schema | tokens | compile ms | matcher us | mask us mean / p99 |"
    lines = [header, "|---|---|---:|---:|---:|---:|"]
    for lib, rows in results.items():
        for name in SCHEMAS:
            rec = rows[name]
            c, mu, mk = cell(rec)
            lines.append(f"| {lib} | {name} | {rec.get('tokens', '')} | {c} | {mu} | {mk} |")
    apply_lines = apply_timings()
    cpu = platform.processor() or platform.machine()
    intro = (
        f"Grammar libraries on {cpu} ({os.cpu_count()} cores, 1 thread), SmolLM2 vocab 49152, compact JSON, "
        f"{args.walks} walks per document. `python loadtests/bench_grammar.py`\n"
    )
    table = "\n".join(lines) + "\n\n" + "\n".join(apply_lines)
    print(intro)
    print(table)
    if args.no_save:
        return
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "bench_grammar.md"), "w") as f:
        f.write("# Structured outputs: grammar library benchmark\n\n" + intro + "\n" + table + "\n\n" + NOTES)
    plot(results, os.path.join(RESULTS, "bench_grammar.png"))


def apply_timings() -> list[str]:
    """Cost of setting forbidden logits to -inf from packed masks (engine.structured.apply_token_bitmask, CPU)."""
    import torch

    from engine.structured import apply_token_bitmask

    out = ["| apply_token_bitmask (float32 logits, CPU) | sparse mask us | dense mask us |", "|---|---:|---:|"]
    for rows in (1, 8, 32):
        # Real masks are sparse (structure: a few tokens allowed) or dense (inside a string: nearly all allowed).
        sparse = torch.zeros(rows, 1536, dtype=torch.int32)
        sparse[:, 3] = 0x0F0F
        dense = torch.full((rows, 1536), -1, dtype=torch.int32)
        dense[:, 7] = 0
        cells = []
        for masks in (sparse, dense):
            logits = torch.randn(rows, 49152)
            times = []
            for _ in range(50):
                t = time.perf_counter_ns()
                apply_token_bitmask(logits, masks)
                times.append(time.perf_counter_ns() - t)
            cells.append(f"{statistics.fmean(times) / 1e3:.0f}")
        out.append(f"| {rows} rows x 49152 | {cells[0]} | {cells[1]} |")
    return out


def plot(results: dict[str, dict[str, dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(SCHEMAS)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / max(1, len(results))
    for k, (lib, rows) in enumerate(results.items()):
        xs = [i + k * width for i in range(len(names))]
        mean = [rows[n].get("mask_mean_us", 0) for n in names]
        p99 = [rows[n].get("mask_p99_us", 0) for n in names]
        comp = [rows[n].get("compile_ms", 0) for n in names]
        axes[0].bar(xs, mean, width, label=f"{lib} mean")
        axes[0].scatter(xs, p99, marker="_", s=200, color="black")
        axes[1].bar(xs, comp, width, label=lib)
        for x, n in zip(xs, names, strict=True):
            if "error" in rows[n]:
                for ax in axes:
                    ax.text(
                        x,
                        0.02,
                        "n/a",
                        rotation=90,
                        ha="center",
                        va="bottom",
                        fontsize=8,
                        transform=ax.get_xaxis_transform(),
                    )
    for ax, title in ((axes[0], "per-token mask (us; bar mean, tick p99)"), (axes[1], "compile (ms)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=20, fontsize=8)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle("Structured-output grammars, SmolLM2 49152-token vocab, 1 CPU thread")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
