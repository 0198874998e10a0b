"""Baselines: ``dense`` (never local, the unmodified model) and ``local`` (always local, StreamingLLM-like)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qada.criteria.base import HeadCriterion, register_criterion
from qada.criteria.context import StepContext

__all__ = ["DenseCriterion", "LocalCriterion"]


@register_criterion("dense")
@dataclass
class DenseCriterion(HeadCriterion):
    """Every head attends to the full context."""

    def decide(self, ctx: StepContext) -> torch.Tensor:
        return torch.zeros(ctx.batch_size, ctx.num_heads, dtype=torch.bool, device=ctx.query.device)


@register_criterion("local")
@dataclass
class LocalCriterion(HeadCriterion):
    """Every head attends to the local window only (sinks + recent tokens)."""

    def decide(self, ctx: StepContext) -> torch.Tensor:
        return torch.ones(ctx.batch_size, ctx.num_heads, dtype=torch.bool, device=ctx.query.device)
