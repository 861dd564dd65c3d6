#!/usr/bin/env bash
# The checks and the tests (README's test command; .ci/run calls it after scripts/setup.sh): lint and format, the
# import contracts of ARCHITECTURE.md, the type checker (strict on common/ and policies/), then pytest (arguments go
# to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "check: ruff" && .venv/bin/ruff check . && .venv/bin/ruff format --check .
echo "check: import contracts" && .venv/bin/lint-imports
echo "check: mypy" && bash scripts/typecheck.sh
echo "check: pytest" && exec .venv/bin/python -m pytest -q --durations=30 "$@"
