"""The two kernels of the ``triton`` executor: split-K decode and log-sum-exp combine. Imported lazily: importing
it imports triton.

``INTERPRETED`` records whether the kernels were decorated for Triton's interpreter (``TRITON_INTERPRET=1`` when
this module was first imported); that cannot change afterwards. ``run(kernel, grid, *args, **kwargs)`` launches.

Token ranges of one row ``r`` of the buffer (``C`` slots): real tokens ``[first, last)`` with ``first = start_r``
(0 without ``START``) and ``last = end_r`` (``C`` without ``END``); ``T_bulk = max(0, last - first - t_local)``;
bulk ``[first + t_sink, first + t_sink + T_bulk)``; the window is the real tokens outside the bulk.

*Virtual block list* of one (row, KV head): the blocks of ``BLOCK_N`` slots the program must read, in order.
When some head of the group is dense (or the row has no bulk) it is every block meeting ``[first, last)``;
otherwise the blocks meeting the sinks ``[first, first + t_sink)`` followed by those meeting the recent tokens
``[last - t_recent, last)``, minus any block already listed (a block holding sinks and recent tokens is read
once). Split ``s`` of ``S`` takes entries ``[s * n, (s + 1) * n)`` with ``n = cdiv(len, S)``: a local group
lists a handful of blocks, so most of its splits are empty and store ``m = -inf, l = 0, acc = 0`` at once.
Nothing is read at or beyond ``last`` nor before ``first``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from qada.attention._budget_rank import budget_group_decision
from qada.attention._group_decision import policy_of_heads

try:  # programmatic dependent launch (Triton >= 3.4): the kernels use it only when asked, on sm_90+
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton
    gdc_launch_dependents = gdc_wait = None


def pdl_intrinsics_compile() -> bool:
    """Whether Triton's programmatic-launch intrinsics take the keyword its code generator passes to a builtin
    (``_semantic``, or ``_builder`` before): Triton 3.4's ``gdc_wait`` / ``gdc_launch_dependents`` still took
    ``_builder`` where its code generator passed ``_semantic``, so a kernel calling them did not compile (found
    compiling for sm_90 with ``benchmarks/kernel_resources.py``); 3.5 on, they do. Without them (before 3.4)
    ``False``."""
    import inspect

    if gdc_wait is None or gdc_launch_dependents is None:
        return False
    wants = set(inspect.signature(tl.program_id).parameters) & {"_semantic", "_builder"}
    takes = set(inspect.signature(gdc_wait).parameters) & set(inspect.signature(gdc_launch_dependents).parameters)
    return bool(wants) and wants <= takes


HAS_PDL = pdl_intrinsics_compile()
"""Whether the kernels may use programmatic dependent launches (:func:`pdl_intrinsics_compile`)."""

try:
    INTERPRETED = bool(triton.knobs.runtime.interpret)
except AttributeError:  # older triton without knobs
    import os

    INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _launch(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """Launch the Triton ``kernel`` on ``grid``."""
    kernel[grid](*args, **kwargs)


if INTERPRETED:  # the interpreter runs Python that torch.compile must not trace: there a launch is a graph break
    import torch

    run = torch.compiler.disable(_launch)
else:
    run = _launch


@triton.jit
def as_float32(x):
    """A float argument ``x`` as a float32 scalar. Triton's launcher passes a Python float as fp32, but
    ``torch.compile`` (a kernel launched from a compiled function) as fp64, which would make the scores and the
    decision float64 (and a loop's carried values change type): the kernels compute in float32 either way."""
    return tl.cast(x, tl.float32)


@triton.jit
def let_next_start(PDL: tl.constexpr):
    """With ``PDL``: the next launch, if launched as a programmatic dependent launch (sm_90+, ``launch_pdl``), may
    start now, while this one runs (it waits in :func:`wait_for_previous` before reading what this one writes).
    Without, nothing."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """With ``PDL``: wait until the previous launch has finished and its writes are visible. A program launched as a
    programmatic dependent launch may start before that: everything it reads before this call must have been
    written before the previous launch started. Without, nothing (stream order waits)."""
    if PDL:
        gdc_wait()


@triton.jit
def group_queries(q_rows, stride_qd, g_ok, D: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr):
    """The queries ``[BLOCK_G, BLOCK_D]`` of one KV group's heads (``q_rows [BLOCK_G, 1]``: each head's first feature,
    where ``g_ok``) in the cache's dtype, or float32 under ``DOT_FP32`` (as :func:`key_scores` takes them)."""
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(q_rows + offs_d[None, :] * stride_qd, mask=g_ok[:, None] & (offs_d < D)[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    return q


@triton.jit
def row_range(START, END, row, C, t_sink, t_local, HAS_START: tl.constexpr, HAS_END: tl.constexpr):
    """``(first, last, t_bulk, bulk_lo, bulk_hi)`` of ``row`` (module docstring), from device values only."""
    if HAS_START:
        first = tl.load(START + row).to(tl.int32)
    else:
        first = tl.full([], 0, dtype=tl.int32)
    if HAS_END:
        last = tl.load(END + row).to(tl.int32)
    else:
        last = tl.full([], 0, dtype=tl.int32) + C
    first = tl.minimum(tl.maximum(first, 0), C)
    last = tl.minimum(tl.maximum(last, first), C)
    t_bulk = tl.maximum(last - first - t_local, 0)
    bulk_lo = first + t_sink
    bulk_hi = bulk_lo + t_bulk  # bulk = [bulk_lo, bulk_hi), empty without a bulk
    return first, last, t_bulk, bulk_lo, bulk_hi


@triton.jit
def block_list(first, last, bulk_lo, bulk_hi, whole, BLOCK_N: tl.constexpr):
    """The virtual block list (module docstring) as ``(a_lo, n_a, b_lo, n_virtual)``: entry ``i`` is block
    ``a_lo + i`` for ``i < n_a``, else ``b_lo + i - n_a``. ``whole``: every block of ``[first, last)``; else the
    blocks meeting ``[first, bulk_lo)`` then those meeting ``[bulk_hi, last)`` not listed already."""
    a_end = tl.where(whole, last, bulk_lo)
    b_begin = tl.where(whole, last, bulk_hi)
    a_lo = first // BLOCK_N
    a_hi = tl.where(a_end > first, tl.cdiv(a_end, BLOCK_N), a_lo)
    b_lo = tl.maximum(b_begin // BLOCK_N, a_hi)
    b_hi = tl.where(last > b_begin, tl.cdiv(last, BLOCK_N), b_lo)
    n_a = a_hi - a_lo
    n_virtual = n_a + tl.maximum(b_hi - b_lo, 0)
    return a_lo, n_a, b_lo, n_virtual


@triton.jit
def key_scores(q, k, INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """``q k^T [BLOCK_G, BLOCK_N]`` in float32, unscaled, of the queries ``q [BLOCK_G, BLOCK_D]`` and a tile of keys
    ``k [BLOCK_N, BLOCK_D]`` as loaded from the cache. 16-bit inputs go to the tensor cores: their products are
    exact in float32, and the sums are float32 (the same scores as upcasting first, up to the order of the sum, in
    a fraction of the registers: a float32 ``ieee`` dot keeps whole rows of both tiles per thread). Float32 inputs
    take ``INPUT_PRECISION`` (``"ieee"``: exact float32). ``DOT_FP32`` (the interpreter's bfloat16 ``tl.dot`` is
    wrong) upcasts the keys; the queries then arrive in float32."""
    if DOT_FP32:
        k = k.to(tl.float32)
    return tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION).to(tl.float32)


@triton.jit
def attend_blocks(
    q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
    first, last, bulk_lo, bulk_hi, has_bulk, read, dense, a_lo, n_a, b_lo, v_begin, v_end, qk_scale, softcap,
    D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Online softmax of the ``G`` queries ``q [BLOCK_G, BLOCK_D]`` over entries ``[v_begin, v_end)`` of the
    virtual block list: returns ``(m [BLOCK_G], l [BLOCK_G], acc [BLOCK_G, BLOCK_D], n_bulk)`` in float32 (log2
    domain, see :func:`qada_decode_split_kernel`) and the number of blocks loaded only for the bulk. ``read``:
    the group reads its bulk; ``dense [BLOCK_G]``: the heads that attend over it."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    n_bulk = tl.zeros([], dtype=tl.int32)
    window_a_end = tl.where(has_bulk, bulk_lo, last)  # the window: [first, window_a_end) and, with a bulk,
    for i in range(v_begin, v_end):  # [bulk_hi, last)
        blk = tl.where(i < n_a, a_lo + i, b_lo + (i - n_a))
        lo = blk * BLOCK_N
        hi = lo + BLOCK_N
        offs = lo + offs_n
        real = (offs >= first) & (offs < last)
        in_bulk = (offs >= bulk_lo) & (offs < bulk_hi)
        # a skipped bulk token is never loaded, even in a window block (tl.where: the interpreter turns
        # tensor | scalar of bool into int32)
        load_ok = tl.where(read, real, real & (in_bulk == 0))
        kv_mask = load_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + offs[:, None].to(tl.int64) * stride_kt + offs_d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)  # fmt: skip
        s = (key_scores(q, k, INPUT_PRECISION, DOT_FP32) * qk_scale).to(tl.float32)
        if SOFTCAP:  # c tanh(s / c) = c (1 - 2 / (exp(2 s / c) + 1)), in the log2 domain
            capped = softcap * (1.0 - 2.0 / (tl.math.exp2(2.0 * s / softcap * 1.4426950408889634) + 1.0))
            s = (capped * 1.4426950408889634).to(tl.float32)  # (a float64 cap must not make the loop float64)
        allowed = load_ok[None, :] & ((in_bulk == 0)[None, :] | dense[:, None])  # [BLOCK_G, BLOCK_N]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no -inf - -inf
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + offs[:, None].to(tl.int64) * stride_vt + offs_d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)  # fmt: skip
        if DOT_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION).to(tl.float32)
        m_i = m_new
        has_window = (tl.maximum(lo, first) < tl.minimum(hi, window_a_end)) | (
            has_bulk & (tl.maximum(lo, bulk_hi) < tl.minimum(hi, last))
        )
        n_bulk += tl.where(has_window, 0, 1)
    return m_i, l_i, acc, n_bulk


@triton.jit
def store_split(ACC, M, L, COUNTS, pair, split, num_splits, acc, m_i, l_i, n_bulk, n_loaded,
                G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """Store one split's ``acc, m, l`` and its two block counts at slot ``(pair, split)``."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < G
    slot = pair.to(tl.int64) * num_splits + split
    out = slot * G + offs_g
    tl.store(ACC + out[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None] & (offs_d < D)[None, :])
    tl.store(M + out, m_i, mask=g_ok)
    tl.store(L + out, l_i, mask=g_ok)
    tl.store(COUNTS + slot * 2, n_bulk)
    tl.store(COUNTS + slot * 2 + 1, n_loaded)


@triton.jit
def through_memory(COUNTS, pair, split, num_splits, flag):
    """``flag`` (0-d bool) as loaded back from memory: stored in this program's second ``COUNTS`` slot (which
    :func:`store_split` overwrites at the end), then loaded after a barrier. A decision made in the kernel decides
    the attention loop's bounds (a group that reads its bulk loops over more blocks); Triton (3.6 to 3.9) does not
    software-pipeline a loop whose bounds derive from another loop's results (the window's scores), so the fused
    kernels' attention would wait for each block's loads. Bounds from a load it pipelines, as in
    :func:`qada_decode_split_kernel` (``benchmarks/kernel_resources.py`` counts the asynchronous copies)."""
    slot = COUNTS + (pair.to(tl.int64) * num_splits + split) * 2 + 1
    tl.store(slot, flag.to(tl.int32))
    tl.debug_barrier()
    return tl.load(slot) != 0


@triton.jit
def attend_split(
    q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd, first, last, bulk_lo, bulk_hi, has_bulk, read,
    dense, ACC, M, L, COUNTS, pair, split, num_splits, qk_scale, softcap,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One program's split of a (row, KV head)'s attention: its share of the virtual block list (every block when
    ``read`` or without a bulk, else the window's), :func:`attend_blocks` over it with the queries ``q [BLOCK_G,
    BLOCK_D]`` (already in the dot's dtype) and the dense heads ``dense``, and :func:`store_split`."""
    a_lo, n_a, b_lo, n_virtual = block_list(first, last, bulk_lo, bulk_hi, read | (has_bulk == 0), BLOCK_N)
    per_split = tl.cdiv(n_virtual, num_splits)
    v_begin = split * per_split
    v_end = tl.minimum(v_begin + per_split, n_virtual)
    m_i, l_i, acc, n_bulk = attend_blocks(
        q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
        first, last, bulk_lo, bulk_hi, has_bulk, read, dense, a_lo, n_a, b_lo, v_begin, v_end, qk_scale, softcap,
        D, BLOCK_G, BLOCK_N, BLOCK_D, INPUT_PRECISION, DOT_FP32, SOFTCAP,
    )  # fmt: skip
    store_split(ACC, M, L, COUNTS, pair, split, num_splits, acc, m_i, l_i, n_bulk, tl.maximum(v_end - v_begin, 0),
                G, D, BLOCK_G, BLOCK_D)  # fmt: skip


@triton.jit
def qada_decode_split_kernel(
    Q, K, V, LOCAL, START, END, ACC, M, L, COUNTS, SCORE, COUNT, DECIDED, BROKEN, READ,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_lb, stride_lh,
    C, H_KV, t_sink, t_local, num_splits, qk_scale, softcap,
    G: tl.constexpr, D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_START: tl.constexpr, HAS_END: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, SOFTCAP: tl.constexpr, PDL: tl.constexpr,
    ALL_DENSE: tl.constexpr, RANK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr,
    PER_GROUP: tl.constexpr, PROMOTE: tl.constexpr, POLICY: tl.constexpr,
):  # fmt: skip
    """One program = one (row, KV head) and one split of its virtual block list, for all ``G`` query heads.

    Reads ``Q [b, H, 1, d]``, ``K, V [b, H_kv, C, d]`` (any strides), ``LOCAL [b, H]`` bool (effective local
    mask), ``START, END [b]`` integers (only with ``HAS_START`` / ``HAS_END``). Writes, at ``(pair, split)``
    with ``pair = row * H_kv + kv_head``, the split's unnormalised ``ACC [.., G, D]``, running max ``M [.., G]``
    (log2 domain: scores are multiplied by ``qk_scale = scale * log2(e)``) and sum ``L [.., G]``, all float32,
    and ``COUNTS [.., 2]`` int32: blocks loaded only for the bulk (no window token), blocks loaded in all.
    ``DOT_FP32`` upcasts the inputs of both dots to float32 (bfloat16 under the interpreter, whose bfloat16
    ``tl.dot`` is wrong). Every loop-carried value is float32 whatever type ``qk_scale`` arrives with. With
    ``SOFTCAP`` the scores are soft-capped, ``c tanh(s / c)`` with ``c = softcap`` (``qk_scale`` is then the
    plain ``scale``, and the capped score is taken to the log2 domain). With ``PDL`` (launched as a programmatic
    dependent launch after the launch that wrote ``LOCAL``) it lets the combine launch start, and waits for the
    previous launch before reading ``LOCAL``. With ``ALL_DENSE`` every head attends over its whole row (the
    ``dense`` criterion's decision: a row without a bulk attends over its window, as the group policy makes it
    local) and ``LOCAL`` is not read. With ``RANK`` the decision is the budget rule's, made in each program
    (:func:`~qada.attention._budget_rank.budget_group_decision`: the row's heads of ``SCORE [b, H]`` float32 ranked,
    the layer's ``COUNT`` (0-d int64) best local, per KV group with ``PER_GROUP``, the group policy ``PROMOTE``;
    ``BLOCK_H >= H``, ``BLOCK_KV >= H_kv``), and split 0 of each (row, KV head) writes it: ``DECIDED``, ``LOCAL``
    (contiguous, the effective mask), ``BROKEN [b, H]`` and ``READ [b, H_kv]`` (bool, as bytes). With ``POLICY``
    the heads were decided apart by the launch before (one program per query head: ``DECIDED [b, H]`` bool,
    contiguous, before the group policy); each program applies the group policy ``PROMOTE`` to its group's
    (:func:`~qada.attention._group_decision.policy_of_heads`) and split 0 writes ``LOCAL`` (contiguous) and
    ``READ``. Without either, ``SCORE``, ``COUNT``, ``DECIDED``, ``BROKEN`` and ``READ`` are not read (any tensor may
    stand for them).
    """
    qk_scale, softcap = as_float32(qk_scale), as_float32(softcap)  # (fp64 where torch.compile launches)
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

    first, last, t_bulk, bulk_lo, bulk_hi = row_range(START, END, row, C, t_sink, t_local, HAS_START, HAS_END)
    has_bulk = t_bulk > 0

    wait_for_previous(PDL)  # (the decision: LOCAL, the scores ranked, or the heads decided apart)
    if ALL_DENSE:
        dense = g_ok  # [BLOCK_G]
    elif RANK:  # the budget rule, made here (split 0 writes the decision)
        dense = budget_group_decision(SCORE, COUNT, DECIDED, LOCAL, BROKEN, READ, row, kv_head, split, has_bulk, H_KV,
                                      G, BLOCK_G, BLOCK_H, BLOCK_KV, PER_GROUP, PROMOTE)
    elif POLICY:  # the group policy on heads decided apart (split 0 writes LOCAL and READ)
        dense = policy_of_heads(DECIDED, LOCAL, READ, row64, kv64, split, H_KV, G, BLOCK_G, PROMOTE)
    else:
        is_local = tl.load(LOCAL + row64 * stride_lb + heads.to(tl.int64) * stride_lh, mask=g_ok, other=1)
        dense = (is_local == 0) & g_ok  # [BLOCK_G]
    read = tl.max(dense.to(tl.int32), axis=0) > 0  # some head of the group attends over the bulk

    q = group_queries(Q + row64 * stride_qb + heads[:, None].to(tl.int64) * stride_qh, stride_qd, g_ok, D, BLOCK_D,
                      DOT_FP32)  # fmt: skip
    attend_split(q, K + row64 * stride_kb + kv64 * stride_kh, V + row64 * stride_vb + kv64 * stride_vh,
                 stride_kt, stride_kd, stride_vt, stride_vd, first, last, bulk_lo, bulk_hi, has_bulk, read, dense,
                 ACC, M, L, COUNTS, pair, split, num_splits, qk_scale, softcap,
                 G, D, BLOCK_G, BLOCK_N, BLOCK_D, INPUT_PRECISION, DOT_FP32, SOFTCAP)  # fmt: skip


@triton.jit
def statistics_row(
    LOCAL, READ, BROKEN, START, END, ROW, SUMS, LAYER, n_heads, H, C, t_local, page_size, heavy, pages, super_page,
    super_pages, exact_reads, G: tl.constexpr, BLOCK_C: tl.constexpr, HAS_START: tl.constexpr, HAS_END: tl.constexpr,
    TAIL_READS: tl.constexpr, ADD: tl.constexpr, ALL_DENSE: tl.constexpr,
):  # fmt: skip
    """The step's statistics row ``ROW [5]`` float64 (:func:`~qada.models.statistics.step_counts`): the fraction of
    the ``n_heads = b H`` query heads ``LOCAL`` (``[b, H]`` bool), of the ``b H_kv`` bulks not ``READ``, 1, the
    heads ``BROKEN`` (forced dense) and ``kv_read`` (:func:`~qada.attention.group_policy.kv_read`): per (row, KV
    head) ``2 T`` vectors when its bulk is read, else ``2 min(T, T_local)``, ``T = T_bulk + T_local``, plus with
    ``TAIL_READS`` the tail-aware criterion's reads (:func:`~qada.criteria.tail.exact_set_reads`: ``exact_reads
    (heavy + G min(n_c, pages) P) + bounds``, ``exact_reads`` 2 where local heads attend over ``E`` (its values
    too), else 1; one level (``super_page`` 0): ``n_c = n_p``, ``bounds = 2 n_p``; a hierarchy of ``S = super_page``
    pages per super-page: ``n_c = min(n_p, super_pages S)``, ``bounds = 2 ceil(n_p / S) + 2 n_c``; ``n_p =
    ceil(filled / P)``, ``filled`` the row's end), over ``2 T`` per (row, KV head). Sums of integers in float64:
    exact, as the torch row's. With ``ADD``, the row is also added to ``SUMS [L, 5]`` float64 at the layer index
    ``LAYER`` (int64, the run's statistics sums). With ``ALL_DENSE`` (the ``dense`` criterion's step: ``LOCAL``,
    ``READ`` and ``BROKEN`` not read) a row's heads are local exactly when it has no bulk, its bulks read when it
    has one (:func:`~qada.attention.group_policy.apply_group_policy`), no head forced dense."""
    offs = tl.arange(0, BLOCK_C)
    H_kv = H // G
    n_pairs = n_heads // G
    n_local = tl.zeros([BLOCK_C], dtype=tl.int64)
    n_broken = tl.zeros([BLOCK_C], dtype=tl.int64)
    if not ALL_DENSE:
        for c0 in range(0, n_heads, BLOCK_C):
            idx = c0 + offs
            ok = idx < n_heads
            n_local += tl.load(LOCAL + idx, mask=ok, other=0).to(tl.int64)
            n_broken += tl.load(BROKEN + idx, mask=ok, other=0).to(tl.int64)
    reads = tl.zeros([BLOCK_C], dtype=tl.float64)
    dense = tl.zeros([BLOCK_C], dtype=tl.float64)
    n_read = tl.zeros([BLOCK_C], dtype=tl.int64)
    for r0 in range(0, n_pairs // H_kv, BLOCK_C):
        rows = r0 + offs
        ok = rows < n_pairs // H_kv
        if HAS_START:
            first = tl.load(START + rows, mask=ok, other=0).to(tl.int64)
        else:
            first = tl.zeros([BLOCK_C], dtype=tl.int64)
        if HAS_END:
            last = tl.load(END + rows, mask=ok, other=0).to(tl.int64)
        else:
            last = tl.zeros([BLOCK_C], dtype=tl.int64) + C
        T = (tl.maximum(last - first - t_local, 0) + t_local).to(tl.float64)
        row_read = tl.zeros([BLOCK_C], dtype=tl.int64)
        if ALL_DENSE:
            has_bulk = ok & (last - first - t_local > 0)
            row_read += tl.where(has_bulk, H_kv, 0)
            n_local += tl.where(ok & (has_bulk == 0), H, 0)
        else:
            for h in range(0, H_kv):
                row_read += tl.load(READ + rows.to(tl.int64) * H_kv + h, mask=ok, other=0).to(tl.int64)
        extra = tl.zeros([BLOCK_C], dtype=tl.float64)
        if TAIL_READS:
            n_pages = ((last + page_size - 1) // page_size).to(tl.float64)
            candidates = n_pages
            bounds = 2 * n_pages
            if super_page > 0:
                candidates = tl.minimum(n_pages, super_pages * super_page + 0.0)  # (+ 0.0: a float, constant or not)
                bounds = 2 * ((last + page_size * super_page - 1) // (page_size * super_page)).to(tl.float64) \
                    + 2 * candidates
            extra = (heavy + G * tl.minimum(candidates, pages) * page_size) * exact_reads + bounds
        row_reads = (row_read.to(tl.float64) * (2 * T) + (H_kv - row_read).to(tl.float64) * (2 * tl.minimum(T, t_local))
                     + H_kv * extra)  # fmt: skip
        reads += tl.where(ok, row_reads, 0.0)
        dense += tl.where(ok, 2 * T * H_kv, 0.0)
        n_read += row_read
    offs_v = tl.arange(0, 8)  # the row's five values, as one vector
    value = tl.where(offs_v == 0, tl.sum(n_local, axis=0).to(tl.float64) / n_heads, 0.0)
    value = tl.where(offs_v == 1, (n_pairs - tl.sum(n_read, axis=0)).to(tl.float64) / n_pairs, value)
    value = tl.where(offs_v == 2, 1.0, value)
    value = tl.where(offs_v == 3, tl.sum(n_broken, axis=0).to(tl.float64), value)
    value = tl.where(offs_v == 4, tl.sum(reads, axis=0) / tl.maximum(tl.sum(dense, axis=0), 1.0), value)
    v_ok = offs_v < 5
    tl.store(ROW + offs_v, value, mask=v_ok)
    if ADD:  # one program, one launch per layer and step, launches in stream order: no other writer
        at = SUMS + tl.load(LAYER).to(tl.int64) * 5 + offs_v
        tl.store(at, tl.load(at, mask=v_ok, other=0.0) + value, mask=v_ok)


@triton.jit
def qada_decode_combine_kernel(
    ACC, M, L, COUNTS, OUT, BULK_BLOCKS, SINKS,
    LOCAL, READ, BROKEN, START, END, ROW, SUMS, LAYER, EXTRA_M, EXTRA_L, EXTRA_ACC, EXTRA_LOCAL,
    stride_ob, stride_oh, stride_od,
    H, num_splits, num_counts, C, t_local, page_size, heavy, pages, super_page, super_pages, exact_reads,
    G: tl.constexpr, D: tl.constexpr,
    BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_SINKS: tl.constexpr, STATS: tl.constexpr, HAS_START: tl.constexpr, HAS_END: tl.constexpr,
    TAIL_READS: tl.constexpr, ADD: tl.constexpr, EXTRA: tl.constexpr, PDL: tl.constexpr,
    ALL_DENSE: tl.constexpr,
):  # fmt: skip
    """Programs ``0 .. b*H-1``: one (row, query head) each, merge its splits by log-sum-exp into ``OUT [b, H, 1,
    d]`` (the query dtype; a split with ``m = -inf`` weighs 0 and a head with nothing attended gets 0). Program
    ``b*H``: sum the bulk-only block counts ``COUNTS[:, 0]`` into the 0-d int64 ``BULK_BLOCKS``; with ``STATS``,
    also the step's statistics row (:func:`statistics_row`, added to ``SUMS[LAYER]`` with ``ADD``; with
    ``ALL_DENSE`` the ``dense`` criterion's, ``LOCAL``, ``READ`` and ``BROKEN`` not read). With ``EXTRA``
    a head that ``EXTRA_LOCAL [b, H]`` (bool) marks local also attends over its extra set, whose attention is one
    more split: ``EXTRA_M, EXTRA_L [b, H]`` and ``EXTRA_ACC [b, H, d]`` float32 (contiguous, log2 domain, as a
    split's; :func:`~qada.functional.extra_set.merge_extra`'s merge by masses). With ``PDL`` (launched as a
    programmatic dependent launch after the split launch) it first waits for the splits."""
    combine_program(ACC, M, L, COUNTS, OUT, BULK_BLOCKS, SINKS, LOCAL, READ, BROKEN, START, END, ROW, SUMS, LAYER,
                    EXTRA_M, EXTRA_L, EXTRA_ACC, EXTRA_LOCAL, stride_ob, stride_oh, stride_od, H, num_splits,
                    num_counts, C, t_local, page_size, heavy, pages, super_page, super_pages, exact_reads,
                    tl.program_id(0), tl.num_programs(0) - 1, G, D, BLOCK_S, CHUNK_S, BLOCK_D, BLOCK_C, HAS_SINKS,
                    STATS, HAS_START, HAS_END, TAIL_READS, ADD, EXTRA, PDL, ALL_DENSE)  # fmt: skip


@triton.jit
def combine_program(
    ACC, M, L, COUNTS, OUT, BULK_BLOCKS, SINKS,
    LOCAL, READ, BROKEN, START, END, ROW, SUMS, LAYER, EXTRA_M, EXTRA_L, EXTRA_ACC, EXTRA_LOCAL,
    stride_ob, stride_oh, stride_od,
    H, num_splits, num_counts, C, t_local, page_size, heavy, pages, super_page, super_pages, exact_reads, pid, n_heads,
    G: tl.constexpr, D: tl.constexpr,
    BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_SINKS: tl.constexpr, STATS: tl.constexpr, HAS_START: tl.constexpr, HAS_END: tl.constexpr,
    TAIL_READS: tl.constexpr, ADD: tl.constexpr, EXTRA: tl.constexpr, PDL: tl.constexpr,
    ALL_DENSE: tl.constexpr,
):  # fmt: skip
    """Program ``pid`` of :func:`qada_decode_combine_kernel` (same arguments), whose ``n_heads = b H`` programs merge
    a query head's splits each and whose program ``n_heads`` counts the bulk blocks and writes the statistics row: for
    that launch, or a launch that carries other programs besides (:mod:`qada.attention._ahead_kernel`)."""
    wait_for_previous(PDL)
    if pid == n_heads:
        # (names differ from the other branch's: Triton requires one type per name across both branches)
        offs_count = tl.arange(0, BLOCK_C)
        n_blocks = tl.zeros([BLOCK_C], dtype=tl.int64)
        for c0 in range(0, num_counts, BLOCK_C):
            idx = c0 + offs_count
            n_blocks += tl.load(COUNTS + idx.to(tl.int64) * 2, mask=idx < num_counts, other=0).to(tl.int64)
        tl.store(BULK_BLOCKS, tl.sum(n_blocks, axis=0))
        if STATS:
            statistics_row(LOCAL, READ, BROKEN, START, END, ROW, SUMS, LAYER, n_heads, H, C, t_local, page_size,
                           heavy, pages, super_page, super_pages, exact_reads, G, BLOCK_C, HAS_START, HAS_END,
                           TAIL_READS, ADD, ALL_DENSE)
    else:
        row = pid // H
        head = pid % H
        base = (row.to(tl.int64) * (H // G) + head // G) * num_splits  # first (pair, split) slot of the head
        g = head % G
        offs_s = tl.arange(0, BLOCK_S)
        s_ok = offs_s < num_splits
        m = tl.load(M + (base + offs_s) * G + g, mask=s_ok, other=float("-inf"))
        m_max = tl.max(m, axis=0)
        if HAS_SINKS:
            sink = tl.load(SINKS + head).to(tl.float32) * 1.4426950408889634  # log2 domain
            m_max = tl.maximum(m_max, sink)
        if EXTRA:  # a local head's extra set: one more split (a dense head's bulk holds it already)
            m_extra = tl.where(tl.load(EXTRA_LOCAL + pid) != 0, tl.load(EXTRA_M + pid), float("-inf"))
            m_max = tl.maximum(m_max, m_extra)
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        offs_c = tl.arange(0, CHUNK_S)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        numerator = tl.zeros([BLOCK_D], dtype=tl.float32)
        denominator = tl.zeros([CHUNK_S], dtype=tl.float32)
        for s0 in range(0, num_splits, CHUNK_S):
            split = s0 + offs_c
            c_ok = split < num_splits
            slot = (base + split) * G + g
            m_c = tl.load(M + slot, mask=c_ok, other=float("-inf"))
            l_c = tl.load(L + slot, mask=c_ok, other=0.0)
            weight = tl.where(m_c == float("-inf"), 0.0, tl.math.exp2(m_c - m_safe))  # empty split: 0
            denominator += weight * l_c
            acc = tl.load(ACC + slot[:, None] * D + offs_d[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0)
            numerator += tl.sum(weight[:, None] * acc, axis=0)
        total = tl.sum(denominator, axis=0)
        if HAS_SINKS:
            total += tl.math.exp2(sink - m_safe)
        if EXTRA:
            weight_extra = tl.where(m_extra == float("-inf"), 0.0, tl.math.exp2(m_extra - m_safe))
            total += weight_extra * tl.load(EXTRA_L + pid)
            numerator += weight_extra * tl.load(EXTRA_ACC + pid.to(tl.int64) * D + offs_d, mask=d_ok, other=0.0)
        result = numerator / tl.where(total > 0, total, 1.0)
        tl.store(OUT + row.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh + offs_d * stride_od,
                 result.to(OUT.dtype.element_ty), mask=d_ok)  # fmt: skip
