"""The moment step of the ``triton_fused`` executor's decode step: the built-in moment sources' in-place update
(``current``: Welford's rank-1 update; ``stored``: the reference range moving by one key) in one launch, one
program per (row, KV head). Imported lazily: importing it imports triton.

Each program updates its (row, KV head)'s float64 state in place and writes the float32 moments criteria read:
the mean and the population covariance ``Σ = ½ (M2 / n + (M2 / n)ᵀ)`` with ``n = max(count, 1)``, the very
operations of :func:`~qada.moments.math.to_bulk_moments`, in the same order. The co-moment is updated row tile by
row tile (pass 1), then, after a barrier, the covariance is written from the updated rows and columns (pass 2).
"""

from __future__ import annotations

import triton
import triton.language as tl

from qada.attention._estimate_kernel import estimate_and_decide
from qada.attention._triton_kernel import as_float32


@triton.jit
def reference_end(n, t_local, offset, first, min_bulk_keys, N):
    """:func:`~qada.moments.stored.reference_bulk_end` of the real length ``n``, clamped to the reference's ``N``."""
    t_bulk = tl.maximum(n - t_local, 0)
    primary = n - offset
    end = tl.where(primary - first >= min_bulk_keys, primary, first + t_bulk)
    end = tl.where(t_bulk > 0, end, first)
    return tl.minimum(end, N)


@triton.jit
def store_covariance(M2, S1, COV, count, SHIFTED: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_D: tl.constexpr):  # fmt: skip
    """Pass 2: ``COV [D, D]`` float32 ``= ½ (C + Cᵀ)``, ``C = M2' / max(count, 1)``, from the updated float64
    ``M2 [D, D]`` (``M2' = M2``), or with ``SHIFTED`` from shifted sums: ``M2' = M2 - count (c cᵀ)``, ``c = S1 /
    max(count, 1)`` (:func:`~qada.moments.math.state_from_shifted_sums`)."""
    n = tl.maximum(count, 1.0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    if SHIFTED:
        c_all = tl.load(S1 + offs_d, mask=d_ok, other=0.0) / n
    for r0 in range(0, D, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        ok = (rows < D)[:, None] & d_ok[None, :]
        a = tl.load(M2 + rows[:, None] * D + offs_d[None, :], mask=ok, other=0.0)  # M2[i, j]
        a_t = tl.load(M2 + offs_d[None, :] * D + rows[:, None], mask=ok, other=0.0)  # M2[j, i]
        if SHIFTED:
            c_rows = tl.load(S1 + rows, mask=rows < D, other=0.0) / n
            a = a - count * (c_rows[:, None] * c_all[None, :])
            a_t = a_t - count * (c_all[None, :] * c_rows[:, None])
        cov = 0.5 * (a / n + a_t / n)
        tl.store(COV + rows[:, None] * D + offs_d[None, :], cov.to(tl.float32), mask=ok)


@triton.jit
def current_moment_step_kernel(
    COUNT, MEAN, M2, OUT_MEAN, OUT_COV, KEYS, START, END,
    Q, LME, GH_X, GH_LOGW, SINKS, DECIDED, LOCAL, READ, BROKEN,
    H_kv, t_local, t_recent, stride_kb, stride_kh, stride_kt, stride_kd, stride_start, stride_end,
    stride_qb, stride_qh, stride_qd, scale, softcap, n_nodes, C, t_sink, log_tau,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_START: tl.constexpr,
    ESTIMATE: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_X: tl.constexpr, SOFTCAP: tl.constexpr,
    DECIDE: tl.constexpr, BLOCK_N: tl.constexpr, END_GIVEN: tl.constexpr, HAS_SINKS: tl.constexpr,
    PROMOTE: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """:func:`~qada.moments.current.current_buffer_step` of one (row, KV head): the key at ``end - 1 - T_recent``
    (clamped at 0) of ``KEYS [b, H_kv, C, D]`` joins the float64 state (``COUNT [b, H_kv]``, ``MEAN [b, H_kv, D]``,
    ``M2 [b, H_kv, D, D]``, contiguous) where the row's bulk grew; ``OUT_MEAN``, ``OUT_COV`` get the float32
    moments. ``START, END [b]``: the rows' bounds (``END`` one past the step's key; any strides). With ``ESTIMATE``,
    then :func:`~qada.attention._estimate_kernel.estimate_and_decide` from the moments just written: the query side
    of the lognormal estimate, and with ``DECIDE`` the group's decision (the other arguments as
    :func:`~qada.attention._estimate_kernel.bulk_estimate_kernel` takes them; ``KEYS`` are the decision's keys)."""
    scale, softcap, log_tau = as_float32(scale), as_float32(softcap), as_float32(log_tau)  # (fp64: see as_float32)
    pid = tl.program_id(0)
    row = pid // H_kv
    head = pid % H_kv
    pair = pid.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    end = tl.load(END + row * stride_end).to(tl.int64)
    if HAS_START:
        start = tl.load(START + row * stride_start).to(tl.int64)
    else:
        start = tl.zeros([], dtype=tl.int64)
    index = tl.maximum(end - 1 - t_recent, 0)
    before = tl.maximum(end - 1 - start - t_local, 0)
    w = tl.where(end - start - t_local > before, 1.0, 0.0).to(tl.float64)
    key = KEYS + row.to(tl.int64) * stride_kb + head.to(tl.int64) * stride_kh + index * stride_kt
    x = tl.load(key + offs_d * stride_kd, mask=d_ok, other=0.0).to(tl.float64)
    count = tl.load(COUNT + pair)
    n = count + w
    mean = tl.load(MEAN + pair * D + offs_d, mask=d_ok, other=0.0)
    mean_new = mean + (x - mean) * (w / tl.maximum(n, 1.0))
    m2 = M2 + pair * D * D
    for r0 in range(0, D, BLOCK_R):  # pass 1: M2 += w (x - mean)(x - mean')ᵀ, row tile by row tile
        rows = r0 + tl.arange(0, BLOCK_R)
        r_ok = rows < D
        ok = r_ok[:, None] & d_ok[None, :]
        delta = (tl.load(key + rows * stride_kd, mask=r_ok, other=0.0).to(tl.float64)
                 - tl.load(MEAN + pair * D + rows, mask=r_ok, other=0.0))  # fmt: skip
        tile = tl.load(m2 + rows[:, None] * D + offs_d[None, :], mask=ok, other=0.0)
        tile = tile + w * (delta[:, None] * (x - mean_new)[None, :])
        tl.store(m2 + rows[:, None] * D + offs_d[None, :], tile, mask=ok)
    tl.debug_barrier()  # every row tile read the old mean and wrote its rows
    tl.store(COUNT + pair, n)
    tl.store(MEAN + pair * D + offs_d, mean_new, mask=d_ok)
    tl.store(OUT_MEAN + pair * D + offs_d, mean_new.to(tl.float32), mask=d_ok)
    store_covariance(m2, MEAN, OUT_COV + pair * D * D, n, False, D, BLOCK_R, BLOCK_D)
    if ESTIMATE:
        tl.debug_barrier()  # the moments are in memory
        estimate_and_decide(Q, LME, GH_X, GH_LOGW, KEYS, START, END, SINKS, DECIDED, LOCAL, READ, BROKEN, row, head,
                            OUT_MEAN + pair * D, 1, OUT_COV + pair * D * D, D, 1, stride_qb, stride_qh, stride_qd,
                            stride_kb, stride_kh, stride_kt, stride_kd, C, H_kv, t_sink, t_local, scale, softcap,
                            n_nodes, log_tau, G, D, BLOCK_G, BLOCK_D, BLOCK_R, BLOCK_X, SOFTCAP, DECIDE, BLOCK_N,
                            HAS_START, END_GIVEN, HAS_SINKS, PROMOTE, INPUT_PRECISION, DOT_FP32)  # fmt: skip


@triton.jit
def stored_moment_step_kernel(
    COUNT, S1, S2, OLD_END, JUMP_N, JUMP_COUNT, JUMP_S1, JUMP_S2, MEAN, COV, REF, SHIFT, START, END, KEYS,
    Q, LME, GH_X, GH_LOGW, SINKS, DECIDED, LOCAL, READ, BROKEN,
    H_kv, N, num_jumps, t_local, offset, first, min_bulk_keys, stride_rh, stride_rn, stride_rd,
    stride_start, stride_end, stride_kb, stride_kh, stride_kt, stride_kd,
    stride_qb, stride_qh, stride_qd, scale, softcap, n_nodes, C, t_sink, log_tau,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_START: tl.constexpr,
    ESTIMATE: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_X: tl.constexpr, SOFTCAP: tl.constexpr,
    DECIDE: tl.constexpr, BLOCK_N: tl.constexpr, END_GIVEN: tl.constexpr, HAS_SINKS: tl.constexpr,
    PROMOTE: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """:func:`~qada.moments.stored.advance_reference_range` of one (row, KV head): the row's reference range
    ``[first, e(n))`` moves from ``e(n - 1)`` (what the previous step, or the prefill, left in ``OLD_END``: every
    step grows each row by one key) to ``e(n)``, adding or removing the key of ``REF [H_kv, N, D]`` between them
    from the float64 sums around ``SHIFT [H_kv, D]`` (``COUNT [b, H_kv]``, ``S1 [b, H_kv, D]``, ``S2 [b, H_kv, D,
    D]``), or, at a length ``JUMP_N [b, K]`` lists, taking the prepared sums ``JUMP_* [b, K, H_kv, ...]``; writes
    ``OLD_END [b]`` (the program of KV head 0) and the float32 ``MEAN``, ``COV``. ``n = END - START``. With
    ``ESTIMATE``, then the estimate's query side (and with ``DECIDE`` the decision, from ``KEYS [b, H_kv, C, d]``) as
    :func:`current_moment_step_kernel`."""
    scale, softcap, log_tau = as_float32(scale), as_float32(softcap), as_float32(log_tau)  # (fp64: see as_float32)
    pid = tl.program_id(0)
    row = pid // H_kv
    head = pid % H_kv
    pair = pid.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    n = tl.load(END + row * stride_end).to(tl.int64)
    if HAS_START:
        n -= tl.load(START + row * stride_start).to(tl.int64)
    new_end = reference_end(n, t_local, offset, first, min_bulk_keys, N)
    old_end = reference_end(n - 1, t_local, offset, first, min_bulk_keys, N)
    delta = new_end - old_end
    w = tl.where((delta <= 1) & (delta >= -1), delta, 0).to(tl.float64)
    index = tl.minimum(tl.maximum(tl.where(delta > 0, old_end, new_end), 0), N - 1)
    ref = REF + head.to(tl.int64) * stride_rh + index * stride_rn
    shift = SHIFT + head * D
    x = tl.load(ref + offs_d * stride_rd, mask=d_ok, other=0.0).to(tl.float64) - tl.load(shift + offs_d, mask=d_ok)
    jump = tl.full([], -1, dtype=tl.int64)
    for k in range(0, num_jumps):  # the prefill listed at most one jump per length
        jump = tl.where(tl.load(JUMP_N + row.to(tl.int64) * num_jumps + k) == n, k, jump)
    hit = jump >= 0
    at = (row.to(tl.int64) * num_jumps + tl.maximum(jump, 0)) * H_kv + head  # the jump's (row, k, head), or k = 0
    count = tl.where(hit, tl.load(JUMP_COUNT + at), tl.load(COUNT + pair) + w)
    # the prepared sums are read only at a jump (``JUMP_S2`` is as large as the state; ``tl.where``, as ``d_ok & hit``
    # with the 0-d ``hit`` is int32 in Triton's interpreter)
    s1 = tl.where(hit, tl.load(JUMP_S1 + at * D + offs_d, mask=tl.where(hit, d_ok, False), other=0.0),
                  tl.load(S1 + pair * D + offs_d, mask=d_ok, other=0.0) + w * x)  # fmt: skip
    s2 = S2 + pair * D * D
    for r0 in range(0, D, BLOCK_R):  # pass 1: S2 += w x xᵀ (or the jump's), row tile by row tile
        rows = r0 + tl.arange(0, BLOCK_R)
        r_ok = rows < D
        ok = r_ok[:, None] & d_ok[None, :]
        x_rows = tl.load(ref + rows * stride_rd, mask=r_ok, other=0.0).to(tl.float64) - tl.load(shift + rows,
                                                                                                  mask=r_ok)
        tile = tl.load(s2 + rows[:, None] * D + offs_d[None, :], mask=ok, other=0.0) + w * (x_rows[:, None]
                                                                                              * x[None, :])
        jumped = tl.load(JUMP_S2 + at * D * D + rows[:, None] * D + offs_d[None, :], mask=tl.where(hit, ok, False),
                         other=0.0)  # fmt: skip
        tl.store(s2 + rows[:, None] * D + offs_d[None, :], tl.where(hit, jumped, tile), mask=ok)
    tl.store(COUNT + pair, count)
    tl.store(S1 + pair * D + offs_d, s1, mask=d_ok)
    if head == 0:
        tl.store(OLD_END + row, new_end.to(OLD_END.dtype.element_ty))
    tl.debug_barrier()  # the updated sums are in memory
    n_safe = tl.maximum(count, 1.0)
    mean = tl.where(count > 0, s1 / n_safe + tl.load(shift + offs_d, mask=d_ok, other=0.0), 0.0)
    tl.store(MEAN + pair * D + offs_d, mean.to(tl.float32), mask=d_ok)
    store_covariance(s2, S1 + pair * D, COV + pair * D * D, count, True, D, BLOCK_R, BLOCK_D)
    if ESTIMATE:
        tl.debug_barrier()  # the moments are in memory
        estimate_and_decide(Q, LME, GH_X, GH_LOGW, KEYS, START, END, SINKS, DECIDED, LOCAL, READ, BROKEN, row, head,
                            MEAN + pair * D, 1, COV + pair * D * D, D, 1, stride_qb, stride_qh, stride_qd, stride_kb,
                            stride_kh, stride_kt, stride_kd, C, H_kv, t_sink, t_local, scale, softcap, n_nodes, log_tau,
                            G, D, BLOCK_G, BLOCK_D, BLOCK_R, BLOCK_X, SOFTCAP, DECIDE, BLOCK_N, HAS_START, END_GIVEN,
                            HAS_SINKS, PROMOTE, INPUT_PRECISION, DOT_FP32)  # fmt: skip
