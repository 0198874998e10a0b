"""The lognormal estimate's query side (paper eqs. 5-7) as Triton code: each query head's ``log E[exp(s)]`` of one
bulk score, from its KV head's bulk moments. Imported lazily: importing it imports triton.

The ``triton_fused`` executor's decisions read it as ``[b, H]`` float32 values, computed once per (row, KV head) and
step: by the moment step's launch from the covariance it computes, block pair by block pair, without reading it back
(:mod:`qada.attention._moment_kernel`), or, for a moment source that steps in torch, by :func:`bulk_estimate_kernel`,
one launch of its own. With ``decide_once`` the same launch then makes the plain ``qada`` decision from it
(:func:`decide_after_estimate`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from qada.attention._fused_kernel import decide_group_and_store
from qada.attention._fused_tail_kernel import page_top_program
from qada.attention._lognormal_kernel import add_block_pair, log_mean_exp, moments_log_mean_exp, query_tile
from qada.attention._triton_kernel import as_float32, let_next_start

__all__ = ["add_block_pair", "bulk_estimate_kernel", "decide_after_estimate", "query_tile", "store_log_mean_exp"]


@triton.jit
def store_log_mean_exp(
    LME, GH_X, GH_LOGW, row, kv_head, mu, var, H_kv, softcap, n_nodes,
    G: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_X: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Store each query head's ``log E[exp(s)]`` of one bulk score under the lognormal model at ``LME [b, H]``
    (float32, contiguous), from ``mu [BLOCK_E]`` (eq. 5, ``scale q·mean``) and ``var [BLOCK_E]`` (eq. 6, ``scale^2 q^T
    cov q``): ``mu + var / 2``, or under ``SOFTCAP`` ``log E[exp(c tanh(s / c))]`` by Gauss-Hermite with the
    ``n_nodes`` nodes ``GH_X`` and log weights ``GH_LOGW``."""
    store_heads(LME, row, kv_head, log_mean_exp(GH_X, GH_LOGW, mu, var, softcap, n_nodes, BLOCK_X, SOFTCAP), H_kv, G,
                BLOCK_E)


@triton.jit
def store_heads(LME, row, kv_head, values, H_kv, G: tl.constexpr, BLOCK_E: tl.constexpr):
    """Store ``values [BLOCK_E]``, one per query head of (``row``, ``kv_head``)'s group (the first ``G``), at ``LME [b,
    H]`` (float32, contiguous)."""
    offs_e = tl.arange(0, BLOCK_E)
    tl.store(LME + row.to(tl.int64) * (H_kv * G) + kv_head * G + offs_e, values, mask=offs_e < G)


@triton.jit
def decide_after_estimate(
    Q, LME, K, START, END, SINKS, DECIDED, LOCAL, READ, BROKEN, row, kv_head,
    stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kt, stride_kd,
    C, H_kv, t_sink, t_local, scale, softcap, log_tau,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, DECIDE: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_START: tl.constexpr, END_GIVEN: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, PROMOTE: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """With ``DECIDE``, the group's ``qada`` decision from the estimates just stored at ``LME``
    (:func:`~qada.attention._fused_kernel.decide_group_and_store`: the keys ``K [b, H_kv, C, d]``, the rows'
    ``START`` / ``END`` (``[b]``, contiguous; ``END`` read only with ``END_GIVEN``), the sink logits, ``log_tau``,
    the group policy; ``DECIDED, LOCAL, BROKEN [b, H]``, ``READ [b, H_kv]`` written)."""
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
    PT_Q, PT_K, PT_START, PT_END, PT_KMIN, PT_KMAX, PT_VALS, PT_IDS, PT_OKS,
    pt_stride_qb, pt_stride_qh, pt_stride_qd, pt_stride_kb, pt_stride_kh, pt_stride_kt, pt_stride_kd,
    pt_stride_eb, pt_stride_eh, pt_stride_ep, pt_stride_ed,
    pt_C, pt_H_kv, pt_t_sink, pt_t_local, pt_scale, pt_n_pages, pt_pages_per_program, pt_n_stretches,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_X: tl.constexpr, SOFTCAP: tl.constexpr, DECIDE: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_START: tl.constexpr, END_GIVEN: tl.constexpr, HAS_SINKS: tl.constexpr, PROMOTE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, PDL: tl.constexpr,
    PAGE_TOPS: tl.constexpr, PT_G: tl.constexpr, PT_D: tl.constexpr, PT_BLOCK_G: tl.constexpr,
    PT_BLOCK_D: tl.constexpr, PT_BLOCK_P: tl.constexpr, PT_PAGE: tl.constexpr, PT_TOP: tl.constexpr,
    PT_BLOCK_M: tl.constexpr, PT_HAS_START: tl.constexpr, PT_HAS_END: tl.constexpr,
):  # fmt: skip
    """One program = one (row, KV head): ``LME [b, H]`` float32 ``log E[exp(s)]`` of its query heads (``Q [b, H,
    d]``) from the bulk moments ``MEAN [b, H_kv, d]``, ``COV [b, H_kv, d, d]`` (any strides and float dtype), under
    ``SOFTCAP`` with the ``n_nodes`` Gauss-Hermite nodes ``GH_X`` and log weights ``GH_LOGW``
    (:func:`qada.functional.capping.hermite_rule`, :func:`store_log_mean_exp`); with ``DECIDE`` then the group's
    decision (:func:`decide_after_estimate`). For a moment source that steps in torch.

    ``q^T cov q`` is summed ``BLOCK_T x BLOCK_T`` block pair by block pair (:func:`add_block_pair`), each pair's
    terms first, then the pairs in order, as the moment step's kernels sum the shares of the covariance they compute
    (:mod:`qada.attention._moment_kernel`): both give the same float32 value (bit for bit where the two kernels
    contract alike). The covariance is symmetric: only its blocks on and above the diagonal are read
    (:func:`~qada.attention._lognormal_kernel.moments_log_mean_exp`).

    With ``PAGE_TOPS`` the launch also carries a ``qada_tail`` step's page-top programs
    (:mod:`qada.attention.page_tops`, the ``PT_`` arguments): grid ``(pairs, 1 + stretches)``, program ``(pair, 1 +
    s)`` runs :func:`~qada.attention._fused_tail_kernel.page_top_program` for stretch ``s`` and nothing else."""
    scale, softcap, log_tau = as_float32(scale), as_float32(softcap), as_float32(log_tau)  # (fp64: see as_float32)
    let_next_start(PDL)  # (with PDL: the split launch may start; it waits before reading what this one writes)
    if PAGE_TOPS:  # the page-top programs this launch carries (grid (pairs, 1 + stretches)): not a moment step
        if tl.program_id(1) > 0:
            page_top_program(PT_Q, PT_K, PT_START, PT_END, PT_KMIN, PT_KMAX, PT_VALS, PT_IDS, PT_OKS, pt_stride_qb,
                             pt_stride_qh, pt_stride_qd, pt_stride_kb, pt_stride_kh, pt_stride_kt, pt_stride_kd,
                             pt_stride_eb, pt_stride_eh, pt_stride_ep, pt_stride_ed, pt_C, pt_H_kv, pt_t_sink,
                             pt_t_local, pt_scale, pt_n_pages, pt_pages_per_program, pt_n_stretches,
                             tl.program_id(0), tl.program_id(1) - 1, PT_G, PT_D, PT_BLOCK_G, PT_BLOCK_D, PT_BLOCK_P,
                             PT_PAGE, PT_TOP, PT_BLOCK_M, PT_HAS_START, PT_HAS_END)  # fmt: skip
            return
    pid = tl.program_id(0)
    row = pid // H_kv
    kv_head = pid % H_kv
    row64 = row.to(tl.int64)
    kv64 = kv_head.to(tl.int64)
    q_head = Q + row64 * stride_qb + (kv64 * G) * stride_qh
    result = moments_log_mean_exp(q_head, MEAN + row64 * stride_mb + kv64 * stride_mh,
                                  COV + row64 * stride_cb + kv64 * stride_ch, GH_X, GH_LOGW, stride_qh, stride_qd,
                                  stride_md, stride_ci, stride_cj, scale, softcap, n_nodes, D, G, BLOCK_D, BLOCK_T,
                                  BLOCK_E, BLOCK_X, SOFTCAP)  # fmt: skip
    store_heads(LME, row, kv_head, result, H_kv, G, BLOCK_E)
    decide_after_estimate(Q, LME, K, START, END, SINKS, DECIDED, LOCAL, READ, BROKEN, row, kv_head, stride_qb,
                          stride_qh, stride_qd, stride_kb, stride_kh, stride_kt, stride_kd, C, H_kv, t_sink, t_local,
                          scale, softcap, log_tau, G, D, BLOCK_G, BLOCK_D, DECIDE, BLOCK_N, HAS_START, END_GIVEN,
                          SOFTCAP, HAS_SINKS, PROMOTE, INPUT_PRECISION, DOT_FP32)  # fmt: skip
