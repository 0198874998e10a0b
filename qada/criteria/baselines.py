"""Baselines: ``dense`` (never local, the unmodified model) and ``local`` (always local, StreamingLLM-like)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qada.criteria.base import HeadCriterion, register_criterion
from qada.step import DecodeStep

__all__ = ["DenseCriterion", "LocalCriterion"]


@register_criterion("dense")
@dataclass
class DenseCriterion(HeadCriterion):
    """Every head attends to the full context."""


    def decide(self, step: DecodeStep) -> torch.Tensor:
        return torch.zeros(step.batch_size, step.num_heads, dtype=torch.bool, device=step.device)


@register_criterion("local")
@dataclass
class LocalCriterion(HeadCriterion):
    """Every head attends to the local window only (sinks + recent tokens)."""


    def decide(self, step: DecodeStep) -> torch.Tensor:
        return torch.ones(step.batch_size, step.num_heads, dtype=torch.bool, device=step.device)
