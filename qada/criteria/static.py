"""The static criterion (paper App. A): a fixed ``[layers, heads]`` mask of permanently local heads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from qada.criteria.base import register_criterion
from qada.criteria.budget import BudgetCriterion
from qada.functional import calibrate_static_mask
from qada.step import DecodeStep

__all__ = ["StaticCriterion"]


@register_criterion("static")
@dataclass
class StaticCriterion(BudgetCriterion):
    """Heads marked True in ``mask[layer]`` are local at every step, the others dense.

    A budget criterion whose score does not depend on the query: each layer keeps exactly its mask's local
    heads (the budget of layer ``l`` is the number of True entries of ``mask[l]``).

    Args:
        mask: ``[L, H]`` bool tensor or nested lists of bools (True = local), e.g. from
            :meth:`from_frequency` (calibrated oracle frequencies, paper App. A).
    """


    mask: Any
    sparsity: float = field(default=0.0, init=False)  # derived from the mask (global layers once bound)
    needs_calibration = True

    def __post_init__(self) -> None:
        if isinstance(self.mask, (str, bytes)) or hasattr(self.mask, "__fspath__"):
            raise ValueError(
                f"expected a static mask as a bool tensor or nested lists but got the path {str(self.mask)!r}; "
                "load a mask file with qada.artifacts.load_head_mask (or `qada generate --static FILE`)"
            )
        try:
            mask = torch.as_tensor(self.mask)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(f"expected a static mask as a [layers, heads] grid of booleans ({error})") from None
        if mask.ndim != 2:
            raise ValueError(f"expected a static mask of shape [layers, heads] but got shape {tuple(mask.shape)}")
        if mask.dtype != torch.bool:
            if not ((mask == 0) | (mask == 1)).all():
                raise ValueError("expected a static mask of booleans (or 0/1) but got other values")
            mask = mask.bool()
        self.mask = mask
        self.sparsity = float(mask.float().mean()) if mask.numel() else 0.0

    @classmethod
    def from_frequency(cls, local_frequency: torch.Tensor, alpha: float) -> StaticCriterion:
        """Calibrate from ``[L, H]`` oracle local frequencies: the ``round(alpha L H)`` most local heads.

        On a hybrid model the sliding-window layers' rows are NaN (never decided): only the ``G`` global layers are
        ranked, ``round(alpha G H)`` of their heads made local, and the sliding rows are True (never used: those
        layers pass through). See :func:`qada.functional.calibrate_static_mask`."""
        return cls(calibrate_static_mask(local_frequency, alpha))

    def bind_layers(self, global_layers: Sequence[int]) -> None:
        """Also make :attr:`sparsity` the fraction of the global layers' heads that are local."""
        super().bind_layers(global_layers)
        rows = [layer for layer in global_layers if 0 <= layer < self.mask.shape[0]]
        if rows and self.mask.shape[1]:
            self.sparsity = float(self.mask[rows].float().mean())

    def check_model(self, num_layers: int, num_heads: int) -> None:
        if tuple(self.mask.shape) != (num_layers, num_heads):
            raise ValueError(
                f"expected a static mask of shape [{num_layers}, {num_heads}] for this model but got "
                f"{list(self.mask.shape)}"
            )

    def layer_state(self, layer: int, slots: int) -> dict[str, torch.Tensor]:
        """``score``: the layer's mask row as floats (1 = local); ``count``: its local heads (0-d)."""
        L, H = self.mask.shape
        if not 0 <= layer < L:
            raise ValueError(f"static mask of shape [{L}, {H}] does not fit layer {layer}")
        row = self.mask[layer]
        return {"score": row.float(), "count": row.sum()}

    def score(self, step: DecodeStep) -> torch.Tensor:
        score = self.state(step)["score"]
        if score.shape[0] != step.num_heads:
            raise ValueError(f"static mask of {score.shape[0]} heads does not fit a step with {step.num_heads} heads")
        return score.expand(step.batch_size, -1)

    def local_count(self, step: DecodeStep) -> torch.Tensor:
        return self.state(step)["count"]
