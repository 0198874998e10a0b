"""The lognormal estimate's query side (paper eqs. 5-7) as Triton code: each query head's ``log E[exp(s)]`` of one
bulk score, from its KV head's bulk moments. Imported lazily: importing it imports triton.

The ``triton_fused`` executor's decisions read it as ``[b, H]`` float32 values, computed once per (row, KV head) and
step: by the moment step's launch right after it writes the moments (:mod:`qada.attention._moment_kernel`), or, for a
moment source that steps in torch, by :func:`bulk_estimate_kernel`, one launch of its own. Every split of the fused
attention used to compute it from the ``d x d`` covariance itself, reading that matrix once per split. With
``decide_once`` the same launch then makes the plain ``qada`` decision from it (:func:`estimate_and_decide`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from qada.attention._fused_kernel import cap, decide_group_and_store, head_query
from qada.attention._triton_kernel import as_float32


@triton.jit
def bulk_log_mean_exp(
    q_head, stride_qh, stride_qd, mean_base, stride_md, cov_base, stride_ci, stride_cj, GH_X, GH_LOGW, scale,
    softcap, n_nodes, G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_X: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """``[BLOCK_G]`` float32 ``log E[exp(s)]`` of one bulk score of each query head under the lognormal model:
    ``mu_s + sigma_s^2 / 2`` with ``mu_s = scale q·mean`` (eq. 5) and ``sigma_s^2 = scale^2 q^T cov q`` (eq. 6), or
    under ``SOFTCAP`` ``log E[exp(c tanh(s / c))]`` by Gauss-Hermite. ``q_head``: the group's first query head (the
    others ``stride_qh`` apart), ``mean_base`` / ``cov_base`` the KV head's mean ``[d]`` and covariance ``[d, d]``.

    Both are float32 sums one query head at a time, ``BLOCK_K`` rows of ``cov`` at a time, the head's query read
    from memory (cached) where it is needed: a float32 dot of the queries and ``cov`` would pad the heads to 16 and,
    done with FMA instructions, hold both operands' rows in every thread."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    mean = tl.load(mean_base + offs_d * stride_md, mask=d_ok, other=0.0).to(tl.float32)
    mu = tl.zeros([BLOCK_G], dtype=tl.float32)
    for g in range(G):
        q_g = head_query(q_head, g, stride_qh, stride_qd, offs_d, d_ok)
        mu = tl.where(offs_g == g, tl.sum(q_g * mean, axis=0), mu)
    mu = mu * scale  # [BLOCK_G]
    var = tl.zeros([BLOCK_G], dtype=tl.float32)  # q^T cov q per head, BLOCK_K rows of cov at a time
    for k0 in range(0, BLOCK_D, BLOCK_K):  # (loops, not unrolled: unrolled, they hold more registers)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < D
        cov_k = tl.load(cov_base + offs_k[:, None].to(tl.int64) * stride_ci + offs_d[None, :] * stride_cj,
                        mask=k_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        for g in range(G):
            q_gk = head_query(q_head, g, stride_qh, stride_qd, offs_k, k_ok)
            q_g = head_query(q_head, g, stride_qh, stride_qd, offs_d, d_ok)
            part = tl.sum(tl.sum(cov_k * q_gk[:, None], axis=0) * q_g, axis=0)
            var = tl.where(offs_g == g, var + part, var)
    var = var * scale * scale
    if SOFTCAP:  # log E[exp(c tanh(s / c))], s ~ N(mu, var): log sum_j w_j / sqrt(pi) exp(cap(mu + sqrt(2) sigma x_j))
        offs_x = tl.arange(0, BLOCK_X)
        x_ok = offs_x < n_nodes
        x = tl.load(GH_X + offs_x, mask=x_ok, other=0.0).to(tl.float32)
        log_w = tl.load(GH_LOGW + offs_x, mask=x_ok, other=0.0).to(tl.float32)
        sigma = tl.sqrt(tl.maximum(var, 0.0))
        terms = log_w[None, :] + cap(mu[:, None] + 1.4142135623730951 * sigma[:, None] * x[None, :], softcap)
        terms = tl.where(x_ok[None, :], terms, float("-inf"))
        peak = tl.max(terms, axis=1)  # finite unless mu or var is NaN (the terms are at most c + log w_j)
        peak = tl.where(tl.abs(peak) < float("inf"), peak, 0.0)
        log_mean_exp = peak + tl.log(tl.sum(tl.exp(terms - peak[:, None]), axis=1))
    else:
        log_mean_exp = mu + 0.5 * var
    return log_mean_exp


@triton.jit
def store_bulk_estimate(
    Q, LME, GH_X, GH_LOGW, row, kv_head, mean_base, stride_md, cov_base, stride_ci, stride_cj,
    stride_qb, stride_qh, stride_qd, H_kv, scale, softcap, n_nodes,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_X: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """:func:`bulk_log_mean_exp` of the ``G`` query heads of (``row``, ``kv_head``) (``Q [b, H, d]``, any strides)
    from the moments at ``mean_base`` / ``cov_base``, stored at ``LME [b, H]`` (float32, contiguous)."""
    row64 = row.to(tl.int64)
    q_head = Q + row64 * stride_qb + (kv_head.to(tl.int64) * G) * stride_qh
    log_mean_exp = bulk_log_mean_exp(q_head, stride_qh, stride_qd, mean_base, stride_md, cov_base, stride_ci,
                                     stride_cj, GH_X, GH_LOGW, scale, softcap, n_nodes, G, D, BLOCK_G, BLOCK_D,
                                     BLOCK_K, BLOCK_X, SOFTCAP)  # fmt: skip
    offs_g = tl.arange(0, BLOCK_G)
    tl.store(LME + row64 * (H_kv * G) + kv_head * G + offs_g, log_mean_exp, mask=offs_g < G)


@triton.jit
def estimate_and_decide(
    Q, LME, GH_X, GH_LOGW, K, START, END, SINKS, DECIDED, LOCAL, READ, BROKEN, row, kv_head,
    mean_base, stride_md, cov_base, stride_ci, stride_cj,
    stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kt, stride_kd,
    C, H_kv, t_sink, t_local, scale, softcap, n_nodes, log_tau,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_X: tl.constexpr, SOFTCAP: tl.constexpr, DECIDE: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_START: tl.constexpr, END_GIVEN: tl.constexpr, HAS_SINKS: tl.constexpr, PROMOTE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """:func:`store_bulk_estimate`, then with ``DECIDE`` the group's ``qada`` decision from it
    (:func:`~qada.attention._fused_kernel.decide_group_and_store`: the keys ``K [b, H_kv, C, d]``, the rows'
    ``START`` / ``END`` (``[b]``, contiguous; ``END`` read only with ``END_GIVEN``), the sink logits, ``log_tau``,
    the group policy; ``DECIDED, LOCAL, BROKEN [b, H]``, ``READ [b, H_kv]`` written)."""
    store_bulk_estimate(Q, LME, GH_X, GH_LOGW, row, kv_head, mean_base, stride_md, cov_base, stride_ci, stride_cj,
                        stride_qb, stride_qh, stride_qd, H_kv, scale, softcap, n_nodes, G, D, BLOCK_G, BLOCK_D,
                        BLOCK_K, BLOCK_X, SOFTCAP)  # fmt: skip
    if DECIDE:
        tl.debug_barrier()  # the heads' estimates are in memory
        decide_group_and_store(Q, K, LME, START, END, SINKS, DECIDED, LOCAL, READ, BROKEN, row, kv_head, stride_qb,
                               stride_qh, stride_qd, stride_kb, stride_kh, stride_kt, stride_kd, C, H_kv, t_sink,
                               t_local, scale, softcap, log_tau, G, D, BLOCK_G, BLOCK_N, BLOCK_D, HAS_START,
                               END_GIVEN, SOFTCAP, HAS_SINKS, PROMOTE, INPUT_PRECISION, DOT_FP32)  # fmt: skip


@triton.jit
def bulk_estimate_kernel(
    Q, MEAN, COV, LME, GH_X, GH_LOGW, K, START, END, SINKS, DECIDED, LOCAL, READ, BROKEN,
    stride_mb, stride_mh, stride_md, stride_cb, stride_ch, stride_ci, stride_cj,
    stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kt, stride_kd,
    H_kv, t_local, scale, softcap, n_nodes, C, t_sink, log_tau,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_X: tl.constexpr, SOFTCAP: tl.constexpr, DECIDE: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_START: tl.constexpr, END_GIVEN: tl.constexpr, HAS_SINKS: tl.constexpr, PROMOTE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """One program = one (row, KV head): ``LME [b, H]`` float32 ``log E[exp(s)]`` of its query heads (``Q [b, H,
    d]``) from the bulk moments ``MEAN [b, H_kv, d]``, ``COV [b, H_kv, d, d]`` (any strides and float dtype), under
    ``SOFTCAP`` with the ``n_nodes`` Gauss-Hermite nodes ``GH_X`` and log weights ``GH_LOGW``
    (:func:`qada.functional.capping.hermite_rule`); with ``DECIDE`` then the group's decision
    (:func:`estimate_and_decide`). For a moment source that steps in torch."""
    scale, softcap, log_tau = as_float32(scale), as_float32(softcap), as_float32(log_tau)  # (fp64: see as_float32)
    pid = tl.program_id(0)
    row = pid // H_kv
    kv_head = pid % H_kv
    row64 = row.to(tl.int64)
    kv64 = kv_head.to(tl.int64)
    estimate_and_decide(Q, LME, GH_X, GH_LOGW, K, START, END, SINKS, DECIDED, LOCAL, READ, BROKEN, row, kv_head,
                        MEAN + row64 * stride_mb + kv64 * stride_mh, stride_md,
                        COV + row64 * stride_cb + kv64 * stride_ch, stride_ci, stride_cj, stride_qb, stride_qh,
                        stride_qd, stride_kb, stride_kh, stride_kt, stride_kd, C, H_kv, t_sink, t_local, scale,
                        softcap, n_nodes, log_tau, G, D, BLOCK_G, BLOCK_D, BLOCK_K, BLOCK_X, SOFTCAP, DECIDE, BLOCK_N,
                        HAS_START, END_GIVEN, HAS_SINKS, PROMOTE, INPUT_PRECISION, DOT_FP32)  # fmt: skip
