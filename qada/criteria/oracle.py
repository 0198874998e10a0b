"""The oracle criterion (paper eq. 2): exact local ratio from all scores. An analysis tool, O(T) per head."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qada.criteria.base import HeadCriterion, register_criterion
from qada.criteria.context import StepContext
from qada.functional import check_threshold, finite_threshold_decision

__all__ = ["OracleCriterion"]


@register_criterion("oracle")
@dataclass
class OracleCriterion(HeadCriterion):
    """Local when ``A_local / (A_local + A_bulk) >= tau``.

    Args:
        tau: threshold in ``[0, 1]``; higher means fewer local heads.
    """

    tau: float = 0.6
    needs_full_scores = True

    def __post_init__(self) -> None:
        check_threshold("tau", self.tau)

    def decide(self, ctx: StepContext) -> torch.Tensor:
        local, broken = finite_threshold_decision(ctx.log_local, ctx.log_bulk, self.tau, ctx.has_bulk)
        ctx.note_fail_safe(broken)
        return local
