#!/usr/bin/env bash
# mypy over the installed layout: the checkout keeps top-level folders that setuptools installs as tokenweir.<folder>
# (pyproject's package-dir), and mypy resolves imports by path, so it reads them through a tree of links that has
# that layout (build/typecheck/tokenweir/<folder> -> <folder>). Arguments go to mypy.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build/typecheck/tokenweir
packages=()
for folder in common policies gateway engine kernels; do
    ln -sfn "$PWD/$folder" "build/typecheck/tokenweir/$folder"
    packages+=(-p "tokenweir.$folder")
done
exec .venv/bin/mypy "${packages[@]}" "$@"
