"""Run every fault scenario of tests/process/faults and print a markdown table (plus each scenario's problems).

    PYTHONPATH=. .venv/bin/python loadtests/fault_table.py                 # the tree it lives in
    PYTHONPATH=/tmp/tw_before .venv/bin/python /tmp/tw_before/loadtests/fault_table.py --before   # HEAD's format
    ... --only redis_cut,clients_leave   --out table.md   --keep (leave the work directories)

The gateway subprocesses run from the tree this file belongs to (cwd and PYTHONPATH = its root), whatever the
editable install points at; the first line printed says which `gateway` package they import. `--before` writes
HEAD's config format (no `state:` section, which HEAD's loader rejects). Needs Redis at 127.0.0.1:6379.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.process.faults.scenarios import SCENARIOS, FaultResult  # noqa: E402
from tests.support.fault_harness import Gateway, redis_available  # noqa: E402

HEADER = "| fault | requests | billed vs served | leaks (slots/holds/reserved) | 5xx (500s) | follow-up |"
RULE = "|---|---:|---|---|---|---|"


def row(r: FaultResult) -> str:
    if r.skipped:
        return f"| {r.fault} | - | n/a: {r.skipped} | - | - | - |"
    ok = "=" if r.billed_events == r.served else "!="
    billed = f"events {r.billed_events} {ok} served {r.served}; store {r.billed_store}; {r.events} events"
    leaks = f"{r.leaked_slots}/{r.leaked_holds}/{r.reserved_left}"
    follow = "-" if r.followup is None else str(r.followup)
    return f"| {r.fault} | {r.requests} | {billed} | {leaks} | {r.n_5xx} ({r.n_500}) | {follow} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", action="store_true", help="HEAD's config format (no `state:` section)")
    parser.add_argument("--only", default="", help="comma-separated scenario function names")
    parser.add_argument("--out", default="", help="also write the table (and problems) to this file")
    parser.add_argument("--pool-n", type=int, default=600, help="requests of the pool-exhaustion storm")
    parser.add_argument("--keep", action="store_true", help="keep the work directories (logs, events, store)")
    args = parser.parse_args(argv)
    why = redis_available()
    if why:
        print(f"Redis is needed: {why}", file=sys.stderr)
        return 2
    chosen = [s for s in SCENARIOS if not args.only or s.__name__ in args.only.split(",")]
    base = Path(tempfile.mkdtemp(prefix="tw_faults_"))
    probe = Gateway("probe", base, {"events": {"path": str(base / "probe.jsonl")}})
    where = probe.imported_from()
    label = "BEFORE (HEAD config format)" if args.before else "AFTER"
    print(f"# fault table, {label}: gateway subprocesses import {where}", flush=True)
    results: list[FaultResult] = []
    t0 = time.monotonic()
    for scenario in chosen:
        kwargs = {"n": args.pool_n} if scenario.__name__ == "redis_pool_exhaustion" else {}
        r = scenario(base / scenario.__name__, before=args.before, **kwargs)
        results.append(r)
        state = "skipped" if r.skipped else f"{len(r.problems)} problem(s)"
        print(f"  ran {scenario.__name__}: {state} in {r.wall_s:.1f}s", file=sys.stderr, flush=True)
    lines = [
        f"Fault table ({label}; gateway from {where}; {time.monotonic() - t0:.0f}s)",
        "",
        HEADER,
        RULE,
        *[row(r) for r in results],
        "",
    ]
    for r in results:
        if r.skipped:
            continue
        lines.append(f"- **{r.fault}** ({r.wall_s:.0f}s): statuses {r.statuses}")
        lines += [f"  - PROBLEM: {p}" for p in r.problems]
        lines += [f"  - note: {n}" for n in r.notes]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    else:
        print(f"work directories kept under {base}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
