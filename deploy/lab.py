"""The lab topology as local processes: 2 engines, 2 gateway replicas (shared Redis + PostgreSQL) behind nginx,
Prometheus scraping all four, and a headless locust run through nginx. scripts/lab.sh and tests/process/lab use this.

    python -m deploy.lab                       # start, run locust for 20 s, print URLs, wait for Ctrl-C
    python -m deploy.lab --locust-seconds 0    # start only
    python -m deploy.lab --exit                # start, run locust, write the dashboard picture, stop
    python -m deploy.lab --disaggregated       # engine-1 prefills, engine-2 decodes: every chat takes both hops
    python -m deploy.lab --canary --exit       # + a scripted canary rollout: one promoted, one rolled back

Redis and PostgreSQL are the machine's (127.0.0.1:6379, :5432): the lab gets a database of its own
(tokenweir_lab_<random>, dropped at the end; TWLAB_PG names the server) and Redis db 9 (TWLAB_REDIS); TWLAB_KEEP=1
keeps the temp dir (configs, logs, events files). nginx and prometheus are Debian's binaries, run as
plain user processes with configs rendered by deploy/render.py into a temp dir. Only 127.0.0.1 is used; every
process started here is stopped by its PID at the end.

This file is the command line. The pieces: deploy/lab_topology.py (what runs and how it is wired, start()),
deploy/lab_procs.py (processes, the per-run database, waiting), deploy/lab_probe.py (locust, Prometheus queries).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from deploy.lab_probe import replica_traffic, run_locust
from deploy.lab_procs import ROOT, LabError, locust_binary
from deploy.lab_topology import start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.lab", description="the tokenweir lab as local processes")
    p.add_argument("--locust-seconds", type=int, default=20, help="0: no locust run")
    p.add_argument("--users", type=int, default=6)
    p.add_argument("--down-upstream", action="store_true", help="add a pool member nothing listens on (faults)")
    p.add_argument("--disaggregated", action="store_true", help="engine-1 prefills, engine-2 decodes")
    p.add_argument("--canary", action="store_true", help="then a canary rollout: one promoted, one rolled back")
    p.add_argument("--exit", action="store_true", help="stop after the locust run instead of waiting for Ctrl-C")
    p.add_argument("--picture", default=str(ROOT / "loadtests" / "results" / "lab_dashboard.png"))
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # lab.sh's trap: SIGTERM -> clean stop below
    try:
        lab = start(down_upstream=args.down_upstream, disaggregated=args.disaggregated)
    except LabError as exc:
        print(f"tokenweir lab: {exc}", file=sys.stderr)
        return 2
    try:
        print(lab.summary(), flush=True)
        if args.locust_seconds > 0 and locust_binary() is None:
            print("tokenweir lab: no locust (.venv/bin/pip install locust): no load run", file=sys.stderr)
        elif args.locust_seconds > 0:
            print(f"tokenweir lab: locust for {args.locust_seconds}s with {args.users} users ...", flush=True)
            res = run_locust(lab, args.locust_seconds, args.users)
            print(res.stdout[-4000:] + res.stderr[-4000:], flush=True)
            print(f"tokenweir lab: locust exit {res.returncode}; requests per replica {replica_traffic(lab)}")
        if args.canary:
            from deploy.lab_canary import run_canary

            try:
                print(f"tokenweir lab: canary rollouts: {run_canary(lab, lambda line: print(line, flush=True))}")
            except LabError as exc:
                print(f"tokenweir lab: canary: {exc}", file=sys.stderr)
                return 1
        if args.locust_seconds > 0 or args.canary:
            time.sleep(5)  # two more scrapes
            from deploy.render_dashboard import render_png

            print(f"tokenweir lab: dashboard picture {render_png(lab.prometheus_url, Path(args.picture))}")
        if not args.exit:
            print("tokenweir lab: running; Ctrl-C stops everything", flush=True)
            while all(p.popen.poll() is None for p in lab.procs):
                time.sleep(1)
            print("tokenweir lab: a process exited:\n" + lab.logs_tail(10), file=sys.stderr)
            return 1
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        print("tokenweir lab: stopping ...", flush=True)
        lab.stop()


if __name__ == "__main__":
    sys.exit(main())
