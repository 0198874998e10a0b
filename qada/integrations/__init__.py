"""qada inside other evaluation tools: :mod:`qada.integrations.lm_eval` (EleutherAI's lm-evaluation-harness).

Each integration is imported on demand and needs its tool installed (``pip install -e ".[lm-eval]"``).
"""
