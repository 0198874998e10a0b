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
# Two pytest-xdist workers share the cores (one torch thread each, tests/conftest.py): the suite takes about half the
# time it takes in one process (16 min against 31 on 2 cores). QADA_TEST_WORKERS=0 runs it in one process.
CORES=$(nproc 2>/dev/null || echo 1)
WORKERS=${QADA_TEST_WORKERS:-$(( CORES < 2 ? 0 : 2 ))}
echo "[test] pytest ($WORKERS workers)"
python -m pytest -n "$WORKERS" --dist worksteal "$@"
echo "[test] sphinx-build -W (docs + doctests)"
rm -rf docs/_build
python -m sphinx -W --keep-going -b html docs docs/_build/html -q
python -m sphinx -W --keep-going -b doctest docs docs/_build/doctest -q
echo "[test] docs built: docs/_build/html/index.html"
