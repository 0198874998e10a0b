"""The moment step of the ``triton_fused`` executor's decode step: the built-in moment sources' in-place update
(``current``: Welford's rank-1 update; ``stored``: the reference range moving by one key) in one launch, one
program per (row, KV head) and block pair. Imported lazily: importing it imports triton.

The launch updates each (row, KV head)'s float64 state in place and writes the float32 moments criteria read: the
mean and the population covariance ``Σ = ½ (M2 / n + (M2 / n)ᵀ)`` with ``n = max(count, 1)``, the very operations
of :func:`~qada.moments.math.to_bulk_moments`, in the same order. The ``d x d`` state is cut into ``BLOCK_T x
BLOCK_T`` block pairs (``[I, J]`` and ``[J, I]``, ``I <= J``: three at ``d = 64``), each updated by a program of its
own: read once, updated, written back and turned into the covariance's two blocks, whose share of each query head's
``q^T cov q`` (eq. 6) the program stores (:func:`~qada.attention._estimate_kernel.add_block_pair`). The last of a
(row, KV head)'s programs to finish (an atomic count, :func:`last_to_arrive`) then updates the count and the mean
or sums, which the others read, sums the shares in block-pair order and writes the estimate (and the decision).
At batch size 1, where the launch has a few (row, KV head)s, its time is its longest program's chain of loads:
one block pair and the end, where one program per (row, KV head) goes through every pair in turn (three at ``d =
64``, each a round of loads after the one before; ``SPREAD`` off, the executor's ``spread_moments=False``, for a
GPU to time both).
"""

from __future__ import annotations

import triton
import triton.language as tl

from qada.attention._estimate_kernel import add_block_pair, decide_after_estimate, query_tile, store_log_mean_exp
from qada.attention._fused_tail_kernel import page_top_program
from qada.attention._triton_kernel import as_float32, let_next_start


@triton.jit
def reference_end(n, t_local, offset, first, min_bulk_keys, N):
    """:func:`~qada.moments.stored.reference_bulk_end` of the real length ``n``, clamped to the reference's ``N``."""
    t_bulk = tl.maximum(n - t_local, 0)
    primary = n - offset
    end = tl.where(primary - first >= min_bulk_keys, primary, first + t_bulk)
    end = tl.where(t_bulk > 0, end, first)
    return tl.minimum(end, N)


@triton.jit
def block_pair_of(k, NB: tl.constexpr):
    """``(i, j)``, ``i <= j``: the blocks of block pair ``k`` of a ``NB x NB`` grid of blocks, the pairs numbered
    row by row over the upper triangle (``(0, 0), (0, 1), ..., (0, NB - 1), (1, 1), ...``)."""
    i = k * 0
    j = k * 0
    for r in tl.static_range(NB):
        first = r * NB - (r * (r - 1)) // 2  # the number of the pair (r, r)
        inside = (k >= first) & (k < first + NB - r)
        i = tl.where(inside, r, i)
        j = tl.where(inside, r + k - first, j)
    return i, j


@triton.jit
def last_to_arrive(ARRIVED, pair, BP: tl.constexpr):
    """Whether this program is the last of the ``BP`` programs of ``pair`` (a (row, KV head)) to get here: each adds
    one to ``ARRIVED [pairs]`` (int32, 0 before the launch; the last sets it back to 0 for the next). What every
    program wrote and read before is then done (the atomic orders it: release, and acquire for the last), so the
    last may read what they wrote and overwrite what they read."""
    if BP == 1:
        last = True
    else:
        tl.debug_barrier()  # every thread of this program has done its loads and stores
        last = tl.atomic_add(ARRIVED + pair, 1, sem="acq_rel") == BP - 1
        if last:
            tl.store(ARRIVED + pair, 0)
    return last


@triton.jit
def add_share(SHARES, qcq, acc, pair, k, BP: tl.constexpr, BLOCK_E: tl.constexpr, ESTIMATE: tl.constexpr,
              SPREAD: tl.constexpr):  # fmt: skip
    """Block pair ``k``'s share ``acc [BLOCK_E, T, T]`` of each head's ``q^T cov q``, summed over its ``T x T``
    terms: with ``SPREAD`` stored at ``SHARES [pairs, BP, BLOCK_E]`` for the last program to sum
    (:func:`sum_shares`), else added to ``qcq [BLOCK_E]``, the running sum of the program that takes every pair in
    turn; returns ``qcq``. Without ``ESTIMATE`` nothing."""
    if ESTIMATE:
        share = tl.sum(tl.sum(acc, axis=2), axis=1)
        if SPREAD:
            tl.store(SHARES + (pair * BP + k) * BLOCK_E + tl.arange(0, BLOCK_E), share)
        else:
            qcq += share
    return qcq


@triton.jit
def sum_shares(SHARES, qcq, pair, BP: tl.constexpr, BLOCK_E: tl.constexpr, SPREAD: tl.constexpr):
    """``[BLOCK_E]`` float32: each head's ``q^T cov q``; with ``SPREAD`` the ``BP`` block pairs' shares ``SHARES
    [pairs, BP, BLOCK_E]`` of ``pair`` summed in block-pair order (as :func:`add_share` sums them without, and
    :func:`~qada.attention._estimate_kernel.bulk_estimate_kernel` does: the same float32 value), else ``qcq``."""
    if SPREAD:
        offs_e = tl.arange(0, BLOCK_E)
        qcq = tl.zeros([BLOCK_E], dtype=tl.float32)
        for k in tl.static_range(BP):
            qcq += tl.load(SHARES + (pair * BP + k) * BLOCK_E + offs_e)
    return qcq


@triton.jit
def transposed_block(STATE, a, rows, cols, ok, i, j, D: tl.constexpr):
    """``STATE[J, I]`` as a ``[T, T]`` block in its own orientation (``rows = I``, ``cols = J``, ``ok`` the ``[I, J]``
    mask), given ``a = STATE[I, J]``: on the diagonal block (``i == j``) it is ``a`` itself (the same addresses in
    the same layout), not read twice."""
    off = i != j
    return tl.where(off, tl.load(STATE + cols[:, None] * D + rows[None, :], mask=tl.where(off, tl.trans(ok), False),
                                 other=0.0), a)


@triton.jit
def store_block_pair(STATE, COV, a, b, cov, rows, cols, ok, i, j, D: tl.constexpr):
    """Store one block pair: the updated float64 state ``a = STATE[I, J]`` and ``b = STATE[J, I]`` (``[T, T]`` each,
    in their own orientation; ``b`` not on the diagonal block ``i == j``, where it is ``a``), and the float32
    covariance ``cov = COV[I, J]`` and its transpose at ``COV[J, I]`` (``rows = I``, ``cols = J``, ``ok`` the
    ``[I, J]`` mask). The caller has waited for every thread's loads of the pair (a barrier): on the diagonal block
    ``a`` and ``b`` are the same memory."""
    off = i != j
    tl.store(STATE + rows[:, None] * D + cols[None, :], a, mask=ok)
    transposed = tl.where(off, tl.trans(ok), False)  # (not ``& off``: the interpreter makes that int32)
    tl.store(STATE + cols[:, None] * D + rows[None, :], b, mask=transposed)
    tl.store(COV + rows[:, None] * D + cols[None, :], cov, mask=ok)
    tl.store(COV + cols[:, None] * D + rows[None, :], tl.trans(cov), mask=transposed)


@triton.jit
def finish_block_pair(STATE, COV, acc, a, b, centred_a, centred_b, n_safe, q_head, stride_qh, stride_qd, rows, cols,
                      i_ok, j_ok, i, j, D: tl.constexpr, G: tl.constexpr, BLOCK_E: tl.constexpr,
                      ESTIMATE: tl.constexpr):  # fmt: skip
    """One block pair's end, for both moment kernels: the covariance's block ``½ (C + Cᵀ)``, ``C = centred /
    n_safe`` (``centred_a = M2'[I, J]``, ``centred_b = M2'[J, I]`` in its own orientation), then, once every thread
    has read the pair, the updated state ``a``, ``b`` and both covariance blocks stored (:func:`store_block_pair`);
    returns ``acc`` plus the pair's share of each head's ``q^T cov q`` with ``ESTIMATE`` (the group's queries at
    ``q_head``), else ``acc``."""
    cov = 0.5 * (centred_a / n_safe + tl.trans(centred_b / n_safe))
    tl.debug_barrier()  # every thread has read the pair (a small block is held by several threads)
    store_block_pair(STATE, COV, a, b, cov.to(tl.float32), rows, cols, i_ok[:, None] & j_ok[None, :], i, j, D)
    if ESTIMATE:
        cov32 = cov.to(tl.float32)
        q_i = query_tile(q_head, stride_qh, stride_qd, rows, i_ok, G, BLOCK_E)
        q_j = query_tile(q_head, stride_qh, stride_qd, cols, j_ok, G, BLOCK_E)
        acc = add_block_pair(acc, cov32, tl.where(i != j, cov32, 0.0), q_i, q_j)
    return acc


@triton.jit
def estimate_and_decide(
    Q, LME, GH_X, GH_LOGW, KEYS, START, END, SINKS, DECIDED, LOCAL, READ, BROKEN, row, head, mean, qcq, offs_d, d_ok,
    stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kt, stride_kd, C, H_kv, t_sink, t_local, scale,
    softcap, n_nodes, log_tau,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_X: tl.constexpr, SOFTCAP: tl.constexpr, DECIDE: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_START: tl.constexpr, END_GIVEN: tl.constexpr, HAS_SINKS: tl.constexpr, PROMOTE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """The moment kernels' estimate, after the block pairs: ``mu_s = scale q·mean`` (eq. 5, ``mean [BLOCK_D]``
    float32, as :func:`~qada.attention._estimate_kernel.bulk_estimate_kernel` computes it) and ``sigma_s^2 =
    scale^2 q^T cov q`` (eq. 6, ``qcq [BLOCK_E]`` the pairs' shares summed, :func:`sum_shares`) stored as each
    head's ``log E[exp(s)]``
    (:func:`~qada.attention._estimate_kernel.store_log_mean_exp`), then with ``DECIDE`` the group's decision
    (:func:`~qada.attention._estimate_kernel.decide_after_estimate`, ``KEYS`` the decision's keys)."""
    q_head = Q + row.to(tl.int64) * stride_qb + (head.to(tl.int64) * G) * stride_qh
    mu = tl.sum(query_tile(q_head, stride_qh, stride_qd, offs_d, d_ok, G, BLOCK_E) * mean[None, :], axis=1) * scale
    var = qcq * scale * scale
    store_log_mean_exp(LME, GH_X, GH_LOGW, row, head, mu, var, H_kv, softcap, n_nodes, G, BLOCK_E, BLOCK_X, SOFTCAP)
    decide_after_estimate(Q, LME, KEYS, START, END, SINKS, DECIDED, LOCAL, READ, BROKEN, row, head, stride_qb,
                          stride_qh, stride_qd, stride_kb, stride_kh, stride_kt, stride_kd, C, H_kv, t_sink, t_local,
                          scale, softcap, log_tau, G, D, BLOCK_G, BLOCK_D, DECIDE, BLOCK_N, HAS_START, END_GIVEN,
                          SOFTCAP, HAS_SINKS, PROMOTE, INPUT_PRECISION, DOT_FP32)  # fmt: skip


@triton.jit
def current_block_pair(OUT_COV, SHARES, key, mean, m2, qcq, k, pair, w, n_safe, q_head, stride_kd, stride_qh,
                       stride_qd, offs_t, D: tl.constexpr, NB: tl.constexpr, BP: tl.constexpr, BLOCK_T: tl.constexpr,
                       G: tl.constexpr, BLOCK_E: tl.constexpr, ESTIMATE: tl.constexpr,
                       SPREAD: tl.constexpr):  # fmt: skip
    """Block pair ``k`` of :func:`current_moment_step_kernel`'s ``m2`` (one (row, KV head)'s ``M2``, ``mean`` its
    ``MEAN``, ``key`` the step's key): updated, written back, its covariance blocks written, its share of each head's
    ``q^T cov q`` stored or added to ``qcq`` (:func:`add_share`); returns ``qcq``."""
    i, j = block_pair_of(k, NB)
    rows = i * BLOCK_T + offs_t
    cols = j * BLOCK_T + offs_t
    i_ok = rows < D
    j_ok = cols < D
    ok = i_ok[:, None] & j_ok[None, :]
    x_i = tl.load(key + rows * stride_kd, mask=i_ok, other=0.0).to(tl.float64)
    mean_i = tl.load(mean + rows, mask=i_ok, other=0.0)
    delta_i = x_i - mean_i
    after_i = x_i - (mean_i + delta_i * (w / n_safe))  # x - mean'
    x_j = tl.load(key + cols * stride_kd, mask=j_ok, other=0.0).to(tl.float64)
    mean_j = tl.load(mean + cols, mask=j_ok, other=0.0)
    delta_j = x_j - mean_j
    after_j = x_j - (mean_j + delta_j * (w / n_safe))
    a = tl.load(m2 + rows[:, None] * D + cols[None, :], mask=ok, other=0.0)
    b = transposed_block(m2, a, rows, cols, ok, i, j, D)
    a = a + w * (delta_i[:, None] * after_j[None, :])
    b = b + w * (delta_j[:, None] * after_i[None, :])
    acc = tl.zeros([BLOCK_E, BLOCK_T, BLOCK_T], dtype=tl.float32)
    acc = finish_block_pair(m2, OUT_COV + pair * D * D, acc, a, b, a, b, n_safe, q_head, stride_qh, stride_qd,
                            rows, cols, i_ok, j_ok, i, j, D, G, BLOCK_E, ESTIMATE)  # fmt: skip
    return add_share(SHARES, qcq, acc, pair, k, BP, BLOCK_E, ESTIMATE, SPREAD)


@triton.jit
def current_moment_step_kernel(
    COUNT, MEAN, M2, OUT_MEAN, OUT_COV, KEYS, START, END,
    Q, LME, GH_X, GH_LOGW, SINKS, DECIDED, LOCAL, READ, BROKEN, ARRIVED, SHARES,
    H_kv, t_local, t_recent, stride_kb, stride_kh, stride_kt, stride_kd, stride_start, stride_end,
    stride_qb, stride_qh, stride_qd, scale, softcap, n_nodes, C, t_sink, log_tau,
    PT_Q, PT_K, PT_START, PT_END, PT_KMIN, PT_KMAX, PT_VALS, PT_IDS, PT_OKS,
    pt_stride_qb, pt_stride_qh, pt_stride_qd, pt_stride_kb, pt_stride_kh, pt_stride_kt, pt_stride_kd,
    pt_stride_eb, pt_stride_eh, pt_stride_ep, pt_stride_ed,
    pt_C, pt_H_kv, pt_t_sink, pt_t_local, pt_scale, pt_n_pages, pt_pages_per_program, pt_n_stretches,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, HAS_START: tl.constexpr,
    ESTIMATE: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_X: tl.constexpr,
    SOFTCAP: tl.constexpr, DECIDE: tl.constexpr, BLOCK_N: tl.constexpr, END_GIVEN: tl.constexpr,
    HAS_SINKS: tl.constexpr, PROMOTE: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
    PDL: tl.constexpr, SPREAD: tl.constexpr,
    PAGE_TOPS: tl.constexpr, PT_G: tl.constexpr, PT_D: tl.constexpr, PT_BLOCK_G: tl.constexpr,
    PT_BLOCK_D: tl.constexpr, PT_BLOCK_P: tl.constexpr, PT_PAGE: tl.constexpr, PT_TOP: tl.constexpr,
    PT_BLOCK_M: tl.constexpr, PT_HAS_START: tl.constexpr, PT_HAS_END: tl.constexpr,
):  # fmt: skip
    """:func:`~qada.moments.current.current_buffer_step` of one (row, KV head): the key at ``end - 1 - T_recent``
    (clamped at 0) of ``KEYS [b, H_kv, C, D]`` joins the float64 state (``COUNT [b, H_kv]``, ``MEAN [b, H_kv, D]``,
    ``M2 [b, H_kv, D, D]``, contiguous) where the row's bulk grew; ``OUT_MEAN``, ``OUT_COV`` get the float32
    moments. ``START, END [b]``: the rows' bounds (``END`` one past the step's key; any strides). With ``ESTIMATE``,
    the query side of the lognormal estimate from those moments (:func:`~qada.attention._estimate_kernel.
    store_log_mean_exp`), and with ``DECIDE`` then the group's decision (the other arguments as
    :func:`~qada.attention._estimate_kernel.bulk_estimate_kernel` takes them; ``KEYS`` are the decision's keys).

    With ``SPREAD``, grid ``(pairs, BP)``: program ``(pair, k)`` takes block pair ``k`` of ``M2``
    (:func:`block_pair_of`; ``[I, J]`` and ``[J, I]``, ``I <= J``, ``BP`` of them): reads it once, updates it (``M2
    += w (x - mean)(x - mean')ᵀ``), writes it back, turns it into the covariance's two blocks ``½ (C + Cᵀ)``, ``C =
    M2 / max(n, 1)``, and stores their share of each head's ``q^T cov q`` at ``SHARES [pairs, BP, BLOCK_E]``
    (float32). The last of the pair's programs (:func:`last_to_arrive`, ``ARRIVED [pairs]`` int32 zeros) updates
    ``COUNT`` and ``MEAN``, which the others read, and writes the estimate from the summed shares. Without, grid
    ``(pairs,)``: one program takes every block pair in turn, then the rest (``ARRIVED``, ``SHARES`` unread).

    With ``PAGE_TOPS`` the launch also carries a ``qada_tail`` step's page-top programs
    (:mod:`qada.attention.page_tops`, the ``PT_`` arguments) after its own ``PROGRAMS`` (``BP`` or 1) per pair:
    program ``(pair, PROGRAMS + s)`` runs :func:`~qada.attention._fused_tail_kernel.page_top_program` for stretch
    ``s`` and nothing else."""
    NB: tl.constexpr = BLOCK_D // BLOCK_T
    BP: tl.constexpr = NB * (NB + 1) // 2
    PROGRAMS: tl.constexpr = BP if SPREAD else 1  # the moment step's programs per (row, KV head)
    scale, softcap, log_tau = as_float32(scale), as_float32(softcap), as_float32(log_tau)  # (fp64: see as_float32)
    let_next_start(PDL)  # (with PDL: the split launch may start; it waits before reading what this one writes)
    if PAGE_TOPS:  # the page-top programs this launch carries (grid (pairs, PROGRAMS + stretches)): no moment step
        if tl.program_id(1) >= PROGRAMS:
            page_top_program(PT_Q, PT_K, PT_START, PT_END, PT_KMIN, PT_KMAX, PT_VALS, PT_IDS, PT_OKS, pt_stride_qb,
                             pt_stride_qh, pt_stride_qd, pt_stride_kb, pt_stride_kh, pt_stride_kt, pt_stride_kd,
                             pt_stride_eb, pt_stride_eh, pt_stride_ep, pt_stride_ed, pt_C, pt_H_kv, pt_t_sink,
                             pt_t_local, pt_scale, pt_n_pages, pt_pages_per_program, pt_n_stretches,
                             tl.program_id(0), tl.program_id(1) - PROGRAMS, PT_G, PT_D, PT_BLOCK_G, PT_BLOCK_D,
                             PT_BLOCK_P, PT_PAGE, PT_TOP, PT_BLOCK_M, PT_HAS_START, PT_HAS_END)  # fmt: skip
            return
    current_moment_program(COUNT, MEAN, M2, OUT_MEAN, OUT_COV, KEYS, START, END, Q, LME, GH_X, GH_LOGW, SINKS, DECIDED,
                           LOCAL, READ, BROKEN, ARRIVED, SHARES, H_kv, t_local, t_recent, stride_kb, stride_kh,
                           stride_kt, stride_kd, stride_start, stride_end, stride_qb, stride_qh, stride_qd, scale,
                           softcap, n_nodes, C, t_sink, log_tau, tl.program_id(0), tl.program_id(1) if SPREAD else 0, 0,
                           D, BLOCK_T, BLOCK_D, HAS_START, ESTIMATE, G, BLOCK_G, BLOCK_E, BLOCK_X, SOFTCAP, DECIDE,
                           BLOCK_N, END_GIVEN, HAS_SINKS, PROMOTE, INPUT_PRECISION, DOT_FP32, SPREAD)  # fmt: skip


@triton.jit
def current_moment_program(
    COUNT, MEAN, M2, OUT_MEAN, OUT_COV, KEYS, START, END,
    Q, LME, GH_X, GH_LOGW, SINKS, DECIDED, LOCAL, READ, BROKEN, ARRIVED, SHARES,
    H_kv, t_local, t_recent, stride_kb, stride_kh, stride_kt, stride_kd, stride_start, stride_end,
    stride_qb, stride_qh, stride_qd, scale, softcap, n_nodes, C, t_sink, log_tau, pid, k, ahead,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, HAS_START: tl.constexpr,
    ESTIMATE: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_X: tl.constexpr,
    SOFTCAP: tl.constexpr, DECIDE: tl.constexpr, BLOCK_N: tl.constexpr, END_GIVEN: tl.constexpr,
    HAS_SINKS: tl.constexpr, PROMOTE: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
    SPREAD: tl.constexpr,
):  # fmt: skip
    """Program ``(pid, k)`` of :func:`current_moment_step_kernel` (same arguments): (row, KV head) ``pid``, block pair
    ``k`` (with ``SPREAD``), for rows ending ``ahead`` keys past ``END`` (0 in that launch; 1 in a combine launch that
    steps the moments for the next decode step, :mod:`qada.attention._ahead_kernel`)."""
    NB: tl.constexpr = BLOCK_D // BLOCK_T
    BP: tl.constexpr = NB * (NB + 1) // 2
    PROGRAMS: tl.constexpr = BP if SPREAD else 1  # the moment step's programs per (row, KV head)
    row = pid // H_kv
    head = pid % H_kv
    pair = pid.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    end = tl.load(END + row * stride_end).to(tl.int64) + ahead
    if HAS_START:
        start = tl.load(START + row * stride_start).to(tl.int64)
    else:
        start = tl.zeros([], dtype=tl.int64)
    index = tl.maximum(end - 1 - t_recent, 0)
    before = tl.maximum(end - 1 - start - t_local, 0)
    w = tl.where(end - start - t_local > before, 1.0, 0.0).to(tl.float64)
    key = KEYS + row.to(tl.int64) * stride_kb + head.to(tl.int64) * stride_kh + index * stride_kt
    count = tl.load(COUNT + pair)
    n = count + w
    mean = MEAN + pair * D
    m2 = M2 + pair * D * D
    n_safe = tl.maximum(n, 1.0)
    offs_t = tl.arange(0, BLOCK_T)
    q_head = Q + row.to(tl.int64) * stride_qb + (head.to(tl.int64) * G) * stride_qh
    qcq = tl.zeros([BLOCK_E], dtype=tl.float32)  # (without SPREAD: the shares summed here, in block-pair order)
    if SPREAD:  # this program's own block pair
        qcq = current_block_pair(OUT_COV, SHARES, key, mean, m2, qcq, k, pair, w, n_safe, q_head,
                                 stride_kd, stride_qh, stride_qd, offs_t, D, NB, BP, BLOCK_T, G, BLOCK_E, ESTIMATE,
                                 SPREAD)  # fmt: skip
    else:  # every block pair in turn
        for kk in range(0, BP):
            qcq = current_block_pair(OUT_COV, SHARES, key, mean, m2, qcq, kk, pair, w, n_safe, q_head, stride_kd,
                                     stride_qh, stride_qd, offs_t, D, NB, BP, BLOCK_T, G, BLOCK_E, ESTIMATE,
                                     SPREAD)  # fmt: skip
    if last_to_arrive(ARRIVED, pair, PROGRAMS):  # every block pair has read the old mean and count
        x = tl.load(key + offs_d * stride_kd, mask=d_ok, other=0.0).to(tl.float64)
        mean_old = tl.load(mean + offs_d, mask=d_ok, other=0.0)
        mean_new = mean_old + (x - mean_old) * (w / n_safe)
        tl.debug_barrier()  # every thread read the old mean
        tl.store(COUNT + pair, n)
        tl.store(mean + offs_d, mean_new, mask=d_ok)
        tl.store(OUT_MEAN + pair * D + offs_d, mean_new.to(tl.float32), mask=d_ok)
        if ESTIMATE:
            estimate_and_decide(Q, LME, GH_X, GH_LOGW, KEYS, START, END, SINKS, DECIDED, LOCAL, READ, BROKEN, row,
                                head, mean_new.to(tl.float32), sum_shares(SHARES, qcq, pair, BP, BLOCK_E, SPREAD),
                                offs_d, d_ok, stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kt,
                                stride_kd, C, H_kv, t_sink, t_local, scale, softcap, n_nodes, log_tau, G, D, BLOCK_G,
                                BLOCK_D, BLOCK_E, BLOCK_X, SOFTCAP, DECIDE, BLOCK_N, HAS_START, END_GIVEN, HAS_SINKS,
                                PROMOTE, INPUT_PRECISION, DOT_FP32)  # fmt: skip


@triton.jit
def stored_block_pair(COV, SHARES, ref, shift, s1_from, s2_from, s2, qcq, k, pair, w_sum, count, n_safe, q_head,
                      stride_rd, stride_qh, stride_qd, offs_t, D: tl.constexpr, NB: tl.constexpr, BP: tl.constexpr,
                      BLOCK_T: tl.constexpr, G: tl.constexpr, BLOCK_E: tl.constexpr, ESTIMATE: tl.constexpr,
                      SPREAD: tl.constexpr):  # fmt: skip
    """Block pair ``k`` of :func:`stored_moment_step_kernel`'s sums (one (row, KV head)'s, read from ``s1_from``,
    ``s2_from``: the state's or a jump's; ``s2`` the state's ``S2``; ``ref`` the key moving in or out): updated,
    written back, centred into its covariance blocks (written), its share of each head's ``q^T cov q`` stored or
    added to ``qcq`` (:func:`add_share`); returns ``qcq``."""
    i, j = block_pair_of(k, NB)
    rows = i * BLOCK_T + offs_t
    cols = j * BLOCK_T + offs_t
    i_ok = rows < D
    j_ok = cols < D
    ok = i_ok[:, None] & j_ok[None, :]
    x_i = tl.load(ref + rows * stride_rd, mask=i_ok, other=0.0).to(tl.float64) - tl.load(shift + rows, mask=i_ok)
    c_i = (tl.load(s1_from + rows, mask=i_ok, other=0.0) + w_sum * x_i) / n_safe
    x_j = tl.load(ref + cols * stride_rd, mask=j_ok, other=0.0).to(tl.float64) - tl.load(shift + cols, mask=j_ok)
    c_j = (tl.load(s1_from + cols, mask=j_ok, other=0.0) + w_sum * x_j) / n_safe
    a = tl.load(s2_from + rows[:, None] * D + cols[None, :], mask=ok, other=0.0)
    b = transposed_block(s2_from, a, rows, cols, ok, i, j, D) + w_sum * (x_j[:, None] * x_i[None, :])
    a = a + w_sum * (x_i[:, None] * x_j[None, :])
    centred_a = a - count * (c_i[:, None] * c_j[None, :])
    centred_b = b - count * (c_j[:, None] * c_i[None, :])
    acc = tl.zeros([BLOCK_E, BLOCK_T, BLOCK_T], dtype=tl.float32)
    acc = finish_block_pair(s2, COV + pair * D * D, acc, a, b, centred_a, centred_b, n_safe, q_head, stride_qh,
                            stride_qd, rows, cols, i_ok, j_ok, i, j, D, G, BLOCK_E, ESTIMATE)  # fmt: skip
    return add_share(SHARES, qcq, acc, pair, k, BP, BLOCK_E, ESTIMATE, SPREAD)


@triton.jit
def stored_moment_step_kernel(
    COUNT, S1, S2, OLD_END, JUMP_N, JUMP_COUNT, JUMP_S1, JUMP_S2, MEAN, COV, REF, SHIFT, START, END, KEYS,
    Q, LME, GH_X, GH_LOGW, SINKS, DECIDED, LOCAL, READ, BROKEN, ARRIVED, SHARES,
    H_kv, N, num_jumps, t_local, offset, first, min_bulk_keys, stride_rh, stride_rn, stride_rd,
    stride_start, stride_end, stride_kb, stride_kh, stride_kt, stride_kd,
    stride_qb, stride_qh, stride_qd, scale, softcap, n_nodes, C, t_sink, log_tau,
    PT_Q, PT_K, PT_START, PT_END, PT_KMIN, PT_KMAX, PT_VALS, PT_IDS, PT_OKS,
    pt_stride_qb, pt_stride_qh, pt_stride_qd, pt_stride_kb, pt_stride_kh, pt_stride_kt, pt_stride_kd,
    pt_stride_eb, pt_stride_eh, pt_stride_ep, pt_stride_ed,
    pt_C, pt_H_kv, pt_t_sink, pt_t_local, pt_scale, pt_n_pages, pt_pages_per_program, pt_n_stretches,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, HAS_START: tl.constexpr,
    ESTIMATE: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_X: tl.constexpr,
    SOFTCAP: tl.constexpr, DECIDE: tl.constexpr, BLOCK_N: tl.constexpr, END_GIVEN: tl.constexpr,
    HAS_SINKS: tl.constexpr, PROMOTE: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
    PDL: tl.constexpr, SPREAD: tl.constexpr,
    PAGE_TOPS: tl.constexpr, PT_G: tl.constexpr, PT_D: tl.constexpr, PT_BLOCK_G: tl.constexpr,
    PT_BLOCK_D: tl.constexpr, PT_BLOCK_P: tl.constexpr, PT_PAGE: tl.constexpr, PT_TOP: tl.constexpr,
    PT_BLOCK_M: tl.constexpr, PT_HAS_START: tl.constexpr, PT_HAS_END: tl.constexpr,
):  # fmt: skip
    """:func:`~qada.moments.stored.advance_reference_range` of one (row, KV head): the row's reference range
    ``[first, e(n))`` moves from ``e(n - 1)`` (what the previous step, or the prefill, left in ``OLD_END``: every
    step grows each row by one key) to ``e(n)``, adding or removing the key of ``REF [H_kv, N, D]`` between them
    from the float64 sums around ``SHIFT [H_kv, D]`` (``COUNT [b, H_kv]``, ``S1 [b, H_kv, D]``, ``S2 [b, H_kv, D,
    D]``), or, at a length ``JUMP_N [b, K]`` lists, taking the prepared sums ``JUMP_* [b, K, H_kv, ...]``; writes
    ``OLD_END [b]`` (the programs of KV head 0) and the float32 ``MEAN``, ``COV``. ``n = END - START``. With
    ``ESTIMATE``, then the estimate's query side (and with ``DECIDE`` the decision, from ``KEYS [b, H_kv, C, d]``) as
    :func:`current_moment_step_kernel`, whose grid and block pairs this kernel shares: each of ``S2``'s block pairs
    updated by its program (``S2 += w x xᵀ``, or the jump's), written back and centred into the covariance's two
    blocks (``½ (C + Cᵀ)``, ``C = (S2 - count c cᵀ) / max(count, 1)``, ``c = S1 / max(count, 1)``), the last of the
    pair's programs updating ``COUNT``, ``S1`` and ``OLD_END``, which the others read (without ``SPREAD``: one
    program per pair, every block pair in turn).

    With ``PAGE_TOPS`` the launch also carries a ``qada_tail`` step's page-top programs
    (:mod:`qada.attention.page_tops`, the ``PT_`` arguments) after its own ``PROGRAMS`` per pair, as
    :func:`current_moment_step_kernel`'s."""
    NB: tl.constexpr = BLOCK_D // BLOCK_T
    BP: tl.constexpr = NB * (NB + 1) // 2
    PROGRAMS: tl.constexpr = BP if SPREAD else 1  # the moment step's programs per (row, KV head)
    scale, softcap, log_tau = as_float32(scale), as_float32(softcap), as_float32(log_tau)  # (fp64: see as_float32)
    let_next_start(PDL)  # (with PDL: the split launch may start; it waits before reading what this one writes)
    if PAGE_TOPS:  # the page-top programs this launch carries (grid (pairs, PROGRAMS + stretches)): no moment step
        if tl.program_id(1) >= PROGRAMS:
            page_top_program(PT_Q, PT_K, PT_START, PT_END, PT_KMIN, PT_KMAX, PT_VALS, PT_IDS, PT_OKS, pt_stride_qb,
                             pt_stride_qh, pt_stride_qd, pt_stride_kb, pt_stride_kh, pt_stride_kt, pt_stride_kd,
                             pt_stride_eb, pt_stride_eh, pt_stride_ep, pt_stride_ed, pt_C, pt_H_kv, pt_t_sink,
                             pt_t_local, pt_scale, pt_n_pages, pt_pages_per_program, pt_n_stretches,
                             tl.program_id(0), tl.program_id(1) - PROGRAMS, PT_G, PT_D, PT_BLOCK_G, PT_BLOCK_D,
                             PT_BLOCK_P, PT_PAGE, PT_TOP, PT_BLOCK_M, PT_HAS_START, PT_HAS_END)  # fmt: skip
            return
    stored_moment_program(COUNT, S1, S2, OLD_END, JUMP_N, JUMP_COUNT, JUMP_S1, JUMP_S2, MEAN, COV, REF, SHIFT, START,
                          END, KEYS, Q, LME, GH_X, GH_LOGW, SINKS, DECIDED, LOCAL, READ, BROKEN, ARRIVED, SHARES, H_kv,
                          N, num_jumps, t_local, offset, first, min_bulk_keys, stride_rh, stride_rn, stride_rd,
                          stride_start, stride_end, stride_kb, stride_kh, stride_kt, stride_kd, stride_qb, stride_qh,
                          stride_qd, scale, softcap, n_nodes, C, t_sink, log_tau, tl.program_id(0),
                          tl.program_id(1) if SPREAD else 0, 0, D, BLOCK_T, BLOCK_D, HAS_START, ESTIMATE, G, BLOCK_G,
                          BLOCK_E, BLOCK_X, SOFTCAP, DECIDE, BLOCK_N, END_GIVEN, HAS_SINKS, PROMOTE, INPUT_PRECISION,
                          DOT_FP32, SPREAD)  # fmt: skip


@triton.jit
def stored_moment_program(
    COUNT, S1, S2, OLD_END, JUMP_N, JUMP_COUNT, JUMP_S1, JUMP_S2, MEAN, COV, REF, SHIFT, START, END, KEYS,
    Q, LME, GH_X, GH_LOGW, SINKS, DECIDED, LOCAL, READ, BROKEN, ARRIVED, SHARES,
    H_kv, N, num_jumps, t_local, offset, first, min_bulk_keys, stride_rh, stride_rn, stride_rd,
    stride_start, stride_end, stride_kb, stride_kh, stride_kt, stride_kd,
    stride_qb, stride_qh, stride_qd, scale, softcap, n_nodes, C, t_sink, log_tau, pid, k, ahead,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, HAS_START: tl.constexpr,
    ESTIMATE: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_X: tl.constexpr,
    SOFTCAP: tl.constexpr, DECIDE: tl.constexpr, BLOCK_N: tl.constexpr, END_GIVEN: tl.constexpr,
    HAS_SINKS: tl.constexpr, PROMOTE: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
    SPREAD: tl.constexpr,
):  # fmt: skip
    """Program ``(pid, k)`` of :func:`stored_moment_step_kernel` (same arguments): (row, KV head) ``pid``, block pair
    ``k`` (with ``SPREAD``), for rows ``ahead`` keys longer than ``END - START`` (0 in that launch; 1 in a combine
    launch that steps the moments for the next decode step, :mod:`qada.attention._ahead_kernel`)."""
    NB: tl.constexpr = BLOCK_D // BLOCK_T
    BP: tl.constexpr = NB * (NB + 1) // 2
    PROGRAMS: tl.constexpr = BP if SPREAD else 1  # the moment step's programs per (row, KV head)
    row = pid // H_kv
    head = pid % H_kv
    pair = pid.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    n = tl.load(END + row * stride_end).to(tl.int64) + ahead
    if HAS_START:
        n -= tl.load(START + row * stride_start).to(tl.int64)
    new_end = reference_end(n, t_local, offset, first, min_bulk_keys, N)
    old_end = reference_end(n - 1, t_local, offset, first, min_bulk_keys, N)
    delta = new_end - old_end
    w = tl.where((delta <= 1) & (delta >= -1), delta, 0).to(tl.float64)
    index = tl.minimum(tl.maximum(tl.where(delta > 0, old_end, new_end), 0), N - 1)
    ref = REF + head.to(tl.int64) * stride_rh + index * stride_rn
    shift = SHIFT + head * D
    jump = tl.full([], -1, dtype=tl.int64)
    for jk in range(0, num_jumps):  # the prefill listed at most one jump per length
        jump = tl.where(tl.load(JUMP_N + row.to(tl.int64) * num_jumps + jk) == n, jk, jump)
    hit = jump >= 0
    at = (row.to(tl.int64) * num_jumps + tl.maximum(jump, 0)) * H_kv + head  # the jump's (row, k, head), or k = 0
    count = tl.where(hit, tl.load(JUMP_COUNT + at), tl.load(COUNT + pair) + w)
    n_safe = tl.maximum(count, 1.0)
    # at a jump the prepared sums replace the state's (``JUMP_S2`` is as large as the state: read only then): every
    # load below reads one or the other, and adds ``w_sum`` (0 at a jump) times the key's share
    s1_base, s2 = S1 + pair * D, S2 + pair * D * D
    s1_from = tl.where(hit, JUMP_S1 + at * D, s1_base)
    s2_from = tl.where(hit, JUMP_S2 + at * D * D, s2)
    w_sum = tl.where(hit, 0.0, w)
    offs_t = tl.arange(0, BLOCK_T)
    q_head = Q + row.to(tl.int64) * stride_qb + (head.to(tl.int64) * G) * stride_qh
    qcq = tl.zeros([BLOCK_E], dtype=tl.float32)  # (without SPREAD: the shares summed here, in block-pair order)
    if SPREAD:  # this program's own block pair
        qcq = stored_block_pair(COV, SHARES, ref, shift, s1_from, s2_from, s2, qcq, k, pair, w_sum,
                                count, n_safe, q_head, stride_rd, stride_qh, stride_qd, offs_t, D, NB, BP, BLOCK_T, G,
                                BLOCK_E, ESTIMATE, SPREAD)  # fmt: skip
    else:  # every block pair in turn
        for kk in range(0, BP):
            qcq = stored_block_pair(COV, SHARES, ref, shift, s1_from, s2_from, s2, qcq, kk, pair, w_sum, count, n_safe,
                                    q_head, stride_rd, stride_qh, stride_qd, offs_t, D, NB, BP, BLOCK_T, G, BLOCK_E,
                                    ESTIMATE, SPREAD)  # fmt: skip
    if last_to_arrive(ARRIVED, pair, PROGRAMS):  # every block pair has read the old sums and count
        x = tl.load(ref + offs_d * stride_rd, mask=d_ok, other=0.0).to(tl.float64) - tl.load(shift + offs_d,
                                                                                               mask=d_ok)
        s1 = tl.load(s1_from + offs_d, mask=d_ok, other=0.0) + w_sum * x
        tl.debug_barrier()  # every thread read the old sums
        tl.store(COUNT + pair, count)
        tl.store(s1_base + offs_d, s1, mask=d_ok)
        if head == 0:
            tl.store(OLD_END + row, new_end.to(OLD_END.dtype.element_ty))
        mean = tl.where(count > 0, s1 / n_safe + tl.load(shift + offs_d, mask=d_ok, other=0.0), 0.0)
        tl.store(MEAN + pair * D + offs_d, mean.to(tl.float32), mask=d_ok)
        if ESTIMATE:
            estimate_and_decide(Q, LME, GH_X, GH_LOGW, KEYS, START, END, SINKS, DECIDED, LOCAL, READ, BROKEN, row,
                                head, mean.to(tl.float32), sum_shares(SHARES, qcq, pair, BP, BLOCK_E, SPREAD),
                                offs_d, d_ok, stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kt,
                                stride_kd, C, H_kv, t_sink, t_local, scale, softcap, n_nodes, log_tau, G, D, BLOCK_G,
                                BLOCK_D, BLOCK_E, BLOCK_X, SOFTCAP, DECIDE, BLOCK_N, HAS_START, END_GIVEN, HAS_SINKS,
                                PROMOTE, INPUT_PRECISION, DOT_FP32)  # fmt: skip
