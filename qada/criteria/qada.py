"""The QAdA criterion (paper eq. 7): the oracle test with the lognormal bulk estimate, O(d^2) per head."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qada.criteria.base import HeadCriterion, register_criterion
from qada.criteria.context import StepContext
from qada.functional import check_threshold, finite_threshold_decision

__all__ = ["QAdACriterion"]


@register_criterion("qada")
@dataclass
class QAdACriterion(HeadCriterion):
    """Local when ``A_local / (A_local + Â_bulk) >= tau`` with ``log Â_bulk = log T_bulk + mu_s + sigma_s^2/2``.

    The estimate needs the bulk key moments of the step (a moment source); a NaN/inf estimate makes the head
    dense and is counted in ``ctx.fail_safe``.

    Args:
        tau: threshold in ``[0, 1]``; higher means fewer local heads.
    """

    tau: float = 0.6
    needs_moments = True

    def __post_init__(self) -> None:
        check_threshold("tau", self.tau)

    def decide(self, ctx: StepContext) -> torch.Tensor:
        local, broken = finite_threshold_decision(ctx.log_local, ctx.log_bulk_estimate, self.tau, ctx.has_bulk)
        ctx.note_fail_safe(broken)
        return local
