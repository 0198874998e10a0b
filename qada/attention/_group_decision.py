"""What every kernel that decides a KV group's heads does after its rule: the group policy and the decision's stores.
Imported lazily: importing it imports triton. The threshold rule (:func:`~qada.attention._fused_kernel.
threshold_decision`) and the budget rule (:func:`~qada.attention._budget_rank.budget_group_decision`) both end here.
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
