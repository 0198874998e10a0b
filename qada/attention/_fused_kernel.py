"""The split kernel of the ``triton_fused`` executor: the QAdA decision (paper eqs. 5-7) and split-K decode in one
launch. Imported lazily: importing it imports triton. Its splits are merged by the ``triton`` executor's combine
kernel (:mod:`qada.attention._triton_kernel`, whose token ranges and virtual block lists this kernel shares).
"""

from __future__ import annotations

import triton
import triton.language as tl

from qada.attention._group_decision import group_policy, store_decision
from qada.attention._lognormal_kernel import cap, moments_log_mean_exp, spread_over_heads
from qada.attention._triton_kernel import (
    as_float32,
    attend_split,
    block_list,
    group_queries,
    key_scores,
    let_next_start,
    row_range,
    through_memory,
    wait_for_previous,
)


@triton.jit
def window_log_mass(
    q, k_base, stride_kt, stride_kd, first, last, bulk_lo, bulk_hi, has_bulk, scale, softcap,
    D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """``(log A_window [BLOCK_G], bad [BLOCK_G])``: the natural-log mass ``logsumexp_i s_i`` of the queries
    ``q [BLOCK_G, BLOCK_D]`` (the cache's dtype, float32 under ``DOT_FP32``) over the row's window (``[first,
    last)`` minus the bulk ``[bulk_lo, bulk_hi)``), with ``s_i = scale q·k_i`` (:func:`key_scores`, float32)
    soft-capped under ``SOFTCAP``, and whether some window score is NaN or ``+inf`` (the eager logsumexp is then not
    finite: the fail-safe). Reads the window's blocks once each."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    a_lo, n_a, b_lo, n_window = block_list(first, last, bulk_lo, bulk_hi, has_bulk == 0, BLOCK_N)
    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_G], dtype=tl.float32)
    bad = tl.zeros([BLOCK_G], dtype=tl.int32)
    for i in range(0, n_window):
        blk = tl.where(i < n_a, a_lo + i, b_lo + (i - n_a))
        offs = blk * BLOCK_N + offs_n
        ok = (offs >= first) & (offs < last) & ((offs < bulk_lo) | (offs >= bulk_hi))
        k = tl.load(k_base + offs[:, None].to(tl.int64) * stride_kt + offs_d[None, :] * stride_kd,
                    mask=ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
        s = key_scores(q, k, INPUT_PRECISION, DOT_FP32) * scale
        if SOFTCAP:
            s = cap(s, softcap)
        broken = (s != s) | (s == float("inf"))  # NaN or +inf: the eager logsumexp is not finite (-inf is 0)
        bad += tl.max(tl.where(ok[None, :] & broken, 1, 0), axis=1)
        s = tl.where(ok[None, :] & (broken == 0), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        total = total * tl.exp(m - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
        m = m_new
    log_window = tl.where(total > 0, m + tl.log(total), float("-inf"))
    return log_window, bad > 0


@triton.jit
def window_log_local(
    q, k_base, stride_kt, stride_kd, first, last, bulk_lo, bulk_hi, has_bulk, scale, softcap, SINKS, heads, g_ok,
    D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """``(log A_local [BLOCK_G], bad [BLOCK_G])``: :func:`window_log_mass`, ``logaddexp``-ed with the heads' sink
    logits ``SINKS[heads]`` under ``HAS_SINKS``."""
    log_local, bad = window_log_mass(q, k_base, stride_kt, stride_kd, first, last, bulk_lo, bulk_hi, has_bulk,
                                     scale, softcap, D, BLOCK_G, BLOCK_N, BLOCK_D, SOFTCAP, INPUT_PRECISION,
                                     DOT_FP32)  # fmt: skip
    if HAS_SINKS:
        sink = tl.load(SINKS + heads, mask=g_ok, other=0.0).to(tl.float32)
        log_local = logaddexp(log_local, sink)
    return log_local, bad


@triton.jit
def logaddexp(a, b):
    """``log(e^a + e^b)`` elementwise (``-inf`` when both are ``-inf``)."""
    hi = tl.maximum(a, b)
    lo = tl.minimum(a, b)
    hi_safe = tl.where(hi == float("-inf"), 0.0, hi)
    return tl.where(hi == float("-inf"), float("-inf"), hi_safe + tl.log(1.0 + tl.exp(lo - hi_safe)))


@triton.jit
def head_query(q_head, g, stride_qh, stride_qd, offs, ok):
    """Features ``offs`` (where ``ok``) of the group's query head ``g`` as float32: the group's first query head at
    ``q_head``, the others ``stride_qh`` apart."""
    return tl.load(q_head + g * stride_qh + offs * stride_qd, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def threshold_decision(log_local, log_bulk, bad, has_bulk, log_tau, G: tl.constexpr, BLOCK_G: tl.constexpr,
                       PROMOTE: tl.constexpr):  # fmt: skip
    """The fail-safe threshold decision of the ``G`` heads of one group and the group policy: ``(decided, local,
    broken, dense [BLOCK_G], read)``. Broken (forced dense) where the row has a bulk and ``log_local``,
    ``log_bulk`` or a flag of ``bad`` is not finite / set; local where ``log_local - logaddexp(log_local,
    log_bulk) >= log_tau`` and not broken, or where the row has no bulk; the group reads its bulk when one of its
    heads is dense; with ``PROMOTE`` every head of such a group is dense."""
    g_ok = tl.arange(0, BLOCK_G) < G
    finite = (tl.abs(log_local) < float("inf")) & (tl.abs(log_bulk) < float("inf")) & (bad == 0)
    broken = has_bulk & (finite == 0) & g_ok
    ratio_ok = (log_local - logaddexp(log_local, log_bulk)) >= log_tau
    decided = tl.where(has_bulk, ratio_ok & (broken == 0), 1) != 0
    local, dense, read = group_policy(decided, g_ok, PROMOTE)
    return decided, local, broken, dense, read


@triton.jit
def qada_fused_split_kernel(
    Q, K, V, LME, START, END, SINKS,
    ACC, M, L, COUNTS, DECIDED, LOCAL, READ, BROKEN,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    C, H_KV, t_sink, t_local, num_splits, scale, qk_scale, softcap, log_tau,
    MEAN, COV, GH_X, GH_LOGW, stride_mb, stride_mh, stride_md, stride_cb, stride_ch, stride_ci, stride_cj, n_nodes,
    G: tl.constexpr, D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_START: tl.constexpr, HAS_END: tl.constexpr, HAS_SINKS: tl.constexpr, PROMOTE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, SOFTCAP: tl.constexpr, PDL: tl.constexpr,
    ESTIMATE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_X: tl.constexpr,
):  # fmt: skip
    """One program = one (row, KV head) and one split: the group's QAdA decision, then its split of the attention.

    Reads ``Q [b, H, 1, d]``, ``K, V [b, H_kv, C, d]``, ``LME [b, H]`` float32 (contiguous), each query head's
    ``log E[exp(s)]`` of one bulk score under the lognormal model (eqs. 5-6, written by the moment step's launch:
    :mod:`qada.attention._estimate_kernel`), ``START, END [b]`` (only with ``HAS_START`` / ``HAS_END``) and the sink
    logits ``SINKS [H]`` (only with ``HAS_SINKS``).

    Decision, in float32 for every query head ``h`` of the group, as the eager ``qada`` criterion computes it:

    * ``log A_local = logsumexp`` of the (capped) window scores ``scale q·k``, ``logaddexp``-ed with ``SINKS[h]``;
    * (eq. 7) ``log Â_bulk = log T_bulk + LME[h]`` (``LME = mu_s + sigma_s^2 / 2``, or ``log E[exp(c tanh(s /
      c))]`` under a cap), ``-inf`` without a bulk;
    * broken (fail-safe, forced dense) where the row has a bulk and a value is not finite; local where
      ``log A_local - logaddexp(log A_local, log Â_bulk) >= log_tau`` and not broken, or where the row has no bulk;
    * the group reads its bulk when one of its heads is dense; with ``PROMOTE`` every head of such a group is dense.

    Every split computes the decision (it fixes the virtual block list); split 0 stores it: ``DECIDED, LOCAL,
    BROKEN [b, H]`` and ``READ [b, H_kv]``, bool (bytes 0/1). The attention and what it writes (``ACC, M, L,
    COUNTS``) are those of :func:`~qada.attention._triton_kernel.qada_decode_split_kernel` with the effective local
    mask.

    With ``PDL`` (launched as a programmatic dependent launch after the moment step's launch, which wrote ``LME``)
    it lets the combine launch start, scores the window while the moment step may still run, and waits for it before
    reading ``LME`` (:func:`group_decision`): everything read before was written before the moment step started.

    With ``ESTIMATE`` (the executor's ``estimate_in_splits``) ``LME`` is not read: each program computes its heads'
    ``log E[exp(s)]`` itself from the KV head's float32 bulk moments ``MEAN [b, H_kv, d]``, ``COV [b, H_kv, d, d]``
    (the ``stride_m*``, ``stride_c*`` strides; under ``SOFTCAP`` the ``n_nodes`` Gauss-Hermite nodes ``GH_X`` and
    log weights ``GH_LOGW``) as the launch writing ``LME`` does
    (:func:`~qada.attention._lognormal_kernel.moments_log_mean_exp`: the same float32 value), after waiting for the
    launch before with ``PDL``: no launch of its own for the estimate.
    """
    scale, qk_scale = as_float32(scale), as_float32(qk_scale)  # (fp64 where torch.compile launches)
    softcap, log_tau = as_float32(softcap), as_float32(log_tau)
    let_next_start(PDL)
    pair = tl.program_id(0)
    split = tl.program_id(1)
    row = pair // H_KV
    kv_head = pair % H_KV
    offs_g = tl.arange(0, BLOCK_G)
    g_ok = offs_g < G
    heads = kv_head * G + offs_g
    row64 = row.to(tl.int64)
    kv64 = kv_head.to(tl.int64)
    k_base = K + row64 * stride_kb + kv64 * stride_kh
    q_rows = Q + row64 * stride_qb + heads[:, None].to(tl.int64) * stride_qh

    first, last, t_bulk, bulk_lo, bulk_hi = row_range(START, END, row, C, t_sink, t_local, HAS_START, HAS_END)
    has_bulk = t_bulk > 0

    # --- the group's decision: log A_local, eq. 7 from LME, the threshold (fail-safe), the group policy -------
    lme = tl.zeros([BLOCK_G], dtype=tl.float32)
    if ESTIMATE:  # the heads' log E[exp(s)] from the moments, as the launch writing LME computes it
        wait_for_previous(PDL)  # the moments are in memory
        lme = spread_over_heads(moments_log_mean_exp(
            Q + row64 * stride_qb + (kv64 * G) * stride_qh, MEAN + row64 * stride_mb + kv64 * stride_mh,
            COV + row64 * stride_cb + kv64 * stride_ch, GH_X, GH_LOGW, stride_qh, stride_qd, stride_md, stride_ci,
            stride_cj, scale, softcap, n_nodes, D, G, BLOCK_D, BLOCK_T, BLOCK_E, BLOCK_X, SOFTCAP,
        ), BLOCK_E, BLOCK_G)  # fmt: skip
    q = group_queries(q_rows, stride_qd, g_ok, D, BLOCK_D, DOT_FP32)
    decided, local, broken, dense, read = group_decision(
        q, k_base, stride_kt, stride_kd, LME, SINKS, row64, heads, g_ok, first, last, t_bulk, bulk_lo, bulk_hi, H_KV,
        scale, softcap, log_tau, lme, G, D, BLOCK_G, BLOCK_N, BLOCK_D, SOFTCAP, HAS_SINKS, PROMOTE, INPUT_PRECISION,
        DOT_FP32, PDL, ESTIMATE,
    )  # fmt: skip
    if split == 0:
        store_decision(DECIDED, LOCAL, BROKEN, READ, row64, kv64, heads, g_ok, H_KV, G, decided, local, broken,
                       read)  # fmt: skip

    # --- the attention over this split's share of the virtual block list ----------------------------------------
    q = group_queries(q_rows, stride_qd, g_ok, D, BLOCK_D, DOT_FP32)
    read = through_memory(COUNTS, pair, split, num_splits, read)  # (pipelined bounds)
    attend_split(q, k_base, V + row64 * stride_vb + kv64 * stride_vh, stride_kt, stride_kd, stride_vt, stride_vd,
                 first, last, bulk_lo, bulk_hi, has_bulk, read, dense, ACC, M, L, COUNTS, pair, split, num_splits,
                 qk_scale, softcap, G, D, BLOCK_G, BLOCK_N, BLOCK_D, INPUT_PRECISION, DOT_FP32,
                 SOFTCAP)  # fmt: skip


@triton.jit
def group_log_masses(
    q, k_base, stride_kt, stride_kd, LME, SINKS, row64, heads, g_ok, first, last, t_bulk, bulk_lo, bulk_hi, H_KV,
    scale, softcap, lme,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
    PDL: tl.constexpr, LME_GIVEN: tl.constexpr,
):  # fmt: skip
    """``(log A_local, log Â_bulk, bad [BLOCK_G], has_bulk)`` of the ``G`` query heads ``heads [BLOCK_G]`` (where
    ``g_ok``) of one (row, KV head): the window's exact mass (and the sink logit) from their queries ``q [BLOCK_G,
    BLOCK_D]`` (as :func:`window_log_mass` takes them), the KV head's keys at ``k_base`` and the row's range
    (:func:`~qada.attention._triton_kernel.row_range`), whether a window score is NaN or ``+inf`` (``bad``), and
    eq. 7's ``log T_bulk + log E[exp(s)]`` from the heads' ``LME [b, H]`` (read after
    :func:`~qada.attention._triton_kernel.wait_for_previous` with ``PDL``; ``-inf`` where the row has no bulk), or
    with ``LME_GIVEN`` from ``lme [BLOCK_G]``, the program's own (``LME`` not read)."""
    has_bulk = t_bulk > 0
    # log A_local: the window's exact mass (and the sink logit)
    log_local, bad = window_log_local(q, k_base, stride_kt, stride_kd, first, last, bulk_lo, bulk_hi, has_bulk,
                                      scale, softcap, SINKS, heads, g_ok, D, BLOCK_G, BLOCK_N, BLOCK_D, SOFTCAP,
                                      HAS_SINKS, INPUT_PRECISION, DOT_FP32)  # fmt: skip
    # eq. 7: the lognormal estimate of log A_bulk (its query side computed once per step: LME, by the previous launch
    # or, deciding once, by this program)
    if LME_GIVEN:
        log_mean_exp = lme
    else:
        wait_for_previous(PDL)
        log_mean_exp = tl.load(LME + row64 * (H_KV * G) + heads, mask=g_ok, other=0.0)
    log_t = tl.log(tl.maximum(t_bulk, 1).to(tl.float32))
    log_bulk = tl.where(has_bulk, log_t + log_mean_exp, float("-inf"))
    return log_local, log_bulk, bad, has_bulk


@triton.jit
def group_decision(
    q, k_base, stride_kt, stride_kd, LME, SINKS, row64, heads, g_ok, first, last, t_bulk, bulk_lo, bulk_hi, H_KV,
    scale, softcap, log_tau, lme,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, PROMOTE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr, PDL: tl.constexpr, LME_GIVEN: tl.constexpr,
):  # fmt: skip
    """The decision of the ``G`` query heads ``heads [BLOCK_G]`` (where ``g_ok``) of one (row, KV head)
    (:func:`qada_fused_split_kernel`'s docstring): ``(decided, local, broken, dense [BLOCK_G], read)``
    (:func:`threshold_decision`) on :func:`group_log_masses` (same arguments)."""
    log_local, log_bulk, bad, has_bulk = group_log_masses(
        q, k_base, stride_kt, stride_kd, LME, SINKS, row64, heads, g_ok, first, last, t_bulk, bulk_lo, bulk_hi, H_KV,
        scale, softcap, lme, G, D, BLOCK_G, BLOCK_N, BLOCK_D, SOFTCAP, HAS_SINKS, INPUT_PRECISION, DOT_FP32, PDL,
        LME_GIVEN,
    )  # fmt: skip
    # the threshold decision (fail-safe), then the group policy
    return threshold_decision(log_local, log_bulk, bad, has_bulk, log_tau, G, BLOCK_G, PROMOTE)


@triton.jit
def decide_group_and_store(
    Q, K, LME, START, END, SINKS, DECIDED, LOCAL, READ, BROKEN, row, kv_head,
    stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kt, stride_kd,
    C, H_KV, t_sink, t_local, scale, softcap, log_tau,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_START: tl.constexpr, HAS_END: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    PROMOTE: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """:func:`group_decision` of (``row``, ``kv_head``), stored as split 0 of :func:`qada_fused_split_kernel` stores
    it (``DECIDED, LOCAL, BROKEN [b, H]``, ``READ [b, H_kv]``): for the launch of one program per (row, KV head) that
    wrote ``LME`` (``decide_once``)."""
    offs_g = tl.arange(0, BLOCK_G)
    g_ok = offs_g < G
    heads = kv_head * G + offs_g
    row64 = row.to(tl.int64)
    kv64 = kv_head.to(tl.int64)
    first, last, t_bulk, bulk_lo, bulk_hi = row_range(START, END, row, C, t_sink, t_local, HAS_START, HAS_END)
    q = group_queries(Q + row64 * stride_qb + heads[:, None].to(tl.int64) * stride_qh, stride_qd, g_ok, D, BLOCK_D,
                      DOT_FP32)  # fmt: skip
    decided, local, broken, dense, read = group_decision(
        q, K + row64 * stride_kb + kv64 * stride_kh, stride_kt, stride_kd, LME, SINKS, row64, heads, g_ok, first, last,
        t_bulk, bulk_lo, bulk_hi, H_KV, scale, softcap, log_tau, 0.0, G, D, BLOCK_G, BLOCK_N, BLOCK_D, SOFTCAP,
        HAS_SINKS, PROMOTE, INPUT_PRECISION, DOT_FP32, False, False,
    )  # fmt: skip
    store_decision(DECIDED, LOCAL, BROKEN, READ, row64, kv64, heads, g_ok, H_KV, G, decided, local, broken,
                   read)  # fmt: skip
