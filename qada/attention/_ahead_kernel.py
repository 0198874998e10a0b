"""The combine launch that also steps the moments for the next decode step: the ``triton_fused`` executor's layer
step with ``estimate_in_splits`` on the built-in ``current`` and ``stored`` sources. Imported lazily: importing it
imports triton.

Each split computes its heads' ``log E[exp(s)]`` from the float32 moments of the step
(:func:`~qada.attention._fused_kernel.qada_fused_split_kernel`'s ``ESTIMATE``), so the moments must be the step's
before its split launch; nothing reads them after it. The moment step of decode step ``t + 1`` (its key entered the
cache ``T_recent`` steps before, and every row grows by one key a step) then runs in step ``t``'s combine launch, as
programs of their own beside the combine's: grid ``(max(b H + 1, b H_kv), 1 + block pairs)``, program ``(p, 0)`` the
combine's program ``p`` (:func:`~qada.attention._triton_kernel.combine_program`), program ``(p, 1 + k)`` block pair
``k`` of (row, KV head) ``p``'s moment step (:func:`~qada.attention._moment_kernel.current_moment_program` /
:func:`~qada.attention._moment_kernel.stored_moment_program`, for rows one key longer; no estimate), the rest idle.
A layer's decode step is then two launches, the split and this one, as the dense path's. With ``PDL`` the moment
programs, too, wait for the split launch (whose programs read the moments they overwrite).
"""

from __future__ import annotations

import triton
import triton.language as tl

from qada.attention._moment_kernel import current_moment_program, stored_moment_program
from qada.attention._triton_kernel import combine_program, wait_for_previous


@triton.jit
def combine_and_current_step_kernel(
    ACC, M, L, COUNTS, OUT, BULK_BLOCKS, SINKS,
    LOCAL, READ, BROKEN, START, END, ROW, SUMS, LAYER, EXTRA_M, EXTRA_L, EXTRA_ACC, EXTRA_LOCAL,
    stride_ob, stride_oh, stride_od,
    H, num_splits, num_counts, C, t_local, page_size, heavy, pages, super_page, super_pages, exact_reads, n_heads,
    MS_COUNT, MS_MEAN, MS_M2, MS_OUT_MEAN, MS_OUT_COV, MS_KEYS, MS_START, MS_END, MS_ARRIVED,
    ms_H_kv, ms_t_local, ms_t_recent, ms_stride_kb, ms_stride_kh, ms_stride_kt, ms_stride_kd, ms_stride_start,
    ms_stride_end, ms_pairs,
    G: tl.constexpr, D: tl.constexpr,
    BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_SINKS: tl.constexpr, STATS: tl.constexpr, HAS_START: tl.constexpr, HAS_END: tl.constexpr,
    TAIL_READS: tl.constexpr, ADD: tl.constexpr, EXTRA: tl.constexpr, PDL: tl.constexpr,
    ALL_DENSE: tl.constexpr,
    MS_D: tl.constexpr, MS_BLOCK_T: tl.constexpr, MS_BLOCK_D: tl.constexpr, MS_HAS_START: tl.constexpr,
):  # fmt: skip
    """:func:`~qada.attention._triton_kernel.qada_decode_combine_kernel` (the arguments before ``n_heads = b H``, its
    programs) and the ``current`` source's moment step for rows one key longer than ``MS_END`` (the ``MS_`` arguments
    as :func:`~qada.attention._moment_kernel.current_moment_step_kernel` takes them, without an estimate;
    ``ms_pairs = b H_kv``): module docstring."""
    p = tl.program_id(0)
    column = tl.program_id(1)
    if column == 0:
        if p <= n_heads:
            combine_program(ACC, M, L, COUNTS, OUT, BULK_BLOCKS, SINKS, LOCAL, READ, BROKEN, START, END, ROW, SUMS,
                            LAYER, EXTRA_M, EXTRA_L, EXTRA_ACC, EXTRA_LOCAL, stride_ob, stride_oh, stride_od, H,
                            num_splits, num_counts, C, t_local, page_size, heavy, pages, super_page, super_pages,
                            exact_reads, p, n_heads, G, D, BLOCK_S, CHUNK_S, BLOCK_D, BLOCK_C, HAS_SINKS, STATS,
                            HAS_START, HAS_END, TAIL_READS, ADD, EXTRA, PDL, ALL_DENSE)  # fmt: skip
    elif p < ms_pairs:
        wait_for_previous(PDL)  # the splits have read the moments this program overwrites
        current_moment_program(MS_COUNT, MS_MEAN, MS_M2, MS_OUT_MEAN, MS_OUT_COV, MS_KEYS, MS_START, MS_END,
                               MS_COUNT, MS_COUNT, MS_COUNT, MS_COUNT, MS_COUNT, MS_COUNT, MS_COUNT, MS_COUNT,
                               MS_COUNT, MS_ARRIVED, MS_COUNT, ms_H_kv, ms_t_local, ms_t_recent, ms_stride_kb,
                               ms_stride_kh, ms_stride_kt, ms_stride_kd, ms_stride_start, ms_stride_end, 0, 0, 0, 1.0,
                               1.0, 1, 1, 0, 0.0, p, column - 1, 1, MS_D, MS_BLOCK_T, MS_BLOCK_D, MS_HAS_START, False,
                               1, 16, 16, 16, False, False, 16, False, False, False, None, False,
                               True)  # fmt: skip


@triton.jit
def combine_and_stored_step_kernel(
    ACC, M, L, COUNTS, OUT, BULK_BLOCKS, SINKS,
    LOCAL, READ, BROKEN, START, END, ROW, SUMS, LAYER, EXTRA_M, EXTRA_L, EXTRA_ACC, EXTRA_LOCAL,
    stride_ob, stride_oh, stride_od,
    H, num_splits, num_counts, C, t_local, page_size, heavy, pages, super_page, super_pages, exact_reads, n_heads,
    MS_COUNT, MS_S1, MS_S2, MS_OLD_END, MS_JUMP_N, MS_JUMP_COUNT, MS_JUMP_S1, MS_JUMP_S2, MS_MEAN, MS_COV, MS_REF,
    MS_SHIFT, MS_START, MS_END, MS_ARRIVED,
    ms_H_kv, ms_N, ms_num_jumps, ms_t_local, ms_offset, ms_first, ms_min_bulk_keys, ms_stride_rh, ms_stride_rn,
    ms_stride_rd, ms_stride_start, ms_stride_end, ms_pairs,
    G: tl.constexpr, D: tl.constexpr,
    BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_SINKS: tl.constexpr, STATS: tl.constexpr, HAS_START: tl.constexpr, HAS_END: tl.constexpr,
    TAIL_READS: tl.constexpr, ADD: tl.constexpr, EXTRA: tl.constexpr, PDL: tl.constexpr,
    ALL_DENSE: tl.constexpr,
    MS_D: tl.constexpr, MS_BLOCK_T: tl.constexpr, MS_BLOCK_D: tl.constexpr, MS_HAS_START: tl.constexpr,
):  # fmt: skip
    """:func:`combine_and_current_step_kernel` with the ``stored`` source's moment step (the ``MS_`` arguments as
    :func:`~qada.attention._moment_kernel.stored_moment_step_kernel` takes them, without an estimate) for rows one
    key longer than ``MS_END - MS_START``."""
    p = tl.program_id(0)
    column = tl.program_id(1)
    if column == 0:
        if p <= n_heads:
            combine_program(ACC, M, L, COUNTS, OUT, BULK_BLOCKS, SINKS, LOCAL, READ, BROKEN, START, END, ROW, SUMS,
                            LAYER, EXTRA_M, EXTRA_L, EXTRA_ACC, EXTRA_LOCAL, stride_ob, stride_oh, stride_od, H,
                            num_splits, num_counts, C, t_local, page_size, heavy, pages, super_page, super_pages,
                            exact_reads, p, n_heads, G, D, BLOCK_S, CHUNK_S, BLOCK_D, BLOCK_C, HAS_SINKS, STATS,
                            HAS_START, HAS_END, TAIL_READS, ADD, EXTRA, PDL, ALL_DENSE)  # fmt: skip
    elif p < ms_pairs:
        wait_for_previous(PDL)  # the splits have read the moments this program overwrites
        stored_moment_program(MS_COUNT, MS_S1, MS_S2, MS_OLD_END, MS_JUMP_N, MS_JUMP_COUNT, MS_JUMP_S1, MS_JUMP_S2,
                              MS_MEAN, MS_COV, MS_REF, MS_SHIFT, MS_START, MS_END, MS_COUNT, MS_COUNT, MS_COUNT,
                              MS_COUNT, MS_COUNT, MS_COUNT, MS_COUNT, MS_COUNT, MS_COUNT, MS_COUNT, MS_ARRIVED,
                              MS_COUNT, ms_H_kv, ms_N, ms_num_jumps, ms_t_local, ms_offset, ms_first,
                              ms_min_bulk_keys, ms_stride_rh, ms_stride_rn, ms_stride_rd, ms_stride_start,
                              ms_stride_end, 0, 0, 0, 0, 0, 0, 0, 1.0, 1.0, 1, 1, 0, 0.0, p, column - 1, 1, MS_D,
                              MS_BLOCK_T, MS_BLOCK_D, MS_HAS_START, False, 1, 16, 16, 16, False, False, 16, False,
                              False, False, None, False, True)  # fmt: skip
