"""The budget rule of the ``triton_fused`` executor's ``qada_budget`` and ``qada_tail_budget`` steps: per row, the
``k`` best-scored heads (or KV groups) are local, one program per row. Imported lazily: importing it imports triton.

It reads the heads' scores (``log A_local - log Â_bulk``: eq. 7's estimate, written by
:func:`qada_budget_score_kernel`, or the tail-aware one, written by the ``qada_tail`` kernel in its score mode) and
writes the decision and the group policy as the split kernels do, so that the ``triton`` executor's split and
combine launches follow on it. The rule is :meth:`~qada.criteria.BudgetedQAdACriterion.decide`'s: a head (a group)
with a non-finite score is never local and, where the row has a bulk, is counted as forced dense; the others rank
by score, ties to the lower index (a stable descending sort); a row without a bulk is all local.
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
        t_bulk, bulk_lo, bulk_hi, H_KV, scale, softcap, G, D, BLOCK_G, BLOCK_N, BLOCK_D, SOFTCAP, HAS_SINKS,
        INPUT_PRECISION, DOT_FP32, False,
    )  # fmt: skip
    tl.store(SCORE + row64 * (H_KV * G) + heads, tl.where(bad > 0, float("nan"), log_local - log_bulk), mask=g_ok)


@triton.jit
def ranks(values, ok, BLOCK: tl.constexpr):
    """The position of each of ``values [BLOCK]`` (where ``ok``) in a stable descending sort of them: the number of
    others that are larger, or equal and earlier."""
    index = tl.arange(0, BLOCK)
    mine = values[:, None]
    other = values[None, :]
    before = ok[None, :] & ((other > mine) | ((other == mine) & (index[None, :] < index[:, None])))
    return tl.sum(before.to(tl.int32), axis=1)


@triton.jit
def qada_budget_decision_kernel(
    SCORE, START, END, COUNT, DECIDED, LOCAL, BROKEN, READ,
    C, t_local,
    H: tl.constexpr, G: tl.constexpr, H_KV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr,
    PER_GROUP: tl.constexpr, PROMOTE: tl.constexpr,
    HAS_START: tl.constexpr, HAS_END: tl.constexpr,
):  # fmt: skip
    """One program = one row: its ``k`` best heads of ``SCORE [b, H]`` (float32) local, or with ``PER_GROUP`` its
    ``k`` best KV groups (a group's score is its heads' minimum, ``-inf`` when one of them is not finite), then the
    group policy. ``k``: the layer's 0-d int64 ``COUNT``. Writes ``DECIDED, LOCAL, BROKEN [b, H]`` and ``READ [b,
    H_kv]`` (bool, written as bytes 0/1)."""
    row = tl.program_id(0)
    first, last, t_bulk, bulk_lo, bulk_hi = row_range(START, END, row, C, 0, t_local, HAS_START, HAS_END)
    has_bulk = t_bulk > 0
    count = tl.load(COUNT).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    h_ok = heads < H
    row64 = row.to(tl.int64)
    score = tl.load(SCORE + row64 * H + heads, mask=h_ok, other=float("-inf"))
    finite = (score == score) & (tl.abs(score) < float("inf")) & h_ok
    ranked = tl.where(finite, score, float("-inf"))
    groups = tl.arange(0, BLOCK_KV)
    member = ((heads[None, :] // G) == groups[:, None]) & h_ok[None, :]  # [BLOCK_KV, BLOCK_H]
    if PER_GROUP:
        g_ok = groups < H_KV
        group_min = tl.min(tl.where(member, ranked, float("inf")), axis=1)
        group_finite = tl.min(tl.where(member, finite.to(tl.int32)[None, :], 1), axis=1) > 0
        group_score = tl.where(group_finite, group_min, float("-inf"))
        local_group = (ranks(group_score, g_ok, BLOCK_KV) < count) & group_finite & g_ok
        local = tl.max(tl.where(member, local_group.to(tl.int32)[:, None], 0), axis=0) > 0
    else:
        local = (ranks(ranked, h_ok, BLOCK_H) < count) & finite
    decided = (local | (has_bulk == 0)) & h_ok
    broken = (finite == 0) & has_bulk & h_ok
    dense = (decided == 0) & h_ok
    read = tl.max(tl.where(member, dense.to(tl.int32)[None, :], 0), axis=1) > 0  # [BLOCK_KV]
    local = decided
    if PROMOTE:
        read_head = tl.max(tl.where(member, read.to(tl.int32)[:, None], 0), axis=0) > 0
        local = decided & (read_head == 0)
    out = row64 * H + heads
    tl.store(DECIDED + out, decided.to(tl.uint8), mask=h_ok)
    tl.store(LOCAL + out, local.to(tl.uint8), mask=h_ok)
    tl.store(BROKEN + out, broken.to(tl.uint8), mask=h_ok)
    tl.store(READ + row64 * H_KV + groups, read.to(tl.uint8), mask=groups < H_KV)
