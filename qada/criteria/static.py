"""The static criterion (paper App. A): a fixed ``[layers, heads]`` mask of permanently local heads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qada.criteria.base import HeadCriterion, register_criterion
from qada.criteria.context import StepContext
from qada.functional import calibrate_static_mask

__all__ = ["StaticCriterion"]


@register_criterion("static")
@dataclass
class StaticCriterion(HeadCriterion):
    """Heads marked True in ``mask[layer]`` are local at every step, the others dense.

    Args:
        mask: ``[L, H]`` bool tensor or nested lists of bools (True = local).
    """

    mask: Any

    def __post_init__(self) -> None:
        mask = torch.as_tensor(self.mask)
        if mask.ndim != 2:
            raise ValueError(f"expected a static mask of shape [layers, heads] but got shape {tuple(mask.shape)}")
        if mask.dtype != torch.bool:
            if not ((mask == 0) | (mask == 1)).all():
                raise ValueError("expected a static mask of booleans (or 0/1) but got other values")
            mask = mask.bool()
        self.mask = mask
        self._on_device: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def from_frequency(cls, local_frequency: torch.Tensor, alpha: float) -> StaticCriterion:
        """Calibrate from ``[L, H]`` oracle local frequencies: the ``round(alpha L H)`` most local heads."""
        return cls(calibrate_static_mask(local_frequency, alpha))

    @property
    def sparsity(self) -> float:
        """Fraction of heads that are local."""
        return float(self.mask.float().mean())

    def decide(self, ctx: StepContext) -> torch.Tensor:
        L, H = self.mask.shape
        if not 0 <= ctx.layer < L or ctx.num_heads != H:
            raise ValueError(
                f"static mask of shape [{L}, {H}] does not fit layer {ctx.layer} with {ctx.num_heads} heads"
            )
        device = ctx.query.device
        if device not in self._on_device:
            self._on_device[device] = self.mask.to(device)
        return self._on_device[device][ctx.layer].expand(ctx.batch_size, H)
