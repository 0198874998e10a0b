"""The budget rule of the ``triton_fused`` executor's ``qada_tail_budget`` step: per row, the ``k`` best-scored heads
(or KV groups) are local, one program per row. Imported lazily: importing it imports triton.

It reads the heads' scores (``log A_local - log Â_bulk``, written by the ``qada_tail`` kernel in its score mode)
and writes the decision and the group policy as the split kernels do, so that the ``triton`` executor's split and
combine launches follow on it. The rule is :meth:`~qada.criteria.BudgetedQAdACriterion.decide`'s: a head (a group)
with a non-finite score is never local and, where the row has a bulk, is counted as forced dense; the others rank
by score, ties to the lower index (a stable descending sort); a row without a bulk is all local.
"""

from __future__ import annotations

import triton
import triton.language as tl

from qada.attention._triton_kernel import row_range


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
