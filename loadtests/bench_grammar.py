"""Structured-output grammar libraries on this CPU with SmolLM2's real 49152-token vocabulary:

    .venv/bin/python loadtests/bench_grammar.py                 # table + loadtests/results/bench_grammar.{md,png}
    .venv/bin/python loadtests/bench_grammar.py --libs llguidance --walks 2

For each library (xgrammar, llguidance, outlines-core) and each schema: compile time (grammar -> token-level
automaton, cache off), matcher creation time (per request), and the per-token mask time (mean and p99) while walking
a valid compact JSON document token by token: compute the mask into a packed int32 bitmask, check the document's
next token is allowed, accept it; at the end check a stop token is allowed. The JSON is compact (no whitespace
between tokens) as engine/text/structured.py configures it. Each library runs in its own subprocess with a time limit so
one that hangs or crashes gets an "n/a (reason)" row instead of taking the run down.

This file is the command line, the subprocess per library, the table and the picture. The pieces:
loadtests/grammar_schemas.py (the schemas and documents), loadtests/grammar_adapters.py (one adapter per library),
loadtests/grammar_measure.py (the walk and the timings).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from loadtests.grammar_measure import apply_timings, worker  # noqa: E402
from loadtests.grammar_schemas import SCHEMAS  # noqa: E402

LIBS = ("xgrammar", "llguidance", "outlines-core", "engine")  # engine: engine/text/structured.py over llguidance
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


NOTES = """Notes:
- compile: grammar -> token-level automaton with the library's cache off; matcher: per-request state from it
  (llguidance and engine: a deep copy of a compiled matcher). mask: computing one packed int32 bitmask.
- engine = engine/text/structured.py (llguidance underneath, the wrapper's Python overhead included).
- xgrammar json_object n/a: its any-JSON sub-grammar hard-codes ", " between nested items even with separators
  (",", ":"), so a compact document is rejected (its output is still JSON, with spaces).
- outlines-core compiles a regex to a DFA: json_object becomes objects nested at most 3 deep, and takes seconds.
- The machine is shared: repeated runs move means by ~2x; the ranking holds.
"""


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
