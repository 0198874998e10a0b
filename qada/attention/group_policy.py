"""GQA group policies: which query heads really attend locally once it is known which KV groups read the bulk.

A KV head's bulk can be skipped only when *all* query heads of its group are local. ``exact`` keeps a local
head local even when its group's bulk is read (the paper's semantics); ``promote`` gives such a head full
attention, which costs no extra KV bytes. Rows without a bulk (at most ``T_local`` real tokens) are local
for every head and never read a bulk: the window is the whole row, so both computations agree.
"""

from __future__ import annotations

import torch

from qada.functional.checks import group_size

__all__ = ["GROUP_POLICIES", "apply_group_policy", "check_group_policy", "head_sparsity", "kv_sparsity"]

GROUP_POLICIES = ("exact", "promote")


def check_group_policy(policy: str) -> None:
    """Raise ``ValueError`` unless ``policy`` is one of :data:`GROUP_POLICIES`."""
    if policy not in GROUP_POLICIES:
        raise ValueError(f"expected group_policy in {GROUP_POLICIES} but got {policy!r}")


def apply_group_policy(
    local: torch.Tensor, has_bulk: torch.Tensor, num_kv_heads: int, policy: str = "exact"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Effective local mask and bulk reads.

    Args:
        local: ``[b, H]`` bool, the criterion's decision (True = local).
        has_bulk: ``[b]`` bool, False for rows with at most ``T_local`` real tokens.
        num_kv_heads: ``H_kv``; query heads ``g*G .. g*G+G-1`` share KV head ``g``.
        policy: ``"exact"`` or ``"promote"``.

    Returns:
        ``(local [b, H], read [b, H_kv])``: the effective local mask (rows without a bulk are all local;
        with ``promote`` every head of a read group is dense) and whether each KV head's bulk is read.
    """
    check_group_policy(policy)
    b, H = local.shape
    G = group_size(H, num_kv_heads)
    local = local | ~has_bulk.to(device=local.device, dtype=torch.bool)[:, None]
    read = (~local).view(b, num_kv_heads, G).any(dim=-1)
    if policy == "promote":
        local = local & ~read.repeat_interleave(G, dim=1)
    return local, read


def head_sparsity(local: torch.Tensor) -> torch.Tensor:
    """0-d float32 tensor: fraction of query heads computed locally (``local [b, H]``)."""
    return local.float().mean()


def kv_sparsity(read: torch.Tensor) -> torch.Tensor:
    """0-d float32 tensor: fraction of (batch, KV head) bulk reads skipped (``read [b, H_kv]``)."""
    return (~read).float().mean()
