#!/usr/bin/env bash
# The tokenweir lab without Docker: 2 engines, 2 gateway replicas (this machine's Redis and PostgreSQL) behind
# nginx, Prometheus scraping them all, then a short headless locust run through nginx. Prints the URLs; Ctrl-C
# stops everything it started. Options go to deploy/lab.py:
#   scripts/lab.sh [--locust-seconds 20] [--users 6] [--down-upstream] [--exit]
# Needs: nginx and prometheus (Debian packages), locust in .venv, Redis on 127.0.0.1:6379, PostgreSQL on :5432.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "lab.sh: no .venv: run bash scripts/setup.sh first" >&2; exit 1; }

missing=()
for bin in nginx prometheus; do
  command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || missing+=("$bin")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "lab.sh: missing ${missing[*]} (Debian packages nginx, prometheus)" >&2
  if [ "$(id -u)" = 0 ]; then
    echo "lab.sh: trying: apt-get install -y nginx prometheus" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y nginx prometheus >&2 \
      || { echo "lab.sh: install failed; run apt-get update && apt-get install -y nginx prometheus" >&2; exit 1; }
  else
    echo "lab.sh: install them: sudo apt-get install -y nginx prometheus" >&2
    exit 1
  fi
fi
[ -x .venv/bin/locust ] || echo "lab.sh: locust missing (.venv/bin/pip install locust): the lab starts without load" >&2

# The lab itself (deploy/lab.py) stops every process it started, by PID, on SIGTERM/SIGINT.
"$PY" -m deploy.lab "$@" &
lab_pid=$!
stop() { kill -TERM "$lab_pid" 2>/dev/null || true; wait "$lab_pid" 2>/dev/null || true; }
trap 'stop; exit 130' INT
trap 'stop; exit 143' TERM
wait "$lab_pid"
