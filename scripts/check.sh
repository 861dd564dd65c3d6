#!/usr/bin/env bash
# The checks and the tests (README's test command; .ci/run calls it after scripts/setup.sh), cheapest first and
# stopping at the first stage that fails: lint and format, the import contracts of ARCHITECTURE.md, the type checker
# (strict on common/, policies/, the request path and the scheduler), the fast loop (the unit tests that load no
# model: seconds), then everything else in parallel (pytest-xdist; a test file stays on one worker, since some files
# share a fixture or a Redis db). With arguments, only pytest runs, with them (e.g. `bash scripts/check.sh
# tests/unit/policies -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTEST=(.venv/bin/python -m pytest -q)
if [ $# -gt 0 ]; then exec "${PYTEST[@]}" "$@"; fi
echo "check: ruff" && .venv/bin/ruff check . && .venv/bin/ruff format --check .
echo "check: import contracts" && .venv/bin/lint-imports
echo "check: mypy" && bash scripts/typecheck.sh
echo "check: unit tests (the fast loop)" && "${PYTEST[@]}" -m "unit and not slow"
# Most of the rest waits on sockets and child processes, so one worker more than the cores keeps both busy.
workers=${TOKENWEIR_TEST_WORKERS:-$(($(nproc) + 1))}
echo "check: the rest, $workers workers" &&
    exec "${PYTEST[@]}" -m "not unit or slow" -n "$workers" --dist loadfile --durations=30
