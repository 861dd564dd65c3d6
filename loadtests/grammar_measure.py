"""The measurements of loadtests/bench_grammar.py: worker() runs in one library's subprocess and prints a JSON line
per schema (compile, matcher creation, per-token mask mean and p99 over walks of the valid document, checking each
token is allowed and a stop token at the end); apply_timings() times engine.text.structured.apply_token_bitmask.
"""

from __future__ import annotations

import json
import statistics
import time

from loadtests.grammar_adapters import ADAPTERS, load_tokenizer
from loadtests.grammar_schemas import SCHEMAS


def _allowed(bitmask, t: int) -> bool:
    return bool((int(bitmask[0, t // 32]) >> (t % 32)) & 1)


def worker(lib: str, walks: int, schemas: list[str]) -> None:
    """Print one JSON line per schema (the parent reads them as they come, so a hang loses only the rest)."""
    import torch

    torch.set_num_threads(1)
    tok = load_tokenizer()
    vocab_size = 49152
    t0 = time.perf_counter()
    try:
        impl = ADAPTERS[lib](tok, vocab_size)
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


def apply_timings() -> list[str]:
    """Cost of setting forbidden logits to -inf from packed masks (engine.text.structured.apply_token_bitmask, CPU)."""
    import torch

    from tokenweir.engine.text.structured import apply_token_bitmask

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
