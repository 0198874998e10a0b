"""The lognormal estimate's query side (paper eqs. 5-7) as Triton device functions: each query head's ``log
E[exp(s)]`` of one bulk score from its KV head's float32 bulk moments, shared by the launch that writes it
(:mod:`qada.attention._estimate_kernel`) and the split that computes it itself
(:mod:`qada.attention._fused_kernel`, ``estimate_in_splits``), so that both give the same float32 value bit for
bit. Imported lazily: importing it imports triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cap(s, softcap):
    """``c tanh(s / c)`` (``c = softcap``) as ``c (1 - 2 / (exp(2 s / c) + 1))``, float32."""
    return (softcap * (1.0 - 2.0 / (tl.math.exp2(2.0 * s / softcap * 1.4426950408889634) + 1.0))).to(tl.float32)


@triton.jit
def query_tile(q_head, stride_qh, stride_qd, offs, ok, G: tl.constexpr, BLOCK_E: tl.constexpr):
    """``[BLOCK_E, len(offs)]`` float32: features ``offs`` (where ``ok``) of the group's ``G`` query heads (the first at
    ``q_head``, the others ``stride_qh`` apart; padding heads 0)."""
    offs_e = tl.arange(0, BLOCK_E)
    return tl.load(q_head + offs_e[:, None] * stride_qh + offs[None, :] * stride_qd,
                   mask=(offs_e < G)[:, None] & ok[None, :], other=0.0).to(tl.float32)  # fmt: skip


@triton.jit
def add_block_pair(acc, cov_ij, cov_ji_t, q_i, q_j):
    """``acc [BLOCK_E, T, T]`` plus one block pair's share of each head's ``q^T cov q`` (eq. 6): ``(cov_ij +
    cov_ji_t) * q_i q_j`` elementwise, with ``cov_ij = cov[I, J]``, ``cov_ji_t = cov[J, I]^T`` (0 on the diagonal
    block, ``I = J``) as ``[T, T]`` float32 and the heads' features ``q_i``, ``q_j [BLOCK_E, T]``. Summed over its
    ``T x T`` terms and over every block pair ``I <= J`` it is ``q^T cov q``."""
    return acc + (cov_ij + cov_ji_t)[None, :, :] * (q_i[:, :, None] * q_j[:, None, :])


@triton.jit
def log_mean_exp(GH_X, GH_LOGW, mu, var, softcap, n_nodes, BLOCK_X: tl.constexpr, SOFTCAP: tl.constexpr):
    """``[BLOCK_E]`` float32: each query head's ``log E[exp(s)]`` of one bulk score under the lognormal model, from
    ``mu [BLOCK_E]`` (eq. 5, ``scale q·mean``) and ``var [BLOCK_E]`` (eq. 6, ``scale^2 q^T cov q``): ``mu + var /
    2``, or under ``SOFTCAP`` ``log E[exp(c tanh(s / c))]`` by Gauss-Hermite with the ``n_nodes`` nodes ``GH_X``
    and log weights ``GH_LOGW``."""
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
        result = peak + tl.log(tl.sum(tl.exp(terms - peak[:, None]), axis=1))
    else:
        result = mu + 0.5 * var
    return result


@triton.jit
def moments_log_mean_exp(
    q_head, mean_base, cov_base, GH_X, GH_LOGW, stride_qh, stride_qd, stride_md, stride_ci, stride_cj, scale,
    softcap, n_nodes,
    D: tl.constexpr, G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_X: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """``[BLOCK_E]`` float32 :func:`log_mean_exp` of the group's ``G`` query heads (the first at ``q_head``) from
    their KV head's bulk moments, the mean at ``mean_base`` (``D`` features ``stride_md`` apart) and the covariance
    at ``cov_base`` (any strides, any float dtype): ``mu = scale q·mean``, and ``q^T cov q`` summed ``BLOCK_T x
    BLOCK_T`` block pair by block pair (:func:`add_block_pair`), each pair's terms first, then the pairs in order,
    as the moment step's kernels sum the shares of the covariance they compute
    (:mod:`qada.attention._moment_kernel`): both give the same float32 value (bit for bit where the kernels
    contract alike). The covariance is symmetric (every moment source makes it ``½ (C + Cᵀ)``, exactly symmetric;
    a loaded one is checked), so only its blocks on and above the diagonal are read: an off-diagonal pair counts
    ``[I, J]`` twice, as the moment kernels do with the block they have just computed."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    mean = tl.load(mean_base + offs_d * stride_md, mask=d_ok, other=0.0).to(tl.float32)
    mu = tl.sum(query_tile(q_head, stride_qh, stride_qd, offs_d, d_ok, G, BLOCK_E) * mean[None, :], axis=1) * scale
    qcq = tl.zeros([BLOCK_E], dtype=tl.float32)
    offs_t = tl.arange(0, BLOCK_T)
    for i in range(0, BLOCK_D // BLOCK_T):
        rows = i * BLOCK_T + offs_t
        i_ok = rows < D
        q_i = query_tile(q_head, stride_qh, stride_qd, rows, i_ok, G, BLOCK_E)
        for j in range(i, BLOCK_D // BLOCK_T):
            cols = j * BLOCK_T + offs_t
            ok = i_ok[:, None] & (cols < D)[None, :]
            cov_ij = tl.load(cov_base + rows[:, None] * stride_ci + cols[None, :] * stride_cj, mask=ok,
                             other=0.0).to(tl.float32)  # fmt: skip
            if i != j:  # an off-diagonal pair: [J, I]^T is [I, J] (a symmetric covariance), the features J too
                cov_ji_t = cov_ij
                q_j = query_tile(q_head, stride_qh, stride_qd, cols, cols < D, G, BLOCK_E)
            else:  # the diagonal block: counted once (0 for its transpose), the features I again
                cov_ji_t = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
                q_j = q_i
            share = add_block_pair(tl.zeros([BLOCK_E, BLOCK_T, BLOCK_T], dtype=tl.float32), cov_ij, cov_ji_t, q_i, q_j)
            qcq += tl.sum(tl.sum(share, axis=2), axis=1)  # (pair by pair, as the moment kernels sum their shares)
    var = qcq * scale * scale
    return log_mean_exp(GH_X, GH_LOGW, mu, var, softcap, n_nodes, BLOCK_X, SOFTCAP)


@triton.jit
def spread_over_heads(values, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr):
    """``values [BLOCK_E]`` as ``[BLOCK_G]`` (``BLOCK_G >= BLOCK_E``; entries past ``BLOCK_E`` 0): each entry moved
    exactly (a sum of it and zeros), a NaN or infinity only into its own entry."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_e = tl.arange(0, BLOCK_E)
    return tl.sum(tl.where(offs_g[:, None] == offs_e[None, :], values[None, :], 0.0), axis=1)
