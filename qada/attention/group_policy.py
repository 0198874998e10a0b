"""GQA group policies: which query heads really attend locally once it is known which KV groups read the bulk.

A KV head's bulk can be skipped only when *all* query heads of its group are local. ``exact`` keeps a local
head local even when its group's bulk is read (the paper's semantics); ``promote`` gives such a head full
attention, which costs no extra KV bytes. Rows without a bulk (at most ``T_local`` real tokens) are local
for every head and never read a bulk: the window is the whole row, so both computations agree.
"""

from __future__ import annotations

import torch

from qada.functional.checks import group_size

__all__ = ["GROUP_POLICIES", "apply_group_policy", "check_group_policy", "head_sparsity", "kv_read", "kv_sparsity"]

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


def kv_read(read: torch.Tensor, length: torch.Tensor, t_local: int, extra: torch.Tensor | None = None) -> torch.Tensor:
    """0-d float64 tensor: the K/V a step reads as a fraction of what dense attention reads.

    Per (row, KV head): ``2 T`` vectors (keys and values of the row's ``T`` real tokens) when its bulk is read, else
    ``2 min(T, T_local)`` (the window), plus ``extra [b]`` vectors the criterion reads besides (e.g. the exact set's
    keys and the page extrema of the tail-aware criteria, :meth:`~qada.criteria.HeadCriterion.extra_reads`);
    summed over rows and heads and divided by ``2 T`` summed likewise.

    Args:
        read: ``[b, H_kv]`` bool, the bulks read; ``length``: ``[b]`` real tokens per row.
    """
    T = length.to(torch.float64)[:, None]  # [b, 1]
    reads = torch.where(read, 2 * T, 2 * T.clamp(max=t_local))
    if extra is not None:
        reads = reads + extra.to(torch.float64)[:, None]
    return reads.sum() / (2 * T * read.shape[1]).sum().clamp(min=1.0)
