"""The fused split-K decode kernel of the ``triton`` executor. Imported lazily: importing it imports triton.

``INTERPRETED`` records whether the kernel was decorated for Triton's interpreter (``TRITON_INTERPRET=1`` when
this module was first imported); that cannot change afterwards.
"""

from __future__ import annotations

import triton
import triton.language as tl

try:
    INTERPRETED = bool(triton.knobs.runtime.interpret)
except AttributeError:  # older triton without knobs
    import os

    INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def qada_decode_split_kernel(
    Q, K, V, LOCAL, START, ACC, M, L, BULK_BLOCKS,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    T, H_KV, t_sink, t_recent, blocks_per_split, num_splits, scale,
    G: tl.constexpr, D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """One program = one (row, KV head) and one split of its KV blocks, for all ``G`` query heads of the group.

    Writes the split's unnormalised ``acc [BLOCK_G, BLOCK_D]``, running max ``m`` and sum ``l`` (float32) and
    the number of blocks it loaded only for the bulk. Blocks with no window token are skipped unless some head
    of the group is dense; an empty split writes ``m = -inf, l = 0, acc = 0``. ``DOT_FP32`` upcasts the
    inputs of both dots to float32 (used for bfloat16 under the interpreter, whose bfloat16 ``tl.dot`` is wrong).
    """
    pid = tl.program_id(0)
    split = tl.program_id(1)
    row = pid // H_KV
    kv_head = pid % H_KV
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < G
    d_ok = offs_d < D
    heads = kv_head * G + offs_g

    row64 = row.to(tl.int64)
    kv64 = kv_head.to(tl.int64)
    q_ptrs = Q + row64 * stride_qb + heads[:, None].to(tl.int64) * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    is_local = tl.load(LOCAL + row64 * (H_KV * G) + heads, mask=g_ok, other=1)
    dense = (is_local == 0) & g_ok  # [BLOCK_G]
    read_bulk = tl.max(dense.to(tl.int32), axis=0) > 0

    first = tl.load(START + row)
    sink_end = tl.minimum(first + t_sink, T)
    bulk_end = tl.maximum(T - t_recent, sink_end)  # bulk = [sink_end, bulk_end)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    n_bulk = tl.full([], 0, dtype=tl.int32)

    num_blocks = tl.cdiv(T, BLOCK_N)
    blk_begin = split * blocks_per_split
    blk_end = tl.minimum(blk_begin + blocks_per_split, num_blocks)
    k_base = K + row64 * stride_kb + kv64 * stride_kh
    v_base = V + row64 * stride_vb + kv64 * stride_vh
    for blk in range(blk_begin, blk_end):
        lo = blk * BLOCK_N
        hi = lo + BLOCK_N
        in_sinks = (lo < sink_end) & (hi > first) & (first < sink_end)
        has_window = in_sinks | ((hi > bulk_end) & (bulk_end < T))
        has_bulk = (lo < bulk_end) & (hi > sink_end)
        if has_window | (read_bulk & has_bulk):
            offs = lo + offs_n
            n_ok = offs < T
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + offs[:, None].to(tl.int64) * stride_kt + offs_d[None, :] * stride_kd,
                        mask=kv_mask, other=0.0)  # fmt: skip
            if DOT_FP32:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale  # [BLOCK_G, BLOCK_N]
            real = (offs >= first) & n_ok
            in_bulk = (offs >= sink_end) & (offs < bulk_end)
            allowed = real[None, :] & ((in_bulk == 0)[None, :] | dense[:, None])
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no -inf - -inf
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + offs[:, None].to(tl.int64) * stride_vt + offs_d[None, :] * stride_vd,
                        mask=kv_mask, other=0.0)  # fmt: skip
            if DOT_FP32:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
            m_i = m_new
            n_bulk += tl.where(has_window, 0, 1)

    out = (pid.to(tl.int64) * num_splits + split) * BLOCK_G
    tl.store(ACC + (out + offs_g[:, None]) * BLOCK_D + offs_d[None, :], acc)
    tl.store(M + out + offs_g, m_i)
    tl.store(L + out + offs_g, l_i)
    tl.store(BULK_BLOCKS + pid * num_splits + split, n_bulk)
