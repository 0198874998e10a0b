"""The score launch of the ``triton_fused`` executor's ``qada_budget`` step: each head's eq. 7 score, one program per
(row, KV head). Imported lazily: importing it imports triton.

The ``triton`` split launch after it ranks a row's scores (:mod:`qada.attention._budget_rank`, the rule of
:meth:`~qada.criteria.BudgetedQAdACriterion.decide`); the ``qada_tail_budget`` step's scores come from the
``qada_tail`` kernel in its score mode instead.
"""

from __future__ import annotations

import triton
import triton.language as tl

from qada.attention._fused_kernel import group_log_masses
from qada.attention._triton_kernel import as_float32, group_queries, row_range


@triton.jit
def qada_budget_score_kernel(
    Q, K, LME, START, END, SINKS, SCORE,
    stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kt, stride_kd,
    C, H_KV, t_sink, t_local, scale, softcap,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_START: tl.constexpr, HAS_END: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """One program = one (row, KV head): its query heads' ``qada_budget`` scores ``log A_local - log Â_bulk`` (eq. 7,
    :meth:`~qada.criteria.BudgetedQAdACriterion.score`) into ``SCORE [b, H]`` float32, NaN where a window score is
    NaN or ``+inf`` (the fail-safe: never local), ``+inf`` for a row without a bulk (local whatever its score).
    ``Q [b, H, d]``, ``K [b, H_kv, C, d]``, the rows' ``START`` / ``END`` and ``LME [b, H]`` (each head's ``log
    E[exp(s)]``, written by the moment step's launch) as :func:`~qada.attention._fused_kernel.group_log_masses`
    reads them."""
    scale, softcap = as_float32(scale), as_float32(softcap)  # (fp64: see as_float32)
    pid = tl.program_id(0)
    row = pid // H_KV
    kv_head = pid % H_KV
    offs_g = tl.arange(0, BLOCK_G)
    g_ok = offs_g < G
    heads = kv_head * G + offs_g
    row64 = row.to(tl.int64)
    kv64 = kv_head.to(tl.int64)
    first, last, t_bulk, bulk_lo, bulk_hi = row_range(START, END, row, C, t_sink, t_local, HAS_START, HAS_END)
    q = group_queries(Q + row64 * stride_qb + heads[:, None].to(tl.int64) * stride_qh, stride_qd, g_ok, D, BLOCK_D,
                      DOT_FP32)  # fmt: skip
    log_local, log_bulk, bad, has_bulk = group_log_masses(
        q, K + row64 * stride_kb + kv64 * stride_kh, stride_kt, stride_kd, LME, SINKS, row64, heads, g_ok, first, last,
        t_bulk, bulk_lo, bulk_hi, H_KV, scale, softcap, 0.0, G, D, BLOCK_G, BLOCK_N, BLOCK_D, SOFTCAP, HAS_SINKS,
        INPUT_PRECISION, DOT_FP32, False, False,
    )  # fmt: skip
    tl.store(SCORE + row64 * (H_KV * G) + heads, tl.where(bad > 0, float("nan"), log_local - log_bulk), mask=g_ok)
