"""Static head masks from recorded oracle frequencies (paper App. A)."""

from __future__ import annotations

import math

import torch

from qada.functional.decisions import check_threshold

__all__ = ["calibrate_static_mask", "static_local_count"]


def static_local_count(alpha: float, num_layers: int, num_heads: int) -> int:
    """``round(alpha * L * H)`` with halves rounded up: how many heads the static criterion makes local."""
    check_threshold("alpha", alpha)
    return int(math.floor(alpha * num_layers * num_heads + 0.5))


def calibrate_static_mask(local_frequency: torch.Tensor, alpha: float) -> torch.Tensor:
    """The ``round(alpha * L * H)`` most frequently local heads of all layers, ranked together.

    Args:
        local_frequency: ``[L, H]`` fraction of decode steps in which the oracle (at ``tau_static``) labelled
            each head local.
        alpha: target fraction of local heads in ``[0, 1]``.

    Returns:
        ``[L, H]`` bool mask, True = permanently local. Ties are broken by ``(layer, head)`` order.
    """
    if local_frequency.ndim != 2:
        raise ValueError(
            f"expected local_frequency of shape [layers, heads] but got {tuple(local_frequency.shape)}"
        )
    if not torch.isfinite(local_frequency).all():
        raise ValueError("expected finite local frequencies but got NaN or inf")
    L, H = local_frequency.shape
    count = static_local_count(alpha, L, H)
    order = torch.sort(local_frequency.flatten().double(), descending=True, stable=True).indices
    mask = torch.zeros(L * H, dtype=torch.bool, device=local_frequency.device)
    mask[order[:count]] = True
    return mask.view(L, H)
