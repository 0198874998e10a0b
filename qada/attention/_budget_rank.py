"""The budget rule of ``qada_budget`` and ``qada_tail_budget`` inside the ``triton`` split kernel (its ``RANK``
mode): each program ranks its row's heads (or KV groups) by score and keeps what its own KV group's heads decide, so
that no launch of its own ranks them; the group policy and the stores are the threshold rule's
(:mod:`qada.attention._group_decision`). Imported lazily: importing it imports triton.

The rule is :meth:`~qada.criteria.BudgetedQAdACriterion.decide`'s: per row the ``k`` best-scored heads (with
``PER_GROUP`` the ``k`` best KV groups, a group's score its heads' minimum, ``-inf`` where one of them is not finite)
are local; a head with a non-finite score is never local and, where the row has a bulk, is counted as forced dense;
ties go to the lower index (a stable descending sort); a row without a bulk is all local. Then the group policy:
a group reads its bulk where one of its heads is dense (``PROMOTE``: its local heads then attend over it too).

A row has at most a few dozen heads: each program ranks all of them again (``BLOCK_H x BLOCK_H`` comparisons), which
costs less than the launch and the dependent wait it replaces.
"""

from __future__ import annotations

import triton
import triton.language as tl

from qada.attention._group_decision import group_policy, store_decision


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
def budget_group_decision(
    SCORE, COUNT, DECIDED, LOCAL, BROKEN, READ, row, kv_head, split, has_bulk, H_KV,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, PER_GROUP: tl.constexpr,
    PROMOTE: tl.constexpr,
):  # fmt: skip
    """The budget decision of one KV group (module docstring): ranks row ``row``'s ``H = H_KV G`` heads of ``SCORE
    [b, H]`` float32 (contiguous; ``BLOCK_H >= H``, ``BLOCK_KV >= H_KV``) with the layer's 0-d int64 ``COUNT``
    (``k``) and returns ``dense [BLOCK_G]``, the group's heads that attend over the bulk after the group policy.
    Split 0 (``split == 0``) stores the group's heads' ``DECIDED, LOCAL, BROKEN [b, H]`` and its ``READ [b, H_kv]``
    entry (bool, as bytes 0/1)."""
    H = H_KV * G
    count = tl.load(COUNT).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    h_ok = heads < H
    row64 = row.to(tl.int64)
    score = tl.load(SCORE + row64 * H + heads, mask=h_ok, other=float("-inf"))
    finite = (score == score) & (tl.abs(score) < float("inf")) & h_ok
    ranked = tl.where(finite, score, float("-inf"))
    if PER_GROUP:
        groups = tl.arange(0, BLOCK_KV)
        member = ((heads[None, :] // G) == groups[:, None]) & h_ok[None, :]  # [BLOCK_KV, BLOCK_H]
        group_min = tl.min(tl.where(member, ranked[None, :], float("inf")), axis=1)
        group_finite = tl.min(tl.where(member, finite.to(tl.int32)[None, :], 1), axis=1) > 0
        group_score = tl.where(group_finite, group_min, float("-inf"))
        local_group = (ranks(group_score, groups < H_KV, BLOCK_KV) < count) & group_finite & (groups < H_KV)
        chosen = tl.max(tl.where(member, local_group.to(tl.int32)[:, None], 0), axis=0) > 0
    else:
        chosen = (ranks(ranked, h_ok, BLOCK_H) < count) & finite
    offs_g = tl.arange(0, BLOCK_G)
    g_ok = offs_g < G
    mine = kv_head * G + offs_g
    pick = heads[None, :] == mine[:, None]  # [BLOCK_G, BLOCK_H]: the group's heads among the row's
    chosen_g = tl.max(tl.where(pick, chosen.to(tl.int32)[None, :], 0), axis=1) > 0
    finite_g = tl.max(tl.where(pick, finite.to(tl.int32)[None, :], 0), axis=1) > 0
    decided = (chosen_g | (has_bulk == 0)) & g_ok
    broken = (finite_g == 0) & has_bulk & g_ok
    local, dense, read = group_policy(decided, g_ok, PROMOTE)
    if split == 0:
        store_decision(DECIDED, LOCAL, BROKEN, READ, row64, kv_head.to(tl.int64), mine, g_ok, H_KV, G, decided,
                       local, broken, read)  # fmt: skip
    return dense
