#!/usr/bin/env bash
# The README's test command: a fresh virtual environment, the whole test suite, the docs with -W.
#   bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-test
rm -rf "$VENV"
bash scripts/setup.sh "$VENV"
export PATH="$PWD/$VENV/bin:$PATH"
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
echo "[test] pytest"
python -m pytest "$@"
echo "[test] sphinx-build -W (docs + doctests)"
rm -rf docs/_build
python -m sphinx -W --keep-going -b html docs docs/_build/html -q
python -m sphinx -W --keep-going -b doctest docs docs/_build/doctest -q
echo "[test] docs built: docs/_build/html/index.html"
