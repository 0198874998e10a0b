"""What every kernel that decides a KV group's heads does after its rule: the group policy and the decision's stores.
Imported lazily: importing it imports triton. The threshold rule (:func:`~qada.attention._fused_kernel.
threshold_decision`) and the budget rule (:func:`~qada.attention._budget_rank.budget_group_decision`) both end here;
where a launch of one program per query head decided the heads apart (a ``qada_tail`` decision launched apart, its
``HEADS_APART``), the ``triton`` split launch applies the group policy to them (:func:`policy_of_heads`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def group_policy(decided, g_ok, PROMOTE: tl.constexpr):
    """The group policy on one group's ``decided [BLOCK_G]`` heads (where ``g_ok``): ``(local, dense [BLOCK_G],
    read)``. The group reads its bulk when one of its heads is dense (``read``, 0-d); with ``PROMOTE`` every head of
    such a group is dense (:func:`~qada.attention.apply_group_policy`)."""
    dense = (decided == 0) & g_ok
    read = tl.max(dense.to(tl.int32), axis=0) > 0  # some head of the group attends over the bulk
    local = decided
    if PROMOTE:
        local = decided & (read == 0)
        dense = (local == 0) & g_ok
    return local, dense, read


@triton.jit
def store_decision(DECIDED, LOCAL, BROKEN, READ, row64, kv64, heads, g_ok, H_KV, G: tl.constexpr, decided, local,
                   broken, read):  # fmt: skip
    """Store a (row, KV head)'s decision: ``decided, local, broken [BLOCK_G]`` at ``DECIDED, LOCAL, BROKEN [b, H]``
    and ``read`` (0-d) at ``READ [b, H_kv]``, bool (bytes 0/1). Returns nothing: a store address computed from a call's
    result would make torch.compile's write analysis take every input of the call as written."""
    out = row64 * (H_KV * G) + heads.to(tl.int64)
    tl.store(DECIDED + out, decided.to(tl.uint8), mask=g_ok)
    tl.store(LOCAL + out, local.to(tl.uint8), mask=g_ok)
    tl.store(BROKEN + out, broken.to(tl.uint8), mask=g_ok)
    tl.store(READ + row64 * H_KV + kv64, read.to(tl.uint8))


@triton.jit
def policy_of_heads(DECIDED, LOCAL, READ, row64, kv64, split, H_KV, G: tl.constexpr, BLOCK_G: tl.constexpr,
                    PROMOTE: tl.constexpr):  # fmt: skip
    """The group policy on a (row, KV head)'s heads as a launch of one program per query head decided them apart:
    reads their ``DECIDED [b, H]`` (bool, contiguous; every head of a row without a bulk decided local) and returns
    ``dense [BLOCK_G]``, the heads that attend over the bulk; split 0 (``split == 0``) stores the group's ``LOCAL [b,
    H]`` heads (contiguous) and its ``READ [b, H_kv]`` entry (bool, as bytes 0/1). Stores addressed from the
    arguments only (see :func:`store_decision`)."""
    offs_g = tl.arange(0, BLOCK_G)
    g_ok = offs_g < G
    out = row64 * (H_KV * G) + kv64 * G + offs_g
    decided = (tl.load(DECIDED + out, mask=g_ok, other=0) != 0) & g_ok
    local, dense, read = group_policy(decided, g_ok, PROMOTE)
    if split == 0:
        tl.store(LOCAL + out, local.to(tl.uint8), mask=g_ok)
        tl.store(READ + row64 * H_KV + kv64, read.to(tl.uint8))
    return dense
